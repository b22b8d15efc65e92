"""Every new architecture over the whole P/D path in one process (tests/unit/test_pd_inprocess.py's
System: a prefill worker chunking by 16 tokens, a decode worker, the gateway): greedy tokens
equal transformers' on prompts longer than the sliding windows, a prompt extending an earlier
one is served from both workers' prefix caches, and every block comes back. DeepSeek-V3 (MLA)
has its own in tests/unit/test_deepseek.py and, over UCX, tests/e2e/test_mla_pd.py."""
from __future__ import annotations

import uuid

import pytest

from engine.sampling_params import SamplingParams
from engine.tiny_model import ensure_default_model
from gateway.request import GenerateInput
from tests.hf_models import hf_greedy
from tests.hf_models_gptoss import make_gpt_oss_model
from tests.hf_models_moe2 import make_moe2_model
from tests.hf_models_window import make_window_model
from tests.unit.test_engine_vs_hf import _prompts
from tests.unit.test_pd_inprocess import System

BUILDERS = {"gemma3_text": make_window_model, "gpt_oss": make_gpt_oss_model,
            "glm4_moe": make_moe2_model, "minimax_m2": make_moe2_model}
NEW = 16


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_over_pd_matches_transformers(tmp_path, kind):
    d = BUILDERS[kind](kind, tmp_path / "m")
    tiny = ensure_default_model()                # the gateway needs a tokenizer to detokenize
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((tiny / name).read_bytes())
    prompts = _prompts()[5:7]                    # 25 and 40 tokens: past every window, chunked
    prompts.append(prompts[-1] + [5, 6, 7, 8, 9, 10, 11, 12, 13])   # a prefix hit on both sides
    ref = [toks for toks, _ in hf_greedy(d, prompts, NEW)]
    with System.started(str(d)) as s:
        async def main():
            outs, cached = [], []
            for prompt in prompts:
                inp = GenerateInput(f"{kind}-" + uuid.uuid4().hex, prompt,
                                    SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
                events = [ev async for ev in s.gateway.generate(inp)]
                outs.append([t for ev in events for t in ev.token_ids])
                cached.append(events[-1].usage.cached_tokens)
            await s.wait_all_free()
            return outs, cached
        outs, cached = s.run(main())
    assert outs == ref
    assert cached[0] == 0 and cached[2] >= 40 // 8 * 8     # the 40-token prompt's full blocks
