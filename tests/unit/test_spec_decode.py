"""Speculative decoding (engine/spec_decode.py): proposals verified in one target forward.

References: the same engine without speculation (greedy output must not change, whatever
the proposer), the target's own distribution (sampled tokens, statistically), the JSON
schema (structured output), the block pool (nothing leaked after rejections and aborts)."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.offline import LLM
from engine.sampler import Sampler, processed_probs
from engine.spec_decode import SpeculativeConfig, SpecState, ngram_propose
from engine.structured import StructuredOutput
from engine.tiny_model import ensure_default_model, make_tiny_model

BS = 8


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft with the target's shape and vocabulary but other random weights: it is
    mostly wrong, so verification rejects."""
    return str(make_tiny_model(tmp_path_factory.mktemp("draft") / "m", seed=7))


def _prompts():
    rng = random.Random(0)
    base = [rng.randrange(3, 1000) for _ in range(24)]
    return [base * 3,                                   # repeats itself: n-gram hits
            base[:16] + [rng.randrange(3, 1000) for _ in range(30)],   # shares a prefix (cache hit)
            [rng.randrange(3, 1000) for _ in range(37)],
            base[:10] * 5 + [11, 12]]


def _run(engine, prompts, params, join_every=2, abort=()):
    """Requests join the batch at different steps; `abort`: ids aborted after 3 steps."""
    pending = list(enumerate(prompts))
    done, step = {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % join_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        if step == 3:
            for rid in abort:
                engine.abort_request(rid)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
        assert step < 5000
    return done


def _engine(model_dir, spec="", **kw):
    opts = dict(block_size=BS, num_blocks=200, max_num_batched_tokens=32)   # chunked prefill
    opts.update(kw)
    return LLMEngine.from_model_dir(model_dir, speculative=spec, **opts)


def _greedy(n=40):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _tokens(done):
    return {k: list(v.token_ids) for k, v in done.items()}


# ----------------------------------------------------------------------------- proposers

def _ngram_reference(tokens, k, n, min_n):
    for size in range(min(n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start:start + size] == suffix:
                return tokens[start + size:start + size + k]
    return []


def test_ngram_proposes_what_followed_the_latest_longest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 5, 4, 2, 3]
    assert ngram_propose(toks, k=2, n=3) == [7, 5]      # [2, 3] latest at 5..6, [x,2,3] none
    assert ngram_propose([1, 2, 3, 1, 2, 3], k=5, n=3) == [1, 2, 3]   # up to the end
    assert ngram_propose([5, 6, 7], k=3, n=2) == []
    assert ngram_propose([4, 4], k=3, n=1) == [4]
    # ids whose bytes straddle a token boundary must not match inside a token
    assert ngram_propose([0x01000000, 0x00000001, 7, 1], k=1, n=1, min_n=1) == [7]
    rng = random.Random(5)
    for _ in range(300):
        vocab = rng.choice([3, 10, 70000, 2**31 - 1])
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k, n = rng.randrange(1, 6), rng.randrange(1, 5)
        min_n = rng.randrange(1, n + 1)
        assert ngram_propose(toks, k, n, min_n) == _ngram_reference(toks, k, n, min_n), (toks, k, n, min_n)


def test_speculative_config_parses_and_rejects():
    assert SpeculativeConfig.parse("") is None
    c = SpeculativeConfig.parse("ngram:n=4,k=3,min_n=2")
    assert (c.method, c.n, c.k, c.min_n) == ("ngram", 4, 3, 2)
    c = SpeculativeConfig.parse("draft:/models/small,k=5,disable_batch_size=8")
    assert (c.method, c.draft_model, c.k, c.disable_batch_size) == ("draft", "/models/small", 5, 8)
    for bad, why in (("beam:k=2", "method"), ("ngram:k=0", "k must"), ("ngram:q=1", "unknown option"),
                     ("ngram:k=x", "integer"), ("draft:k=4", "needs a model"),
                     ("ngram:n=2,min_n=3", "min_n")):
        with pytest.raises(ValueError, match=why):
            SpeculativeConfig.parse(bad)


def test_adaptive_k_shrinks_backs_off_and_grows_back():
    s = SpecState(k=4)
    waits = []
    for _ in range(8):
        s.update(proposed=s.k, accepted=0, k_max=4)
        waits.append(s.wait)
        skipped = 0
        while not s.ready():
            skipped += 1
        assert skipped == waits[-1]
    assert s.k == 1
    assert waits == [0, 0, 0, 0, 2, 4, 8, 16]    # poor acceptance: ever longer pauses
    for _ in range(6):
        s.update(proposed=s.k, accepted=s.k, k_max=4)
    assert s.k == 4 and s.wait == 0 and s.ready()


# ----------------------------------------------------------------------------- greedy: unchanged

def test_greedy_unchanged_with_ngram_across_chunks_prefix_hits_and_preemption(model_dir):
    prompts = _prompts()
    ref = _tokens(_run(_engine(model_dir), prompts, _greedy()))
    spec = _engine(model_dir, "ngram:n=3,k=4")
    assert _tokens(_run(spec, prompts, _greedy())) == ref
    st = spec.spec_stats
    assert st.num_accepted_tokens > 0 and st.num_draft_tokens > st.num_accepted_tokens
    assert spec.kv.prefix_hits > 0
    assert spec.kv.num_held_blocks() == 0
    # a cache so small that requests are preempted (and recomputed) on the way
    small = _engine(model_dir, "ngram:n=3,k=4", num_blocks=24)
    assert _tokens(_run(small, prompts, _greedy())) == ref
    assert small.scheduler.num_preemptions > 0 and small.spec_stats.num_accepted_tokens > 0
    assert small.kv.num_held_blocks() == 0


@pytest.mark.parametrize("which", ["self", "other"])
def test_greedy_unchanged_with_a_draft_model(model_dir, other_draft, which):
    """The target as its own draft (nearly everything accepted: max_tokens lands inside
    accepted runs) and a wrong draft (nearly everything rejected)."""
    draft = model_dir if which == "self" else other_draft
    prompts = _prompts()
    for n in (1, 5, 13, 40):
        ref = _tokens(_run(_engine(model_dir), prompts, _greedy(n)))
        spec = _engine(model_dir, f"draft:{draft},k=4")
        assert _tokens(_run(spec, prompts, _greedy(n))) == ref, n
        assert all(len(t) == n for t in ref.values())
        assert spec.kv.num_held_blocks() == 0
    st = spec.spec_stats
    if which == "self":
        assert st.num_accepted_tokens >= 0.9 * st.num_draft_tokens > 0
    else:
        assert st.num_accepted_tokens < 0.5 * st.num_draft_tokens


def test_logprobs_of_every_emitted_token_match(model_dir):
    """Each token of an accepted run reports its own position's logprob and top-k, as
    without speculation (the logits of k+1 positions computed in one forward)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = _prompts()
    ref = _run(_engine(model_dir), prompts, params)
    spec = _engine(model_dir, f"draft:{model_dir},k=4")
    got = _run(spec, prompts, params)
    assert spec.spec_stats.num_accepted_tokens > 20
    for rid, r in ref.items():
        g = got[rid]
        assert list(g.token_ids) == list(r.token_ids)
        assert list(g.logprobs) == pytest.approx(list(r.logprobs), abs=1e-4)
        for tg, tr in zip(g.top_logprobs, r.top_logprobs):
            assert [t for t, _ in tg] == [t for t, _ in tr]
            assert [v for _, v in tg] == pytest.approx([v for _, v in tr], abs=1e-4)


def test_stop_strings_and_stop_tokens_with_speculation(model_dir):
    prompts = _prompts()[:3]
    plain = LLM(model_dir, block_size=BS, num_blocks=200)
    spec = LLM(model_dir, block_size=BS, num_blocks=200, speculative=f"draft:{model_dir},k=4")
    free = plain.generate(prompts, _greedy(30))
    stops = [o.text[len(o.text) // 2:len(o.text) // 2 + 2] for o in free]
    for i, p in enumerate(prompts):
        tok = free[i].token_ids[9]
        for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stops[i]]),
                       SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tok])):
            a, b = plain.generate([p], params)[0], spec.generate([p], params)[0]
            assert (b.text, list(b.token_ids), b.finish_reason, b.stop_reason) == \
                   (a.text, list(a.token_ids), a.finish_reason, a.stop_reason)
            assert a.finish_reason == "stop"
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    assert spec.engine.kv.num_held_blocks() == 0


def test_per_request_off_switch_and_large_batches_do_not_speculate(model_dir):
    spec = _engine(model_dir, "ngram:n=3,k=4,disable_batch_size=3")
    prompts = _prompts()
    off = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False)
    _run(spec, prompts, off)
    assert spec.spec_stats.num_drafts == 0
    # all four at once: the batch is at the threshold while they all run
    for i, p in enumerate(prompts):
        spec.add_request(f"b{i}", p, _greedy(20))
    drafted = []
    while spec.has_unfinished_requests():
        before = spec.spec_stats.num_drafts
        running = len(spec.scheduler.running)
        spec.step()
        drafted.append((running, spec.spec_stats.num_drafts - before))
    assert all(d == 0 for r, d in drafted if r >= 3)
    assert spec.kv.num_held_blocks() == 0


# ----------------------------------------------------------------------------- sampling: exact

class _Row:
    def __init__(self, params, generator=None):
        self.sampling_params, self.generator = params, generator
        self.prompt_token_ids, self.output_token_ids = [1, 2], []


@pytest.mark.parametrize("params,draft", [
    (SamplingParams(temperature=1.0), 2),                 # a likely draft
    (SamplingParams(temperature=0.7), 5),                 # an unlikely one
    (SamplingParams(temperature=1.0, top_k=3), 4),        # outside the top-k: never accepted
    (SamplingParams(temperature=1.3, top_p=0.8), 0),
])
def test_verified_tokens_follow_the_target_distribution(params, draft):
    """Accept-with-p(d)-else-draw-from-p-without-d emits exactly p. A chi-square test over
    8000 draws with a bound (df 5, p = 1e-6) that the wrong rules fail by far: always
    accepting, or resampling from p with the draft left in, both move p(draft) by > 0.15."""
    logits = torch.tensor([[2.0, 1.0, 1.5, 0.2, 0.9, -1.0]])
    p = processed_probs(logits, [params])[0]
    sampler = Sampler(eos_token_ids=set())
    torch.manual_seed(0)
    n, counts, accepted = 8000, torch.zeros(6), 0
    for _ in range(n):
        out, ok = sampler.verify(logits, _Row(params), None, draft)
        counts[out.token_ids[0]] += 1
        accepted += ok
    expected = p * n
    live = expected > 0
    assert counts[~live].sum() == 0                        # masked tokens never come out
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    assert chi2 < 35.9, (counts.tolist(), expected.tolist())
    assert abs(accepted / n - float(p[draft])) < 0.03


def test_seeded_requests_are_reproducible_with_speculation(model_dir):
    prompts = _prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True)
    a = _tokens(_run(_engine(model_dir, f"draft:{model_dir},k=3"), prompts, params))
    b = _tokens(_run(_engine(model_dir, f"draft:{model_dir},k=3"), prompts, params))
    assert a == b


# ----------------------------------------------------------------------------- structure, blocks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_valid_with_speculation(model_dir, temperature):
    llm = LLM(model_dir, block_size=BS, num_blocks=200, speculative=f"draft:{model_dir},k=4")
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=120,
                            structured=StructuredOutput(json_schema=SCHEMA))
    outs = llm.generate(["Hello there", "The quick brown fox", "Tokens, blocks"], params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.kv.num_held_blocks() == 0 and len(llm.engine.structured) == 0


def test_every_block_returns_after_rejections_and_aborts(model_dir, other_draft):
    eng = _engine(model_dir, f"draft:{other_draft},k=4", num_blocks=40)
    _run(eng, _prompts(), _greedy(30), abort=("r0", "r1"))
    assert eng.spec_stats.num_draft_tokens > eng.spec_stats.num_accepted_tokens
    assert eng.kv.num_held_blocks() == 0
    assert eng.speculator.draft.engine.kv.num_held_blocks() == 0      # the draft's shadows finished too


# ----------------------------------------------------------------------------- over P/D

def test_greedy_unchanged_over_prefill_decode(model_dir, monkeypatch):
    """A decode worker with n-gram speculation behind the gateway: the offline engine's greedy
    tokens (no speculation), the prompt's KV from the prefill worker, every block back."""
    import asyncio
    import uuid

    from gateway.request import GenerateInput
    from tests.unit.test_pd_inprocess import System

    prompts = _prompts()[:3]
    ref = LLM(model_dir, block_size=BS, num_blocks=64).generate(prompts, _greedy(24))
    accepted = []                 # the decode worker's engine runs in this process
    verify = LLMEngine._verify

    def counting(self, s, logits):
        before = self.spec_stats.num_accepted_tokens
        out = verify(self, s, logits)
        accepted.append(self.spec_stats.num_accepted_tokens - before)
        return out
    monkeypatch.setattr(LLMEngine, "_verify", counting)

    async def one(prompt):
        tokens, last = [], None
        async for ev in system.gateway.generate(GenerateInput("spec-" + uuid.uuid4().hex, prompt, _greedy(24))):
            tokens += ev.token_ids
            last = ev
        return tokens, last

    async def main():
        outs = await asyncio.gather(*map(one, prompts))
        for (tokens, last), r in zip(outs, ref):
            assert tokens == list(r.token_ids)
            assert last.finish_reason == "length" and last.usage.completion_tokens == 24
        assert sum(accepted) > 0, accepted
        await system.wait_all_free()

    with System.started(model_dir, decode_options={"speculative": "ngram:n=3,k=4"}) as system:
        system.run(main())


def test_off_switch_travels_over_grpc_and_counters_reach_metrics(model_dir):
    from engine.outputs import EngineStats
    from services import metrics
    from services.protoconv import sampling_from_proto, sampling_to_proto
    from tests.unit.test_telemetry import scrape, value

    assert sampling_from_proto(sampling_to_proto(SamplingParams(speculative=False))).speculative is False
    from protos.pdserve.v1 import common_pb2
    assert sampling_from_proto(common_pb2.SamplingParams()).speculative is True   # unset: on

    eng = _engine(model_dir, "ngram:n=3,k=4")
    _run(eng, _prompts(), _greedy(30))
    st = eng.stats()
    assert st.spec_num_accepted_tokens == eng.spec_stats.num_accepted_tokens > 0
    m = metrics.Metrics("decode")
    m.set_engine_stats(st)
    s = scrape(metrics.render_metrics(m.registry).decode())
    for name, want in (("drafts", st.spec_num_drafts), ("draft_tokens", st.spec_num_draft_tokens),
                       ("accepted_tokens", st.spec_num_accepted_tokens),
                       ("emitted_tokens", st.spec_num_emitted_tokens)):
        assert value(s, f"pdserve:spec_decode_num_{name}_total", role="decode") == want
    assert st.spec_num_emitted_tokens == st.spec_num_accepted_tokens + st.spec_num_drafts
    assert isinstance(st, EngineStats)
