"""gateway/openai/tools: tool-call output read as it grows (CallStream; StreamedCalls for
tool_choice auto) gives each call's name first, then its arguments' JSON in pieces that join
to exactly the arguments json.loads / parse_calls find in the whole text (strings with escaped
quotes and braces, nesting, arrays, every call format); auto output that cannot be a call is
released as content as soon as that is known."""
import json
import random

from gateway.openai.protocol import Tool
from gateway.openai.tools import CallStream, StreamedCalls, parse_calls


def _stream(text, array, rng):
    s, events, end = CallStream(array), [], 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 7))
        events += s.feed(text[:end])
    return s, events


def test_pieces_join_to_the_arguments_of_every_call():
    rng = random.Random(0)
    calls = [{"name": "get_weather", "arguments": {"city": 'Pa"r}is {', "days": [1, {"a": [2]}]}},
             {"name": "get_time", "arguments": {}},
             {"name": "x", "arguments": {"s": "\\\\", "u": "\\u00e9"}}]
    for array, text in ((False, json.dumps(calls[0])),
                        (True, json.dumps(calls)), (True, json.dumps(calls, indent=2))):
        for _ in range(20):
            s, events = _stream(text, array, rng)
            want = json.loads(text) if array else [json.loads(text)]
            assert s.complete()
            for k, call in enumerate(want):
                mine = [e for e in events if e[0] == k]
                assert mine[0] == (k, call["name"], "")           # the name before any piece
                joined = "".join(p for _, n, p in mine[1:])
                assert all(n is None for _, n, _ in mine[1:])
                assert json.loads(joined) == call["arguments"]


def test_cut_output_is_not_complete():
    text = json.dumps({"name": "f", "arguments": {"a": "long value"}})
    s = CallStream(False)
    events = s.feed(text[:-8])
    assert events[0] == (0, "f", "") and not s.complete()
    assert CallStream(True).complete() is False


# ----------------------------------------------------------------------------- auto

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
         for n in ("get_weather", "get_time")]
W = {"name": "get_weather", "arguments": {"city": "Pa\"ris}", "days": [1, {"a": 2}]}}
T = {"name": "get_time", "arguments": {}}
NOPE = json.dumps({"name": "nope", "arguments": {"a": 1}})
CALL_TEXTS = [                                   # every format parse_calls reads
    json.dumps(W),
    json.dumps([W, T], indent=1),
    json.dumps(W) + "\n" + json.dumps(T),
    "<tool_call>\n" + json.dumps(W) + "\n</tool_call>\n<tool_call>" + json.dumps(T) + "</tool_call>",
    '  {"arguments": {"x":1},  "name": "get_time"}',
]


def _auto(text, rng, tools=TOOLS):
    s, events, modes, end = StreamedCalls(tools, forced=False), [], [], 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 5))
        new = s.feed(text[:end])
        events += new
        modes.append((end, s.mode, bool(new)))
    return s, events, modes


def test_auto_streams_each_call_once_recognised():
    """Held until the first call's name is read and its arguments begin, then each call's
    name before its pieces, and the pieces join to exactly the arguments the unstreamed
    parse returns."""
    rng = random.Random(1)
    for text in CALL_TEXTS:
        want = parse_calls(text, TOOLS)
        assert want is not None, text
        args_begin = text.index("{", text.index('"arguments"')) + 1
        name_value = text.index('"', text.index(":", text.index('"name"')))
        recognised = max(args_begin, text.index('"', name_value + 1) + 1)   # text[:recognised]
        for _ in range(20):
            s, events, modes = _auto(text, rng)
            assert s.mode == "calls" and s.finish(text) == ([], True)
            for end, mode, sent in modes:            # nothing sent before that
                assert (mode == "calls") == (end >= recognised) and (sent <= (mode == "calls"))
            assert sorted({k for k, _, _ in events}) == list(range(len(want)))
            for k, call in enumerate(want):
                mine = [e for e in events if e[0] == k]
                assert mine[0] == (k, call["function"]["name"], "")
                assert all(n is None for _, n, _ in mine[1:])
                assert "".join(p for _, _, p in mine[1:]) == call["function"]["arguments"]


