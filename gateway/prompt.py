"""Prompts as both fronts take them: chat messages -> token ids, and the one prompt check.

Tokenizing runs in a worker thread (`encode`, `chat_prompt_ids` are coroutines): a 10 MB
prompt must not hold the event loop that serves everyone else. A text too long for the
context even if every token covered the longest token string is refused without tokenizing
it, and text that is not valid Unicode (a lone surrogate) is refused before it reaches the
tokenizer.

Tools reach the prompt through the chat template. A template with no tools section (it
renders the same text with and without tools, as SmolLM2's does) gets them in pdserve's
generic format instead, as llama.cpp does for such templates: the tool list as JSON
schemas, the reply format (Hermes-style <tool_call> tags) and an example call in the system
prompt (`generic_tools_prompt`), and that example as a first exchange (a WARNING once per
template; the format is documented in gateway/README.md).

`check_prompt` is what the gateway verifies before any worker sees a prompt (the gRPC API
through `Gateway.generate()`, the OpenAI shim before it fans out); workers keep their own
checks. A failure is a `PromptError`: a GatewayError (INVALID_ARGUMENT) whose `kind` lets
the OpenAI shim word it the way OpenAI clients expect (gateway/openai/errors.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import grpc

from engine.tokenizer import Tokenizer

from .request import GatewayError
from .validate import check_text

log = logging.getLogger(__name__)

# The generic format (Hermes-style tags; bench/tool_auto.py measures it on SmolLM2-135M):
# HEADER, <tools> one JSON line per tool </tools>, REPLY, an example call, OTHERWISE.
GENERIC_TOOLS_HEADER = "You are a function calling AI model. You are given these tools:"
GENERIC_TOOLS_REPLY = ("When the user asks for something a tool can do, do not answer yourself: "
                       "call the tool by replying with only a <tool_call></tool_call> block "
                       "holding a JSON object with the tool's name and arguments, like this:")
GENERIC_TOOLS_OTHERWISE = "Otherwise reply to the user as usual."
_EXAMPLE_VALUES = {"string": "...", "number": 1, "integer": 1, "boolean": True}
_PROBE = ([{"role": "user", "content": "x"}],
          [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}])
# (tokenizer, its chat_template kwarg) -> whether that template has a tools section: keyed by
# the tokenizer's identity (its templates never change), not their text; the oldest entry goes
# past RENDERS_TOOLS_MAX (a client's own template sources are keys too)
_renders_tools: dict[tuple[Tokenizer, str], bool] = {}
_renders_tools_lock = threading.Lock()      # _render runs in worker threads
RENDERS_TOOLS_MAX = 64


# template variables a request sets through its own fields (or a template source: not a kwarg)
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "chat_template"})


class PromptError(GatewayError):
    """kind: "empty" | "negative" | "vocab" | "too_long" | "no_room" | "template"."""

    def __init__(self, kind: str, message: str, num_tokens: int = 0, context_length: int = 0,
                 max_tokens: int | None = None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.kind, self.num_tokens = kind, num_tokens
        self.context_length, self.max_tokens = context_length, max_tokens


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """A client's chat_template_kwargs may not set the request's own fields or the template."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & (kwargs or {}).keys())
    if reserved:
        raise PromptError("template", f"chat_template_kwargs cannot set {', '.join(reserved)} "
                          "(they are the request's own fields)")


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
                          template_kwargs: dict[str, Any] | None = None,
                          example_call: bool = True) -> list[int]:
    """Render `messages` (and `tools`) with the model's chat template and encode them.
    `template_kwargs` are more template variables (and `chat_template`, a template name or
    source); their add_generation_prompt, when given, wins over the argument (as in vLLM).
    `example_call`: the generic format's example exchange (with_generic_tools), which a
    forced tool_choice, held to the format by its grammar, goes without."""
    extra = dict(template_kwargs or {})
    add_generation_prompt = bool(extra.pop("add_generation_prompt", add_generation_prompt))
    try:
        text = await asyncio.to_thread(_render, tok, messages, add_generation_prompt, tools,
                                       extra, example_call)
    except Exception as e:  # template errors (raise_exception), no template
        raise PromptError("template", f"chat template: {e}") from None
    # Templates that begin with the BOS token already contain it.
    has_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
    return await encode(tok, text, context_length, "messages", add_special_tokens=not has_bos)


