"""Every supported architecture, quantization, kernel backend and KV cache dtype gives the
greedy tokens (and logprobs) recorded in tests/golden/outputs.json by the engine as it was
before its restructure: tests/golden.py says how the models are made and compared."""
from __future__ import annotations

import pytest

from engine.models import SUPPORTED_ARCHITECTURES
from engine.quant import QUANTIZATIONS
from tests import golden

ALL = golden.recorded()
MINE = golden.capability() in ALL
# this machine's recording, or else any (compared across ISAs: tests/golden.py)
RECORDED = ALL.get(golden.capability()) or next(iter(ALL.values()))
TOLERANCE = golden.TIGHT if MINE else golden.CROSS_ISA
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
    bad = golden.compare(want, got, **TOLERANCE)
    assert not bad, f"{bad} ({'this CPU capability' if MINE else 'across CPU capabilities'})"


@pytest.mark.parametrize("tol", [golden.TIGHT, golden.CROSS_ISA])
def test_compare_catches_a_changed_token_and_logprob_and_stops_at_a_near_tie(tol):
    want = {"tokens": [[5, 6, 7]], "logprobs": [[-0.1, -0.2, -0.3]], "margins": [[1.0, 1.0, 1.0]]}
    assert golden.compare(want, want, **tol) == []
    assert golden.compare(want, dict(want, tokens=[[5, 9, 7]]), **tol)
    assert golden.compare(want, dict(want, logprobs=[[-0.1, -0.2 - 3 * tol["atol"], -0.3]]), **tol)
    tie = dict(want, margins=[[1.0, tol["near_tie"] / 2, 1.0]])
    assert golden.compare(tie, dict(want, tokens=[[5, 6, 9]]), **tol) == []
