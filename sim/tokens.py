"""Prompt token ids synthesised from a trace record's `hash_ids` (Mooncake: one id per
512-token block of the prompt), so that equal ids give equal token blocks and so real
prefix-cache hits in the engine's chained block hashes (engine/kv_cache_manager.py).

    block id h            -> BLOCK_TOKENS ids drawn from random.Random(h) (the same ids
                             for the same h, in any run, in any request)
    the prompt            -> the blocks of hash_ids in order, cut to input_length; a prompt
                             longer than its ids cover is padded with ids unique to the request
                             (seeded by the simulation's seed and the request's index)
The engine's block size must divide BLOCK_TOKENS (16 does) for two equal Mooncake blocks to
be equal engine blocks; otherwise only the whole-prefix hits at common boundaries remain.
"""
from __future__ import annotations

import random
from functools import lru_cache

BLOCK_TOKENS = 512
VOCAB = 32000                # ids below every supported tokenizer's vocabulary


@lru_cache(maxsize=4096)
def block_tokens(hash_id: int) -> tuple[int, ...]:
    """The BLOCK_TOKENS ids of Mooncake block `hash_id`."""
    rng = random.Random(hash_id * 2654435761 + 1)
    return tuple(rng.randrange(VOCAB) for _ in range(BLOCK_TOKENS))


def prompt_tokens(hash_ids, input_length: int, seed: int, index: int) -> list[int]:
    """`input_length` ids: the blocks of `hash_ids`, then ids unique to request `index`."""
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= input_length:
            break
        out.extend(block_tokens(int(h)))
    del out[input_length:]
    if len(out) < input_length:
        rng = random.Random(f"{seed}:{index}")
        out.extend(rng.randrange(VOCAB) for _ in range(input_length - len(out)))
    return out
