"""Recorded greedy outputs of every supported architecture, quantization, kernel backend and
KV cache dtype on tiny models: a guard that a restructure of the engine changes no output.

The models are deterministic without transformers' initialisation (its config classes write
config.json; every weight is drawn here from one seeded generator, in name order), so the
recording depends on torch and this file only. `tests/golden/outputs.json` holds, per CPU
capability (torch's kernel ISA, which is also what cpu.c's -march=native build takes) and
case, each prompt's greedy tokens, their logprobs and the margin between the top two.

    python3 -m tests.golden --write      # record this machine's (only when outputs are meant to change)
    python3 -m tests.golden --write --without-bf16-tiles    # ... as its ISA without bf16 tiles

tests/unit/test_golden_outputs.py runs every case and compares: tokens identical up to the
first recorded near-tie (a top-two margin under the tolerance's near-tie, where rounding may
legitimately pick the other token; everything after it is then not compared), logprobs
within its atol. On a machine of a recorded capability the tolerance is TIGHT: outputs as
before up to float32 summation order. Elsewhere it is CROSS_ISA: torch's and cpu.c's kernels
sum in another order there, and the quantized paths round activations to bfloat16, where an
ulp of summation becomes an ulp of bfloat16 (measured on AVX2 against torch's portable
kernels, `ATEN_CPU_CAPABILITY=default python3 -m tests.golden --spread`: CROSS_ISA's comment);
a wrong layout, group, bias or weight on these random models changes tokens and moves
logprobs by O(1).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

GOLDEN = Path(__file__).with_name("golden") / "outputs.json"
TIGHT = dict(near_tie=2e-3, atol=2e-4)        # (near-tie margin, logprob atol)
# measured: torch's portable kernels (ATEN_CPU_CAPABILITY=default) against the AVX2 recording,
# largest logprob difference 6.9e-2 (bf16 int8 path), no token changed past a 5e-2 margin
CROSS_ISA = dict(near_tie=1e-1, atol=1.5e-1)
NEW_TOKENS = 8
DIMS = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
# per architecture: tests/hf_models.py's kind and the config overrides that keep every
# quantization's shapes valid (K a multiple of 128, N of 16)
ARCHS = {
    "llama": {}, "llama3": {}, "llama-tied": {}, "mistral": {}, "qwen2": {},
    "qwen3": dict(head_dim=64),
    "mixtral": dict(intermediate_size=128),
    "qwen2_moe": dict(moe_intermediate_size=128, shared_expert_intermediate_size=128),
    "qwen3_moe": dict(head_dim=64, moe_intermediate_size=128),
    "gemma3_text": dict(head_dim=32, layer_types=["sliding_attention", "full_attention"],
                   tie_word_embeddings=False),
    "deepseek_v3": dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
                        v_head_dim=32, moe_intermediate_size=128),
    # tests/hf_models_moe2.py's kinds
    "glm4_moe": dict(head_dim=32, moe_intermediate_size=128),
    "minimax_m2": dict(head_dim=32, intermediate_size=128),
    # tests/hf_models_gptoss.py's builder: a window of 4 on layer 0, 4 experts top-2
    "gpt_oss": dict(head_dim=32, intermediate_size=128, sliding_window=4, num_local_experts=4),
}
# the kinds tests/hf_models.make_hf_model does not build: kind -> "module:function(kind, out, **config)"
BUILDERS = {"gemma3_text": "tests.hf_models_window:make_window_model",
            "deepseek_v3": "tests.hf_models_mla:make_mla_model",
            "glm4_moe": "tests.hf_models_moe2:make_moe2_model",
            "minimax_m2": "tests.hf_models_moe2:make_moe2_model",
            "gpt_oss": "tests.hf_models_gptoss:make_gpt_oss_model"}
# Gemma multiplies its embedding by sqrt(hidden): its table drawn N(0, 1/hidden), so that the
# embedding does not outweigh the layers' (normed) outputs and every prompt repeat its token
EMBED_SCALE = {"gemma3_text": DIMS["hidden_size"] ** -0.5}
QUANTS = ("none", "int8", "int8_g32", "int4_g32", "int4_g128", "fp8", "fp8_tensor")
PREQUANT = {  # file kind -> how it is written (tests/gguf_files.py, tests/prequant_files.py)
    "gguf-Q8_0": ("gguf", "Q8_0"), "gguf-Q4_0": ("gguf", "Q4_0"), "gguf-Q4_1": ("gguf", "Q4_1"),
    "hf-fp8_tensor": ("hf", "fp8_tensor"), "hf-fp8_channel": ("hf", "fp8_channel"),
    "hf-ct_int4": ("hf", "ct_int4"), "hf-ct_fp8": ("hf", "ct_fp8"),
}


def cases() -> dict[str, dict]:
    """name -> {arch, file (float | a PREQUANT kind), engine options}."""
    out = {}

    def add(arch, file="float", **opts):
        opts.setdefault("kernel_backend", "auto")
        name = "/".join([arch, file] + [f"{k}={v}" for k, v in sorted(opts.items())])
        out[name] = dict(arch=arch, file=file, options=opts)

    for arch in ARCHS:
        for backend in ("auto", "torch"):
            for q in QUANTS:
                add(arch, quantization=q, kernel_backend=backend)
    for arch in ("llama", "qwen3", "mixtral"):
        for kv in ("fp8_e4m3", "int8"):
            add(arch, kv_cache_dtype=kv)
    for kind in PREQUANT:
        add("llama", kind)
    for kind in ("gguf-Q8_0", "gguf-Q4_1"):
        add("llama-tied", kind)
        add("llama", kind, kernel_backend="torch")
    add("qwen2", "gguf-Q8_0")
    add("llama", dtype="bfloat16")
    add("qwen3_moe", dtype="bfloat16", quantization="int8")
    add("llama", speculative="ngram:n=2,k=3")
    add("llama", quantization="int8", speculative="ngram:n=2,k=3")
    add("llama", enable_prefix_caching=False)
    return out


def prompts() -> list[list[int]]:
    """Three prompts: two share a 16-token prefix (a prefix-cache hit), one repeats itself
    (n-gram proposals get accepted), and the longest is prefilled in three chunks."""
    g = np.random.default_rng(7)
    shared, loop = g.integers(3, 1000, 16).tolist(), g.integers(3, 1000, 6).tolist()
    return [shared + g.integers(3, 1000, 21).tolist(), g.integers(3, 1000, 5).tolist(), shared + loop * 3]


def engine_options(opts: dict) -> dict:
    return dict(dict(num_blocks=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=8), **opts)


def _weights(names_shapes: dict[str, tuple], seed: int, embed: float = 1.0) -> dict[str, torch.Tensor]:
    """Every tensor from one generator in name order: norms 1 + N(0, 0.1^2), biases N(0, 0.1^2),
    embeddings N(0, 1), projections and experts N(0, 1/fan_in), the head N(0, 25/hidden)
    (logits with a standard deviation of ~5: few near-ties; a tied table is scaled as the
    head, else every tied model repeats its input token); embeddings then times `embed`."""
    g = np.random.default_rng(seed)       # numpy's streams are the same on every CPU; torch's
    out = {}                               # vectorized normal_ is not (AVX2 vs portable)
    for name, shape in sorted(names_shapes.items()):
        r = torch.from_numpy(g.standard_normal(shape, dtype=np.float32))
        if "norm" in name:
            out[name] = 1 + 0.1 * r
        elif name.endswith("bias"):
            out[name] = 0.1 * r
        elif "embed_tokens" in name:      # tied: the head too, so scaled as one
            out[name] = embed * (r if "lm_head.weight" in names_shapes else r * 5 / math.sqrt(shape[-1]))
        elif name.startswith("lm_head"):
            out[name] = r * 5 / math.sqrt(shape[-1])
        else:
            out[name] = r / math.sqrt(shape[-1])
    return out


def make_float_model(arch: str, out: Path) -> Path:
    """A Hugging Face directory of `arch` with this file's weights and the tiny model's
    tokenizer (the GGUF writer reads it)."""
    from engine.tiny_model import make_tiny_model
    import importlib

    from tests.hf_models import make_hf_model
    make = make_hf_model
    if arch in BUILDERS:
        module, _, name = BUILDERS[arch].partition(":")
        make = getattr(importlib.import_module(module), name)
    d = make(arch, out / arch, **{**DIMS, **ARCHS[arch]})
    st = d / "model.safetensors"
    tensors = load_file(str(st))
    save_file(_weights({k: tuple(v.shape) for k, v in tensors.items()}, seed=1,
                                          embed=EMBED_SCALE.get(arch, 1.0)), str(st))
    tiny = make_tiny_model(out / "tiny")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / f, d / f)
    return d


def model_path(arch: str, file: str, root: Path, made: dict) -> Path:
    """The model directory (or GGUF file) of a case, built once per (arch, file) under root."""
    key = (arch, file)
    if key in made:
        return made[key]
    if (arch, "float") not in made:
        made[arch, "float"] = make_float_model(arch, root / f"{arch}-float")
    src = made[arch, "float"]
    if file != "float":
        how, what = PREQUANT[file]
        dest = root / f"{arch}-{file}"
        if how == "gguf":
            from tests.gguf_files import write_gguf
            dest.mkdir(parents=True)
            made[key] = write_gguf(src, dest / "m.gguf", what, pre="qwen2" if arch == "qwen2" else "gpt2")
        else:
            from tests.prequant_files import write_quantized
            made[key] = write_quantized(src, dest, what)
    return made[key]


def fingerprint(path: Path) -> str:
    """The bytes a case's model is made of (weights and config), so a changed input is told
    apart from a changed output."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".json")
        and p.name not in ("tokenizer.json", "tokenizer_config.json"))
    for p in files:
        data = p.read_bytes()
        if p.name == "config.json":        # transformers' version string is not the model
            c = json.loads(data)
            c.pop("transformers_version", None)
            data = json.dumps(c, sort_keys=True).encode()
        h.update(p.name.encode() + data)
    return h.hexdigest()[:16]


