"""`engine.step()` as the engine runs it (scheduling, input preparation, CUDA-graph replay,
sampling on the device, output processing) on a Llama-3.1-8B-shaped model with random bf16
weights, batch 1 / 16 / 64 / 256 at 1k and 8k context, beside, in the same run: the bandwidth
floor (weights + KV bytes / measured copy bandwidth), transformers eager (one short
measurement) and the plain-torch CUDA-graph peer (the anchors' script, run as a subprocess).
Then energy: per-request `energy_joules` (services/energy.py's meter on the engine) summed
against NVML's total energy counter over the same steps, and joules per output token.

    python bench/decode_step.py --peer ../shared/anchors/gpu_torch_graph_decode.py   # CUDA, < 2 min
    python bench/decode_step.py --smoke          # CPU, tiny shape: checks the code paths only

Requests enter as the decode worker's do (`add_remote_request` + `remote_kv_done`: the KV is
"already there"), so each measured step is a pure decode step of B requests at the context.
Host side = schedule + input preparation (lists -> tensors -> the graphs' static buffers) +
output processing after the sampled ids are back: the work the GPU waits for, timed around the
engine's own calls (the graph launch and the sampler's launches are not in it).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.llm_engine as llm_engine  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.models import build  # noqa: E402
from engine.models.base import CausalLM  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
BS = 16


def model_dir(shape: dict, tmp: str) -> str:
    """A model directory holding only config.json (weights are random: see random_model)."""
    cfg = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
               rope_theta=500000.0, rope_scaling=ROPE, max_position_embeddings=131072,
               tie_word_embeddings=False)
    Path(tmp, "config.json").write_text(json.dumps(cfg))
    return tmp


def random_model(cfg: ModelConfig, dtype, device, backend="auto") -> CausalLM:
    """load_model's stand-in: the model built on `device` with N(0, 0.02) weights drawn there
    (16 GB in bf16: never through the CPU)."""
    with torch.device("meta"):
        m = build(cfg, backend)
    m.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    m.cos_sin = m.rotary_table(device)
    return m.eval().requires_grad_(False)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, n) -> float:
    """bytes read + written per second by a device-to-device copy (median of 10)."""
    x = torch.empty(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ts = []
    for _ in range(11):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        ts.append(time.perf_counter() - t)
    return 2 * n * 4 / statistics.median(ts[1:])


class PhaseClock:
    """Wraps the engine's own calls to time a step's host-side phases."""

    def __init__(self, eng):
        self.t = dict(sched=0.0, prep=0.0, sample_end=0.0)
        for obj, name, key in ((eng.scheduler, "schedule", "sched"), (eng.runner, "prepare", "prep"),
                               (eng.runner.graphs, "stage", "prep")):
            if obj is not None:
                setattr(obj, name, self._timed(getattr(obj, name), key))
        sampler = eng.sampler

        def sample(*a, **k):
            out = sampler(*a, **k)
            self.t["sample_end"] = time.perf_counter()
            return out
        eng.sampler = sample

    def _timed(self, fn, key):
        def run(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            self.t[key] += time.perf_counter() - t
            return out
        return run

    def reset(self):
        self.t.update(sched=0.0, prep=0.0, sample_end=0.0)


def add_batch(eng, batch, ctx, max_tokens, vocab, tag) -> list[str]:
    g = torch.Generator().manual_seed(batch * 100003 + ctx)
    rids = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        rid = f"{tag}-{i}"
        prompt = torch.randint(3, vocab, (ctx,), generator=g).tolist()
        if eng.add_remote_request(rid, prompt, params) is None:
            raise RuntimeError(f"no KV blocks for batch {batch} x {ctx}")
        eng.remote_kv_done(rid, prompt[-1])
        rids.append(rid)
    return rids


def measure(eng, clock, batch, ctx, steps, vocab, device) -> dict:
    """Median wall time and host side of `steps` steps of `batch` requests whose contexts
    end at `ctx` (prompts of ctx - steps - 8 tokens)."""
    rids = add_batch(eng, batch, ctx - steps - 8, steps + 8, vocab, f"b{batch}c{ctx}")
    for _ in range(3):
        eng.step()
    sync(device)
    walls, host = [], []
    for _ in range(steps):
        clock.reset()
        t = time.perf_counter()
        outs = eng.step()
        end = time.perf_counter()
        assert len(outs) == batch, (len(outs), batch)
        walls.append(end - t)
        host.append(clock.t["sched"] + clock.t["prep"] + (end - clock.t["sample_end"]))
    for rid in rids:
        eng.abort_request(rid)
    return dict(step=statistics.median(walls), host=statistics.median(host))


def energy_run(eng, meter, handle, batch, ctx, seconds, vocab, step_s) -> dict:
    """Steps back to back for about `seconds`; the meter's per-request joules summed against
    NVML's energy counter read just before and after."""
    import pynvml
    n = max(20, int(seconds / step_s))
    warm = max(5, int(1.0 / step_s))      # NVML's power reading averages over ~1 s: load it first
    rids = add_batch(eng, batch, ctx, n + warm + 8, vocab, f"e{batch}")
    for _ in range(warm):
        eng.step()
    torch.cuda.synchronize()
    before = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)       # mJ
    t = time.perf_counter()
    tokens = 0
    eng.step_observers.append(meter)
    for _ in range(n):
        tokens += len(eng.step())
    took = time.perf_counter() - t
    nvml_j = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - before) / 1e3
    eng.step_observers.remove(meter)
    per_request = sum(meter.pop(rid) or 0.0 for rid in rids)
    for rid in rids:
        eng.abort_request(rid)
    return dict(batch=batch, ctx=ctx, seconds=took, tokens=tokens, nvml=nvml_j, meter=per_request)


