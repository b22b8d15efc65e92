"""The prefix cache's block hashes, torch-free so the gateway computes the very keys the
workers' caches use (engine/kv_cache_manager.py keys its blocks with them, KV events carry
them, gateway/prefix_index.py matches prompts against them).

Chained: hash_i = blake2b-128(hash_{i-1} || block i's token ids as int64 bytes), hash_{-1} = b"",
so equal hashes mean equal whole prefixes. Only full blocks are hashed.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def hash_block_tokens(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` (at most `max_blocks` of them)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out, parent = [], b""
    for i in range(n):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
