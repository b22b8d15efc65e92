"""Helpers for the kernel tests: fresh random seeds, paged-cache builders, tolerances."""
from __future__ import annotations

import os

import torch

# On a GPU machine the kernels run for real on CUDA; otherwise under the interpreter on CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def fresh_generator() -> tuple[torch.Generator, int]:
    """A generator seeded from os.urandom: every run draws new inputs; the seed goes into
    each assertion message so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def on_device(*ts):
    """Copies of the (CPU-built) inputs on DEVICE; references keep using the CPU originals."""
    return tuple(t.to(DEVICE) for t in ts)


def assert_close(actual, expected, dtype, seed, what=""):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOL[dtype],
                               msg=lambda m: f"{what} seed={seed}: {m}")


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def paged_cache(gen, context_lens, block_size, num_kv_heads, head_dim, dtype, spare_blocks=3):
    """Caches with random contents and a block table whose blocks are a random permutation
    of the pool (non-contiguous, out of order). Unused table entries point at block 0."""
    need = [(L + block_size - 1) // block_size for L in context_lens]
    nb = sum(need) + spare_blocks
    perm = torch.randperm(nb, generator=gen)
    width = max(max(need), 1)
    table = torch.zeros(len(context_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    k_cache = randn(gen, nb, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = randn(gen, nb, block_size, num_kv_heads, head_dim, dtype=dtype)
    return k_cache, v_cache, table
