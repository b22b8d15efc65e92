"""The torch kernels the CPU engine runs (engine/kernels/reference.py) against independent
references: transformers' Llama rotary embedding, and dense causal attention per sequence
(torch's scaled_dot_product_attention on unpaged K/V)."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine.kernels import reference
from engine.kernels.rope import build_cos_sin_cache


def test_rotary_matches_transformers_with_and_without_shared_rows():
    d, T = 64, 7
    cache = build_cos_sin_cache(d, 512, 10000.0)
    pos = torch.tensor([0, 1, 5, 77, 200, 311, 511])
    q, k = torch.randn(T, 9, d), torch.randn(T, 3, d)
    cos, sin = cache[pos, :d // 2], cache[pos, d // 2:]
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]     # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for rows in (None, reference.rope_rows(pos, cache)):
        got_q, got_k = reference.rotary_embedding(pos, q, k, cache, rows)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=1e-6)
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("lens", [[37], [16], [1, 40, 17], [0, 23, 0]])
def test_decode_attention_matches_dense_attention(lens):
    """One sequence (no mask), ragged batches (masked), padding rows (context 0: zeros)."""
    bs, hq, hkv, d = 16, 9, 3, 64
    nblk = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = torch.randn(nblk, bs, hkv, d), torch.randn(nblk, bs, hkv, d)
    perm = torch.randperm(nblk).tolist()        # blocks scattered through the cache
    width = max(1, max(-(-n // bs) for n in lens))
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        ids = [perm.pop() for _ in range(-(-n // bs))]
        table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d)
    got = reference.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), 0.125)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b], torch.zeros(hq, d))
            continue
        k = k_cache[table[b].long()].flatten(0, 1)[:n].transpose(0, 1)       # [H_kv, n, D]
        v = v_cache[table[b].long()].flatten(0, 1)[:n].transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], k, v, scale=0.125, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)
