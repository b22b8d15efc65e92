"""Prompts as both fronts take them: chat messages -> token ids, and the one prompt check.

Tokenizing runs in a worker thread (`encode`, `chat_prompt_ids` are coroutines): a 10 MB
prompt must not hold the event loop that serves everyone else. A text too long for the
context even if every token covered the longest token string is refused without tokenizing
it, and text that is not valid Unicode (a lone surrogate) is refused before it reaches the
tokenizer.

`check_prompt` is what the gateway verifies before any worker sees a prompt (the gRPC API
through `Gateway.generate()`, the OpenAI shim before it fans out); workers keep their own
checks. A failure is a `PromptError`: a GatewayError (INVALID_ARGUMENT) whose `kind` lets
the OpenAI shim word it the way OpenAI clients expect (gateway/openai/errors.py).
"""
from __future__ import annotations

import asyncio
from typing import Any

import grpc

from engine.tokenizer import Tokenizer

from .request import GatewayError
from .validate import check_text


# template variables a request sets through its own fields (or a template source: not a kwarg)
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "chat_template"})


class PromptError(GatewayError):
    """kind: "empty" | "negative" | "vocab" | "too_long" | "no_room" | "template"."""

    def __init__(self, kind: str, message: str, num_tokens: int = 0, context_length: int = 0,
                 max_tokens: int | None = None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.kind, self.num_tokens = kind, num_tokens
        self.context_length, self.max_tokens = context_length, max_tokens


def check_prompt(ids: list[int], context_length: int, vocab_size: int = 0,
                 max_tokens: int | None = None) -> None:
    """Raise PromptError unless `ids` is a prompt the model can continue: not empty, ids in
    [0, vocab_size) (0: unknown, not checked), shorter than the context length (0: unknown),
    and with `max_tokens` (when given) room for that many more."""
    n, L = len(ids), context_length
    if not ids:
        raise PromptError("empty", "the prompt is empty")
    if any(t < 0 for t in ids):
        raise PromptError("negative", "the prompt has negative token ids")
    outside = [t for t in ids if t >= vocab_size] if vocab_size else []
    if outside:
        raise PromptError("vocab", f"prompt has token ids outside the vocabulary "
                                   f"[0, {vocab_size}): {outside[:5]}")
    if L and n >= L:
        raise PromptError("too_long", f"the prompt has {n} tokens: the context length is {L}, "
                          f"so at most {L - 1} prompt tokens leave room for one generated token",
                          n, L)
    if L and max_tokens is not None and n + max_tokens > L:
        raise PromptError("no_room", f"the prompt has {n} tokens and max_tokens asks for "
                          f"{max_tokens} more: the context length is {L}", n, L, max_tokens)


async def encode(tok: Tokenizer, text: str, context_length: int, param: str = "prompt",
                 add_special_tokens: bool = True) -> list[int]:
    """`text`'s token ids, tokenized off the event loop (InvalidInput, PromptError)."""
    check_text(text, param)
    nbytes = len(text.encode("utf-8"))
    # slack x4 (+4 kB): normalizers may drop characters (accents, control codes)
    if context_length and nbytes > 4 * context_length * tok.max_token_bytes + 4096:
        raise PromptError("too_long", f"the prompt has {nbytes} bytes of text: far more than "
                          f"the context length of {context_length} tokens holds",
                          nbytes, context_length)
    return await asyncio.to_thread(tok.encode, text, add_special_tokens)


async def chat_prompt_ids(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None, context_length: int = 0,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render `messages` (and `tools`) with the model's chat template and encode them.
    `template_kwargs` (REST's chat_template_kwargs) are more template variables; their
    add_generation_prompt, when given, wins over the argument (as in vLLM)."""
    extra = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise PromptError("template", f"chat_template_kwargs cannot set {', '.join(reserved)} "
                          "(they are the request's own fields)")
    add_generation_prompt = bool(extra.pop("add_generation_prompt", add_generation_prompt))
    try:
        text = await asyncio.to_thread(tok.apply_chat_template, messages,
                                       add_generation_prompt=add_generation_prompt, tools=tools,
                                       **extra)
    except Exception as e:  # template errors (raise_exception), no template
        raise PromptError("template", f"chat template: {e}") from None
    # Templates that begin with the BOS token already contain it.
    has_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
    return await encode(tok, text, context_length, "messages", add_special_tokens=not has_bos)
