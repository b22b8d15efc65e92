"""`quantize_model`: a loaded float model's layers swapped for quantized ones, in place.

Every scheme's quantizer computes in float32 and rounds half to even (torch.round); the
formats are in each scheme's file.
"""
from __future__ import annotations

from torch import nn

from . import check_method, get_scheme
from .linear import QuantEmbedding, QuantExperts, QuantLinear

# the output head and embedding table under every method: int8 with a float16 scale per 32
# values (GGUF Q8_0's layout). SmolLM2-135M, int8 decoder linears, 2047 tokens of GPL-3
# (bench/logs/2026-11-30-quant-eval.log, measured while int8 above 16 rows still ran in float32):
# perplexity +0.30% with the head and embedding int8 per row, +0.30% int8_g32, +0.36% float32;
# greedy tokens agreeing 60.5%, 65.0%, 74.6%; weights 0.50x, 0.51x, 0.82x of bf16.
# None: leave them in the model dtype.
HEAD: str | None = "int8_g32"


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every quantizable decoder linear of a loaded CausalLM (its
    `quantizable_linears()`) that is still nn.Linear by a QuantLinear of `method`, in place;
    the float weights are dropped. The output head and the embedding table become HEAD
    (int8_g32) under every method (SmolLM2-135M: an fp8 head and embedding cost +3.0%
    perplexity; llama.cpp keeps its output in 8 bits too), one table shared with a tied head
    (a lookup dequantizes the rows it reads), unless the checkpoint already held them
    quantized. An MoE block's experts become a QuantExperts; routers, gates and norms stay
    float. 'none' and 'auto' (the loader has already installed what the checkpoint holds
    quantized; an MoE checkpoint's experts are dequantized) leave the model as is."""
    if check_method(method) in ("none", "auto"):
        return model
    backend = model.backend
    if HEAD is not None:
        _quantize_head(model, backend)
    for _, parent, name, lin in model.quantizable_linears():
        if isinstance(lin, nn.Linear):
            setattr(parent, name, QuantLinear.quantize(
                method, lin.weight.data, None if lin.bias is None else lin.bias.data, backend=backend))
    for block in model.moe_blocks():
        if not isinstance(block.experts, QuantExperts):     # swiglu: GPT-OSS's activation
            block.experts = QuantExperts.of(method, block.experts, backend, getattr(block, "swiglu", None))
    return model


def _quantize_head(model: nn.Module, backend: str) -> None:
    scheme = get_scheme(HEAD)
    if model.lm_head is not None and not isinstance(model.lm_head, QuantLinear):
        model.lm_head = QuantLinear.quantize(HEAD, model.lm_head.weight.data, head=True, backend=backend)
    if not isinstance(model.embed_tokens, QuantEmbedding):
        emb = model.embed_tokens.weight.data
        model.embed_tokens = QuantEmbedding(scheme.quantize(emb), emb.dtype, backend)
        if model.lm_head is None:   # tied: one int8 table for lookups and logits
            model.lm_head = model.embed_tokens.tied_head()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights as held (parameters and persistent buffers, each once)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
