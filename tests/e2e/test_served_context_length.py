"""The gateway serves the context length its workers enforce (their Stats), not the one in
the model's config.json: workers started with --max-model-len 40 (config.json: 4096) make
/v1/models say 40 and the gateway refuse a 45-token prompt with the OpenAI 400, while a
prompt that fits is served."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import EngineOptions
from pdserve.launcher import free_port

pytestmark = pytest.mark.e2e
SERVED = 40


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(1, 1, http_port=free_port("127.0.0.1"),
                        engine=EngineOptions.of(max_model_len=SERVED))


def test_models_and_limits_follow_the_workers(system, model_dir):
    import openai
    assert json.loads((Path(model_dir) / "config.json").read_text())[
        "max_position_embeddings"] > SERVED
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{system.http_port}/v1", api_key="x",
                           max_retries=0)
    (model,) = client.models.list().data
    assert model.model_extra["max_model_len"] == SERVED
    ok = client.completions.create(model=model.id, prompt=list(range(10, 30)), max_tokens=5,
                                   temperature=0)
    assert ok.usage.prompt_tokens == 20 and ok.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model.id, prompt=list(range(10, 55)), max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    assert str(SERVED) in e.value.message


# A request without max_tokens is capped at what the decode cache holds (decode admission),
# never refused for a prompt that fits.
def test_chat_without_max_tokens_when_the_full_context_does_not_fit_the_cache(start_system):
    import openai
    system = start_system(1, 1, http_port=free_port("127.0.0.1"),
                          engine=EngineOptions.of(num_blocks=32, block_size=16))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{system.http_port}/v1", api_key="x",
                           max_retries=0, timeout=300)
    (model,) = client.models.list().data
    assert model.model_extra["max_model_len"] > 32 * 16      # the full context cannot fit
    r = client.chat.completions.create(model=model.id, temperature=0,
                                       messages=[{"role": "user", "content": "Tell me a story."}])
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
