"""DeviceSampler (logits left on the device, one copy back) against the CPU Sampler, the
reference: the same tokens for every kind of row (greedy, temperature, top-k/p, min-p,
penalties, logit bias, min_tokens, a grammar mask, seeded and unseeded), the same raw logprobs.
On CPU tensors everywhere; on CUDA tensors too where CUDA exists."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine.sampler import DeviceSampler, Sampler
from engine.sampling_params import SamplingParams
from kernel_testlib import fresh_generator

EOS = 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)


def _rows(gen) -> list[Row]:
    hist = lambda n: torch.randint(0, 300, (n,), generator=gen).tolist()   # noqa: E731
    P = SamplingParams
    return [
        Row(P(temperature=0)),
        Row(P(temperature=0, logprobs=5), hist(7), hist(3)),
        Row(P(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
            hist(20), hist(12)),
        Row(P(temperature=0, logit_bias={5: 30.0, 7: -100.0, 10**6: 1.0}, logprobs=2)),
        Row(P(temperature=0, min_tokens=4, stop_token_ids=[9]), hist(5), hist(1)),
        Row(P(temperature=0.8, seed=11, top_k=20, logprobs=0)),
        Row(P(temperature=1.2, seed=12, top_p=0.8, min_p=0.05), hist(4), hist(6)),
        Row(P(temperature=1.0, seed=13, repetition_penalty=0.7, logit_bias={3: 4.0})),
        Row(P(temperature=0.7, top_k=1)),                   # unseeded, yet only one choice
        Row(P(temperature=1.0, seed=14, max_tokens=20, min_tokens=3, ignore_eos=True)),
    ]


def _compare(got, want, seed, where):
    assert got.token_ids == want.token_ids, f"seed={seed} {where}"
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                               atol=1e-4, rtol=1e-5, msg=lambda m: f"seed={seed} {where}: {m}")
    for g, w in zip(got.top_logprobs, want.top_logprobs):
        assert (g is None) == (w is None), f"seed={seed} {where}"
        if g is not None:
            assert [t for t, _ in g] == [t for t, _ in w], f"seed={seed} {where}"
            assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-4, f"seed={seed} {where}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_mask", [False, True])
def test_device_sampler_matches_cpu_sampler(device, with_mask):
    gen, seed = fresh_generator()
    V = 300
    dev_rows = _rows(torch.Generator().manual_seed(0))
    cpu_rows = _rows(torch.Generator().manual_seed(0))       # identical twins, own generators
    for step in range(4):                                     # seeded generators advance per step
        logits = torch.randn(len(cpu_rows), V, generator=gen) * 3
        allowed = None
        if with_mask:
            allowed = torch.rand(len(cpu_rows), V, generator=gen) < 0.5
            allowed[0] = False
            allowed[0, 17] = True                             # a grammar with one choice
        # every row is deterministic given its seed (the unseeded one has top_k=1), so the
        # device's own RNG cannot change a token
        want = Sampler({EOS})(logits, cpu_rows, allowed)
        got = DeviceSampler({EOS})(logits.to(device), dev_rows, allowed)
        _compare(got, want, seed, f"{device} step {step}")
        if with_mask:
            assert got.token_ids[0] == 17
        for c, d, t in zip(cpu_rows, dev_rows, got.token_ids):
            c.output_token_ids.append(t)
            d.output_token_ids.append(t)


def test_greedy_batch_is_argmax_with_raw_logprobs():
    gen, seed = fresh_generator()
    logits = torch.randn(6, 50, generator=gen)
    rows = [Row(SamplingParams(temperature=0, logprobs=3)) for _ in range(6)]
    out = DeviceSampler({EOS})(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist(), f"seed={seed}"
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(torch.tensor(out.logprobs), lp.max(-1).values)
    assert [t for t, _ in out.top_logprobs[0]] == lp[0].topk(3).indices.tolist()


def test_unseeded_rows_follow_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0])
    rows = [Row(SamplingParams(temperature=1.0)) for _ in range(4000)]
    got = DeviceSampler({EOS})(probs.log().repeat(4000, 1).to(DEVICES[-1]), rows).token_ids
    freq = torch.bincount(torch.tensor(got), minlength=4).float() / 4000
    assert freq[3] == 0
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
