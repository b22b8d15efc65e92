"""Torch reference for paged MLA decode attention: the oracle of mla_decode.py (Triton) and of
cpu.c's pd_mla_decode_attention.

Multi-head latent attention (DeepSeek-V2/V3) caches ONE vector per token and layer, shared by
every head: the compressed KV (kv_lora_rank values) then the rotary key (qk_rope_head_dim):

    kv_cache [num_blocks, block_size, D]     D = kv_lora_rank + qk_rope_head_dim (576)
              row = | c_kv (v_dim = kv_lora_rank) | k_rope |

In the weight-absorbed decode form the model folds W_UK into the query and W_UV into the
output projection, so each head attends in the latent space: its query q_h [D] is the
absorbed latent query then the rotary query, its key is the whole row and its value the first
v_dim values of the same row. That is multi-query attention with one K/V "head" of width D
whose value is a prefix of its key.

    out[b, h] = softmax_j(q[b, h] . kv[b, j] * scale) @ kv[b, j, :v_dim],  j < context_lens[b]

kv[b, j] is token j of request b, read through block_tables as reference.py describes.
"""
from __future__ import annotations

import torch


def paged_mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, v_dim: int) -> torch.Tensor:
    """q [B, H, D] (one decode token per request) -> [B, H, v_dim] in q's dtype.

    Every request's blocks are gathered into a padded [B, L] context, L the longest; positions
    past a request's length are masked. Scores, softmax and the value sum in fp32. Requests
    with context length 0 (padding rows) get zeros."""
    B, H, D = q.shape
    bs = kv_cache.shape[1]
    lens = context_lens.tolist()
    L = max(lens, default=0)
    nblk = (L + bs - 1) // bs
    if nblk == 0:
        return q.new_zeros(B, H, v_dim)
    idx = block_tables[:, :nblk].long()
    kv = kv_cache[idx].flatten(1, 2)[:, :L].float()                # [B, L, D]
    s = torch.matmul(q.float(), kv.transpose(1, 2)).mul_(scale)    # [B, H, L]
    if min(lens) < L:
        valid = torch.arange(L, device=q.device) < context_lens.to(q.device).unsqueeze(1)
        s.masked_fill_(~valid[:, None, :], float("-inf"))
    out = torch.matmul(s.softmax(-1), kv[..., :v_dim])             # [B, H, v_dim]
    if min(lens) == 0:
        out[context_lens == 0] = 0.0                               # all -inf rows give NaN
    return out.to(q.dtype)
