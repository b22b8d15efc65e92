"""The one check of a public request's sampling input, for both fronts (REST and gRPC).

Everything a client sends ends up in proto fields (int32, int64, float) and in per-token
work on the workers, so it is bounded here, before any worker sees it:

    n and n x prompts        at most MAX_N choices, MAX_CHOICES per request
    stop                     at most MAX_STOP strings of at most MAX_STOP_BYTES (UTF-8)
    numbers                  finite (no NaN/Inf), integers within their proto field;
                             temperature in [0, 2] (OpenAI's range, on both fronts)
    chat roles               one of CHAT_ROLES
    structured output        a valid spec (check_request, no tokenizer), and one that compiles
                             against the model's tokenizer (GrammarCheck: a grammar naming a
                             special token the model lacks is refused here, not by a worker)
    token ids                logit_bias keys and stop_token_ids inside the vocabulary
    min_tokens               room for them in the context (also without max_tokens)
    text                     valid UTF-8 (a lone surrogate such as \\ud800 is refused)
    REST body                at most MAX_BODY_BYTES (413; gateway/openai/app.py); a gRPC
                             request too (INVALID_ARGUMENT; gateway/grpc_server.py)

Prompt token ids are checked by gateway/prompt.py's check_prompt. A failure is an
`InvalidInput` (a GatewayError, INVALID_ARGUMENT) naming the parameter.
"""
from __future__ import annotations

import math
import threading

import grpc

from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput, StructuredOutputs
from engine.structured import validate as validate_structured

from .request import GatewayError

MAX_BODY_BYTES = 32 << 20    # a REST request body (a 10 MB prompt fits)
MAX_N = 128                  # choices of one prompt
MAX_CHOICES = 256            # n x prompts of one request
MAX_STOP = 16
MAX_STOP_BYTES = 1024
MAX_TOKEN_LIST = 1024        # stop_token_ids and logit_bias entries
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_TEMPERATURE = 2.0
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class InvalidInput(GatewayError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.param = param


def check_text(text: str, param: str) -> None:
    """Text must be encodable as UTF-8 (JSON's \\ud800 escapes decode to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInput(f"{param} is not valid Unicode: a lone surrogate at position "
                           f"{e.start}", param) from None


def check_request(p: SamplingParams, n: int, prompt_lens: list[int], vocab_size: int,
                  context_length: int) -> None:
    """Raise InvalidInput unless `n` choices of each prompt (lengths `prompt_lens`) with
    params `p` are within the bounds above."""
    if not 1 <= n <= MAX_N:
        raise InvalidInput(f"n must be in [1, {MAX_N}], got {n}", "n")
    if n * len(prompt_lens) > MAX_CHOICES:
        raise InvalidInput(f"n x prompts is {n} x {len(prompt_lens)} = {n * len(prompt_lens)}: "
                           f"at most {MAX_CHOICES} choices per request", "n")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if not math.isfinite(getattr(p, name)):
            raise InvalidInput(f"{name} must be a finite number, got {getattr(p, name)}", name)
    if not 0 <= p.temperature <= MAX_TEMPERATURE:
        raise InvalidInput(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {p.temperature}",
                           "temperature")
    _int_range("top_k", p.top_k, 0, INT32_MAX)
    if p.seed is not None:       # choice j uses seed + j: all must fit the proto's int64
        _int_range("seed", p.seed, INT64_MIN, INT64_MAX - (n - 1))
    if p.max_tokens is not None:
        _int_range("max_tokens", p.max_tokens, 1, INT32_MAX)
    _int_range("min_tokens", p.min_tokens, 0, INT32_MAX)
    _check_stop(p.stop)
    _token_list("stop_token_ids", p.stop_token_ids, vocab_size)
    _token_list("logit_bias", list(p.logit_bias), vocab_size)
    for v in p.logit_bias.values():
        if not (math.isfinite(v) and -100 <= v <= 100):
            raise InvalidInput(f"logit_bias values must be finite, in [-100, 100], got {v}",
                               "logit_bias")
    if p.structured is not None:
        try:
            validate_structured(p.structured)
        except ValueError as e:
            raise InvalidInput(str(e), "response_format") from None
    if context_length and p.min_tokens and prompt_lens:
        longest = max(prompt_lens)
        if longest + p.min_tokens > context_length:
            raise InvalidInput(f"min_tokens={p.min_tokens} does not fit: the prompt has {longest} "
                               f"tokens and the context length is {context_length}", "min_tokens")


def _int_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise InvalidInput(f"{name} must be in [{lo}, {hi}], got {value}", name)


def _check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP:
        raise InvalidInput(f"at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    for s in stop:
        check_text(s, "stop")
        if len(s.encode("utf-8")) > MAX_STOP_BYTES:
            raise InvalidInput(f"stop strings must be at most {MAX_STOP_BYTES} bytes, got one of "
                               f"{len(s.encode('utf-8'))}", "stop")


def _token_list(name: str, ids: list[int], vocab_size: int) -> None:
    if len(ids) > MAX_TOKEN_LIST:
        raise InvalidInput(f"{name}: at most {MAX_TOKEN_LIST} token ids, got {len(ids)}", name)
    hi = vocab_size or INT32_MAX + 1
    outside = [t for t in ids if not 0 <= t < hi]
    if outside:
        raise InvalidInput(f"{name} has token ids outside the vocabulary [0, {hi}): {outside[:5]}",
                           name)


def template_role(role: str, param: str = "messages") -> str:
    """A message's role as chat templates know it (OpenAI's "developer" is "system");
    InvalidInput unless one of CHAT_ROLES."""
    if role not in CHAT_ROLES:
        raise InvalidInput(f"message role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                           param)
    return "system" if role == "developer" else role


class GrammarCheck:
    """Structured-output specs compiled against the model's own tokenizer, as a worker will
    compile them (cached; `check` blocks: call it in a thread). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._compiler: StructuredOutputs | None = None
        self._lock = threading.Lock()

    def check(self, spec: StructuredOutput, param: str = "response_format") -> None:
        with self._lock:
            if self._compiler is None:
                self._compiler = StructuredOutputs(self._tokenizer.to_json(), self._vocab_size,
                                                   self._tokenizer.eos_token_ids)
            try:
                self._compiler.check(spec)
            except ValueError as e:
                raise InvalidInput(str(e), param) from None
