"""engine.output_processor: stop strings (cut, held-back partial matches), stop tokens,
max_tokens, include_stop_str_in_output; expected text from the tokenizer's own decode()."""
from __future__ import annotations

import pytest

from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model
from engine.tokenizer import Tokenizer

TEXT = "The cat sat on the mat, then the dog stopped by and sat down too."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("Story: ")


def ids_of(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text                      # the fixture text round-trips
    return ids


def one_by_one(proc, ids):
    text, deltas = "", []
    for t in ids:
        d = proc.add([t], [(-0.5, None)])
        if d is not None:
            text += d.text
            deltas.append(d)
        if proc.finished:
            break
    return text, deltas


def test_stop_string_cuts_and_holds_back_partial_matches(tok, prompt):
    ids = ids_of(tok, TEXT)
    proc = OutputProcessor(tok, prompt, SamplingParams(max_tokens=None, stop=["dog"]))
    emitted, held_back = "", False
    for k, t in enumerate(ids):
        d = proc.add([t], [(-0.5, None)])
        emitted += d.text if d is not None else ""
        if proc.finished:
            break
        so_far = tok.decode(ids[:k + 1])
        assert so_far.startswith(emitted)
        held = so_far[len(emitted):]
        assert held == "" or "dog".startswith(held)          # only a possible "dog" is held
        assert not any("dog".startswith(so_far[j:]) for j in range(len(emitted)))  # all of it
        held_back |= len(emitted) < len(so_far)
    assert held_back, "no step held back a possible stop string"
    assert emitted == TEXT[:TEXT.index("dog")]
    assert proc.finish_reason == "stop" and proc.stop_reason == "dog"
    assert d.finish_reason == "stop" and d.stop_reason == "dog"
    # the token that completed "dog" is the last one taken; later tokens are dropped
    assert tok.decode(proc.token_ids).startswith(TEXT[:TEXT.index("dog") + 3])
    assert not tok.decode(proc.token_ids[:-1]).startswith(TEXT[:TEXT.index("dog") + 3])
    late = proc.add(ids[len(proc.token_ids):], [(0.0, None)] * 40)
    assert (late.token_ids, late.text, late.finish_reason) == ([], "", "stop")


def test_include_stop_str_in_output_and_one_batch(tok, prompt):
    ids = ids_of(tok, TEXT)
    p = SamplingParams(max_tokens=None, stop=["sat down", "mat,"], include_stop_str_in_output=True)
    d = OutputProcessor(tok, prompt, p).add(ids, [(-1.0, None)] * len(ids))
    assert d.text == TEXT[:TEXT.index("mat,") + len("mat,")]
    assert d.finish_reason == "stop" and d.stop_reason == "mat,"
    assert len(d.token_ids) < len(ids) and d.logprobs is None     # no logprobs asked


def test_stop_token_ends_without_its_text(tok, prompt):
    ids = ids_of(tok, TEXT)
    at = 6
    stop_id = ids[at]
    assert stop_id not in ids[:at]
    proc = OutputProcessor(tok, prompt, SamplingParams(max_tokens=None, stop_token_ids=[stop_id],
                                                       logprobs=0))
    text, deltas = one_by_one(proc, ids)
    assert text == tok.decode(ids[:at])
    assert proc.finish_reason == "stop" and proc.stop_reason == stop_id
    assert proc.token_ids == ids[:at + 1]
    assert sum(len(d.logprobs) for d in deltas) == at + 1        # one per token, as given


def test_eos_stops_unless_ignored(tok, prompt):
    ids = ids_of(tok, "Hello there") + [tok.eos_token_id] + ids_of(tok, " more")
    proc = OutputProcessor(tok, prompt, SamplingParams(max_tokens=None))
    assert one_by_one(proc, ids)[0] == "Hello there"
    assert (proc.finish_reason, proc.stop_reason) == ("stop", tok.eos_token_id)
    proc = OutputProcessor(tok, prompt, SamplingParams(max_tokens=None, ignore_eos=True))
    assert one_by_one(proc, ids)[0] == tok.decode(ids, skip_special_tokens=True)
    assert proc.finish_reason is None


def test_max_tokens_and_context_length_give_length(tok, prompt):
    ids = ids_of(tok, TEXT)
    d = OutputProcessor(tok, prompt, SamplingParams(max_tokens=4)).add(ids, [(0.0, None)] * len(ids))
    assert d.token_ids == ids[:4] and d.text == tok.decode(ids[:4])
    assert d.finish_reason == "length" and d.stop_reason is None
    proc = OutputProcessor(tok, prompt, SamplingParams(max_tokens=100), max_model_len=len(prompt) + 3)
    text, _ = one_by_one(proc, ids)
    assert proc.token_ids == ids[:3] and text == tok.decode(ids[:3]) and proc.finish_reason == "length"
    rest = OutputProcessor(tok, prompt, SamplingParams(max_tokens=10, min_tokens=5))
    rest.add(ids[:3], [(0.0, None)] * 3)
    assert (rest.remaining_params().max_tokens, rest.remaining_params().min_tokens) == (7, 2)


def test_worker_finish_reason_and_held_text_flushed(tok, prompt):
    ids = ids_of(tok, "ends with do")
    proc = OutputProcessor(tok, prompt, SamplingParams(max_tokens=None, stop=["dog"]))
    text, _ = one_by_one(proc, ids[:-1])
    d = proc.add(ids[-1:], [(0.0, None)], "length")     # the worker stopped: nothing held
    assert text + d.text == "ends with do" and d.finish_reason == "length"
