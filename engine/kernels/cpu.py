"""The C kernels of cpu.c (and the files it #includes: cpu_mla.c, cpu_int4.c, cpu_bf16.c, cpu_pool.c,
cpu_step.c, part of the cache key): built
once per machine with the host C compiler, loaded with ctypes.

`library()` is None where they cannot be had (no compiler, not x86-64/aarch64 Linux); the
model then runs the torch references (as it does with --kernel-backend torch). The shared
object is cached under engine.config.cache_dir()/cpu-kernels, keyed by the sources, the flags,
the compiler and the CPU's flags (-march=native code must not run on another CPU), and is
written to a temporary name and renamed, so processes starting together never see half a file.

Each wrapper checks what the C code assumes (device, dtypes, contiguity) and takes the
pointers; reference.py holds the torch definition of every op and the tests compare the two.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine.config import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu.c")
INCLUDED = tuple(SOURCE.with_name(f) for f in ("cpu_mla.c", "cpu_int4.c", "cpu_bf16.c", "cpu_pool.c",
                                                "cpu_step.c"))
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread"]
BUILD_TIMEOUT_S = 120
_DTYPE = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_lib: ctypes.PyDLL | None | bool = False      # False: not tried yet
_nogil: ctypes.CDLL | None = None             # the same library, called without the GIL

_SCRATCH = ("pd_rms_norm", "pd_decode_attention", "pd_mla_decode_attention", "pd_int8_matmul",
            "pd_int8g32_matmul", "pd_rope_decode_attention", "pd_int4_matmul", "pd_bf16_matmul",
            "pd_int4_avx512", "pd_bf16_native", "pd_bf16_tiles_usable")
# 1: no memory (the last three: 1 = vectorized / the AMX tiles usable)
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "pd_rms_norm": [_P, _I, _L, _P, _L, _P, _L, _P, _P, _I, _L, _I, _I, _F],
    "pd_rope_write_kv": [_P, _P, _P, _I, _I, _I, _L, _L, _L, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P],
    "pd_decode_attention": [_P, _P, _P, _I, _I, _I, _I, _P, _I, _P, _I, _F, _I, _P, _P, _I],
    "pd_mla_decode_attention": [_P, _P, _L, _I, _I, _I, _I, _P, _I, _P, _I, _F, _P, _I],
    "pd_rope_decode_attention": [_P, _P, _P, _I, _I, _I, _L, _L, _L, _I, _I, _I, _I, _I, _P, _P,
                                 _P, _P, _P, _I, _P, _I, _P, _F, _I, _P, _P, _I],
    "pd_silu_and_mul": [_P, _I, _L, _P, _I, _L, _I, _I],
    "pd_int8_matmul": [_P, _I, _I, _I, _P, _P, _I, _P, _I],
    "pd_int8g32_matmul": [_P, _I, _I, _I, _P, _P, _I, _P],
    "pd_int4_matmul": [_P, _I, _L, _I, _I, _I, _P, _P, _P, _I, _P],
    "pd_int4_avx512": [],
    "pd_bf16_matmul": [_P, _I, _I, _I, _P, _I, _P],
    "pd_bf16_native": [],
    "pd_bf16_tiles_usable": [],
}


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _build() -> tuple[ctypes.PyDLL, ctypes.CDLL] | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64") or not cc:
        log.info("CPU kernels: no C compiler or not Linux x86-64/aarch64; using the torch references")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        texts = [f.read_text() for f in (SOURCE, *INCLUDED)]
        key = hashlib.sha256("\0".join([*texts, *FLAGS, version, _cpu_id()]).encode()).hexdigest()[:16]
        cache = cache_dir() / "cpu-kernels"
        path = cache / f"pdserve_cpu_{key}.so"
        if not path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
            os.close(fd)
            try:
                subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                               capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        # PyDLL: called with the GIL held. Each kernel takes microseconds; releasing the GIL
        # around it (CDLL) let a worker's gRPC thread take it at every call, and the engine
        # thread then waited out the switch interval to get it back: +10 ms a decode step.
        lib = ctypes.PyDLL(str(path))
        # CDLL: a whole decode step (pd_decode_step, milliseconds) runs without the GIL, so
        # the worker's event loop sends the last step's tokens meanwhile
        nogil = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU kernels could not be built (%s); using the torch references", str(detail)[:500])
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, (ctypes.c_int if name in _SCRATCH else None)
    nogil.pd_decode_step.restype = ctypes.c_int     # argtypes: engine/models/decode_plan.py
    nogil.pd_pool_new.argtypes, nogil.pd_pool_new.restype = [_I, _L, _L], ctypes.c_void_p
    nogil.pd_pool_free.argtypes, nogil.pd_pool_free.restype = [ctypes.c_void_p], None
    return lib, nogil


def library() -> ctypes.PyDLL | None:
    """The loaded kernels, built on first call; None where they cannot be had."""
    global _lib, _nogil
    if _lib is False:
        with _lock:
            if _lib is False:
                built = _build()
                _lib, _nogil = built if built else (None, None)
    return _lib


def nogil_library() -> ctypes.CDLL | None:
    """The same kernels called without the GIL (for calls of milliseconds: pd_decode_step)."""
    return _nogil if library() is not None else None


def has_int4() -> bool:
    """Whether the int4 kernel (cpu_int4.c) runs vectorized here: built with AVX-512. Without
    it the int4 layers keep torch's kernel (engine/quant/int4.py)."""
    lib = library()
    return lib is not None and lib.pd_int4_avx512() == 1


