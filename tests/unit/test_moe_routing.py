"""DeepSeek-style MoE routing ("noaux_tc": sigmoid scores, the correction bias for the choice
only, grouped top-k, renormalised weights times routed_scaling_factor) and the ungated shared
experts, against transformers' own routers and MoE blocks (DeepseekV3, Glm4Moe, MiniMaxM2)
on random inputs; the config checks that refuse what the block cannot run."""
from __future__ import annotations

import os

import pytest
import torch

from engine.config import ModelConfig, MoeConfig
from engine.models.layers import MLP
from engine.models.moe import SparseMoeBlock, select_experts

H, E = 32, 16


def _gen():
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def _hf_config(kind: str, **kw):
    import transformers as T
    common = dict(hidden_size=H, num_experts_per_tok=kw.pop("top_k", 4), moe_intermediate_size=8,
                  norm_topk_prob=kw.pop("norm", True), routed_scaling_factor=kw.pop("scale", 2.5),
                  n_shared_experts=2, vocab_size=64, num_attention_heads=4, num_key_value_heads=2)
    if kind == "deepseek_v3":
        return T.DeepseekV3Config(n_routed_experts=E, **common, **kw)
    return T.Glm4MoeConfig(n_routed_experts=E, **common, **kw)


def _hf_router(kind, gen, **kw):
    import transformers as T
    cfg = _hf_config(kind, **kw)
    cls = {"deepseek_v3": T.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter,
           "glm4_moe": T.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter}[kind]
    router = cls(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        # a bias on the scale of the sigmoid scores' spread, so it changes choices
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3)
    return cfg, router


def _same_choice(ids, want_ids, w, want_w, seed):
    # transformers takes top-k unsorted: compare each token's experts as a set, weights by expert
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values), f"seed={seed}: experts differ"
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices),
                               rtol=1e-6, atol=1e-7, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("groups,norm,top_k", [((4, 2), True, 4), ((4, 1), False, 3),
                                               ((1, 1), True, 2), ((8, 3), True, 6)])
def test_select_experts_as_transformers_topk_router(kind, groups, norm, top_k):
    gen, seed = _gen()
    n_group, topk_group = groups
    cfg, router = _hf_router(kind, gen, n_group=n_group, topk_group=topk_group, norm=norm, top_k=top_k)
    x = torch.randn(37, H, generator=gen)
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    w, ids = select_experts(logits, top_k, norm, scoring="sigmoid",
                            correction_bias=router.e_score_correction_bias, n_group=n_group,
                            topk_group=topk_group, scaling=cfg.routed_scaling_factor)
    _same_choice(ids, want_ids, w, want_w, seed)
    if n_group > 1:             # every chosen expert lies in one of the topk_group kept groups
        assert all(len(set(r)) <= topk_group for r in (ids // (E // n_group)).tolist()), seed


def test_the_correction_bias_steers_the_choice_not_the_weights():
    gen, seed = _gen()
    logits = torch.randn(9, E, generator=gen)
    bias = torch.zeros(E)
    bias[5] = 100.0                     # expert 5 always chosen, at its own sigmoid score
    w, ids = select_experts(logits, 2, False, scoring="sigmoid", correction_bias=bias)
    assert (ids == 5).any(-1).all(), seed
    w5 = w[ids == 5]
    torch.testing.assert_close(w5, torch.sigmoid(logits[:, 5]))


def test_minimax_m2_router():
    """MiniMax-M2: sigmoid, the correction bias, no groups, always renormalised, no scale."""
    import transformers as T
    gen, seed = _gen()
    cfg = T.MiniMaxM2Config(hidden_size=H, num_local_experts=E, num_experts_per_tok=3,
                            intermediate_size=8, vocab_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    router = T.models.minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter(cfg)
    bias = torch.randn(E, generator=gen) * 0.3
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        logits, want_w, want_ids = router(torch.randn(23, H, generator=gen), bias)
    w, ids = select_experts(logits, 3, True, scoring="sigmoid", correction_bias=bias)
    _same_choice(ids, want_ids, w, want_w, seed)


def _model_config(moe: MoeConfig) -> ModelConfig:
    return ModelConfig(model_dir="", architecture="", vocab_size=64, hidden_size=H,
                       intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                       rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False,
                       qk_norm=False, max_model_len=64, moe=moe)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_moe_block_with_shared_experts_as_transformers(kind):
    """The whole block: routed experts + the ungated shared experts (n_shared_experts x
    moe_intermediate_size), weights copied from transformers' DeepseekV3MoE / Glm4MoeMoE."""
    import transformers as T
    gen, seed = _gen()
    cfg = _hf_config(kind, n_group=4, topk_group=2)
    hf = {"deepseek_v3": T.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE,
          "glm4_moe": T.models.glm4_moe.modeling_glm4_moe.Glm4MoeMoE}[kind](cfg).eval()
    with torch.no_grad():
        for p in [*hf.parameters(), *hf.buffers()]:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    moe = MoeConfig.checked("config.json", num_experts=E, top_k=4, intermediate_size=8,
                            norm_topk_prob=True, shared_intermediate_size=16, sparse_layers=[0],
                            scoring="sigmoid", correction_bias=True, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, shared_expert_gate=False)
    c = _model_config(moe)
    block = SparseMoeBlock(c, "torch", MLP(c, "torch", 16)).eval()
    assert block.shared_expert_gate is None
    sh = hf.shared_experts
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        block.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        block.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        block.experts.down_proj.copy_(hf.experts.down_proj)
        block.shared_expert.gate_up_proj.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        block.shared_expert.down_proj.weight.copy_(sh.down_proj.weight)
        x = torch.randn(1, 29, H, generator=gen)
        want = hf(x)[0]
        got = block(x[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")


def test_router_stays_float32_in_a_bfloat16_model():
    moe = MoeConfig.checked("c", num_experts=E, top_k=2, intermediate_size=8, norm_topk_prob=True,
                            shared_intermediate_size=0, sparse_layers=[0], scoring="sigmoid",
                            correction_bias=True)
    block = SparseMoeBlock(_model_config(moe), "torch").to(torch.bfloat16)
    assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
    assert block.experts.gate_up_proj.dtype == torch.bfloat16
    w, ids = block.route(torch.randn(3, H, dtype=torch.bfloat16))
    assert w.dtype == torch.float32 and ids.shape == (3, 2)
    # softmax routers (Mixtral, Qwen) are cast with the model as before
    soft = MoeConfig.checked("c", num_experts=E, top_k=2, intermediate_size=8, norm_topk_prob=True,
                             shared_intermediate_size=0, sparse_layers=[0])
    assert SparseMoeBlock(_model_config(soft), "torch").to(torch.bfloat16).gate.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("changes,message", [
    (dict(scoring="sqrtsoftplus"), "unsupported scoring_func 'sqrtsoftplus' in c"),
    (dict(n_group=3), "n_group 3 in c must divide the 16 experts"),
    (dict(n_group=16), "n_group 16 in c must divide the 16 experts into groups of at least 2"),
    (dict(n_group=4, topk_group=5), "topk_group 5 must be in 1..4"),
    (dict(n_group=4, topk_group=1, top_k=5), "num_experts_per_tok 5 in c exceeds the experts of topk_group 1"),
])
def test_bad_routing_config_is_a_clear_error(changes, message):
    fields = dict(num_experts=E, top_k=2, intermediate_size=8, norm_topk_prob=True,
                  shared_intermediate_size=0, sparse_layers=[0], scoring="sigmoid")
    with pytest.raises(ValueError, match=message):
        MoeConfig.checked("c", **{**fields, **changes})