def run_case(case: dict, path: Path) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(path, **engine_options(case["options"]))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts(), params)
    rec = {"tokens": [], "logprobs": [], "margins": []}
    for o in outs:
        rec["tokens"].append(list(o.token_ids))
        rec["logprobs"].append([round(float(x), 6) for x in o.logprobs])
        rec["margins"].append([round(float(t[0][1] - t[1][1]), 6) for t in o.top_logprobs])
    assert llm.engine.kv.num_held_blocks() == 0
    return rec


def capability() -> str:
    """torch's kernel ISA, and "+bf16" where the CPU has bfloat16 tiles: the engine then
    multiplies prefill chunks by bfloat16 copies of 4-bit weights (engine/quant/amx.py,
    `--amx-weights auto`), another rounding class than a CPU of the same ISA without them;
    "+amx" where those are AMX tiles (amx_bf16): oneDNN's bfloat16 matmul then runs on them
    and sums in another order than with avx512_bf16's dot products (measured on a Xeon with
    AMX against the AMD recording of "AVX512+bf16": logprobs 2e-3 to 3e-2 apart)."""
    from engine.quant import amx
    flags = amx.cpu_flags()
    tiles = "+amx" if "amx_bf16" in flags else "+bf16" if amx.bf16_tiles(flags) else ""
    return torch.backends.cpu.get_cpu_capability() + tiles


