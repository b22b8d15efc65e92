"""Structured output: constrain sampling to a JSON schema, a regex or a Lark grammar.

    SamplingParams.structured = StructuredOutput(json_schema=...)    (the spec, plain data)
            │
    StructuredOutputs (one per engine)
      ├─ LLTokenizer            built once, from tokenizer.json, sized to the model's vocab
      ├─ compiled grammars      spec key -> pristine llguidance LLMatcher (LRU); a request
      │                         gets a deep copy, so a schema is compiled once
      └─ request_id -> _State   the request's matcher + how many output tokens it consumed

    each step, before sampling:   token_mask(rows)  -> bool [B, V] (True = allowed), filled
                                  for all constrained rows at once (LLExecutor, parallel)
    each appended token:          advance(req)      -> consumes output tokens it has not seen
                                                       yet; True once the grammar is complete

`advance` consumes `req.output_token_ids[consumed:]`, so it is idempotent: a request that is
preempted and recomputed keeps its tokens and its matcher, and nothing is consumed twice.
On the decode side the first token comes from the prefill worker (`remote_kv_done`) and goes
through the same `advance`, so both halves of a request follow one grammar.

Uses llguidance (no transformers): JSON is compact (`whitespace_flexible: False`), which also
keeps a weak model from looping on whitespace. A grammar is complete when the matcher is
stopped (llguidance: `is_stopped()` turns true on the last grammar token, which is kept).
"""
from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)

_JSON_DEFAULTS = {"whitespace_flexible": False}
_CACHE_SIZE = 128


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: json_object (any JSON object), json_schema (a dict or its JSON text),
    regex, grammar (Lark syntax, llguidance dialect)."""
    json_object: bool = False
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured output needs exactly one of json_object, json_schema, "
                             f"regex, grammar (got {given or 'none'})")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise ValueError("json_schema must be a dict or a JSON string")

    @property
    def kind(self) -> str:
        return ("json_object" if self.json_object else "json_schema" if self.json_schema is not None
                else "regex" if self.regex is not None else "grammar")

    @property
    def value(self) -> str:
        """The spec as one string (a schema as compact JSON): the cache key and wire form.
        Keys keep their order: a schema's property order is the order they are generated in
        (OpenAI's too; a tool call's "name" comes before its "arguments")."""
        if self.json_object:
            return ""
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"json_schema is not valid JSON: {e}") from None
            return json.dumps(schema, separators=(",", ":"))
        return self.regex if self.regex is not None else self.grammar

    @classmethod
    def from_kind(cls, kind: str, value: str) -> "StructuredOutput":
        if kind == "json_object":
            return cls(json_object=True)
        if kind in ("json_schema", "regex", "grammar"):
            return cls(**{kind: value})
        raise ValueError(f"unknown structured output kind {kind!r}")

    def to_grammar(self) -> str:
        """The llguidance grammar (JSON text); raises ValueError on a malformed spec."""
        from llguidance import LLMatcher

        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_DEFAULTS)
        if self.json_schema is not None:
            schema = json.loads(self.value)
            if not isinstance(schema, dict):
                raise ValueError("json_schema must be a JSON object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        return LLMatcher.grammar_from_lark(self.grammar)


def validate(spec: StructuredOutput) -> None:
    """Check a spec without a tokenizer (cheap; for front ends). Raises ValueError."""
    from llguidance import LLMatcher

    try:
        grammar = spec.to_grammar()
    except ValueError:
        raise
    except Exception as e:          # llguidance raises plain exceptions on bad input
        raise ValueError(f"invalid {spec.kind}: {e}") from None
    is_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid {spec.kind}: {msgs[0] if msgs else 'rejected'}")


@dataclass
class _State:
    matcher: Any                 # llguidance.LLMatcher
    consumed: int = 0            # output tokens already fed to the matcher


class StructuredOutputs:
    """Per-engine grammar compiler, cache and per-request matchers (engine thread only)."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids):
        self.tokenizer_json = tokenizer_json     # the tokenizer.json text
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltok = None
        self._executor = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._states: dict[str, _State] = {}
        self.compilations = 0     # cache misses (tests, metrics)

    # -- lifecycle of one request ---------------------------------------------------------
    def add(self, request_id: str, spec: StructuredOutput) -> None:
        """Give the request a fresh matcher for `spec`; raises ValueError on a bad spec."""
        self._states[request_id] = _State(self._compile(spec).deep_copy())

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def check(self, spec: StructuredOutput) -> None:
        """Compile `spec` against this tokenizer (cached, as `add` does); raises ValueError
        when it cannot be served, e.g. a grammar naming a special token the model lacks (the
        front ends call this before any worker sees the request)."""
        self._compile(spec)

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def prime(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Feed tokens the grammar's output began with before this request's own outputs
        (a decode worker recomputing a prompt that ends with the first generated token)."""
        st = self._states.get(request_id)
        if st is not None:
            for t in token_ids:
                st.matcher.consume_token(int(t))

    def advance(self, request_id: str, output_token_ids: Sequence[int]) -> bool:
        """Feed the tokens the matcher has not seen; True when the grammar is complete (the
        request should stop). A token the grammar rejects (only possible for a token sampled
        elsewhere without the mask) is logged and also ends the request."""
        st = self._states.get(request_id)
        if st is None:
            return False
        m = st.matcher
        for t in output_token_ids[st.consumed:]:
            st.consumed += 1
            if m.is_stopped():
                return True
            if not m.consume_token(int(t)):
                log.warning("request %s: token %d violates its grammar: %s", request_id, t,
                            m.get_error())
                return True
        return m.is_stopped() or m.is_error()

    # -- masks ----------------------------------------------------------------------------
    def token_mask(self, request_ids: Sequence[str], vocab: int) -> torch.Tensor | None:
        """Bool [B, vocab] allowed-token mask for these rows, or None when none is constrained.
        Unconstrained rows allow everything."""
        import torch   # lazily: the spec half of this module is imported by the gateway
        rows = [(self._states[r].matcher, i) for i, r in enumerate(request_ids) if r in self._states]
        if not rows:
            return None
        words = (vocab + 31) // 32
        bitmask = torch.full((len(request_ids), words), -1, dtype=torch.int32)
        # llguidance.torch.fill_next_token_bitmask_par does this, but importing that module
        # runs torch.compile's setup (seconds): call the executor directly.
        self._get_executor().unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4,
                                                     len(request_ids))
        return unpack_bitmask(bitmask, vocab)

    # -- internals ------------------------------------------------------------------------
    def _compile(self, spec: StructuredOutput):
        key = (spec.kind, spec.value)
        m = self._compiled.get(key)
        if m is not None:
            self._compiled.move_to_end(key)
            return m
        from llguidance import LLMatcher

        try:
            grammar = spec.to_grammar()
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"invalid {spec.kind}: {e}") from None
        m = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {spec.kind}: {m.get_error()}")
        self.compilations += 1
        self._compiled[key] = m
        while len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return m

    def _tokenizer(self):
        if self._lltok is None:
            from llguidance import LLTokenizer

            if self.tokenizer_json is None:
                raise ValueError("structured output needs the model's tokenizer")
            self._lltok = LLTokenizer(self.tokenizer_json,
                                      n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_ids or None)
        return self._lltok

    def _get_executor(self):
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))
        return self._executor


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [B, ceil(V/32)] (bit j of word w = token 32w + j) -> bool [B, V]."""
    import torch
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1   # [B, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
