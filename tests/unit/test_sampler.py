"""Sampler: masks, penalties and seeds against hand-computed values."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from engine.sampler import (Sampler, compute_prompt_logprobs, min_p_mask, top_k_mask,
                            top_p_mask)
from engine.sampling_params import SamplingParams

EOS = 2


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# probs 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (sum 1): logits are their logs.
PROBS6 = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]])
LOGITS6 = PROBS6.log()


def survivors(x: torch.Tensor) -> list[int]:
    return torch.isfinite(x[0]).nonzero().flatten().tolist()


def test_top_k_mask_keeps_k_best():
    assert survivors(top_k_mask(LOGITS6, torch.tensor([3]))) == [0, 1, 2]
    assert survivors(top_k_mask(LOGITS6, torch.tensor([1]))) == [0]
    assert survivors(top_k_mask(LOGITS6, torch.tensor([0]))) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("p, kept", [
    # cumulative: 0.4, 0.65, 0.8, 0.9, 0.96, 1.0 (thresholds chosen away from float ties)
    (0.01, [0]),
    (0.3, [0]),             # the top token alone reaches 0.3
    (0.5, [0, 1]),          # 0.4 < 0.5: the token crossing p (0.25) is kept
    (0.6, [0, 1]),
    (0.7, [0, 1, 2]),
    (0.85, [0, 1, 2, 3]),
    (0.95, [0, 1, 2, 3, 4]),
    (0.99, [0, 1, 2, 3, 4, 5]),
    (1.0, [0, 1, 2, 3, 4, 5]),
])
def test_top_p_mask(p, kept):
    assert survivors(top_p_mask(LOGITS6, torch.tensor([p]))) == kept


@pytest.mark.parametrize("min_p, kept", [
    (0.0, [0, 1, 2, 3, 4, 5]),
    (0.2, [0, 1, 2, 3]),    # threshold 0.08
    (0.3, [0, 1, 2]),       # threshold 0.12
    (0.5, [0, 1]),          # threshold 0.2
    (1.0, [0]),
])
def test_min_p_mask(min_p, kept):
    assert survivors(min_p_mask(LOGITS6, torch.tensor([min_p]))) == kept


def test_masks_are_per_row():
    x = LOGITS6.repeat(2, 1)
    y = top_k_mask(x, torch.tensor([2, 0]))
    assert torch.isfinite(y).sum(-1).tolist() == [2, 6]


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(4, 50) * 3
    rows = [Row(SamplingParams(temperature=0.0, logprobs=3)) for _ in range(4)]
    out = Sampler({EOS})(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, t].item(), abs=1e-6)
        values, ids = raw[i].topk(3)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-6)


def test_logprobs_stay_raw_under_processing():
    logits = torch.randn(1, 30)
    params = SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5,
                            logit_bias={5: 4.0}, logprobs=2)
    row = Row(params, prompt_token_ids=[1, 2, 3], output_token_ids=[4], generator=None)
    out = Sampler({EOS})(logits, [row])
    raw = torch.log_softmax(logits, -1)[0]
    assert out.logprobs[0] == pytest.approx(raw[out.token_ids[0]].item(), abs=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == raw.topk(2).indices.tolist()


def test_no_top_logprobs_unless_asked():
    rows = [Row(SamplingParams(temperature=0.0)), Row(SamplingParams(temperature=0.0, logprobs=0))]
    out = Sampler({EOS})(torch.randn(2, 10), rows)
    assert out.top_logprobs == [None, None]
    assert len(out.logprobs) == 2


def test_seed_reproducible_regardless_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 200)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(neighbour_first: bool) -> list[int]:
        tokens = []
        row = Row(seeded)
        for _ in range(8):  # several steps: the generator advances per request
            other = Row(SamplingParams(temperature=1.3, top_k=5))
            rows = [other, row] if neighbour_first else [row]
            lg = torch.cat([logits[2:3], logits[:1]]) if neighbour_first else logits[:1]
            out = Sampler({EOS})(lg, rows)
            tokens.append(out.token_ids[-1])
        return tokens

    a, b = run(False), run(True)
    assert a == b
    c = []
    row = Row(SamplingParams(temperature=1.0, seed=99))
    for _ in range(8):
        c.append(Sampler({EOS})(logits[:1], [row]).token_ids[0])
    assert c != a


def test_sampling_follows_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0])
    logits = probs.log().repeat(4000, 1)
    rows = [Row(SamplingParams(temperature=1.0))] * 4000
    tokens = torch.tensor(Sampler(set())(logits, rows).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq[3] == 0
    assert torch.allclose(freq, probs, atol=0.03)


def test_temperature_and_top_k_restrict_samples():
    logits = LOGITS6.repeat(500, 1)
    rows = [Row(SamplingParams(temperature=2.0, top_k=2))] * 500
    assert set(Sampler(set())(logits, rows).token_ids) == {0, 1}
    rows = [Row(SamplingParams(temperature=1.0, min_p=0.5))] * 500
    assert set(Sampler(set())(logits, rows).token_ids) == {0, 1}
    rows = [Row(SamplingParams(temperature=1.0, top_p=0.5))] * 500
    assert set(Sampler(set())(logits, rows).token_ids) == {0, 1}


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = Row(SamplingParams(temperature=0.0, repetition_penalty=2.0),
              prompt_token_ids=[0], output_token_ids=[1, 1])
    from engine.sampler import apply_penalties
    x = logits.clone()
    apply_penalties(x, [row])
    assert x.tolist() == [[1.0, -2.0, 0.5, 3.0, -2.0]]


def test_presence_and_frequency_penalties_hand_computed():
    from engine.sampler import apply_penalties
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    row = Row(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
              prompt_token_ids=[3, 3, 3], output_token_ids=[0, 0, 0, 1])
    x = logits.clone()
    apply_penalties(x, [row])
    # token 0: 1 - 0.5 - 3*0.25 = -0.25; token 1: 1 - 0.5 - 0.25 = 0.25; prompt-only 3: none
    assert x[0].tolist() == pytest.approx([-0.25, 0.25, 1.0, 1.0])


def test_penalties_only_touch_their_rows():
    from engine.sampler import apply_penalties
    x = torch.ones(2, 4)
    rows = [Row(SamplingParams(), output_token_ids=[0]),
            Row(SamplingParams(frequency_penalty=1.0), output_token_ids=[0])]
    apply_penalties(x, rows)
    assert x.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    row = Row(SamplingParams(temperature=0.0, repetition_penalty=1.5), output_token_ids=[0])
    assert Sampler(set())(logits, [row]).token_ids == [1]  # 3/1.5 = 2 < 2.5


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])  # EOS=2 best, stop id 3 next
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert Sampler({EOS})(logits, [Row(p, output_token_ids=[4])]).token_ids == [4]
    assert Sampler({EOS})(logits, [Row(p, output_token_ids=[4, 4])]).token_ids == [2]
    # With ignore_eos, EOS does not stop the request, so it is not masked.
    p2 = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler({EOS})(logits, [Row(p2)]).token_ids == [2]


def test_logit_bias():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    row = Row(SamplingParams(temperature=0.0, logit_bias={1: 10.0, 99: 5.0}))
    assert Sampler(set())(logits, [row]).token_ids == [1]
    row = Row(SamplingParams(temperature=1.0, logit_bias={0: -math.inf}))
    assert 0 not in Sampler(set())(logits.repeat(50, 1), [row] * 50).token_ids


def test_prompt_logprobs():
    logits = torch.randn(5, 20)
    targets = [3, 1, 4, 1, 5]
    chosen, tops = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx([raw[i, t].item() for i, t in enumerate(targets)], abs=1e-6)
    assert [[t for t, _ in top] for top in tops] == raw.topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits, targets, 0)[1] == [[]] * 5
