"""pdserve's model engine: paged KV cache, token-budget scheduler, sampler, Llama-family models.

Exports are imported lazily, so light users (the gateway needs only `engine.tokenizer` and
`engine.sampling_params`) never pay for importing torch.
"""
from importlib import import_module

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
_WHERE = {"LLM": "llm_engine", "LLMEngine": "llm_engine", "RequestOutput": "outputs",
          "SamplingParams": "sampling_params"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
