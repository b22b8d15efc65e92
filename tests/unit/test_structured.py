"""Structured output (engine/structured.py): grammar-constrained sampling with llguidance.

The tiny model's weights are random, so left alone it never closes a string: tests bound
strings and numbers in the schema (or bias quote tokens for json_object). A logit bias can
never push a token past the mask (it is applied before the mask, and -inf + b = -inf).
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.sampler import Sampler
from engine.structured import StructuredOutput, StructuredOutputs, unpack_bitmask, validate
from engine.tiny_model import ensure_default_model
from tests.helpers import split_generate

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Hello there", "The quick brown fox", "Tokens, blocks and caches"]


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_model_dir(model_dir, num_blocks=256)


@pytest.fixture(scope="module")
def quote_ids(engine):
    tok = engine.tokenizer
    return [tok.token_to_id(s) for s in ('"', '"}', "}")]


def text_of(engine, out) -> str:
    """What a client reads: the engine returns token ids; text is the output processor's."""
    return engine.tokenizer.decode(list(out.token_ids))


def run(engine, prompts, params):
    ids = [f"r{i}-{id(params)}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    final = {}
    for _ in range(10_000):
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        if len(final) == len(ids):
            break
    return [final[i] for i in ids]


def assert_grammar_accepts(engine, spec, token_ids, complete=True):
    """A fresh matcher accepts every generated token (and the grammar is complete)."""
    from llguidance import LLMatcher

    m = LLMatcher(engine.structured._tokenizer(), spec.to_grammar())
    for t in token_ids:
        assert m.consume_token(t), (t, m.get_error())
    if complete:
        assert m.is_stopped() or m.is_accepting()


def assert_no_blocks_held(engine):
    assert engine.kv.num_held_blocks() == 0
    assert len(engine.structured) == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(engine, temperature):
    spec = StructuredOutput(json_schema=SCHEMA)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=200, structured=spec)
    for out in run(engine, PROMPTS, params):
        assert out.finish_reason == "stop", text_of(engine, out)
        assert out.stop_reason is None
        value = json.loads(text_of(engine, out))
        jsonschema.validate(value, SCHEMA)
        assert_grammar_accepts(engine, spec, out.token_ids)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object_output_parses(engine, quote_ids, temperature):
    """Random weights nest objects without end; a bias towards quotes, commas and braces
    lets most outputs finish. Every output is a valid JSON prefix; finished ones parse."""
    spec = StructuredOutput(json_object=True)
    bias = {t: 5.0 for t in quote_ids}
    params = SamplingParams(temperature=temperature, seed=2, max_tokens=200, logit_bias=bias,
                            structured=spec)
    outs = run(engine, PROMPTS, params)
    for out in outs:
        assert_grammar_accepts(engine, spec, out.token_ids, complete=out.finish_reason == "stop")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(text_of(engine, out)), dict)
    assert sum(o.finish_reason == "stop" for o in outs) >= 1
    assert_no_blocks_held(engine)


def test_schema_given_as_string_and_regex_and_lark(engine):
    s1 = StructuredOutput(json_schema=json.dumps(SCHEMA))
    s2 = StructuredOutput(json_schema=SCHEMA)
    assert s1.value == s2.value
    before = engine.structured.compilations
    run(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=200, structured=s1))
    run(engine, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=200, structured=s2))
    assert engine.structured.compilations - before <= 1        # one compile, served from cache
    out, = run(engine, PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=50, structured=StructuredOutput(regex=r"(yes|no), [0-9]{3}")))
    assert out.finish_reason == "stop"
    assert text_of(engine, out)[:3] in ("yes", "no,") and text_of(engine, out)[-3:].isdigit()
    out, = run(engine, PROMPTS[:1], SamplingParams(
        temperature=1.0, seed=1, max_tokens=50,
        structured=StructuredOutput(grammar='start: "a" ("b" | "c") ("b" | "c") "d"\n')))
    assert out.finish_reason == "stop"
    assert text_of(engine, out).startswith("a") and text_of(engine, out).endswith("d")
    assert assert_no_blocks_held(engine) is None


def test_properties_generated_in_the_schema_order(engine):
    """The schema's property order is the output's (as OpenAI's structured outputs): the wire
    form keeps key order ("z" before "a" here, where sorted keys would put "a" first)."""
    schema = {"type": "object", "properties": {"z": {"const": 1}, "a": {"enum": ["x", "y"]}},
              "required": ["z", "a"], "additionalProperties": False}
    spec = StructuredOutput(json_schema=schema)
    assert json.loads(spec.value) == schema and list(json.loads(spec.value)["properties"]) == ["z", "a"]
    for temperature in (0.0, 1.0):
        out, = run(engine, PROMPTS[:1], SamplingParams(temperature=temperature, seed=4,
                                                       max_tokens=50, structured=spec))
        assert out.finish_reason == "stop"
        assert text_of(engine, out).startswith('{"z":1,"a":"'), text_of(engine, out)
    assert_no_blocks_held(engine)


