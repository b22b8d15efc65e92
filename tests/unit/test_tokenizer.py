"""Tokenizer vs transformers, incremental detokenization, stop strings."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.tiny_model import make_tiny_model
from engine.tokenizer import IncrementalDetokenizer, StopStrings, Tokenizer

TEXTS = [
    "Hello world",
    "",
    " leading space and  double  spaces",
    "The quick brown fox: 42, 3.14!",
    "héllo 🤖 世界 naïve\n\ttabs",
    "emoji 👩‍👩‍👧 and CJK 東京タワー 한국어",
]
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds <numbers> & more",
                                          "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, model_dir):
    """A Llama-2-style tokenizer: Metaspace, byte fallback, post-processor adding <s>."""
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers, processors, trainers

    from engine.tiny_model import CORPUS
    t = HFTok(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    t.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    spec = json.loads(t.to_str())
    vocab = spec["model"]["vocab"]
    for b in byte_tokens:  # byte-fallback pieces are ordinary vocab entries, as in Llama 2
        vocab.setdefault(b, len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    t = HFTok.from_str(json.dumps(spec))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                     special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("llama")
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False}, "eos_token": "</s>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
        "chat_template": [{"name": "default", "template": "{% for m in messages %}[{{ m.role }}]"
                                                          "{{ m.content }}{% endfor %}"},
                          {"name": "tool_use", "template": "TOOLS{{ tools | tojson }}"}]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return d


def test_special_ids(tok):
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_ids) == (1, 0, {2})
    assert tok.vocab_size == 1024


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_matches_transformers(tok, hf_tok, gen_prompt, tools):
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt, tools=tools)
    theirs = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt, tools=tools,
                                        tokenize=False)
    assert ours == theirs
    assert ours.startswith("<s>") and ours.endswith("<|assistant|>\n") == gen_prompt
    assert ("<numbers> & more" in ours) == (tools is not None)  # tojson does not escape HTML


def test_chat_template_helpers(tok):
    src = "{{ raise_exception('nope') if messages | length == 0 else strftime_now('%Y') }}"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=src).isdigit()
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="nope"):
        tok.apply_chat_template([], chat_template=src)


def test_llama_style_tokenizer_matches_transformers(llama_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    tok = Tokenizer.from_dir(llama_dir)
    assert tok.eos_token_ids == {2, 5} and tok.bos_token_id == 1
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids) == text or text.startswith(" ")  # Strip eats one leading space


def test_named_chat_templates(llama_dir):
    tok = Tokenizer.from_dir(llama_dir)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "[user]hi"
    assert tok.apply_chat_template(msgs, tools=[{"a": 1}]) == 'TOOLS[{"a": 1}]'
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "TOOLS[]"


def test_chat_template_jinja_file_wins(tmp_path, model_dir):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _stream(tok, prompt, output, skip=True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in output]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS[3:])
def test_incremental_detokenization_byte_level(tok, text):
    prompt = tok.encode("Prompt text:")
    output = tok.encode(text, add_special_tokens=False) + [2]  # ends with EOS (skipped)
    detok, deltas = _stream(tok, prompt, output)
    assert detok.text == "".join(deltas) == tok.decode(output) == text
    assert not any("\ufffd" in d for d in deltas)
    # Multi-byte characters span several byte tokens, so some calls must have waited.
    if any(ord(c) > 127 for c in text):
        assert "" in deltas[:-1]


@pytest.mark.parametrize("text", TEXTS[2:])
def test_incremental_detokenization_llama_style(llama_dir, text):
    tok = Tokenizer.from_dir(llama_dir)
    prompt = tok.encode("Prompt text:")
    output = tok.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tok, prompt, output)
    # With the prompt as left context, the leading space of the first piece is kept.
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)):]
    assert detok.text == "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_keeps_window_small(tok):
    text = "The river runs quietly through the valley. " * 40
    output = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    for t in output:
        detok.add(t)
        assert len(detok._ids) <= 16
    assert detok.text == text


def test_special_tokens_kept_when_asked(tok):
    out = tok.encode("hi", add_special_tokens=False) + [2]
    detok, _ = _stream(tok, [1], out, skip=False)
    assert detok.text == "hi</s>"


def test_stop_string_spanning_tokens(tok):
    stops = StopStrings(["brown fox", "zzz"])
    text = ""
    found = None
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    for t in tok.encode("The quick brown fox jumps", add_special_tokens=False):
        found = stops.feed(detok.add(t))
        if found is not None:
            text = detok.text
            break
    assert found == (len("The quick "), "brown fox")
    assert text[found[0]:].startswith("brown fox")
    assert len(tok.encode("brown fox", add_special_tokens=False)) > 1
    # (the matcher against a naive reference: tests/unit/test_stop_strings.py)
