"""Bad input: a clear ValueError, and nothing left allocated."""
import json

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.config import ModelConfig
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("m"), max_position_embeddings=64)


def test_empty_prompt(model_dir):
    llm = LLM(model_dir, num_blocks=32)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2))
    assert llm.engine.kv.num_held_blocks() == 0 and not llm.engine.has_unfinished_requests()


def test_prompt_longer_than_context(model_dir):
    llm = LLM(model_dir, num_blocks=32)
    with pytest.raises(ValueError, match="context length is 64"):
        llm.generate([list(range(3, 70))])
    assert llm.engine.kv.num_held_blocks() == 0


def test_max_tokens_must_be_positive():
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=bad)


def test_generation_stops_at_context_length(model_dir):
    out = LLM(model_dir, num_blocks=32).generate(
        [list(range(3, 60))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 57


def test_unknown_architecture(tmp_path, model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        ModelConfig.from_dir(tmp_path)


def test_missing_files(tmp_path, model_dir):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLMEngine.from_model_dir(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")


def test_token_ids_outside_vocab_and_duplicate_ids(model_dir):
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("a", [1, 99999])
    engine.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2, 3])
    assert engine.abort_request("a")
    assert engine.kv.num_held_blocks() == 0


def test_abort_mid_generation_frees_blocks(model_dir):
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=32)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(3, 20 + i)), SamplingParams(max_tokens=20))
    engine.step()
    engine.step()
    assert engine.kv.num_held_blocks() > 0
    for i in range(4):
        engine.abort_request(f"r{i}")
    assert engine.kv.num_held_blocks() == 0 and not engine.has_unfinished_requests()
    engine.kv.pool.check()


def test_prefill_only_needs_blocks_for_the_prompt_only(model_dir):
    """The prefill role never decodes: a long max_tokens must not be refused for it."""
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=3)      # 48 token slots
    params = SamplingParams(max_tokens=60, temperature=0)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("full", list(range(3, 20)), params)
    engine.add_request("pre", list(range(3, 20)), params, prefill_only=True)
    out = next(o for o in engine.step())
    assert out.finish_reason == "prefill_done" and len(out.block_ids) == 2
    engine.release("pre")
    assert engine.kv.num_held_blocks() == 0


def test_no_max_tokens_on_a_cache_smaller_than_the_context_is_served(model_dir):
    """Without max_tokens the request may run to the end of the context; a cache that cannot
    hold the whole context still serves it, ending with "length" when the cache is full."""
    engine = LLMEngine.from_model_dir(model_dir, num_blocks=3)      # 48 token slots
    assert engine.config.model.max_model_len > 48
    prompt = list(range(3, 20))
    engine.add_request("open", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    final = None
    for _ in range(100):                                            # bounded: 31 tokens
        final = next((o for o in engine.step() if o.finished), None)
        if final is not None:
            break
    assert final is not None and final.finish_reason == "length"
    assert len(prompt) + len(final.token_ids) == 48
    assert engine.kv.num_held_blocks() == 0
