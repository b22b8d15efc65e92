"""Prompts of a given token length for `pdserve bench`, synthesised from Mooncake block ids so
that equal ids share text (a shared prefix the server can cache) and the length is hit by the
server's own token count.

Each BLOCK_TOKENS-token block of a prompt is words drawn from VOCAB by a random generator seeded
with (seed, block id): the same id gives the same words in every prompt. A prompt is its blocks'
words in order, cut at its length (the last block is usually partial: the cut text is a prefix
of that block's full text, so sharing still holds).

Token counts come from the server's `POST /tokenize` (vLLM's and pdserve's body {model, prompt};
llama.cpp's llama-server {content}). `calibrate` counts each VOCAB word with a leading space
once; BPE tokenizers split text at spaces before merging, so a prompt of space-led words has
the sum of their counts, and `build` chooses words to hit the length exactly. The first
prompts of each length are checked by a real count and corrected at their tail; one that was
off turns the check on for every prompt. A server without /tokenize gets an approximate
length (APPROX_TOKENS_PER_WORD for these common words) and the run is marked so.
"""
from __future__ import annotations

import random
from typing import Callable

import httpx

from sim.trace import BLOCK_TOKENS

VOCAB = tuple("""the of and to in is that for it as was with be by on not he this are or his
from at which but have an they you were her she there one all we their can has been if more
when will would who so no time people year way day man thing woman life child world school
state family student group country problem hand part place case week company system program
question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend
father power hour game line end member law car city name team minute idea kid body back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education a b c d e f g h i j k
l m n o p r s t u w y""".split())
APPROX_TOKENS_PER_WORD = 1.0          # VOCAB's words are whole tokens in common BPE vocabularies
CHECKED_PER_LENGTH = 2                # prompts of one length checked by a real count


class ServerTokenizer:
    """Token counts by a server's /tokenize (the vLLM/pdserve form, else llama-server's)."""

    def __init__(self, base: str, model: str, headers: dict, timeout_s: float = 30.0):
        self.http = httpx.Client(base_url=base.rstrip("/"), headers=headers, timeout=timeout_s)
        self.model, self.form = model, None

    def _bodies(self, text: str):
        forms = {"vllm": {"model": self.model, "prompt": text, "add_special_tokens": False},
                 "llama": {"content": text, "add_special": False}}
        order = [self.form] if self.form else list(forms)
        return [(f, forms[f]) for f in order]

    def count(self, text: str) -> int | None:
        """`text`'s tokens (no special tokens), or None where the server cannot say."""
        for form, body in self._bodies(text):
            try:
                r = self.http.post("/tokenize", json=body)
                tokens = r.json().get("tokens") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                tokens = None
            if isinstance(tokens, list) and (tokens or not text):
                self.form = form
                return len(tokens)
        return None

    def close(self) -> None:
        self.http.close()


class PromptBuilder:
    """build(hash_ids, input_length) -> prompt text (module docstring)."""

    def __init__(self, count: Callable[[str], int | None] | None, seed: int = 0):
        self.count, self.seed = count, seed
        self.cost: dict[str, int] = {w: 1 for w in VOCAB}
        self.exact = False                 # lengths by the server's count (else approximate)
        self.always_check = False
        self.checked: dict[int, int] = {}
        self.blocks: dict[int, list[str]] = {}

    def calibrate(self) -> bool:
        """Each word's token count by the server; False (approximate lengths) without one."""
        if self.count is None or self.count(" the") is None:
            return False
        cost = {w: self.count(" " + w) for w in VOCAB}
        self.cost = {w: c for w, c in cost.items() if c}
        if not any(c == 1 for c in self.cost.values()):
            self.cost = {w: 1 for w in VOCAB}
            return False
        self.exact = True
        return True

    def _block(self, block_id: int) -> list[str]:
        """A block's words: BLOCK_TOKENS tokens' worth, the same for the same id."""
        if block_id not in self.blocks:
            rng = random.Random(f"{self.seed}:{block_id}")
            words = list(self.cost)
            ones = [w for w in words if self.cost[w] == 1] or words
            out, tokens = [], 0
            while tokens < BLOCK_TOKENS:
                w = rng.choice(words if BLOCK_TOKENS - tokens > 4 else ones)
                if tokens + self.cost[w] <= BLOCK_TOKENS:
                    out.append(w)
                    tokens += self.cost[w]
            self.blocks[block_id] = out
        return self.blocks[block_id]

    def _cut(self, words: list[str], tokens: int) -> list[str]:
        out, n = [], 0
        for w in words:
            if n + self.cost[w] > tokens:
                break
            out.append(w)
            n += self.cost[w]
        return out

    def words(self, hash_ids, input_length: int, unique: int) -> list[str]:
        """The words of a prompt of `input_length` tokens whose blocks are `hash_ids`, then
        blocks of its own (ids from `unique`, negative: never equal to a trace's)."""
        nblocks = -(-input_length // BLOCK_TOKENS)
        ids = list(hash_ids)[:nblocks]
        ids += [-(unique * 1024 + k + 1) for k in range(nblocks - len(ids))]
        out = []
        for i, b in enumerate(ids):
            out += self._cut(self._block(b), min(BLOCK_TOKENS, input_length - i * BLOCK_TOKENS))
        return self._pad(out, input_length - sum(self.cost[w] for w in out), unique)

    def _pad(self, words: list[str], missing: int, unique: int) -> list[str]:
        ones = [w for w in self.cost if self.cost[w] == 1]
        rng = random.Random(f"{self.seed}:pad:{unique}")
        return words + [rng.choice(ones) for _ in range(max(0, missing))]

    def build(self, hash_ids, input_length: int, unique: int) -> str:
        words = self.words(hash_ids, input_length, unique)
        text = "".join(" " + w for w in words)
        if not self.exact or not (self.always_check
                                  or self.checked.get(input_length, 0) < CHECKED_PER_LENGTH):
            return text
        self.checked[input_length] = self.checked.get(input_length, 0) + 1
        for _ in range(3):
            n = self.count(text)
            if n is None or n == input_length:
                break
            self.always_check = True
            words = self._cut(words, sum(self.cost[w] for w in words) - max(0, n - input_length))
            words = self._pad(words, input_length - n if n < input_length else 0, unique)
            text = "".join(" " + w for w in words)
        return text
