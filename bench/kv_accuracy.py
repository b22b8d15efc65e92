"""Issue 33 item 4: KV cache quantization accuracy on texts the developers did not pick.

  python bench/kv_accuracy.py [--model GGUF_OR_DIR] [--limit 2048] [--context 1024]

Perplexity (pdserve.eval.perplexity: sliding windows, stride context/2) of each text under
the engine with a float KV cache (none), int8 and fp8_e4m3 (8-bit with per-(block, head)
scales and the calibrated K shift, engine/kv_calibration.py), and the delta against none.
Texts: the Apache-2.0 and GPL-3 licences (English legal prose) and Python's argparse.py
(source code, not prose). Default model: the embedded SmolLM2-135M-Instruct GGUF.
"""
from __future__ import annotations

import argparse
import argparse as _argparse_module
import platform
import time
from pathlib import Path

TEXTS = {"Apache-2.0": "/usr/share/common-licenses/Apache-2.0",
         "GPL-3": "/usr/share/common-licenses/GPL-3",
         "argparse.py": _argparse_module.__file__}
KV = ["auto", "int8", "fp8_e4m3"]


def main() -> None:
    from engine import LLM
    from pdserve import eval as ev
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache/pdserve/smollm2-135m-instruct/"
                                           "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--limit", type=int, default=2048)
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()} "
          f"{platform.processor() or ''}, model {Path(a.model).name}, first {a.limit} tokens "
          f"of each text, context {a.context}, stride {a.context // 2}", flush=True)
    ids = {name: ev.text_ids(a.model, path, a.limit) for name, path in TEXTS.items()}
    ppl = {}
    for kv in KV:
        llm = LLM(a.model, kv_cache_dtype=kv)
        for name in TEXTS:
            t0 = time.perf_counter()
            ppl[name, kv] = ev.perplexity(ids[name], a.context, a.context // 2,
                                          ev.llm_logprobs(llm), f"kv {kv}").value
            print(f"{name} kv {kv}: {ppl[name, kv]:.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        del llm
    print("\n| text | tokens | none | int8 | vs none | fp8_e4m3 | vs none |\n|---|---|---|---|---|---|---|")
    for name in TEXTS:
        base = ppl[name, "auto"]
        cells = " | ".join(f"{ppl[name, kv]:.4f} | {100 * (ppl[name, kv] / base - 1):+.2f}%"
                           for kv in KV[1:])
        print(f"| {name} | {len(ids[name])} | {base:.4f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