def tagged_call(name: str, arguments: Any) -> str:
    """One call in the generic format: a <tool_call> block holding {"name", "arguments"}."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def example_call(tools: list[dict]) -> tuple[str, str]:
    """An example exchange for the first tool: a request in its description's words, and
    the call, its arguments placeholders of their schema's types."""
    f = tools[0].get("function", tools[0])
    props = (f.get("parameters") or {}).get("properties") or {}
    args = {k: _EXAMPLE_VALUES.get(v.get("type"), "...") for k, v in props.items()
            if isinstance(v, dict)}
    what = (f.get("description") or f["name"]).rstrip(".")
    return f"Please {what[:1].lower()}{what[1:]}.", tagged_call(f["name"], args)


def generic_tools_prompt(tools: list[dict]) -> str:
    """The tool list, the reply format and an example call, for a system prompt (OpenAI
    `tools` entries)."""
    lines = [json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f})
             for f in (t.get("function", t) for t in tools)]
    return "\n".join([GENERIC_TOOLS_HEADER, "<tools>", *lines, "</tools>", GENERIC_TOOLS_REPLY,
                      example_call(tools)[1], GENERIC_TOOLS_OTHERWISE])


def with_generic_tools(messages: list[dict], tools: list[dict], example: bool = True) -> list[dict]:
    """`messages` with the tools in the system prompt (appended to the first message when it
    is a system one, else a system message first), then (`example`) the example exchange as
    the first turn (a small model follows a call it saw made: bench/tool_auto.py), and earlier
    assistant tool calls written as content in the same format, for a template that renders
    neither."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "content": "\n".join(tagged_call(c["function"]["name"], _arguments(c))
                                           for c in m["tool_calls"])}
            del m["tool_calls"]
        out.append(m)
    prompt = generic_tools_prompt(tools)
    ask, call = example_call(tools)
    shot = [{"role": "user", "content": ask}, {"role": "assistant", "content": call}] if example else []
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}, *shot, *out[1:]]
    return [{"role": "system", "content": prompt}, *shot, *out]


def _arguments(call: dict) -> Any:
    """A call's arguments as JSON values (OpenAI messages carry them as JSON text)."""
    args = call["function"].get("arguments", {})
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _render(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool,
            tools: list[dict] | None, template_kwargs: dict, example_call: bool = True) -> str:
    if tools and not _template_renders_tools(tok, template_kwargs):
        messages, tools = with_generic_tools(messages, tools, example_call), None
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools, **template_kwargs)


def _template_renders_tools(tok: Tokenizer, template_kwargs: dict) -> bool:
    """Whether the template has a tools section: a probe conversation rendered with and
    without a tool differs. Found once per template (a WARNING when it has none)."""
    key = (tok, str(template_kwargs.get("chat_template")))
    with _renders_tools_lock:
        known = _renders_tools.get(key)
    if known is not None:
        return known
    messages, tools = _PROBE
    with_tools = tok.apply_chat_template(messages, tools=tools, **template_kwargs)
    renders = with_tools != tok.apply_chat_template(messages, **template_kwargs)
    with _renders_tools_lock:
        first = key not in _renders_tools
        while len(_renders_tools) >= RENDERS_TOOLS_MAX:
            del _renders_tools[next(iter(_renders_tools))]
        _renders_tools[key] = renders
    if first and not renders:
        log.warning("the model's chat template has no tools section: requests with tools "
                    "get them in the system prompt in pdserve's generic format "
                    "(gateway/README.md, 'Tool calls')")
    return renders
