"""Every quantized variant end to end over P/D (both workers and the gateway in one process,
tests/unit/test_pd_inprocess.py's System): the gateway's greedy tokens equal the offline
engine's with the same options, so the KV (and, for an 8-bit cache, its scales) arrived
intact; every block is free afterwards. A prefill worker with an fp8 KV cache and a decode
worker with a float one: FAILED_PRECONDITION naming the KV dtype and the scale layout."""
import uuid

import grpc
import pytest

from engine.offline import LLM
from engine.sampling_params import SamplingParams
from gateway.request import GenerateInput
from protos.pdserve.v1 import decode_pb2, prefill_pb2
from tests.unit.test_pd_inprocess import BS, RPC_S, System, _dest, _greedy, _prompt

VARIANTS = [dict(quantization="int8"), dict(quantization="int4_g32"), dict(quantization="fp8"),
            dict(kv_cache_dtype="fp8_e4m3"), dict(kv_cache_dtype="int8"),
            dict(quantization="int8", kv_cache_dtype="int8")]


@pytest.fixture(scope="module")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_variant_over_pd_matches_offline(model_dir, options):
    prompts = [_prompt(30, 2), _prompt(13, 5)]         # several blocks, a partial last block
    llm = LLM(model_dir, block_size=BS, num_blocks=64, **options)
    refs = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
            for p in prompts]
    with System.started(model_dir, prefill_options=options, decode_options=options) as s:
        async def main():
            for prompt, ref in zip(prompts, refs):
                inp = GenerateInput("q-" + uuid.uuid4().hex, prompt,
                                    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
                tokens = [t async for ev in s.gateway.generate(inp) for t in ev.token_ids]
                assert tokens == list(ref.token_ids)
            await s.wait_all_free()
        s.run(main())


def test_kv_dtype_mismatch_is_failed_precondition(model_dir):
    with System.started(model_dir, prefill_options=dict(kv_cache_dtype="fp8_e4m3")) as s:
        async def main():
            rid, prompt = "mm-" + uuid.uuid4().hex, _prompt(20, 1)
            stream = s.dec.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                           sampling=_greedy(4)), timeout=RPC_S)
            kv = (await stream.read()).kv_ready
            assert kv.compat.dtype == "float32" and kv.compat.kv_scales == "none"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await s.pre.Prefill(prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=_greedy(4), destination=_dest(kv)),
                    timeout=RPC_S)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "float8_e4m3fn" in e.value.details() and "kv_scales" in e.value.details()
            stream.cancel()
            await s.wait_all_free()
        s.run(main())