def _ok(status: int, op: str) -> None:
    """The status of a kernel that allocates scratch memory (0: done)."""
    if status:
        raise MemoryError(f"CPU kernel {op}: no memory for its scratch buffer")


def _dt(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPE:
        raise TypeError(f"CPU kernels take float32 or bfloat16 activations, not {t.dtype}")
    return _DTYPE[t.dtype]


def _f32(t: torch.Tensor, name: str) -> int:
    """The pointer of a contiguous float32 CPU tensor."""
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"{name}: a contiguous float32 CPU tensor is required")
    return t.data_ptr()


def _rows(t: torch.Tensor, name: str) -> int:
    """The row stride of t [T, ...] (views with strided rows, as into one qkv row, are fine);
    ValueError unless each row is contiguous (its trailing dims packed) on the CPU."""
    if not t.is_cpu or t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2]):
        raise ValueError(f"{name}: a CPU tensor with contiguous rows is required "
                         f"(shape {tuple(t.shape)}, strides {t.stride()})")
    return t.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None):
    """reference.rms_norm, every step in float32 (x may be bfloat16, as a CPU int8/int4 matmul
    returns it); the normed rows in `out_dtype` (default float32). With `residual` (float32,
    contiguous) returns (normed, residual) with x added to `residual` in place: the model's
    residual stream is its own (CausalLM.forward), so no copy is made."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    out = torch.empty(*x.shape, dtype=out_dtype or torch.float32)   # ints: a Size parses 2x slower
    res = 0 if residual is None else _f32(residual, "residual")
    _ok(library().pd_rms_norm(x2.data_ptr(), _dt(x2), _rows(x2, "x"), res, H, res, H,
                              _f32(weight, "weight"), out.data_ptr(), _dt(out), H, x2.shape[0], H, eps),
        "rms_norm")
    return out if residual is None else (out, residual)


def rope_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """reference.rotary_embedding then reference.write_kv_cache (rotated k, v): q [T, Hq, D],
    k / v [T, Hkv, D], each float32 or bfloat16 (row-strided views of one qkv row are fine);
    float32 caches [blocks, bs, Hkv, D]; int64 positions and slots; cos_sin_cache
    [max_pos, R], R <= D even: the rotary dimension (partial rotary passes the rest through).
    Returns the rotated q, float32 [T, Hq, D]."""
    T, Hq, D = q.shape
    R = cos_sin_cache.shape[1]
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slots are int64")
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"cos_sin_cache rows have {R} values: the rotary dimension must be even "
                         f"and at most head_dim {D}")
    q_out = torch.empty(T, Hq, D)
    library().pd_rope_write_kv(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _dt(q), _dt(k), _dt(v),
        _rows(q, "q"), _rows(k, "k"), _rows(v, "v"),
        T, Hq, k.shape[1], D, R, positions.contiguous().data_ptr(), _f32(cos_sin_cache, "cos_sin_cache"),
        q_out.data_ptr(), _f32(k_cache, "k_cache"), _f32(v_cache, "v_cache"),
        slot_mapping.contiguous().data_ptr())
    return q_out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out_dtype: torch.dtype | None = None, *, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """reference.paged_decode_attention over float32 caches (int32 tables and lengths); the
    output in `out_dtype` (default float32). `window` (None: all keys) and `sinks` ([Hq]
    float32 or None) as there."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens are int32")
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}, expected ({Hq},)")
    tables = block_tables.contiguous()
    out = torch.empty(B, Hq, D, dtype=out_dtype or torch.float32)
    _ok(library().pd_decode_attention(
        _f32(q, "q"), _f32(k_cache, "k_cache"), _f32(v_cache, "v_cache"), bs, Hq, Hkv, D,
        tables.data_ptr(), tables.shape[1], context_lens.contiguous().data_ptr(), B, scale,
        window or 0, None if sinks is None else _f32(sinks, "sinks"), out.data_ptr(), _dt(out)),
        "decode_attention")
    return out