def test_auto_content_is_released_as_soon_as_it_cannot_be_a_call():
    for text, decided_at in (("Hello {", 1), ("  \n Sure", 5), ("<b>bold", 2), ("<tool_x>", 7),
                             (NOPE, NOPE.index("{", 1) + 1)):
        s = StreamedCalls(TOOLS, forced=False)
        for end in range(1, len(text) + 1):
            assert s.feed(text[:end]) == []
            assert s.mode == ("content" if end >= decided_at else "held"), (text, end)
    s = StreamedCalls(TOOLS, forced=False)
    s.feed("<tool_call>\n")
    assert s.mode == "held"


def test_auto_not_quite_calls():
    """JSON that may still be a call stays held, and is content once its first object closes
    without a tool's name and arguments (or an array's first element is not an object); a
    first call whose arguments are a JSON string stays held (the end parses all, as
    unstreamed); a later call naming no tool is not sent and the stream does not finish with
    tool_calls; text that is not valid JSON does not break the scanner."""
    rng = random.Random(2)
    s, events, _ = _auto('{"a": 1, "b": [2]', rng)
    assert s.mode == "held" and events == []
    for text, closed in (('{"a": 1, "b": [2]} and', 18), ('[1, {"name": "get_time"', 2),
                         ('{"name": "get_time"} x', 20), ('<tool_call>{"arguments": {}}</tool_call>', 28)):
        assert text[closed - 1] in "}1"
        s = StreamedCalls(TOOLS, forced=False)
        for end in range(1, len(text) + 1):
            assert s.feed(text[:end]) == []
            assert s.mode == ("content" if end >= closed else "held"), (text, end)
    text = json.dumps(W) + "\n" + json.dumps({"name": "rm_rf", "arguments": {}})
    s, events, _ = _auto(text, rng)
    assert {k for k, _, _ in events} == {0} and s.finish(text) == ([], False)
    assert parse_calls(text, TOOLS) is None
    s, events, _ = _auto('{"name": "get_\\q", "arguments": {"\\x": "\n"}} trailing', rng)
    assert events == [] and s.mode == "content"
    text = json.dumps({"name": "get_time", "arguments": "{}"}) + "\n" + json.dumps(W)
    s, events, _ = _auto(text, rng)        # the first call cannot stream: all at the end
    assert s.mode == "held" and events == [] and not s.sent_calls
    assert [c["function"]["arguments"] for c in parse_calls(text, TOOLS)] == ["{}", json.dumps(W["arguments"])]
    cut = json.dumps(W)[:-5]
    s, events, _ = _auto(cut, rng)
    assert events and s.finish(cut) == ([], False)


def test_auto_stream_agrees_with_the_unstreamed_parse():
    """Random outputs (calls in every format, cut, with text around them, unknown names,
    string arguments, plain JSON, prose) in random pieces: output that parses as calls is
    never streamed as content, and a stream that finishes with tool_calls sends exactly the
    parsed calls (a later one with string arguments whole at the end); output that does not
    parse never finishes with tool_calls."""
    rng = random.Random(3)
    objs = [W, T, {"name": "rm", "arguments": {}}, {"name": "get_time", "arguments": "{}"},
            {"a": 1}, {"name": "get_weather", "arguments": {"city": "Lima", "days": 2}, "x": [1]}]
    seen = {"content": 0, "calls": 0, "held": 0}
    for _ in range(400):
        items = [rng.choice(objs) for _ in range(rng.randint(1, 3))]
        form = rng.randrange(4)
        text = (json.dumps(items[0]) if form == 0 else json.dumps(items) if form == 1 else
                "\n".join(json.dumps(i) for i in items) if form == 2 else
                "".join(f"<tool_call>\n{json.dumps(i)}\n</tool_call>\n" for i in items))
        r = rng.random()
        if r < 0.2:
            text = text[:rng.randint(1, len(text))]
        elif r < 0.3:
            text = rng.choice(["Sure: ", "  ", "{", "Hi"]) + text
        elif r < 0.4:
            text += rng.choice([" done", "\n", "}"])
        want = parse_calls(text, TOOLS)
        s, events, _ = _auto(text, rng)
        seen[s.mode] += 1
        if want is not None:
            assert s.mode != "content", text
        if s.sent_calls:
            rest, complete = s.finish(text)
            assert complete == (want is not None), text
            events += rest
            for k, call in enumerate(want or []):
                mine = [e for e in events if e[0] == k]
                assert mine[0][1] == call["function"]["name"]
                assert "".join(p for _, _, p in mine[1:]) == call["function"]["arguments"]
    assert min(seen.values()) > 20, seen
