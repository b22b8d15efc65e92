"""Every supported architecture, quantization, kernel backend and KV cache dtype gives the
greedy tokens (and logprobs) recorded in tests/golden/outputs.json by the engine as it was
before its restructure: tests/golden.py says how the models are made and compared."""
from __future__ import annotations

import json

import pytest

from engine.config import QUANTIZATIONS, SUPPORTED_ARCHITECTURES
from tests import golden

RECORDED = json.loads(golden.GOLDEN.read_text())
CASES = golden.cases()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("golden"), {}
    return lambda case: golden.model_path(case["arch"], case["file"], root, made)


def test_every_case_is_recorded_and_every_architecture_and_method_has_cases():
    assert sorted(CASES) == sorted(RECORDED), "python3 -m tests.golden --write records new cases"
    kinds = {c["arch"] for c in CASES.values()}
    assert set(SUPPORTED_ARCHITECTURES.values()) <= kinds
    methods = {c["options"].get("quantization") for c in CASES.values()}
    assert set(QUANTIZATIONS) - {"auto"} <= methods


@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_match_the_recording(models, name):
    case, want = CASES[name], RECORDED[name]
    path = models(case)
    assert golden.fingerprint(path) == want["fingerprint"], \
        "the case's model files differ from the recorded ones (an input changed, not the engine)"
    got = golden.run_case(case, path)
    assert not golden.compare(want, got), golden.compare(want, got)


def test_compare_catches_a_changed_token_and_logprob_and_stops_at_a_near_tie():
    want = {"tokens": [[5, 6, 7]], "logprobs": [[-0.1, -0.2, -0.3]], "margins": [[1.0, 1.0, 1.0]]}
    assert golden.compare(want, want) == []
    assert golden.compare(want, dict(want, tokens=[[5, 9, 7]]))
    assert golden.compare(want, dict(want, logprobs=[[-0.1, -0.2 - 3 * golden.LOGPROB_ATOL, -0.3]]))
    tie = dict(want, margins=[[1.0, golden.NEAR_TIE / 2, 1.0]])
    assert golden.compare(tie, dict(want, tokens=[[5, 6, 9]])) == []
