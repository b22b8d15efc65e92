"""Decode step and prefill throughput of pdserve's model on a Llama-3.1-8B-shaped model with
random bf16 weights, beside the bandwidth floor, the matmul ceiling and transformers eager,
all measured in the same run. One markdown table.

    python bench/decode_step.py                 # CUDA, 8B shape: about 3-4 minutes on an H200
    python bench/decode_step.py --smoke         # CPU, tiny shape: checks the code paths only

Decode runs through engine.cuda_graph.DecodeGraphs (one CUDA graph per batch bucket, the
same object the engine uses); prefill runs the model eagerly on 4 x 4096 tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import ModelConfig  # noqa: E402
from engine.cuda_graph import DecodeGraphs  # noqa: E402
from engine.kernels import build_cos_sin_cache  # noqa: E402
from engine.model import AttentionMetadata, CausalLM  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16)
BS = 16


def model_config(shape: dict, max_len: int) -> ModelConfig:
    return ModelConfig(
        model_dir="(random)", architecture="LlamaForCausalLM", rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False,
        qk_norm=False, max_model_len=max_len, **shape)


def random_model(cfg: ModelConfig, dtype, device) -> CausalLM:
    with torch.device("meta"):
        m = CausalLM(cfg)
    m.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    m.cos_sin = build_cos_sin_cache(cfg.head_dim, cfg.max_model_len + 1, cfg.rope_theta,
                                    cfg.rope_scaling, device)
    return m.eval().requires_grad_(False)


def timer(device):
    if device == "cuda":
        def run(fn, iters):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            return statistics.median(ts)
    else:
        def run(fn, iters):
            fn()
            ts = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return statistics.median(ts)
    return run


def decode_inputs(batch: int, ctx: int, device):
    """Each sequence owns cdiv(ctx+1, BS) consecutive blocks; its new token sits at `ctx`."""
    per = -(-(ctx + 1) // BS)
    tables = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
    pos = torch.full((batch,), ctx, dtype=torch.int64)
    slots = tables[:, ctx // BS].long() * BS + ctx % BS
    meta = AttentionMetadata(slots.to(device), tables.to(device),
                             torch.full((batch,), ctx + 1, dtype=torch.int32, device=device),
                             torch.arange(batch + 1, dtype=torch.int32, device=device), 1, ctx + 1)
    return torch.randint(0, 500, (batch,), device=device), pos.to(device), meta


def hf_decode_step(shape, batch, ctx, dtype, device, run):
    """transformers eager decode step on the same shape (random weights), seconds."""
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=ctx + 64)
    with torch.device(device):
        m = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, 500, (batch, ctx), device=device)
    with torch.inference_mode():
        out = m(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)

        def step():
            m(input_ids=nxt, past_key_values=cache, use_cache=True)
            for layer in getattr(cache, "layers", []):      # keep the length fixed
                if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > ctx:
                    layer.keys, layer.values = layer.keys[..., :ctx, :], layer.values[..., :ctx, :]
        t = run(step, 5)
    del m, cache
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (code-path check)")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--no-hf", action="store_true")
    a = ap.parse_args()
    device = "cpu" if a.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench/decode_step.py needs CUDA (use --smoke on CPU)")
        return 0
    shape, dtype = (TINY, torch.float32) if a.smoke else (LLAMA_8B, torch.bfloat16)
    batches = [int(x) for x in a.batches.split(",")]
    run = timer(device)
    cfg = model_config(shape, max_len=max(a.ctx + 64, 4096 + 16))
    model = random_model(cfg, dtype, device)
    esize = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * esize
    per = -(-(a.ctx + 1) // BS)
    nblocks = max(max(batches) * per, 4 * 4096 // BS + 8)
    kv = torch.zeros(cfg.num_layers, 2, nblocks, BS, cfg.num_kv_heads, cfg.head_dim,
                     dtype=dtype, device=device)
    model.bind_kv_cache(kv)

    # baselines measured now, on this device
    big = torch.empty(2**28 if not a.smoke else 2**20, dtype=torch.float32, device=device)
    copy_bw = 2 * big.numel() * 4 / run(lambda: big.clone(), 10)          # bytes read + written
    n = 8192 if not a.smoke else 256
    x = torch.randn(n, n, dtype=dtype, device=device)
    mm_flops = 2 * n**3 / run(lambda: x @ x, 10)
    del big, x

    graphs = DecodeGraphs(model, max(batches), -(-cfg.max_model_len // BS), device)
    t = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t
    rows = []
    for b in batches:
        ids, pos, meta = decode_inputs(b, a.ctx, device)
        step = run(lambda: graphs.run(ids, pos, meta), 20)
        kv_bytes = b * (a.ctx + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * esize
        floor = (weight_bytes + kv_bytes) / copy_bw
        hf = None
        if not a.no_hf:
            try:
                hf = hf_decode_step(shape, b, a.ctx, dtype, device, run)
            except Exception as e:          # the baseline must not hide our own numbers
                print(f"transformers baseline failed at batch {b}: {e!r}")
        rows.append((b, step, floor, hf))

    # prefill: 4 sequences x 4096 tokens, eager, triton prefill attention
    S, B = (4096, 4) if not a.smoke else (64, 2)
    per_p = S // BS
    tables = torch.arange(B * per_p, dtype=torch.int32).view(B, per_p)
    p = torch.arange(S).repeat(B)
    slots = (tables.long().repeat_interleave(BS, 1) * BS + torch.arange(BS).repeat(per_p)).flatten()
    meta = AttentionMetadata(slots.to(device), tables.to(device),
                             torch.full((B,), S, dtype=torch.int32, device=device),
                             torch.arange(0, B * S + 1, S, dtype=torch.int32, device=device), S, S)
    ids = torch.randint(0, 500, (B * S,), device=device)
    with torch.inference_mode():
        pre = run(lambda: model(ids, p.to(device), meta), 3)
    n_params = sum(p_.numel() for n_, p_ in model.named_parameters() if "embed" not in n_)
    attn = B * cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * S * S / 2
    pre_flops = (2 * n_params * B * S + attn) / pre

    print(f"\n{'CPU smoke, tiny shape' if a.smoke else torch.cuda.get_device_name()}: "
          f"Llama-3.1-8B shape, {dtype}, context {a.ctx}, weights {weight_bytes / 1e9:.2f} GB; "
          f"copy {copy_bw / 1e12:.2f} TB/s, matmul {mm_flops / 1e12:.0f} TFLOP/s (same run); "
          f"graph capture {capture_s:.1f} s\n")
    print("| batch | pdserve step (CUDA graph) | floor (weights+KV / copy BW) | share of floor "
          "| out tok/s | transformers eager | vs transformers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b, step, floor, hf in rows:
        hf_s = "-" if hf is None else f"{hf * 1e3:.2f} ms"
        ratio = "-" if hf is None else f"{hf / step:.1f}x"
        print(f"| {b} | {step * 1e3:.2f} ms | {floor * 1e3:.2f} ms | {floor / step:.0%} "
              f"| {b / step:,.0f} | {hf_s} | {ratio} |")
    print(f"\nprefill {B} x {S} tokens: {pre * 1e3:.1f} ms, {B * S / pre:,.0f} tok/s, "
          f"{pre_flops / 1e12:.0f} TFLOP/s = {pre_flops / mm_flops:.0%} of the matmul ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
