"""gateway/openai/tools for a forced tool_choice (named or required): the call is announced as
soon as its name is known (a named call before any token), its arguments stream as generated,
and output cut at any point (max_tokens) is still calls: the arguments generated so far, never
the wrapper; complete only when every call closed. References: json.loads of the whole text,
and the schema's own key order as llguidance generates it."""
import json

import pytest

from engine.structured import StructuredOutput
from gateway.openai.protocol import Tool
from gateway.openai.tools import StreamedCalls, forced_calls, forced_schema

TOOLS = [Tool.model_validate({"type": "function", "function": {
    "name": n, "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}})
    for n in ("get_time", "get_date")]
NAMED = {"name": "get_time", "arguments": {"tz": "UTC", "date": "2025-01-01", "x": [1, {"y": "}"}]}}
REQUIRED = [NAMED, {"name": "get_date", "arguments": {}}]


def test_the_schema_generates_the_name_first():
    """The wire form keeps the schema's key order (llguidance generates properties in it):
    "name" then "arguments", so a stream knows the name before the arguments."""
    for name in ("get_time", None):
        value = json.loads(StructuredOutput(json_schema=forced_schema(TOOLS, name)).value)
        call = value if name else value["items"]["anyOf"][0]
        assert list(call["properties"]) == ["name", "arguments"]


def _prefixes(text):
    return [text[:end] for end in range(len(text) + 1)]


def test_named_call_announced_before_any_token_and_streamed():
    text = json.dumps(NAMED, separators=(",", ":"))
    s = StreamedCalls(TOOLS, forced=True, name="get_time")
    events = s.feed("")
    assert [(k, n) for k, n, _ in events] == [(0, "get_time")]
    for prefix in _prefixes(text)[1:]:
        new = s.feed(prefix)
        assert all(k == 0 and n is None for k, n, _ in new)     # announced once
        events += new
    assert "".join(p for _, _, p in events) == json.dumps(NAMED["arguments"], separators=(",", ":"))
    assert s.finish(text) == ([], True)


@pytest.mark.parametrize("array", [False, True])
def test_cut_output_is_calls_with_the_arguments_so_far(array):
    """At every cut: only calls, each a tool's name with a prefix of its arguments' text (the
    whole text once closed), complete only once the output closed; the wrapper never shows."""
    want = REQUIRED if array else [NAMED]
    text = json.dumps(want if array else NAMED)
    args = [json.dumps(c["arguments"]) for c in want]
    name = None if array else "get_time"
    for prefix in _prefixes(text):
        calls, complete = forced_calls(prefix, array, name)
        assert complete == (prefix == text), prefix
        if name:
            assert len(calls) == 1                       # named: a call from the first token
        for c, w, a in zip(calls, want, args):
            assert c["type"] == "function" and c["id"].startswith("call_")
            assert c["function"]["name"] == w["name"]
            assert a.startswith(c["function"]["arguments"]), (prefix, c)
            assert '"name"' not in c["function"]["arguments"]
        closed = [c for c in calls if c["function"]["arguments"] in args]
        assert [json.loads(c["function"]["arguments"]) for c in closed] == \
            [w["arguments"] for w in want[:len(closed)]]
    if array:
        calls, _ = forced_calls(text[:text.index("get_date") + 3], True, None)
        assert [c["function"]["name"] for c in calls] == ["get_time"]   # the second name unfinished


def test_streamed_cut_matches_unstreamed():
    text = json.dumps(REQUIRED)
    for cut in (5, 20, len(text) // 2, len(text) - 3):
        s = StreamedCalls(TOOLS, forced=True, array=True)
        events = []
        for prefix in _prefixes(text[:cut]):
            events += s.feed(prefix)
        rest, complete = s.finish(text[:cut])
        assert rest == [] and not complete
        calls, _ = forced_calls(text[:cut], True, None)
        got = {}
        for k, n, p in events:
            got.setdefault(k, [None, ""])
            got[k][0] = n or got[k][0]
            got[k][1] += p
        assert [tuple(v) for v in got.values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
