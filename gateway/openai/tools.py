"""Tool calling: constrain (tool_choice required / named) and parse (auto).

Forced calls are enforced by a JSON schema over the chat template's call format
`{"name": ..., "arguments": {...}}`: a named function gets one such object (its name a
const), `required` an array of one or more of them (any of the tools). `auto` leaves the
model free; its output is parsed as calls when it is exactly that format (a JSON object or
array, or `<tool_call>...</tool_call>` blocks as Hermes-style templates write them).
Streamed, both send each call's name and then its arguments as they are generated
(StreamedCalls over one incremental scanner, CallStream).
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
    """OpenAI tool_calls for `text`, or None when it is not (only) tool calls. Each call's
    `arguments` is its JSON text as generated (what a stream of it sends, piece by piece)."""
    names = {t.function.name for t in tools}
    text = text.strip()
    tagged = _TAGGED.findall(text)
    array = False
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
        else:
            array = isinstance(value, list)
        items = value if isinstance(value, list) else [value]
    scan = CallStream(array)
    scan.feed(text)
    calls = []
    for item, spans in zip(items, scan.calls):
        if not (isinstance(item, dict) and item.get("name") in names and "arguments" in item):
            return None
        args = item["arguments"]
        if not isinstance(args, str):
            args = text[spans["start"]:spans["end"]] if spans["end"] else json.dumps(args)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": item["name"], "arguments": args}})
    return calls if calls and len(calls) == len(items) else None


def forced_calls(text: str, array: bool, name: str | None) -> tuple[list[dict[str, Any]], bool]:
    """The calls in a forced tool_choice's output and whether they are complete. Output cut
    short (max_tokens) still gives its calls: the last one with the arguments generated so far
    (a call whose name was not finished is left out, unless tool_choice named it)."""
    scan = CallStream(array, eager=True, name=name)
    scan.feed(text)
    calls = [{"id": c["id"], "type": "function", "function": {
                 "name": c["name"],
                 "arguments": "" if c["start"] is None else text[c["start"]:c["end"] or len(text)]}}
             for c in scan.calls if c["name"] is not None]
    return calls, scan.complete()


class StreamedCalls:
    """One streamed choice's tool calls, sent as they are generated (OpenAI's and vLLM's
    streaming shape): each call's id and name as soon as its arguments begin, then the
    arguments' JSON piece by piece.

    A forced tool_choice is calls from the first token (the grammar makes it one): each call
    is announced as soon as its name is read, a named tool_choice's before any token (`name`).
    With
    `auto` the output is held while it may still become a call, then either
      - it is recognised as one: its first call object has a tool's name and its arguments
        have begun (`{"name": "f", "arguments": {`, also inside `[...]` or after
        `<tool_call>`) -> calls, streamed from then on;
      - or it cannot be one (it begins with anything else, the call names no tool, its first
        object closes without a name and arguments, an array holds no object) -> content:
        what was held is sent, the rest streams as content.
    Text still held at the end (e.g. the first call's arguments given as a JSON string) is
    parsed whole with parse_calls, as unstreamed. A stream commits when it recognises a call: if the finished
    text is not only calls after all, the finish reason is the model's own, not "tool_calls".
    """

    def __init__(self, tools: list[Tool], forced: bool, array: bool = False,
                 name: str | None = None):
        self.tools = tools
        self.names = {t.function.name for t in tools}
        self.forced = forced
        self.mode = "calls" if forced else "held"      # auto: -> "content" | "calls"
        self.scan = CallStream(array, eager=True, name=name) if forced else None
        self.dropped: int | None = None                # auto: the first call naming no tool

    @property
    def sent_calls(self) -> bool:
        return self.mode == "calls" and any(c["announced"] for c in self.scan.calls)

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        """The choice's text so far -> new (call index, name when announcing else None,
        arguments piece) events; with auto, may move `mode` from "held" to "content" or
        "calls"."""
        if self.mode == "held" and self.scan is None:
            self._start(text.lstrip())
        if self.scan is None or self.mode == "content":
            return []
        events = self.scan.feed(text)
        if self.forced:
            return events
        for k, name, _ in events:
            if name is not None and name not in self.names and self.dropped is None:
                self.dropped = k
        if self.dropped is not None:
            events = [e for e in events if e[0] < self.dropped]
        if self.mode == "held":
            if events and events[0][0] == 0:
                self.mode = "calls"
            else:              # a later call when the first cannot stream: the end parses all
                if self.dropped == 0 or self._not_a_call(text):
                    self.mode = "content"
                return []
        return events

    def _not_a_call(self, text: str) -> bool:
        """Held output that can no longer be calls: its first object closed without a tool's
        name and arguments, or an array whose first element is not an object."""
        first = self.scan.calls[0] if self.scan.calls else None
        if first is not None:
            return first["closed"] and not (first["name"] in self.names and first["args"])
        rest = text.lstrip()[1:].lstrip()
        return self.scan.call_depth == 2 and rest != "" and not rest.startswith("{")

    def _start(self, t: str) -> None:
        """The first characters (left-stripped) decide whether a call may follow."""
        if t[:1] in ("{", "["):
            self.scan = CallStream(t[0] == "[")
        elif t.startswith("<tool_call>"):
            self.scan = CallStream(False)
        elif t and not "<tool_call>".startswith(t):
            self.mode = "content"

    def finish(self, text: str) -> tuple[list[tuple[int, str | None, str]], bool]:
        """At the end, for a stream that sent calls: the events still to send (a later call
        the scanner could not stream, its arguments a JSON string, goes whole) and whether it
        finishes with "tool_calls" (auto: the whole text parses as calls, as unstreamed)."""
        if self.forced:
            return [], self.scan.complete()
        parsed = parse_calls(text, self.tools)
        if parsed is None:
            return [], False
        events = []
        for k, (c, call) in enumerate(zip(self.scan.calls, parsed)):
            if not c["announced"]:
                c["announced"] = True
                events += [(k, call["function"]["name"], ""), (k, None, call["function"]["arguments"])]
        return events, True


class CallStream:
    """Tool calls read while the output grows, so a stream can send each call's name as soon
    as it is known and its `arguments` JSON piece by piece instead of all at the end.

    The call format is `{"name": N, "arguments": {...}}` (what forced_schema's grammar
    makes), several of them in a JSON array (`array`), one per line, or each inside
    `<tool_call>...</tool_call>`, so a scanner of JSON structure suffices: a call is an object
    at `call_depth` (text between calls, tags included, is skipped); the object value of its
    "arguments" key is streamed as it arrives (a character scanned inside it never changes:
    the text only grows)."""

    def __init__(self, array: bool, eager: bool = False, name: str | None = None):
        self.call_depth = 2 if array else 1
        self.eager = eager                    # announce a call on its name (forced output)
        self.pos = self.depth = 0
        self.in_str = self.esc = self.closed = False
        self.str_start = 0
        self.key: str | None = None           # the last key read at call depth
        self.expect_key = False
        # {"id", "name", "start", "end" (of the arguments), "sent", "announced", "args" (the
        #  key was read), "opened", "closed" (the call object)}
        self.calls: list[dict[str, Any]] = []
        if name is not None:                  # a named tool_choice: call 0's name is known
            self._new_call(name, opened=False)

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        """New (call index, name when announcing it else None, arguments piece) events."""
        for i in range(self.pos, len(text)):
            self._scan(text, i)
        self.pos = len(text)
        events = []
        for k, c in enumerate(self.calls):
            if c["name"] is None or (c["start"] is None and not self.eager):
                continue
            if not c["announced"]:
                c["announced"] = True
                events.append((k, c["name"], ""))
            if c["start"] is None:
                continue
            upto = c["end"] if c["end"] is not None else len(text)
            piece = text[c["start"] + c["sent"]:upto]
            if piece:
                c["sent"] += len(piece)
                events.append((k, None, piece))
        return events

    def complete(self) -> bool:
        """The output closed (its object or array) and held calls, each with a name and
        closed arguments."""
        return self.closed and bool(self.calls) and all(
            c["end"] is not None and c["name"] for c in self.calls)

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
                    try:
                        value = json.loads(text[self.str_start:i + 1])
                    except ValueError:     # free text (auto) need not be valid JSON
                        value = None
                    if self.expect_key:
                        self.key, self.expect_key = value, False
                        self.calls[-1]["args"] |= value == "arguments"
                    elif self.key == "name":
                        self.calls[-1]["name"] = value
            return
        if c == '"':
            self.in_str, self.str_start = True, i
        elif c in "{[":
            if self.depth == self.call_depth - 1 and c == "{":
                if self.calls and not self.calls[-1]["opened"]:
                    self.calls[-1]["opened"] = True
                else:
                    self._new_call(None)
                self.expect_key = True
            elif at_call and self.key == "arguments" and self.calls:
                self.calls[-1]["start"] = i
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if (self.depth == self.call_depth and self.key == "arguments" and self.calls
                    and self.calls[-1]["start"] is not None and self.calls[-1]["end"] is None):
                self.calls[-1]["end"] = i + 1
            if self.depth == self.call_depth - 1 and c == "}" and self.calls:
                self.calls[-1]["closed"] = True
            self.closed |= self.depth == 0 and bool(self.calls)
        elif c == "," and at_call:
            self.key, self.expect_key = None, True

    def _new_call(self, name: str | None, opened: bool = True) -> None:
        self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "start": None,
                           "end": None, "sent": 0, "announced": False, "args": False,
                           "opened": opened, "closed": False})