def test_bad_specs_rejected(engine):
    with pytest.raises(ValueError):
        StructuredOutput()
    with pytest.raises(ValueError):
        StructuredOutput(json_object=True, regex="a")
    for spec in (StructuredOutput(json_schema="{not json"), StructuredOutput(regex="(unclosed"),
                 StructuredOutput(grammar="start: undefined_rule")):
        with pytest.raises(ValueError):
            validate(spec)
        with pytest.raises(ValueError):
            engine.add_request("bad", "hi", SamplingParams(structured=spec))
        assert "bad" not in engine.requests
    assert_no_blocks_held(engine)


def test_mask_never_lets_a_disallowed_token_through():
    """Sampler level: whatever the bias, penalties or min_tokens, only allowed tokens."""
    torch.manual_seed(0)
    V, B = 64, 6

    class Row:
        def __init__(self, params):
            self.sampling_params, self.prompt_token_ids = params, [1, 2, 3]
            self.output_token_ids, self.generator = [], None

    sampler = Sampler({2})
    for trial in range(50):
        logits = torch.randn(B, V) * 3
        allowed = torch.rand(B, V) < 0.1
        allowed[:, 2] = trial % 2 == 0            # EOS sometimes the only way out
        allowed[torch.arange(B), torch.randint(0, V, (B,))] = True
        params = [SamplingParams(temperature=t, top_k=k, logit_bias={5: 100.0}, min_tokens=m,
                                 repetition_penalty=1.3)
                  for t, k, m in [(0, 0, 0), (1, 0, 0), (0.7, 5, 3), (1.5, 0, 3), (0, 0, 3), (1, 2, 0)]]
        out = sampler(logits, [Row(p) for p in params], allowed)
        for i, t in enumerate(out.token_ids):
            assert allowed[i, t], (trial, i, t)
            assert out.logprobs[i] == pytest.approx(torch.log_softmax(logits[i], -1)[t].item())


def test_unpack_bitmask_layout():
    bm = torch.zeros(2, 2, dtype=torch.int32)
    bm[0, 0] = 1 - 2**31                           # bits 0 and 31: tokens 0 and 31
    bm[1, 1] = 1 << 3                              # token 35
    m = unpack_bitmask(bm, 40)
    assert m.shape == (2, 40)
    assert m[0].nonzero().flatten().tolist() == [0, 31]
    assert m[1].nonzero().flatten().tolist() == [35]


def test_preemption_does_not_consume_twice(model_dir):
    """With too few blocks, requests are preempted and recomputed; outputs stay valid and each
    matcher consumed every output token exactly once (a double consume would break JSON)."""
    eng = LLMEngine.from_model_dir(model_dir, num_blocks=10, block_size=16)
    spec = StructuredOutput(json_schema=SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=60, structured=spec)
    prompts = [p * 3 for p in PROMPTS]
    consumed = {}
    real_advance = eng.structured.advance

    def spy(rid, out_ids):
        done = real_advance(rid, out_ids)
        st = eng.structured._states.get(rid)
        if st is not None:
            consumed[rid] = (st.consumed, len(out_ids))
        return done

    eng.structured.advance = spy
    outs = run(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert all(a == b for a, b in consumed.values())
    ref = run(LLMEngine.from_model_dir(model_dir, num_blocks=256), prompts, params)
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert_grammar_accepts(eng, spec, o.token_ids, complete=o.finish_reason == "stop")
    assert_no_blocks_held(eng)


def test_split_prefill_decode_follows_one_grammar(model_dir):
    """The prefill engine samples the first token under the grammar; the decode engine's
    matcher consumes that token from remote_kv_done and continues: same output as one engine."""
    pre = LLMEngine.from_model_dir(model_dir, num_blocks=64)
    dec = LLMEngine.from_model_dir(model_dir, num_blocks=64)
    spec = StructuredOutput(json_schema=SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=200, structured=spec)
    ref = run(LLMEngine.from_model_dir(model_dir, num_blocks=64), PROMPTS, params)
    for i, (p, r) in enumerate(zip(PROMPTS, ref)):
        first, final = split_generate(pre, dec, f"pd{i}", p, params)
        assert first.finish_reason == "prefill_done"
        assert len(pre.structured) == 0                 # done with its grammar already
        assert final.token_ids == r.token_ids
        jsonschema.validate(json.loads(text_of(dec, final)), SCHEMA)
    assert_no_blocks_held(pre)
    assert_no_blocks_held(dec)


def test_abort_drops_matcher(engine):
    engine.add_request("ab", "hi", SamplingParams(max_tokens=50,
                                                  structured=StructuredOutput(json_object=True)))
    engine.step()
    assert engine.structured.has("ab")
    engine.abort_request("ab")
    assert not engine.structured.has("ab")
    assert_no_blocks_held(engine)


def test_tokenizer_built_once(model_dir):
    so = StructuredOutputs((model_dir / "tokenizer.json").read_text(), 1024, {2})
    so.add("a", StructuredOutput(json_object=True))
    tok = so._lltok
    so.add("b", StructuredOutput(regex="x+"))
    assert so._lltok is tok and len(so) == 2
