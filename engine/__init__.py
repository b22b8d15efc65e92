"""pdserve's model engine: paged KV cache, token-budget scheduler, sampler, Llama-family models.

Exports are imported lazily, so light users (the gateway needs only `engine.tokenizer` and
`engine.sampling_params`) never pay for importing torch.
"""
__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from .offline import LLM
        return LLM
    if name == "LLMEngine":
        from .llm_engine import LLMEngine
        return LLMEngine
    if name == "RequestOutput":
        from .outputs import RequestOutput
        return RequestOutput
    if name == "SamplingParams":
        from .sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