def compare(want: dict, got: dict, near_tie: float, atol: float) -> list[str]:
    """What differs, in words; empty when the outputs agree (see the module docstring)."""
    bad = []
    for i, (wt, gt) in enumerate(zip(want["tokens"], got["tokens"])):
        for j, (a, b) in enumerate(zip(wt, gt)):
            if want["margins"][i][j] < near_tie:
                break               # a near-tie: this token and the rest may legitimately differ
            if a != b:
                bad.append(f"prompt {i} token {j}: {b} where {a} was recorded")
                break
            lp_w, lp_g = want["logprobs"][i][j], got["logprobs"][i][j]
            if abs(lp_w - lp_g) > atol:
                bad.append(f"prompt {i} token {j}: logprob {lp_g} where {lp_w} was recorded")
                break
    return bad


def dumps(rec: dict[str, dict]) -> str:
    """The recording as JSON, one case a line (a diff then names the cases that changed)."""
    caps = [f'{json.dumps(cap)}: {{\n' + ",\n".join(f"{json.dumps(name)}: {json.dumps(r, sort_keys=True)}"
                                                   for name, r in sorted(cases.items())) + "\n}"
            for cap, cases in sorted(rec.items())]
    return "{\n" + ",\n".join(caps) + "\n}\n"


def recorded() -> dict[str, dict]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def run_all(root: Path, archs: list[str] | None = None) -> dict[str, dict]:
    """Every case (or those of `archs`) run here: name -> its record."""
    made, record = {}, {}
    all_cases = {k: c for k, c in cases().items() if archs is None or c["arch"] in archs}
    for n, (name, case) in enumerate(all_cases.items(), 1):
        path = model_path(case["arch"], case["file"], root, made)
        record[name] = dict(fingerprint=fingerprint(path), **run_case(case, path))
        print(f"[{n}/{len(all_cases)}] {name}", file=sys.stderr, flush=True)
    return record


