"""Conversions between engine types and pdserve.v1 messages, shared by the gateway and both
workers. A leaf module: imports engine's plain dataclasses (no torch) and the protos only."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from protos.pdserve.v1 import common_pb2

if TYPE_CHECKING:
    from kvtransfer.wire import CompatKey

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "prefill_done": common_pb2.FINISH_REASON_UNSPECIFIED,   # not finished for the client
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items() if k != "prefill_done"}
# Trailing metadata of a failed Prefill whose cause is the destination's KV endpoint (connect,
# handshake or send failed): the gateway blames the decode worker, not the prefill worker.
KV_DESTINATION_FAULT = ("pdserve-fault", "kv-destination")


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output, speculative=p.speculative)
    if p.seed is not None:
        m.seed = p.seed
    if p.max_tokens is None:
        m.max_tokens_unlimited = True
    else:
        m.max_tokens = p.max_tokens
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    for k, v in p.logit_bias.items():
        m.logit_bias[k] = v
    if p.structured is not None:
        m.structured.CopyFrom(structured_to_proto(p.structured))
    return m


def structured_to_proto(s: StructuredOutput) -> common_pb2.StructuredOutput:
    if s.json_object:
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(**{s.kind: s.value})


def structured_from_proto(m: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no kind is set; raises ValueError on a malformed schema."""
    kind = m.WhichOneof("kind")
    return None if kind is None else StructuredOutput.from_kind(kind, getattr(m, kind))


def sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults; raises ValueError on bad values."""
    d = SamplingParams.__dataclass_fields__
    def opt(name):
        return getattr(m, name) if m.HasField(name) else d[name].default
    max_tokens = None if m.max_tokens_unlimited else opt("max_tokens")
    return SamplingParams(
        n=opt("n"), temperature=opt("temperature"), top_p=opt("top_p"), top_k=m.top_k,
        min_p=m.min_p, seed=opt("seed"), presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty, repetition_penalty=opt("repetition_penalty"),
        max_tokens=max_tokens, min_tokens=m.min_tokens, stop=list(m.stop),
        stop_token_ids=list(m.stop_token_ids), ignore_eos=m.ignore_eos, logprobs=opt("logprobs"),
        prompt_logprobs=opt("prompt_logprobs"), logit_bias=dict(m.logit_bias),
        skip_special_tokens=opt("skip_special_tokens"),
        include_stop_str_in_output=m.include_stop_str_in_output,
        structured=structured_from_proto(m.structured) if m.HasField("structured") else None,
        speculative=opt("speculative"))


def logprob_from_proto(t: common_pb2.TokenLogprob):
    """(logprob, [(id, logprob)] or None) as in GenerateEvent.logprobs."""
    top = [(x.token_id, x.logprob) for x in t.top_logprobs] or None
    return t.logprob, top


def worker_sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """As `sampling_from_proto`, for a worker: the gateway fans out n > 1, workers take n=1."""
    sp = sampling_from_proto(m)
    if sp.n != 1:
        raise ValueError(f"invalid sampling parameter n={sp.n}: workers take n=1 "
                         "(the gateway fans out n > 1)")
    return sp


def token_logprob(token_id: int, logprob: float | None, top) -> common_pb2.TokenLogprob:
    """`top`: [(token_id, logprob)] best first, or None."""
    msg = common_pb2.TokenLogprob(token_id=int(token_id), logprob=float(logprob or 0.0))
    for tid, lp in top or ():
        msg.top_logprobs.add(token_id=int(tid), logprob=float(lp))
    if top:
        ids = [int(t) for t, _ in top]
        msg.rank = ids.index(int(token_id)) + 1 if int(token_id) in ids else 0
    return msg


def output_tokens(out: RequestOutput, n_new: int | None = None) -> list[common_pb2.TokenLogprob]:
    """The last `n_new` generated tokens of `out` (default: its new tokens) as TokenLogprobs."""
    n = len(out.new_token_ids) if n_new is None else n_new
    total = len(out.token_ids)
    res = []
    for i in range(total - n, total):
        lp = out.logprobs[i] if i < len(out.logprobs) else 0.0
        top = out.top_logprobs[i] if i < len(out.top_logprobs) else None
        res.append(token_logprob(out.token_ids[i], lp, top))
    return res


def prompt_logprobs(out: RequestOutput) -> list[common_pb2.TokenLogprob]:
    if out.prompt_logprobs is None:
        return []
    return [token_logprob(t, lp, top) for t, (lp, top) in zip(out.prompt_token_ids, out.prompt_logprobs)]


def compat_to_proto(c: "CompatKey") -> common_pb2.KvCompat:
    return common_pb2.KvCompat(model=c.model, dtype=c.dtype, block_size=c.block_size,
                               num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, protocol_version=c.protocol_version,
                               kv_scales=c.kv_scales, layout=c.layout)


def compat_from_proto(m: common_pb2.KvCompat) -> "CompatKey":
    from kvtransfer.wire import CompatKey    # torch: only the workers call this
    return CompatKey(m.model, m.dtype, m.block_size, m.num_layers, m.num_kv_heads, m.head_dim,
                     m.protocol_version, m.kv_scales, m.layout)
