"""`pdserve bench` end to end: against a real pdserve system on the tiny model in its three load
modes (--concurrency, --rate, --trace), and against a small fake OpenAI server that answers
429 and 500, breaks a stream and sends no usage, so every count is known in advance.

Prompt lengths are checked with the `tokenizers` library reading the model's tokenizer.json
(not pdserve's tokenizer), and the summary's percentiles with numpy's. Each run is a few
seconds of load on the tiny model.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from pdserve import cli
from pdserve.bench_prompts import PromptBuilder, ServerTokenizer
from pdserve.launcher import free_port
from sim.stats import SUMMARY_KEYS
from sim.trace import TraceRecord, write_trace

pytestmark = pytest.mark.e2e
HANG_S = 3.0


@pytest.fixture(scope="module")
def system(start_system):
    port = free_port()
    start_system(1, 1, http_port=port)
    return f"http://127.0.0.1:{port}"


def bench(capsys, *argv) -> tuple[dict, str]:
    """`pdserve bench ... --json` in this process: (the JSON object, stderr)."""
    capsys.readouterr()
    assert cli.main(["bench", *argv, "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out.strip().splitlines()[-1]), out.err


def sane(s: dict, sent: int) -> None:
    assert tuple(k for k in s if k != "run") == SUMMARY_KEYS
    assert s["requests"] == s["completed"] == sent
    assert s["errors"] == s["rejected_429"] == 0
    assert s["tokens_from_usage"] is True and s["run"]["prompt_tokens_exact"] is True
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_p99_ms"]
    assert s["ttft_p50_ms"] <= s["e2e_p50_ms"] and s["ttft_p90_ms"] <= s["e2e_p90_ms"]
    assert 0 < s["itl_p50_ms"] <= s["itl_p90_ms"] < s["e2e_p90_ms"]
    assert s["throughput_tok_s"] > 0 and s["slo_attainment"] == 1.0
    assert s["goodput_rps"] == pytest.approx(sent / s["duration_s"], rel=1e-3)


def test_concurrency(system, capsys):
    s, err = bench(capsys, "--url", system, "--concurrency", "3", "--num-requests", "9",
                   "--input-tokens", "200", "--output-tokens", "12")
    sane(s, 9)
    # throughput: every request made exactly its 12 tokens (ignore_eos), over the window
    assert s["throughput_tok_s"] == pytest.approx(9 * 12 / s["duration_s"], rel=1e-3)
    assert "sent 9/9 done 9/9 errors 0 429 0" in err


def test_chat_endpoint(system, capsys):
    s, _ = bench(capsys, "--url", system, "--endpoint", "chat", "--concurrency", "2",
                 "--num-requests", "4", "--input-tokens", "50", "--output-tokens", "7")
    sane(s, 4)
    assert s["throughput_tok_s"] == pytest.approx(4 * 7 / s["duration_s"], rel=1e-3)


def test_rate_with_slo(system, capsys):
    s, _ = bench(capsys, "--url", system, "--rate", "4", "--duration", "2.5",
                 "--input-tokens", "64", "--output-tokens", "8", "--seed", "3")
    assert s["requests"] >= 3          # seeded Poisson: the same count every run
    sane(s, s["requests"])
    tight, _ = bench(capsys, "--url", system, "--rate", "4", "--duration", "2.5",
                     "--input-tokens", "64", "--output-tokens", "8", "--seed", "3",
                     "--slo-ttft-ms", "0.001")
    assert tight["requests"] == s["requests"] and tight["goodput_rps"] == 0
    assert tight["slo_attainment"] == 0.0


def test_trace_replay_and_shared_prefixes(system, capsys, tmp_path):
    recs = [TraceRecord(0, 600, 6, (1, 2)), TraceRecord(200, 1100, 6, (1, 2, 3)),
            TraceRecord(400, 300, 10, (4,)), TraceRecord(700, 1030, 4, (1, 2, 5)),
            TraceRecord(900, 50, 5)]
    path = tmp_path / "t.jsonl"
    write_trace(path, recs)
    s, _ = bench(capsys, "--url", system, "--trace", str(path), "--rate-scale", "2")
    sane(s, len(recs))
    assert s["throughput_tok_s"] == pytest.approx(31 / s["duration_s"], rel=1e-3)


def test_prompts_have_the_length_by_the_models_own_tokenizer(system, model_dir):
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    model = httpx.get(system + "/v1/models").json()["data"][0]["id"]
    tok = ServerTokenizer(system, model, {})
    b = PromptBuilder(tok.count, seed=1)
    assert b.calibrate() and b.exact
    for n, ids in ((1, ()), (37, (9,)), (512, (7,)), (513, (7, 8)), (1800, (7, 8, 9))):
        text = b.build(ids, n, unique=n)
        assert len(ref.encode(text, add_special_tokens=False).ids) == n, n
    a, c = b.build((7, 8), 700, 1), b.build((7, 8, 9), 1300, 2)
    assert c.startswith(a)                      # shared ids: shared text
    assert not b.build((), 700, 3).startswith(a[:200])
    tok.close()


class Fake(BaseHTTPRequestHandler):
    """Request n (from 0) of /v1/completions: n % 4 == 1 -> 429, n % 4 == 2 -> 500, n == 7 ->
    an error chunk mid-stream, else max_tokens chunks of one token, no usage. No /tokenize.
    `strict`: a body with ignore_eos gets 400, as OpenAI's own API answers unknown fields.
    `hang`: the request numbers that stall HANG_S before their stream starts."""
    n = 0
    strict = False
    hang: set[int] = set()
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def _json(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._json(200, {"data": [{"id": "fake-model"}]} if self.path == "/v1/models" else {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            return self._json(404, {"error": {"message": "not found"}})
        if Fake.strict and "ignore_eos" in body:
            return self._json(400, {"error": {"message": "Unrecognized request argument "
                                              "supplied: ignore_eos"}})
        with Fake.lock:
            n, Fake.n = Fake.n, Fake.n + 1
        if n in Fake.hang:
            time.sleep(HANG_S)
        if n % 4 in (1, 2):
            return self._json(429 if n % 4 == 1 else 500, {"error": {"message": "no"}})
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(body["max_tokens"]):
                chunk = {"error": {"message": "boom"}} if n == 7 and i == 2 else \
                    {"choices": [{"index": 0, "text": f" t{i}"}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass                      # the client gave up (its timeout): nothing to say


@pytest.fixture
def fake():
    Fake.n, Fake.strict, Fake.hang = 0, False, set()
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Fake)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    t.join(10)


def test_fake_server_429_500_and_no_usage(fake, capsys, tmp_path):
    s, err = bench(capsys, "--url", fake, "--concurrency", "1", "--num-requests", "10",
                   "--warmup", "0", "--output-tokens", "5", "--input-tokens", "20",
                   "--records", str(tmp_path / "r.jsonl"))
    recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["status"] for r in recs] == ["ok", "rejected", "error", "ok", "ok", "rejected",
                                           "error", "error", "ok", "rejected"]
    assert [r["http_status"] for r in recs][:3] == [200, 429, 500]
    # n = 0..9: 429 at 1, 5, 9; 500 at 2, 6; an error chunk at 7; ok at 0, 3, 4, 8
    assert (s["requests"], s["completed"], s["rejected_429"], s["errors"]) == (10, 4, 3, 3)
    assert s["tokens_from_usage"] is False and s["run"]["prompt_tokens_exact"] is False
    assert s["throughput_tok_s"] == pytest.approx(4 * 5 / s["duration_s"], rel=1e-3)
    assert s["slo_attainment"] == pytest.approx(0.4)
    assert "errors 3 429 3" in err
    assert any("HTTP 500" in e for e in s["run"]["error_samples"])


def test_summary_percentiles_are_numpys(fake, capsys, monkeypatch):
    """The table's figures are sim.stats over the records loadgen returned: p90 as numpy."""
    from pdserve import loadgen
    seen = []
    real = loadgen.send

    async def spy(http, target, job):
        r = await real(http, target, job)
        seen.append(r)
        return r
    monkeypatch.setattr(loadgen, "send", spy)
    s, _ = bench(capsys, "--url", fake, "--concurrency", "2", "--num-requests", "12",
                 "--warmup", "0", "--output-tokens", "4")
    ok = [r for r in seen if r["status"] == "ok"]
    assert len(ok) == s["completed"] > 0
    assert s["ttft_p90_ms"] == pytest.approx(
        1000 * float(np.percentile([r["ttft_s"] for r in ok], 90)), abs=1e-3)


