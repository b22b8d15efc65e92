"""Tool calling: constrain (tool_choice required / named) and parse (auto).

Forced calls are enforced by a JSON schema over the chat template's call format
`{"name": ..., "arguments": {...}}`: a named function gets one such object (its name a
const), `required` an array of one or more of them (any of the tools). `auto` leaves the
model free; its output is parsed as calls when it is exactly that format (a JSON object or
array, or `<tool_call>...</tool_call>` blocks as Hermes-style templates write them).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .protocol import Tool

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def call_schema(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_schema(tools: list[Tool], name: str | None, parallel: bool = True) -> dict[str, Any]:
    """The schema for tool_choice: a named function (one call) or "required" (>= 1 call;
    exactly 1 when `parallel` is off, as OpenAI's parallel_tool_calls=false means)."""
    if name is not None:
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return call_schema(tool)
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [call_schema(t) for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_calls(text: str, tools: list[Tool]) -> list[dict[str, Any]] | None:
    """OpenAI tool_calls for `text`, or None when it is not (only) tool calls."""
    names = {t.function.name for t in tools}
    text = text.strip()
    tagged = _TAGGED.findall(text)
    if tagged:
        if _TAGGED.sub("", text).strip():
            return None
        items = []
        for block in tagged:
            try:
                items.append(json.loads(block))
            except ValueError:
                return None
    else:
        if not text.startswith(("{", "[")):
            return None
        try:
            value = json.loads(text)
        except ValueError:
            # several calls, one per line (the tiny template's format)
            try:
                value = [json.loads(line) for line in text.splitlines() if line.strip()]
            except ValueError:
                return None
        items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in names and "arguments" in item):
            return None
        args = item["arguments"]
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": item["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return calls or None


def may_be_call(text: str) -> bool:
    """Whether a streamed output that begins with `text` might turn out to be a tool call
    (then the stream holds the content back until the end)."""
    t = text.lstrip()
    return t == "" or t.startswith(("{", "[")) or "<tool_call>".startswith(t[:11]) or t.startswith("<tool_call>")


class CallBuffer:
    """One streamed choice's content, held back while it may still be a tool call.

    With tools in play, content that starts like a call (`may_be_call`) is held until it
    either stops looking like one (then released as content, and nothing is held again) or
    the choice finishes (then `calls()` parses it). A forced tool_choice holds from the start
    and never releases early.
    """

    def __init__(self, tools: list[Tool], parse: bool, forced: bool):
        self.tools, self.parse, self.forced = tools, parse, forced
        self.holding = forced
        self._sent_text = False

    def update(self, text: str, delta: str, finished: bool) -> bool:
        """The choice's text so far and its newest delta; True when the held content must be
        sent now as content (all of `text`): it is not a call after all."""
        if self.parse and not self.holding and not self._sent_text and may_be_call(text):
            self.holding = True
        if self.holding and not finished and delta and not may_be_call(text) and not self.forced:
            self.holding = False
            self._sent_text = True
            return True
        return False

    def sent(self, delta: str) -> None:
        """`delta` went out as content."""
        self._sent_text = self._sent_text or bool(delta)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """At the end: the held text as tool calls (None: not holding, or not calls)."""
        return parse_calls(text, self.tools) if self.holding else None