def spread(want: dict, got: dict) -> tuple[float, int]:
    """Against CROSS_ISA's near-tie: the largest logprob difference, and how many prompts
    change a token."""
    worst, flips = 0.0, 0
    for name in want:
        w, g = want[name], got[name]
        for i in range(len(w["tokens"])):
            for j, (a, b) in enumerate(zip(w["tokens"][i], g["tokens"][i])):
                if w["margins"][i][j] < CROSS_ISA["near_tie"]:
                    break
                if a != b:
                    flips += 1
                    break
                worst = max(worst, abs(w["logprobs"][i][j] - g["logprobs"][i][j]))
    return worst, flips


if __name__ == "__main__":
    import os
    import tempfile
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    archs = sys.argv[3:] if sys.argv[2:3] == ["--arch"] else None
    if sys.argv[2:3] == ["--without-bf16-tiles"]:    # record what a CPU without them computes
        from engine.quant import amx
        flags = amx.cpu_flags()
        amx.cpu_flags = lambda: frozenset(flags - set(amx.TILE_FLAGS))
        del sys.argv[2]
        archs = sys.argv[3:] if sys.argv[2:3] == ["--arch"] else None
    if sys.argv[1:2] not in (["--write"], ["--spread"]) or (len(sys.argv) > 2 and not archs):
        sys.exit("usage: python3 -m tests.golden --write | --spread [--without-bf16-tiles] [--arch "
                 "ARCH ...] (this machine against the recording; --without-bf16-tiles: as a CPU "
                 "of the same ISA without bfloat16 tiles; --arch: only those architectures' "
                 "cases, merged into the recording)")
    with tempfile.TemporaryDirectory() as tmp:
        got = run_all(Path(tmp), archs)
    rec = recorded()
    if sys.argv[1] == "--spread":
        for cap, want in rec.items():
            worst, flips = spread(want, got)
            print(f"{capability()} against {cap}: largest logprob difference {worst:.2e}, "
                  f"{flips} prompts with a token changed before a near-tie")
        sys.exit(0)
    rec[capability()] = {**rec.get(capability(), {}), **got} if archs else got
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(dumps(rec))
    print(f"wrote {GOLDEN} ({capability()})")