def test_a_server_refusing_ignore_eos_gets_requests_without_it(fake, capsys):
    Fake.strict = True
    s, _ = bench(capsys, "--url", fake, "--concurrency", "1", "--num-requests", "4",
                 "--output-tokens", "3")
    # n = 0 the warm-up (its retry without ignore_eos); 1: 429, 2: 500, 3 and 4 ok
    assert s["run"]["ignore_eos"] is False
    assert (s["completed"], s["rejected_429"], s["errors"]) == (2, 1, 1)


def _llama_server() -> Path | None:
    from engine.config import cache_dir
    found = sorted((cache_dir() / "llama-server").glob("*/llama-server"))
    return found[0] if found else None


def test_llama_server_peer(capsys, tmp_path):
    """Against llama.cpp's own server (bench/build_llama_server.sh's cached binary; skipped
    where it was not built): its /tokenize form, its usage, the same summary."""
    import subprocess
    from engine.config import cache_dir
    from tests.helpers import wait_until
    binary = _llama_server()
    gguf = cache_dir() / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if binary is None or not gguf.is_file():
        pytest.skip("llama-server not built here (bench/build_llama_server.sh) or no default model")
    port = free_port()
    with open(tmp_path / "llama-server.log", "wb") as log:
        proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", "1", "-c", "4096",
                                 "--parallel", "4", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200, None
            except httpx.HTTPError as e:
                return proc.poll() is not None, e
        wait_until(up, 60, "llama-server /health")
        assert proc.poll() is None, (tmp_path / "llama-server.log").read_text()[-2000:]
        s, _ = bench(capsys, "--url", base, "--concurrency", "2", "--num-requests", "4",
                     "--input-tokens", "40", "--output-tokens", "6")
        sane(s, 4)
        assert s["throughput_tok_s"] == pytest.approx(4 * 6 / s["duration_s"], rel=1e-3)
    finally:
        proc.terminate()
        proc.wait(20)


def test_client_timeout_is_an_error_and_duration_bounds_a_closed_loop(fake, capsys):
    Fake.hang = {3}
    t0 = time.monotonic()
    s, _ = bench(capsys, "--url", fake, "--concurrency", "2", "--duration", "1.0",
                 "--warmup", "0", "--output-tokens", "2", "--timeout", "0.5")
    # well within the deadline (duration + 2 timeouts), the stalled request cut at 0.5 s
    assert time.monotonic() - t0 < HANG_S
    assert s["errors"] >= 1 and any("Timeout" in e for e in s["run"]["error_samples"])
    assert s["requests"] == s["completed"] + s["errors"] + s["rejected_429"] > 4


def test_measure_is_the_cli_without_printing(fake):
    from pdserve.bench import measure, parse
    summary, run, records = measure(parse(["--url", fake, "--concurrency", "1", "--num-requests",
                                           "4", "--warmup", "0", "--no-progress"]))
    assert (summary["requests"], summary["completed"], len(records)) == (4, 2, 4)
    assert run["model"] == "fake-model" and not run["prompt_tokens_exact"]
