"""Token ids -> what a client sees: text deltas, stop strings, finish reasons (torch-free).

One `OutputProcessor` per request (vLLM v1 keeps the same in its front end). Workers decide
on token criteria only (EOS, stop token ids, max_tokens); text-level rules live here:

    add(token ids, logprobs, worker's finish reason)
        per token:  stop token (EOS unless ignore_eos, or stop_token_ids), once min_tokens
                    are out  -> finish "stop", the token's text is not emitted
                    else detokenize; a stop string ends the request, the text is cut where
                    it begins (kept with include_stop_str_in_output)
                    max_tokens (or the context length) reached -> finish "length"
        text delta: the stable text minus what was sent; while unfinished, a tail that may
                    be the start of a stop string is held back until it is resolved
        -> Delta(new ids, text delta, logprobs, finish_reason, stop_reason) | None

Tokens that arrive after a text-level stop (the worker had not seen it yet) are dropped.
Imports only engine.tokenizer and engine.sampling_params: the gateway process uses it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer, StopStrings, Tokenizer

# (logprob of the sampled token, [(token id, logprob)] best first, or None)
Logprob = tuple[float, "list[tuple[int, float]] | None"]


@dataclass
class Delta:
    token_ids: list[int]                  # tokens accepted by this add()
    text: str                             # new stable text
    logprobs: list[Logprob] | None        # one per token when params.logprobs is set and
                                          # add() was given them; else None
    finish_reason: str | None = None      # None | "stop" | "length" | a worker's reason
    stop_reason: int | str | None = None  # the stop token id or stop string that matched


class OutputProcessor:
    """What one request has produced so far; `add()` each batch of new tokens."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams, max_model_len: int = 0):
        p = params
        self.params = p
        self.prompt_token_ids = list(prompt_token_ids)
        self.eos = set() if p.ignore_eos else set(tokenizer.eos_token_ids)
        self.stop_ids = set(p.stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, p.skip_special_tokens)
        self.stops = StopStrings(p.stop) if p.stop else None
        limit = max_model_len - len(self.prompt_token_ids) if max_model_len else None
        caps = [x for x in (p.max_tokens, limit) if x is not None]
        self.max_tokens: int | None = min(caps) if caps else None
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._cut_text = ""      # the final text when a stop string cut it
        self._emitted = 0        # characters of text already returned

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: Sequence[int], logprobs: Sequence[Logprob] | None = None,
            finish_reason: str | None = None) -> Delta | None:
        """Process new tokens (and their logprobs); `finish_reason` is the producer's reason
        for the last of them. Returns what to send, None when there is nothing new."""
        new_ids, lps = [], []
        for k, t in enumerate(token_ids):
            if self.finished:
                break                                # tokens after a text-level stop
            self.token_ids.append(t)
            new_ids.append(t)
            if logprobs is not None:
                lps.append(logprobs[k])
            self._check(t)
        if not self.finished and finish_reason is not None:
            self.finish_reason = finish_reason
            if finish_reason == "stop" and self.token_ids and \
                    self.token_ids[-1] in self.stop_ids | self.eos:
                self.stop_reason = self.token_ids[-1]
        text = self._stable_text()
        delta = text[self._emitted:] if len(text) > self._emitted else ""
        self._emitted = max(self._emitted, len(text))
        if not new_ids and not delta and not self.finished:
            return None
        want_lps = self.params.logprobs is not None and logprobs is not None
        return Delta(new_ids, delta, lps if want_lps else None, self.finish_reason,
                     self.stop_reason)

    def remaining_params(self) -> SamplingParams:
        """Sampling parameters for producing the rest after the tokens so far (the same
        request continued elsewhere: a migrated stream). No max_tokens asked stays unset:
        the worker caps it by the context and by what its cache holds."""
        p, n = self.params, len(self.token_ids)
        return replace(p, max_tokens=None if p.max_tokens is None else self.max_tokens - n,
                       min_tokens=max(0, p.min_tokens - n))

    def _check(self, token: int) -> None:
        p, n = self.params, len(self.token_ids)
        if (token in self.stop_ids or token in self.eos) and n >= p.min_tokens:
            self.finish_reason, self.stop_reason = "stop", token
        else:
            delta = self.detok.add(token)
            if self.stops is not None:
                self._check_stop_strings(delta, n >= p.min_tokens)
        if not self.finished and self.max_tokens is not None and n >= self.max_tokens:
            self.finish_reason = "length"

    def _check_stop_strings(self, delta: str, active: bool) -> None:
        """Every delta goes through the matcher (its state follows the whole text); a stop
        string ending in it counts once min_tokens are out."""
        found = self.stops.feed(delta)
        if found is not None and active:
            at, s = found
            self._cut_text = self.detok.text[:at + (len(s) if self.params.include_stop_str_in_output else 0)]
            self.finish_reason, self.stop_reason = "stop", s

    def _stable_text(self) -> str:
        if self.finish_reason == "stop" and isinstance(self.stop_reason, str):
            return self._cut_text
        if self.finished:
            self.detok.flush()
            return self.detok.text
        text = self.detok.text
        if self.stops is not None:
            text = text[:len(text) - self.stops.held()]
        return text