def hf_decode_step(shape, ctx, dtype, device, steps=3) -> float:
    """transformers eager, batch 1: median seconds of a decode step at context `ctx`."""
    import transformers
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=ctx + 64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            m = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(0, 500, (1, ctx), device=device)
    ts = []
    with torch.inference_mode():
        out = m(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps + 1):
            sync(device)
            t = time.perf_counter()
            nxt = m(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            sync(device)
            ts.append(time.perf_counter() - t)
    del m, cache, out
    return statistics.median(ts[1:])


def run_peer(path: str, smoke: bool, timeout: int) -> list[str]:
    """The peer's own table lines, measured by its own process (after ours has freed the GPU)."""
    if not path or not Path(path).exists():
        return [f"(peer not run: {path or 'no --peer given'} does not exist)"]
    try:
        p = subprocess.run([sys.executable, path] + (["--tiny"] if smoke else []), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"(peer timed out after {timeout} s)"]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("|")]
    return lines if p.returncode == 0 else lines + [f"(peer failed rc={p.returncode}: {p.stderr[-300:]})"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (code-path check)")
    ap.add_argument("--peer", default=os.environ.get("PDSERVE_TORCH_PEER", ""),
                    help="path of the plain-torch CUDA-graph peer script (anchors)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-hf", action="store_true")
    a = ap.parse_args()
    device = "cpu" if a.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench/decode_step.py needs CUDA (use --smoke on CPU)")
        return 0
    shape, dtype = (TINY, torch.float32) if a.smoke else (LLAMA_8B, torch.bfloat16)
    configs = [(b, c) for c in (1024, 8192) for b in (1, 16, 64, 256)]
    if a.smoke:
        configs = [(b, c) for c in (64, 256) for b in (1, 16, 256)]
    esize = torch.empty((), dtype=dtype).element_size()
    kv_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * esize
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 2**33
    weights_est = 16.1e9 if not a.smoke else 0
    budget = (free - weights_est) * 0.75                   # graphs, logits, activations keep the rest
    fits = [(b, c) for b, c in configs if b * (c + a.steps + 32) * kv_per_token <= budget]
    skipped = [x for x in configs if x not in fits]
    max_len = max(c for _, c in configs) + a.steps + 64
    num_blocks = max(b * -(-(c + a.steps + 32) // BS) for b, c in fits) + 64
    copy_bw = copy_bandwidth(device, 2**28 if not a.smoke else 2**20)
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write)", flush=True)

    llm_engine.load_model = random_model                   # random weights, drawn on the device
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        eng = llm_engine.LLMEngine.from_model_dir(
            model_dir(shape, tmp), device=device, dtype="float32" if a.smoke else "bfloat16",
            max_model_len=max_len, num_blocks=num_blocks, max_num_seqs=max(b for b, _ in configs),
            enable_prefix_caching=False, decode_graphs=True)
        build_s = time.perf_counter() - t
    gc.collect()
    gc.freeze()                                            # as the workers do once built
    g = eng.runner.graphs
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    print(f"engine built in {build_s:.1f} s ({len(g.graphs)} graphs: batch buckets {g.buckets}, "
          f"context buckets {g.context_buckets}); weights {weight_bytes / 1e9:.2f} GB", flush=True)
    clock = PhaseClock(eng)
    rows = []
    for b, c in fits:
        r = measure(eng, clock, b, c, a.steps, shape["vocab_size"], device)
        floor = (weight_bytes + b * c * kv_per_token) / copy_bw
        rows.append((b, c, r["step"], r["host"], floor))
        print(f"batch {b} ctx {c}: step {r['step'] * 1e3:.2f} ms, host {r['host'] * 1e3:.3f} ms, "
              f"floor {floor * 1e3:.2f} ms", flush=True)

    name = "CPU smoke, tiny shape" if a.smoke else f"{torch.cuda.get_device_name()}, Llama-3.1-8B shape"
    print(f"\n{name}, {dtype}, weights {weight_bytes / 1e9:.2f} GB, copy {copy_bw / 1e12:.2f} TB/s "
          f"(same run); engine.step() median of {a.steps}, greedy, sampled on the device\n")
    print("| batch | context | pdserve engine.step() | out tok/s | host side (sched+prep+output) "
          "| floor (weights+KV / copy BW) | share of floor |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b, c, step, host, floor in rows:
        print(f"| {b} | {c} | {step * 1e3:.2f} ms | {b / step:,.0f} | {host * 1e3:.3f} ms "
              f"| {floor * 1e3:.2f} ms | {floor / step:.0%} |")
    for b, c in skipped:
        print(f"| {b} | {c} | not run: KV {b * c * kv_per_token / 1e9:.0f} GB does not fit | | | | |")
    print(flush=True)

    if device == "cuda":
        try:
            print_energy(eng, rows, shape["vocab_size"])
        except Exception as e:                               # a missing NVML must not hide the rest
            print(f"energy not measured: {type(e).__name__}: {e}", flush=True)
    del eng, g, clock
    gc.unfreeze()
    gc.collect()                                             # the wrappers make cycles
    if device == "cuda":
        torch.cuda.empty_cache()

    if not a.no_hf:
        ctx = 1024 if not a.smoke else 64
        try:
            hf = hf_decode_step(shape, ctx, dtype, device)
            ours = next((s for b, c, s, _, _ in rows if b == 1 and c == min(cc for _, cc in configs)), None)
            vs = f" = {hf / ours:.1f}x pdserve's step" if ours else ""
            print(f"\ntransformers eager, batch 1, context {ctx}: {hf * 1e3:.2f} ms per step{vs}", flush=True)
        except Exception as e:                               # the baseline must not hide ours
            print(f"transformers baseline failed: {type(e).__name__}: {e}", flush=True)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\nplain-torch CUDA-graph peer (anchors script, its own process, same run):")
    for ln in run_peer(a.peer, a.smoke, 75):
        print(ln, flush=True)
    return 0


def print_energy(eng, rows, vocab) -> None:
    import pynvml

    from services.energy import EnergyMeter, gpu_index, nvml_power_reader
    idx = gpu_index("cuda")
    meter = EnergyMeter(nvml_power_reader(idx))
    if not meter.available:
        raise RuntimeError("NVML gives no power reading here")
    handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
    step_of = {(b, c): s for b, c, s, _, _ in rows}
    energy = [energy_run(eng, meter, handle, b, 1024, 2.5, vocab, step_of.get((b, 1024), 0.02))
              for b in (1, 256)]
    print("| batch | context | steps' wall time | output tokens | NVML energy | sum of per-request "
          "energy_joules | meter / NVML | J per output token (NVML) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for e in energy:
        print(f"| {e['batch']} | {e['ctx']} | {e['seconds']:.2f} s | {e['tokens']} | {e['nvml']:.1f} J "
              f"| {e['meter']:.1f} J | {e['meter'] / e['nvml']:.3f} | {e['nvml'] / e['tokens']:.4f} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
