"""The CUDA-graph decode path's static buffers and padding, run eagerly on CPU: the padded
bucketed forward gives the same logits as the plain path, and padding rows write no KV."""
import random

import torch

from engine import LLMEngine, SamplingParams
from engine.runner import ModelRunner
from tests.hf_models import make_hf_model


def test_padded_decode_matches_plain_path(tmp_path):
    d = make_hf_model("llama", tmp_path / "m")
    plain = LLMEngine.from_model_dir(d, num_blocks=64)
    graphed = LLMEngine.from_model_dir(d, num_blocks=64)
    graphed.runner = ModelRunner(graphed.model, 64, 16, torch.float32, "cpu",
                                 max_num_seqs=8, decode_graphs=True)
    assert graphed.runner.graphs.buckets == [1, 2, 4, 8]
    calls = []
    run = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = []
    for e in (plain, graphed):
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, params)
        done = {}
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    done[o.request_id] = o
        outs.append(done)
    assert calls and 3 in calls          # a 3-row batch ran in the 4-row bucket
    for rid in outs[0]:
        assert outs[0][rid].token_ids == outs[1][rid].token_ids
        assert max(abs(a - b) for a, b in zip(outs[0][rid].logprobs, outs[1][rid].logprobs)) < 1e-5
    assert graphed.kv.num_held_blocks() == 0
