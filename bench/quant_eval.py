"""Issue 11, int8 accuracy and the int8_g32 (GGUF Q8_0) layout's CPU cost.

  python bench/quant_eval.py GGUF TEXT OUT_DIR [--limit 512]

1. Writes GGUF's weights, dequantized by transformers, as a float Hugging Face directory in
   OUT_DIR (a pre-quantized checkpoint only serves its own method: int8 needs float weights).
2. int8 decoder linears with the head and embedding int8 per row, int8_g32, and float:
   `pdserve eval perplexity`'s table for each (engine.quant.quantize.HEAD set in turn).
3. The int8 engine's decode speed with each head layout (alternating rounds).
4. One [N x K] layer at 1 token, 1 thread: float32, the int8 per-channel kernel, int8_g32 as
   two nibble halves on the int4 kernel, and int8_g32 group-major (a loop of the int8 kernel
   over the groups: the tied head's layout); microseconds, median of rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def export_float(gguf: Path, out: Path) -> Path:
    import transformers as T
    from safetensors.torch import save_file
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    m = T.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = m.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in m.state_dict().items()
               if not (tied and k == "lm_head.weight")}, str(out / "model.safetensors"))
    c = m.config.to_dict()
    c.pop("quantization_config", None)
    c["architectures"] = [type(m).__name__]
    (out / "config.json").write_text(json.dumps(c, indent=1))
    T.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def head_ablation(model: Path, text: str, limit: int, context: int = 256) -> None:
    import engine.quant.quantize as L
    from pdserve import eval as ev
    ids = ev.text_ids(str(model), text, limit)
    for head in ("int8", "int8_g32", None):
        L.HEAD = head
        rows = ev.variants(str(model), ids, context, context // 2, ["int8"], ["auto"])
        print(f"\n### int8 decoder linears; head and embedding: {head or 'float32'}\n", flush=True)
        print(ev.variant_table(rows, text), flush=True)
    L.HEAD = "int8_g32"


def head_speed(model: Path, tokens: int = 64, rounds: int = 3) -> None:
    """int8 engines with each head/embedding layout, one stream: decode tok/s, the engines
    taking turns (median of `rounds`)."""
    import engine.quant.quantize as L
    from engine import LLM
    from engine.quant.quantize import weight_bytes
    from pdserve.eval import _decode_tok_s
    llms, speeds = {}, {}
    for head in ("int8", "int8_g32", None):
        L.HEAD = head
        llms[head] = LLM(str(model), quantization="int8", num_blocks=64)
    L.HEAD = "int8_g32"
    for _ in range(rounds):
        for head, llm in llms.items():
            speeds.setdefault(head, []).append(_decode_tok_s(llm, list(range(5, 37)), tokens))
    print(f"\n### int8 engine decode by head/embedding layout, one stream, {tokens} tokens, median "
          f"of {rounds} alternating rounds\n\n| head and embedding | weights MB | decode tok/s | rounds |\n"
          "|---|---|---|---|")
    for head, llm in llms.items():
        print(f"| {head or 'float32'} | {weight_bytes(llm.engine.model) / 1e6:.1f} | "
              f"{statistics.median(speeds[head]):.1f} | {' '.join(f'{v:.1f}' for v in speeds[head])} |",
              flush=True)


def _us(f, rounds: int = 5, n: int = 20) -> float:
    f()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def layer_costs(shapes) -> None:
    from engine.quant.int8 import quantize_int8
    from engine.quant.linear import QuantEmbedding, QuantLinear
    torch.set_num_threads(1)
    for n, k in shapes:
        w, x = torch.randn(n, k) * 0.05, torch.randn(1, k)
        g32 = quantize_int8(w, 32)
        rows = [("float32 F.linear", lambda: torch.nn.functional.linear(x, w)),
                ("int8 per channel, _weight_int8pack_mm", (lambda l: lambda: l(x))(QuantLinear.quantize("int8", w))),
                ("int8_g32, two nibble halves on _weight_int4pack_mm_for_cpu",
                 (lambda l: lambda: l(x))(QuantLinear.of(g32))),
                ("int8_g32 group-major (tied head), _weight_int8pack_mm per group",
                 (lambda l: lambda: l(x))(QuantEmbedding(g32, torch.float32).tied_head()))]
        print(f"\n### One layer [{n} x {k}], 1 token, 1 thread\n\n| path | us | vs float32 |\n|---|---|---|")
        base = None
        for name, f in rows:
            us = _us(f, n=20 if n * k < 5e6 else 3)
            base = base or us
            print(f"| {name} | {us:.0f} | {base / us:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("text")
    ap.add_argument("out", type=Path)
    ap.add_argument("--limit", type=int, default=512)
    a = ap.parse_args()
    model = export_float(a.gguf, a.out)
    print(f"float export of {a.gguf.name}: {model}", flush=True)
    layer_costs([(1536, 576), (49152, 576)])
    head_ablation(model, a.text, a.limit)
    head_speed(model)


if __name__ == "__main__":
    main()
