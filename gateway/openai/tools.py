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


class ForcedCallStream:
    """A forced tool_choice's calls read while the constrained output grows, so a stream can
    send each call's name as soon as it is known and its `arguments` JSON piece by piece, as
    OpenAI and vLLM stream them, instead of all at the end.

    The grammar (forced_schema) makes the output `{"name": N, "arguments": {...}}`, or a JSON
    array of such objects for `required`, so a scanner of JSON structure suffices: a call is
    an object at `call_depth`; the object value of its "arguments" key is streamed as it
    arrives (a character scanned inside it never changes: the text only grows)."""

    def __init__(self, array: bool):
        self.call_depth = 2 if array else 1
        self.pos = self.depth = 0
        self.in_str = self.esc = False
        self.str_start = 0
        self.key: str | None = None           # the last key read at call depth
        self.expect_key = False
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "start", "end", "sent", "announced"}

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        """New (call index, name when announcing it else None, arguments piece) events."""
        for i in range(self.pos, len(text)):
            self._scan(text, i)
        self.pos = len(text)
        events = []
        for k, c in enumerate(self.calls):
            if c["name"] is None or c["start"] is None:
                continue
            if not c["announced"]:
                c["announced"] = True
                events.append((k, c["name"], ""))
            upto = c["end"] if c["end"] is not None else len(text)
            piece = text[c["start"] + c["sent"]:upto]
            if piece:
                c["sent"] += len(piece)
                events.append((k, None, piece))
        return events

    def complete(self) -> bool:
        """Every call's arguments closed (and there is at least one)."""
        return bool(self.calls) and all(c["end"] is not None and c["name"] for c in self.calls)

    def _scan(self, text: str, i: int) -> None:
        c = text[i]
        at_call = self.depth == self.call_depth
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if at_call and self.calls:
                    value = json.loads(text[self.str_start:i + 1])
                    if self.expect_key:
                        self.key, self.expect_key = value, False
                    elif self.key == "name":
                        self.calls[-1]["name"] = value
            return
        if c == '"':
            self.in_str, self.str_start = True, i
        elif c in "{[":
            if self.depth == self.call_depth - 1 and c == "{":
                self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": None,
                                   "start": None, "end": None, "sent": 0, "announced": False})
                self.expect_key = True
            elif at_call and self.key == "arguments" and self.calls:
                self.calls[-1]["start"] = i
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if (self.depth == self.call_depth and self.key == "arguments" and self.calls
                    and self.calls[-1]["start"] is not None and self.calls[-1]["end"] is None):
                self.calls[-1]["end"] = i + 1
        elif c == "," and at_call:
            self.key, self.expect_key = None, True
