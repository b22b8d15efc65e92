"""Decode from CUDA graphs against the eager engine, over one workload that walks every batch
bucket with padding rows, two context buckets, prefix-cache hits and preemption.

On CUDA the graphs are really captured and replayed (Triton kernels, fp32); on CPU the same
test runs the padded static-buffer path eagerly (capture is a GPU-only step), so the
bucketing and padding are checked everywhere. Greedy tokens must be identical and the top-5
logprobs close; every KV block comes back."""
import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.cuda_graph import context_buckets
from kernel_testlib import DEVICE
from tests.hf_models import make_hf_model

MAX_LEN = 2048                     # context buckets 1024 and 2048


def _engine(d, graphs: bool) -> LLMEngine:
    # 66 blocks of 16: the long prompt fits, 8 requests growing to ~190 tokens do not
    return LLMEngine.from_model_dir(d, device=str(DEVICE), dtype="float32", num_blocks=66,
                                    max_num_seqs=8, max_num_batched_tokens=2048,
                                    decode_graphs=graphs)


def _workload(engine: LLMEngine) -> dict:
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(40)]              # 2.5 blocks of prefix
    done, step = {}, 0

    def add(i, prompt, n):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n,
                                                           ignore_eos=True, logprobs=5))
    # wave 1: a long prompt (context bucket 2048) and three short ones; wave 2: eight with
    # long outputs, which outgrow the cache together
    add(0, [rng.randrange(3, 500) for _ in range(1030)], 6)
    for i in range(1, 4):
        add(i, shared + [rng.randrange(3, 500) for _ in range(3 * i)], 10 + 7 * i)
    while engine.has_unfinished_requests():
        if step == 3:                   # wave 2: the shared prefix is cached by now
            for i in range(4, 12):
                add(i, shared + [rng.randrange(3, 500) for _ in range(i)], 140 + i)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
    return done


@pytest.mark.parametrize("kind", ["llama"])
def test_graph_decode_matches_eager(tmp_path, kind):
    d = make_hf_model(kind, tmp_path / "m", max_position_embeddings=MAX_LEN)
    eager, graphed = _engine(d, False), _engine(d, True)
    assert eager.runner.graphs is None
    g = graphed.runner.graphs
    assert g.buckets == [1, 2, 4, 8] and g.context_buckets == context_buckets(MAX_LEN) == [1024, 2048]
    if DEVICE.type == "cuda":
        assert set(g.graphs) == {(b, c) for b in g.buckets for c in g.context_buckets}
    rows = []
    run = g.run
    g.run = lambda ids, *a: rows.append(ids.shape[0]) or run(ids, *a)
    want, got = _workload(eager), _workload(graphed)
    assert set(got) == set(want) == {f"r{i}" for i in range(12)}
    for rid, w in want.items():
        assert got[rid].token_ids == w.token_ids, rid
        for a, b in zip(got[rid].top_logprobs, w.top_logprobs):
            assert [t for t, _ in a] == [t for t, _ in b], rid
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-3, rid
    # the mix really happened, the same way in both engines
    for e in (eager, graphed):
        s = e.stats()
        assert s.num_preemptions > 0 and s.prefix_cache_hits > 0, s
        assert e.kv.num_held_blocks() == 0
    # every batch bucket replayed, some with padding rows, and both context buckets
    assert {b for b, _ in g.replays} == {1, 2, 4, 8} and {3, 5, 6, 7} & set(rows)
    assert {c for _, c in g.replays} == {1024, 2048}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="capture is CUDA-only")
def test_prefill_engine_captures_no_graphs(tmp_path):
    d = make_hf_model("llama", tmp_path / "m")
    e = LLMEngine.from_model_dir(d, device="cuda", num_blocks=16, decode_graphs=False)
    assert e.runner.graphs is None
    assert LLMEngine.from_model_dir(d, device="cuda", num_blocks=16).runner.graphs.graphs
