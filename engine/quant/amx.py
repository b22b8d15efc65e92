"""bfloat16 weights beside the quantized ones, for the matmuls of several rows (prefill
chunks, batched decode, speculative verification), run by oneDNN on the CPU's bfloat16
tiles (`--amx-weights`, EngineOptions.amx_weights).

Why: the quantized kernels are bound by reading the weight at one row and by widening the
codes at many (torch's int4 kernel tops out at ~40-60 GFLOP/s here, cpu_int4.c's float32
one at ~100-130); oneDNN's bfloat16 brgemm (AMX on recent Xeons, `avx512_core_bf16` on this
EPYC, chosen by oneDNN from the CPU) runs the same [M, K] x [K, N] product at 200-400
GFLOP/s a core once M reaches a few rows (bench/amx.py, bench/RESULTS.md "AMX"). One row
and small batches stay on the int4 kernel: bound by reading the weight, and the int4 copy is
a quarter of the bytes.

    cpu_flags()            the CPU's feature flags (/proc/cpuinfo's first "flags" line), cached
    bf16_tiles(flags)      True where oneDNN multiplies bfloat16 natively: amx_bf16 or avx512_bf16
    choose(mode, flags, need, budget)
                           the pure selection: off -> never; bf16 -> always (asked for); auto ->
                           only with the tiles and when the copies fit the byte budget
    attach(model, mode, budget_gb, min_rows, device)
                           each decoder QuantLinear of `model` of 4-bit weights or whose kernel
                           multiplies in bfloat16 already (not the heads, see below;
                           `candidates`) keeps `dense` = its dequantized weight rounded once to
                           bfloat16 (a non-persistent buffer: state_dict and weight_bytes are
                           unchanged); QuantLinear.forward then multiplies x [M >= min_rows, K]
                           by it (torch.nn.functional.linear in bfloat16, bfloat16 out), and the
                           model's decode plan (models/decode_plan.py) leaves batches of that
                           many rows to the layer path. Returns an AmxPlan saying what was
                           chosen and why.

Numerics: x and each weight rounded to bfloat16 (relative error <= 2^-9 per value),
accumulated in float32, the output rounded to bfloat16: a few bfloat16 ulps of the output
from the float32 int4 kernel's (tests/kernels/test_amx.py bounds it against float32), far
inside what the 4-bit codes themselves round (a step of 1/15 of a group's range).

On by default (`auto`, EngineOptions.amx_weights) where the CPU has bfloat16 tiles: a
1k-token prefill of the default model runs 2.3-3x faster with them (bench/RESULTS.md). The
golden outputs are recorded per CPU capability with them on; the transformers comparisons
(test_engine_vs_hf.py, test_gguf.py, test_prequant_gguf.py) pass with them on, and
tests/kernels/test_decode_plan.py compares the int4 kernels alone (off) with transformers
within the float32 engine's own tolerance.

The output head is left on its own kernel: on CPU it writes float32 logits from the stored
codes (int8_g32's G32Plain), where a bfloat16 product would round each logit to 2^-8 of its
size and swap near-tied tokens (see int8_g32.refine_top); its rows are one per sampling
request, never a prefill chunk.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from . import AMX_WEIGHTS

log = logging.getLogger(__name__)

TILE_FLAGS = ("amx_bf16", "avx512_bf16")
DEFAULT_MIN_ROWS = 8          # measured: bench/logs/2026-12-03-amx.log (int4 wins below)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU (Linux /proc/cpuinfo); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bf16_tiles(flags) -> bool:
    """Whether oneDNN has a native bfloat16 matmul on a CPU with `flags`."""
    return any(f in flags for f in TILE_FLAGS)


def choose(mode: str, flags, need_bytes: int, budget_bytes: int) -> tuple[bool, str]:
    """(on, why). `mode` one of AMX_WEIGHTS."""
    if mode not in AMX_WEIGHTS:
        raise ValueError(f"unsupported amx_weights {mode!r}: expected one of {AMX_WEIGHTS}")
    if mode == "off":
        return False, "off (asked)"
    if mode == "bf16":
        return True, "bf16 (asked)"
    if not bf16_tiles(flags):
        return False, f"off: the CPU has none of {TILE_FLAGS}"
    if need_bytes > budget_bytes:
        return False, (f"off: the bfloat16 copies need {need_bytes / 2**20:.0f} MiB, over the "
                       f"budget of {budget_bytes / 2**20:.0f} MiB")
    tiles = "amx_bf16" if "amx_bf16" in flags else "avx512_bf16"
    return True, f"on ({tiles})"


@dataclass
class AmxPlan:
    on: bool
    why: str
    layers: int = 0
    bytes: int = 0
    min_rows: int = DEFAULT_MIN_ROWS
    names: list = field(default_factory=list)


def candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, QuantLinear) of every quantized linear that is not an output head and whose
    kernel already multiplies in bfloat16 (Packed.input_dtype: torch's int4 and int8 CPU
    layouts) or whose weights are 4-bit (cpu_int4.c's float32 kernel: rounding a 4-bit
    code times its float16 scale to bfloat16, 2^-9 of the weight, is far inside the code's
    own step of 1/15 of the group's range), so that the copy changes no precision class;
    float32 kernels of 8-bit weights (cpu.c's int8_g32, fp8's) keep theirs."""
    from .linear import QuantLinear
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear) and not m.head
            and (m.packed.input_dtype == torch.bfloat16 or m.method.startswith("int4"))]


def attach(model: nn.Module, mode: str = "auto", budget_gb: float = 1.0,
           min_rows: int = DEFAULT_MIN_ROWS, device: str = "cpu", flags=None) -> AmxPlan:
    """Give the model's decoder QuantLinears their bfloat16 copies where `choose` says so
    (only on CPU: elsewhere the Triton kernels serve every M). `flags`: the CPU's (default
    cpu_flags())."""
    if min_rows < 1:
        raise ValueError(f"amx_min_rows must be >= 1, got {min_rows}")
    layers = candidates(model)
    need = sum(2 * m.out_features * m.in_features for _, m in layers)
    if torch.device(device).type != "cpu":
        plan = AmxPlan(False, "off: not a CPU model", min_rows=min_rows)
    elif not layers:
        plan = AmxPlan(False, "off: no quantized linears", min_rows=min_rows)
    else:
        on, why = choose(mode, cpu_flags() if flags is None else flags, need, int(budget_gb * 2**30))
        plan = AmxPlan(on, why, min_rows=min_rows)
    if plan.on:
        for name, m in layers:
            m.keep_dense(min_rows)
        _replan(model)
        plan.layers, plan.bytes, plan.names = len(layers), need, [n for n, _ in layers]
    log.info("amx weights: %s%s", plan.why, f", {plan.layers} layers, {plan.bytes / 2**20:.0f} MiB "
             f"of bfloat16, from {min_rows} rows" if plan.on else "")
    return plan


def detach(model: nn.Module) -> None:
    """Drop every bfloat16 copy (back to the quantized kernels for every M)."""
    for _, m in candidates(model):
        m.drop_dense()
    _replan(model)


def _replan(model: nn.Module) -> None:
    """The model's decode plan, which points at each layer's copy, rebuilt (models/base.py)."""
    if getattr(model, "decode_plan", None) is not None:
        model.plan_decode()