def rope_decode_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                          out_dtype: torch.dtype | None = None, *, window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """rope_write_kv, then decode_attention of the rotated q, in one call (a decode step: one
    query per sequence, q [B, Hq, D]); the arguments and results are those two's."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    R = cos_sin_cache.shape[1]
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slots are int64")
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"cos_sin_cache rows have {R} values: the rotary dimension must be even "
                         f"and at most head_dim {D}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens are int32")
    if {block_tables.shape[0], context_lens.shape[0], positions.shape[0], slot_mapping.shape[0]} != {B}:
        raise ValueError(f"one query per sequence: {B} queries, {block_tables.shape[0]} table rows, "
                         f"{context_lens.shape[0]} lengths, {positions.shape[0]} positions, "
                         f"{slot_mapping.shape[0]} slots")
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}, expected ({Hq},)")
    tables = block_tables.contiguous()
    out = torch.empty(B, Hq, D, dtype=out_dtype or torch.float32)
    _ok(library().pd_rope_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _dt(q), _dt(k), _dt(v),
        _rows(q, "q"), _rows(k, "k"), _rows(v, "v"), B, Hq, Hkv, D, R,
        positions.contiguous().data_ptr(), _f32(cos_sin_cache, "cos_sin_cache"),
        _f32(k_cache, "k_cache"), _f32(v_cache, "v_cache"), slot_mapping.contiguous().data_ptr(),
        bs, tables.data_ptr(), tables.shape[1], context_lens.contiguous().data_ptr(), scale,
        window or 0, None if sinks is None else _f32(sinks, "sinks"), out.data_ptr(), _dt(out)),
        "rope_decode_attention")
    return out


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, v_dim: int,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """reference.paged_mla_decode_attention: q [B, H, D] float32, kv_cache [blocks, bs, D]
    float32 (one latent row per token), int32 tables and lengths -> [B, H, v_dim] in
    `out_dtype` (default float32). ValueError for a table entry outside the pool or a
    context longer than its table row (the C code checks both before reading any row)."""
    B, H, D = q.shape
    if kv_cache.dim() != 3 or kv_cache.shape[2] != D:
        raise ValueError(f"kv_cache: [blocks, block_size, {D}] expected, got {tuple(kv_cache.shape)}")
    if not 0 < v_dim <= D:
        raise ValueError(f"v_dim {v_dim} must be in 1..{D} (the kv_lora_rank part of a row)")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens are int32")
    if block_tables.shape[0] != B or tuple(context_lens.shape) != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} need one row per request ({B})")
    tables = block_tables.contiguous()
    out = torch.empty(B, H, v_dim, dtype=out_dtype or torch.float32)
    status = library().pd_mla_decode_attention(
        _f32(q, "q"), _f32(kv_cache, "kv_cache"), kv_cache.shape[0], kv_cache.shape[1], H, D, v_dim,
        tables.data_ptr(), tables.shape[1], context_lens.contiguous().data_ptr(), B, scale,
        out.data_ptr(), _dt(out))
    if status == 2:
        raise ValueError(f"block_tables entry outside the pool of {kv_cache.shape[0]} blocks, or "
                         f"context_lens past {tables.shape[1]} blocks of {kv_cache.shape[1]}")
    _ok(status, "mla_decode_attention")
    return out


def silu_and_mul(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """reference.silu_and_mul in float32 (x float32 or bfloat16); the result in `out_dtype`
    (default float32)."""
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)
    out = torch.empty(*x.shape[:-1], I, dtype=out_dtype or torch.float32)
    library().pd_silu_and_mul(x2.data_ptr(), _dt(x2), _rows(x2, "x"), out.data_ptr(), _dt(out), I,
                              x2.shape[0], I)
    return out


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch.ops.aten._weight_int8pack_mm(x, qweight, scale), any M (one thread): x [M, K]
    float32 or bfloat16, qweight [N, K] int8, scale [N] bfloat16 -> [M, N] bfloat16."""
    M, K = x.shape
    N = qweight.shape[0]
    if qweight.dtype != torch.int8 or scale.dtype != torch.bfloat16 or not qweight.is_contiguous():
        raise ValueError("qweight: contiguous int8 [N, K]; scale: bfloat16 [N]")
    x = x.contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16)
    _ok(library().pd_int8_matmul(x.data_ptr(), _dt(x), M, K, qweight.data_ptr(),
                                 scale.contiguous().data_ptr(), N, y.data_ptr(), _dt(y)), "int8_matmul")
    return y


