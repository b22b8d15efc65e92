"""gateway/openai/tools.ForcedCallStream: a forced tool_choice's output read as it grows gives
each call's name first, then its arguments' JSON in pieces that join to exactly the arguments
json.loads finds in the whole text (strings with escaped quotes and braces, nesting, arrays)."""
import json
import random

from gateway.openai.tools import ForcedCallStream


def _stream(text, array, rng):
    s, events, end = ForcedCallStream(array), [], 0
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
    s = ForcedCallStream(False)
    events = s.feed(text[:-8])
    assert events[0] == (0, "f", "") and not s.complete()
    assert ForcedCallStream(True).complete() is False
