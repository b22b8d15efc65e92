"""DeepSeek-V3's latent KV cache across real worker processes over UCX: a prefill worker
chunking a tiny MLA model's prompts into a decode worker gives transformers' greedy tokens;
a decode worker whose cache has another layout (a GQA model under the same name) is refused
at once, the error naming both layouts, with no block held on either side."""
from __future__ import annotations

import time
import uuid

import grpc
import pytest

from engine.tiny_model import ensure_default_model
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.e2e.test_workers import BS, Worker, _dest, _generate, _greedy, _held, _stats
from tests.hf_models import hf_greedy, make_hf_model
from tests.hf_models_mla import make_deepseek
from tests.unit.test_engine_vs_hf import _prompts

pytestmark = pytest.mark.e2e


def _with_tokenizer(d):
    tiny = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((tiny / name).read_bytes())
    return str(d)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    mla = make_deepseek(tmp_path_factory.mktemp("mla") / "m")
    gqa = make_hf_model("llama", tmp_path_factory.mktemp("gqa") / "m")     # the same model name
    logs = tmp_path_factory.mktemp("logs")
    started = []
    try:
        dec = Worker("decode_worker.server", _with_tokenizer(mla), logs / "decode.log", block_size=BS,
                     num_blocks=64, kv_expiry_s=10)
        other = Worker("decode_worker.server", _with_tokenizer(gqa), logs / "decode_gqa.log",
                       block_size=BS, num_blocks=64, kv_expiry_s=10)
        started += [dec, other]
        pre = Worker("prefill_worker.server", str(mla), logs / "prefill.log", block_size=BS, num_blocks=64,
                     max_num_batched_tokens=16, decode=f"127.0.0.1:{dec.port},127.0.0.1:{other.port}")
        started.append(pre)
        for w in started:
            w.wait_serving()
        yield mla, pre, dec, other
    finally:
        for w in started:
            w.terminate()
        for w in started:
            w.stop()


def test_latent_cache_over_ucx_matches_transformers(system):
    mla, pre, dec, _ = system
    prompts = _prompts()[4:7]                            # 17, 25, 40 tokens: chunked by 16
    ref = hf_greedy(mla, prompts, 16)
    for prompt, (toks, _) in zip(prompts, ref):
        tokens, *_ = _generate(pre, dec, prompt, _greedy(16))
        assert tokens == toks
    assert _stats(pre, "p").compat.layout == "mla(kv_lora_rank=32, rope_dim=16)"
    assert _held(_stats(pre, "p")) == 0 and _held(_stats(dec, "d")) == 0


def test_layout_mismatch_is_refused_naming_both_layouts(system):
    _, pre, _, other = system
    d = decode_pb2_grpc.DecodeWorkerStub(other.channel)
    prompt, rid = _prompts()[4], "layout-" + uuid.uuid4().hex
    stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=_greedy(3)),
                      timeout=20)
    kv = next(stream).kv_ready
    t = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillWorkerStub(pre.channel).Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(3), destination=_dest(kv)), timeout=10)
    assert time.monotonic() - t < 5
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msg = e.value.details()
    assert "mla(kv_lora_rank=32, rope_dim=16)" in msg and "gqa(kv_heads=2, head_dim=16)" in msg, msg
    assert d.Abort(common_pb2.AbortRequest(request_id=rid), timeout=5).found
    list(stream)
    assert _held(_stats(pre, "p")) == 0 and _held(_stats(other, "d")) == 0
