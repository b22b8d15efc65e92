"""Conversions between pdserve.v1 messages and engine/kvtransfer types.

Shared by both workers (decode_worker imports it too; it depends on engine, kvtransfer and
protos only, so it can move to a shared worker package without changes).
"""
from __future__ import annotations

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from kvtransfer.wire import CompatKey
from protos.pdserve.v1 import common_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "prefill_done": common_pb2.FINISH_REASON_UNSPECIFIED,   # not finished for the client
}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults. Raises ValueError (bad values)."""
    kw = dict(top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
              frequency_penalty=p.frequency_penalty, min_tokens=p.min_tokens,
              stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
              logit_bias=dict(p.logit_bias), include_stop_str_in_output=p.include_stop_str_in_output)
    for name in ("n", "temperature", "top_p", "seed", "repetition_penalty", "max_tokens",
                 "logprobs", "prompt_logprobs", "skip_special_tokens"):
        if p.HasField(name):
            kw[name] = getattr(p, name)
    if p.max_tokens_unlimited:
        kw["max_tokens"] = None
    kind = p.structured.WhichOneof("kind") if p.HasField("structured") else None
    if kind is not None:
        kw["structured"] = StructuredOutput.from_kind(kind, getattr(p.structured, kind))
    sp = SamplingParams(**kw)
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


def compat_to_proto(c: CompatKey) -> common_pb2.KvCompat:
    return common_pb2.KvCompat(model=c.model, dtype=c.dtype, block_size=c.block_size,
                               num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, protocol_version=c.protocol_version)


def compat_from_proto(m: common_pb2.KvCompat) -> CompatKey:
    return CompatKey(m.model, m.dtype, m.block_size, m.num_layers, m.num_kv_heads, m.head_dim,
                     m.protocol_version)


def model_compat(engine) -> CompatKey:
    """This engine's compatibility key: the model is named by its directory's name."""
    return CompatKey.from_cache(engine.kv_cache, engine.config.model.name)
