"""Tiny random Hugging Face models for the equivalence tests, saved with `save_pretrained`."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.15, bos_token_id=1, eos_token_id=None, pad_token_id=0)


def make_hf_model(kind: str, out: Path, **overrides) -> Path:
    """kind: llama | llama3 (rope scaling) | llama-tied | mistral | qwen2 | qwen3, or an MoE
    model: mixtral (top-2 of 8, a sliding window) | qwen2_moe (top-4 of 8 unnormalised, the
    shared expert, layer 0 dense) | qwen3_moe (top-2 of 8 renormalised, q/k norm)."""
    import transformers as T
    kw = dict(COMMON, **overrides)
    if kind == "llama":
        cfg = T.LlamaConfig(**kw)
    elif kind == "llama3":
        cfg = T.LlamaConfig(**kw, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})
    elif kind == "llama-tied":
        cfg = T.LlamaConfig(**kw, tie_word_embeddings=True)
    elif kind == "mistral":
        cfg = T.MistralConfig(**{"sliding_window": None, **kw})
    elif kind == "qwen2":
        cfg = T.Qwen2Config(**kw)
    elif kind == "qwen3":
        cfg = T.Qwen3Config(**{"head_dim": 24, **kw})
    elif kind == "mixtral":     # `overrides` win over the MoE models' own sizes too
        cfg = T.MixtralConfig(**{**kw, **dict(intermediate_size=48, num_local_experts=8,
                                              num_experts_per_tok=2, sliding_window=256), **overrides})
    elif kind == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(**{**dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=96, norm_topk_prob=False,
                                         mlp_only_layers=[0]), **kw})
    elif kind == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(**{**dict(head_dim=24, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True), **kw})
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    cls = {"mistral": T.MistralForCausalLM, "qwen2": T.Qwen2ForCausalLM,
           "qwen3": T.Qwen3ForCausalLM, "mixtral": T.MixtralForCausalLM,
           "qwen2_moe": T.Qwen2MoeForCausalLM, "qwen3_moe": T.Qwen3MoeForCausalLM,
           }.get(kind, T.LlamaForCausalLM)
    model = cls(cfg).float().eval()
    with torch.no_grad():   # biases are zero-initialised: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int):
    """Greedy tokens and the log-probs of each chosen token, one prompt at a time (no padding)."""
    import transformers as T
    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                           output_logits=True, return_dict_in_generate=True,
                           pad_token_id=0, eos_token_id=None)
        toks = g.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(g.logits, toks)]
        outs.append((toks, lps))
    return outs
