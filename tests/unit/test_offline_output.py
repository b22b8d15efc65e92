"""The offline `LLM` runs the same OutputProcessor as the gateway: text, stop strings and
finish reasons, checked against the greedy run without stop strings (the reference)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.tiny_model import ensure_default_model


@pytest.fixture(scope="module")
def llm():
    return LLM(ensure_default_model(), num_blocks=128)


def test_text_is_the_decoded_tokens(llm):
    out, = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    assert out.text == llm.tokenizer.decode(list(out.token_ids))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_and_frees_the_request(llm, include):
    ref, = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stop = ref.text[10:13]                  # a string the greedy output is known to contain
    assert len(stop) == 3 and stop.strip(), ref.text
    at = ref.text.index(stop)
    out, = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                      stop=[stop], include_stop_str_in_output=include))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:at + (len(stop) if include else 0)]
    assert list(out.token_ids) == list(ref.token_ids[:len(out.token_ids)])
    assert len(out.token_ids) < len(ref.token_ids) and len(out.logprobs) == len(out.token_ids)
    eng = llm.engine
    assert not eng.requests and not eng.has_unfinished_requests()
    assert eng.kv.num_held_blocks() == 0            # the aborted request returned its blocks
