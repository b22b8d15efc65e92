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
        rows = []
        for local in (["--model", model], []):    # without --model: the server's tokenizer
            assert cli.main(["eval", "perplexity", *local, "--data", str(DATA),
                             "--context", str(CONTEXT), "--stride", str(STRIDE),
                             "--limit", str(LIMIT), "--url", f"http://127.0.0.1:{port}"]) == 0
            out = capsys.readouterr().out
            rows.append(next(line for line in out.splitlines() if line.startswith("url ")))
    finally:
        system.stop()
    for row in rows:
        tokens, wins, ctx, stride, _, ppl = row.split()[-6:]
        assert (int(tokens), int(wins), int(ctx), int(stride)) == (r.tokens, r.windows, CONTEXT,
                                                                   STRIDE)
        assert float(ppl) == pytest.approx(r.value, rel=1e-3)


def test_eval_needs_a_model_or_a_url():
    with pytest.raises(SystemExit, match="give --model .* or --url"):
        cli.main(["eval", "perplexity", "--data", str(DATA)])


TASK = """task: pdserve_gpl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_matches_pdserve(model, tmp_path, monkeypatch):
    """lm-eval's own `local-completions` model against a running pdserve, on a loglikelihood
    task defined on a local JSON file (no hub): each document's loglikelihood equals the one
    from pdserve eval's engine path on the same tokens."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")          # lm-eval[api]
    import json

    from lm_eval.tasks import TaskManager

    from engine.tokenizer import Tokenizer
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lines = [x.strip() for x in DATA.read_text().splitlines() if len(x.strip()) > 40][:6]
    cuts = [x.rfind(" ", 0, len(x) // 2) for x in lines]     # at a word boundary
    docs = [{"context": x[:i], "continuation": x[i:]} for x, i in zip(lines, cuts)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "pdserve_gpl.yaml").write_text(TASK.format(data=tmp_path / "docs.jsonl"))

    port = free_port()
    system = Launcher(model, 1, 1, http_port=port, log_dir=tmp_path / "logs")
    system.start(120)
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": Path(model).name, "tokenizer": model, "num_concurrent": 1,
                        "max_retries": 1, "tokenized_requests": True,
                        "base_url": f"http://127.0.0.1:{port}/v1/completions"},
            tasks=["pdserve_gpl"], task_manager=TaskManager(include_path=str(tmp_path / "task")),
            log_samples=True, bootstrap_iters=0)
    finally:
        system.stop()
    got = {s["doc"]["context"]: s["resps"][0][0][0] for s in out["samples"]["pdserve_gpl"]}
    assert len(got) == len(docs)
    tok = Tokenizer.from_dir(model)
    logprobs_of = engine_logprobs(model, num_blocks=64)
    for d in docs:
        ctx = tok.encode(d["context"], add_special_tokens=False)
        whole = tok.encode(d["context"] + d["continuation"], add_special_tokens=False)
        assert whole[:len(ctx)] == ctx
        want = sum(logprobs_of([whole])[0][len(ctx):])
        assert got[d["context"]] == pytest.approx(want, abs=1e-3)