def int8g32_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale per 32 values of a row).T: x [M, K] float32 or bfloat16, qweight [N, K]
    int8, scale [N, K/32] float32 -> [M, N] float32."""
    M, K = x.shape
    N = qweight.shape[0]
    if (K % 32 or qweight.dtype != torch.int8 or not qweight.is_contiguous()
            or tuple(scale.shape) != (N, K // 32)):
        raise ValueError("qweight: contiguous int8 [N, K], K % 32 == 0; scale: float32 [N, K/32]")
    x = x.contiguous()
    y = torch.empty(M, N)
    _ok(library().pd_int8g32_matmul(x.data_ptr(), _dt(x), M, K, qweight.data_ptr(), _f32(scale, "scale"),
                                    N, y.data_ptr()), "int8g32_matmul")
    return y


def int4_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
                group: int) -> torch.Tensor:
    """x @ W.T for cpu_int4.c's layout: x [M, K] float32 or bfloat16 (rows may be strided),
    codes [N, K/2] uint8 (each 32 values of a row: value j low nibble, j + 16 high), scale and
    min [N, K/group] float16 -> [M, N] float32."""
    M, K = x.shape
    N = codes.shape[0]
    if (K % group or group % 32 or codes.dtype != torch.uint8 or tuple(codes.shape) != (N, K // 2)
            or not codes.is_contiguous() or scale.dtype != torch.float16 or mn.dtype != torch.float16
            or tuple(scale.shape) != (N, K // group) or not scale.is_contiguous() or not mn.is_contiguous()):
        raise ValueError(f"int4_matmul: codes uint8 [{N}, {K // 2}], scale and min float16 "
                         f"[{N}, {K // group}], contiguous; K % group == 0, group % 32 == 0")
    y = torch.empty(M, N)
    _ok(library().pd_int4_matmul(x.data_ptr(), _dt(x), _rows(x, "x"), M, K, group, codes.data_ptr(),
                                 scale.data_ptr(), mn.data_ptr(), N, y.data_ptr()), "int4_matmul")
    return y


def has_bf16() -> bool:
    """Whether cpu_bf16.c's kernel runs on the CPU's bfloat16 dot products here (built with
    AVX512_BF16); without them the decode plan leaves batches of bfloat16 rows to oneDNN."""
    lib = library()
    return lib is not None and lib.pd_bf16_native() == 1


def has_bf16_tiles() -> bool:
    """Whether cpu_bf16.c multiplies batches of `bf16_tile_rows()` rows or more on the AMX
    tiles here (built with AMX_BF16, and the kernel let this process use them)."""
    lib = library()
    return lib is not None and lib.pd_bf16_tiles_usable() == 1


def bf16_tile_rows(rows: int | None = None) -> int:
    """The row count from which cpu_bf16.c takes the AMX tiles (0: never); `rows` sets it
    for the process (bench/cpu_step.py compares the two kernels)."""
    lib = library()
    if lib is None:
        return 0
    v = ctypes.c_int.in_dll(lib, "pd_bf16_tile_rows")
    if rows is not None:
        v.value = rows
    return v.value


def bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) rounded to bfloat16, @ w [N, K] bfloat16 (contiguous),
    summed in float32 -> [M, N] float32 (cpu_bf16.c)."""
    M, K = x.shape
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] != K or not w.is_contiguous():
        raise ValueError(f"bf16_matmul: w must be a contiguous bfloat16 [N, {K}]")
    x = x.contiguous()
    y = torch.empty(M, w.shape[0])
    _ok(library().pd_bf16_matmul(x.data_ptr(), _dt(x), M, K, w.data_ptr(), w.shape[0], y.data_ptr()),
        "bf16_matmul")
    return y
