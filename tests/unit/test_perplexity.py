"""`pdserve eval perplexity` (pdserve/eval.py): the engine's perplexity of a real text (the
GPL-3 on every Debian machine) equals transformers' on the same tokens and windows within
0.1%, and the `--url` path through a running server's /v1/completions agrees with it."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.tiny_model import ensure_default_model
from pdserve import cli
from pdserve.eval import engine_logprobs, perplexity, text_ids, windows
from pdserve.launcher import Launcher, free_port

DATA = Path("/usr/share/common-licenses/GPL-3")
CONTEXT, STRIDE, LIMIT = 256, 96, 2500

pytestmark = pytest.mark.skipif(not DATA.is_file(), reason="needs Debian's common-licenses")


@pytest.mark.parametrize("n,context,stride", [(2, 4, 3), (10, 4, 1), (100, 16, 7), (64, 16, 15),
                                               (17, 16, 8), (1000, 1000, 300)])
def test_windows_score_every_token_once_with_enough_context(n, context, stride):
    scored = []
    for i, (b, e, first) in enumerate(windows(n, context, stride)):
        assert 0 <= b < first <= e <= n and e - b <= context
        if i:
            assert first - b >= context - stride
        scored += range(first, e)
    assert scored == list(range(1, n))


def test_windows_without_overlap_are_refused():
    with pytest.raises(ValueError, match="stride < context"):
        windows(100, 16, 16)


@pytest.fixture(scope="module")
def model():
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def engine_result(model):
    ids = text_ids(model, DATA, LIMIT)
    return ids, perplexity(ids, CONTEXT, STRIDE, engine_logprobs(model, num_blocks=128), "engine")


def _transformers_perplexity(model_dir, ids, context, stride) -> float:
    """transformers' documented recipe (labels -100 outside the scored tokens, loss)."""
    import transformers as T
    m = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count, prev_end = 0.0, 0, 0
    x = torch.tensor([ids])
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        labels = x[:, begin:end].clone()
        labels[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            loss = m(x[:, begin:end], labels=labels).loss.item()
        n = int((labels[:, 1:] != -100).sum())         # the loss shifts labels by one
        nll, count, prev_end = nll + loss * n, count + n, end
        if end == len(ids):
            break
    return math.exp(nll / count)


def test_engine_perplexity_equals_transformers(model, engine_result):
    ids, r = engine_result
    assert r.tokens == len(ids) - 1 and len(ids) == LIMIT
    want = _transformers_perplexity(model, ids, CONTEXT, STRIDE)
    assert r.value == pytest.approx(want, rel=1e-3)


def test_url_path_agrees_with_the_engine(model, engine_result, tmp_path, capsys):
    _, r = engine_result
    system = Launcher(model, 1, 1, http_port=free_port(), log_dir=tmp_path)
    system.start(120)
    try:
        port = system.children[-1].argv[system.children[-1].argv.index("--http-port") + 1]
        assert cli.main(["eval", "perplexity", "--model", model, "--data", str(DATA),
                         "--context", str(CONTEXT), "--stride", str(STRIDE), "--limit", str(LIMIT),
                         "--url", f"http://127.0.0.1:{port}"]) == 0
    finally:
        system.stop()
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("url "))
    tokens, wins, ctx, stride, _, ppl = row.split()[-6:]
    assert (int(tokens), int(wins), int(ctx), int(stride)) == (r.tokens, r.windows, CONTEXT, STRIDE)
    assert float(ppl) == pytest.approx(r.value, rel=1e-3)
