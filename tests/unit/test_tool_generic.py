"""gateway/prompt: a chat template with no tools section (SmolLM2's, copied below) gets the
tools in the system prompt in the generic format, found by rendering with and without tools,
with one WARNING per template; a template with a tools section renders them itself, exactly
as transformers does. A reply in the documented format is read as calls by the same parser
`auto` uses, streamed and not."""
import asyncio
import json
import logging
import random

import pytest

from engine.tokenizer import Tokenizer
from gateway import prompt
from gateway.openai.protocol import Tool
from gateway.openai.tools import StreamedCalls, parse_calls

from .test_tokenizer import model_dir, tok  # noqa: F401 (the tiny model and its tokenizer)

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
           "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "the time in a zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
    {"type": "function", "function": {"name": "get_date", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "What time is it in UTC?"}]


def _ids(tok, messages, tools=None, **kw):
    return asyncio.run(prompt.chat_prompt_ids(tok, messages, True, tools, template_kwargs=kw))


def test_no_tools_section_gets_the_generic_prompt(tok, caplog):  # noqa: F811
    prompt._renders_tools.clear()
    with caplog.at_level(logging.WARNING, "gateway.prompt"):
        plain = _ids(tok, ASK, chat_template=SMOLLM2)
        with_tools = _ids(tok, ASK, TOOLS, chat_template=SMOLLM2)
        again = _ids(tok, ASK, TOOLS, chat_template=SMOLLM2)
    assert plain == _ids(tok, ASK, [], chat_template=SMOLLM2) and again == with_tools
    assert len(with_tools) > len(plain)
    assert sum("no tools section" in r.getMessage() for r in caplog.records) == 1
    text = tok.decode(with_tools, skip_special_tokens=False)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "..."}}\n</tool_call>'
    assert text == tok.bos_token + (           # the tiny tokenizer adds its BOS
        "<|im_start|>system\n" + prompt.GENERIC_TOOLS_HEADER + "\n<tools>\n"
        '{"name": "get_time", "description": "the time in a zone", "parameters": {"type": "object", '
        '"properties": {"tz": {"type": "string"}}, "required": ["tz"]}}\n'
        '{"name": "get_date", "parameters": {"type": "object"}}\n</tools>\n'
        + prompt.GENERIC_TOOLS_REPLY + "\n" + call + "\n" + prompt.GENERIC_TOOLS_OTHERWISE + "<|im_end|>\n"
        "<|im_start|>user\nPlease the time in a zone.<|im_end|>\n"          # the example exchange
        "<|im_start|>assistant\n" + call + "<|im_end|>\n"
        "<|im_start|>user\nWhat time is it in UTC?<|im_end|>\n<|im_start|>assistant\n")
    # a system message of the user's own keeps its text, the tools after it
    mine = _ids(tok, [{"role": "system", "content": "Be brief."}, *ASK], TOOLS, chat_template=SMOLLM2)
    assert tok.decode(mine, skip_special_tokens=False).startswith(tok.bos_token +
        "<|im_start|>system\nBe brief.\n\n" + prompt.GENERIC_TOOLS_HEADER)


def test_a_forced_choice_goes_without_the_example_exchange(tok):  # noqa: F811
    """example_call=False (a forced tool_choice: its grammar holds the format): the same system
    prompt, and the user's turn right after it."""
    def text(**kw):
        return tok.decode(asyncio.run(prompt.chat_prompt_ids(
            tok, ASK, True, TOOLS, template_kwargs={"chat_template": SMOLLM2}, **kw)), skip_special_tokens=False)
    with_example, without = text(), text(example_call=False)
    system = with_example.split("<|im_end|>")[0]
    assert without == system + ("<|im_end|>\n<|im_start|>user\nWhat time is it in UTC?<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert "Please the time in a zone." in with_example


def test_earlier_calls_written_in_the_same_format(tok):  # noqa: F811
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_date", "arguments": {}}}]
    msgs = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]
    text = tok.decode(_ids(tok, msgs, TOOLS, chat_template=SMOLLM2), skip_special_tokens=False)
    said = text.split("<|im_start|>assistant\n")[2].split("<|im_end|>")[0]   # [1]: the example
    assert said == ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>')
    assert [c["function"] for c in parse_calls(said, [Tool.model_validate(t) for t in TOOLS])] == [
        {"name": "get_time", "arguments": '{"tz": "UTC"}'}, {"name": "get_date", "arguments": "{}"}]


def test_a_template_with_a_tools_section_renders_them_itself(tok, model_dir, caplog):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    with caplog.at_level(logging.WARNING, "gateway.prompt"):
        ours = _ids(tok, ASK, TOOLS)
    assert ours == hf.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
    assert not caplog.records


def test_the_documented_reply_format_is_read_as_calls():
    """The prompt's own example call, and several of them, are read as calls by auto's
    parser: whole, and streamed in random pieces to the same calls."""
    tools = [Tool.model_validate(t) for t in TOOLS]
    ask, one = prompt.example_call(TOOLS)
    assert ask == "Please the time in a zone." and one in prompt.generic_tools_prompt(TOOLS)
    several = one + "\n" + prompt.tagged_call("get_date", {})
    rng = random.Random(0)
    for text, want in ((one, [("get_time", '{"tz": "..."}')]),
                       (several, [("get_time", '{"tz": "..."}'), ("get_date", "{}")])):
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in parse_calls(text, tools)] == want
        s, got, end = StreamedCalls(tools, forced=False), {}, 0
        while end < len(text):
            end = min(len(text), end + rng.randint(1, 4))
            for k, name, piece in s.feed(text[:end]):
                got.setdefault(k, [name, ""])[1] += piece
        assert s.finish(text) == ([], True)
        assert [tuple(v) for v in got.values()] == want


def test_the_probe_runs_once_per_template_in_a_bounded_cache(tok, monkeypatch):  # noqa: F811
    """The probe renders twice the first time a (tokenizer, template) is seen and never again
    (the key is the tokenizer's identity, not its templates' text); a client's own template
    sources, each a key, evict the oldest past RENDERS_TOOLS_MAX."""
    prompt._renders_tools.clear()
    renders = []
    real = Tokenizer.apply_chat_template
    monkeypatch.setattr(Tokenizer, "apply_chat_template",
                        lambda self, m, *a, **k: renders.append(m) or real(self, m, *a, **k))
    for _ in range(3):
        _ids(tok, ASK, TOOLS, chat_template=SMOLLM2)
    assert sum(m is prompt._PROBE[0] for m in renders) == 2 and len(renders) == 5
    monkeypatch.setattr(prompt, "RENDERS_TOOLS_MAX", 4)
    for i in range(10):
        _ids(tok, ASK, TOOLS, chat_template=SMOLLM2 + f"{{# {i} #}}")
    assert len(prompt._renders_tools) == 4
    assert (tok, SMOLLM2 + "{# 9 #}") in prompt._renders_tools
