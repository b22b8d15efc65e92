"""pdserve's model engine: paged KV cache, token-budget scheduler, sampler, Llama-family models.

Exports are imported lazily, so light users (the gateway needs only `engine.tokenizer` and
`engine.sampling_params`) never pay for importing torch.
"""
__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name in ("LLM", "LLMEngine"):
        from . import llm_engine
        return getattr(llm_engine, name)
    if name == "RequestOutput":
        from .outputs import RequestOutput
        return RequestOutput
    if name == "SamplingParams":
        from .sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
