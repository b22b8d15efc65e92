"""The K shift of an 8-bit KV cache (kernels/reference.py, "K shift"): per layer and KV head,
the mean K [H_kv, D] of one fixed calibration prompt, subtracted from every K before it is
quantized. Attention over the shifted keys is unchanged (softmax ignores a logit offset that
every key of a query shares); only the quantization error shrinks, for fp8 most.

    ModelRunner.__init__ (an 8-bit GQA cache, no attention sinks)
      -> k_shift(): one prefill of CALIBRATION_TOKENS fixed ids into the first blocks with no
         shift, K read back (dequantized) and averaged per layer / head / channel, those
         blocks and scales zeroed again (no block of the pool is in use yet)
      -> bind_k_shift(): each layer's Attention keeps its row and hands it to the K/V write

The prompt is fixed (calibration_ids, from the vocabulary size alone), so every worker of a
deployment computes the same shift: a prefill worker's blocks and a decode worker's own
tokens carry the same m (up to float rounding across devices, which moves a logit by
q.(m - m'), far below the quantization error). The KV handshake names this layout
(kvtransfer.wire.SCALE_LAYOUT), so a peer without the shift is refused."""
from __future__ import annotations

import torch

from .models.layers import AttentionMetadata

CALIBRATION_TOKENS = 512
FIRST_ID = 1000          # past the special and byte tokens of a BPE vocabulary: ordinary merges


def calibration_ids(vocab_size: int, n: int = CALIBRATION_TOKENS) -> list[int]:
    """n consecutive ids from FIRST_ID (wrapping in a small vocabulary)."""
    return [(FIRST_ID + i) % vocab_size for i in range(n)]


def wants_shift(model, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> bool:
    """An 8-bit cache of K and V (not MLA's latent) in a model without attention sinks (a
    sink's logit does not move with the keys', so the shift would change its weight)."""
    return kv_scales is not None and kv_cache.shape[1] == 2 and not model.config.attention_sinks


@torch.inference_mode()
def k_shift(model, kv_cache: torch.Tensor, kv_scales: torch.Tensor) -> torch.Tensor:
    """[num_layers, H_kv, D] fp32: the mean K of the calibration prompt, per layer (the
    caller's cache must be unused: its first blocks are written, then zeroed)."""
    layers, _, num_blocks, bs, heads, dim = kv_cache.shape
    n = min(CALIBRATION_TOKENS, num_blocks * bs, model.config.max_model_len)
    nblk, dev = -(-n // bs), kv_cache.device
    pos = torch.arange(n, device=dev)
    meta = AttentionMetadata(
        slot_mapping=pos, block_tables=torch.arange(nblk, dtype=torch.int32, device=dev)[None],
        context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev), max_q_len=n,
        max_context_len=n)
    ids = torch.tensor(calibration_ids(model.config.vocab_size, n), device=dev)
    model(ids, pos, meta)
    k = kv_cache[:, 0, :nblk].float() * kv_scales[:, 0, :nblk, None, :, None]  # [L, nblk, bs, H, D]
    shift = k.flatten(1, 2)[:, :n].mean(1).contiguous()                       # [L, H, D]
    kv_cache[:, :, :nblk].view(torch.int8).zero_()
    kv_scales[:, :, :nblk].zero_()
    return shift


def bind_k_shift(model, shift: torch.Tensor) -> None:
    for layer, s in zip(model.layers, shift):
        layer.self_attn.k_shift = s
