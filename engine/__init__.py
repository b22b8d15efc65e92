"""pdserve's model engine: paged KV cache, token-budget scheduler, sampler, Llama-family models."""
from .llm_engine import LLM, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
