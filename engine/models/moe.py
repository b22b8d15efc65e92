"""The mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) and how checkpoints' per-expert
tensors are stacked at load.

    router   logits = x @ gate.T  [T, E]  ->  softmax (fp32)  ->  top-k  (-> renormalise)
    experts  engine.kernels.fused_moe over the stacked weights:
             gate_up_proj [E, 2I, H] = cat(gate, up) of each expert,  down_proj [E, H, I]
             (with --quantization: engine.quant.linear.QuantExperts, a quantized layer each)
    shared   Qwen2-MoE only: + sigmoid(x @ shared_expert_gate.T) * dense MLP(x)

Routing is device-side tensor ops of shapes fixed by T (no host sync), so a decode step with
MoE layers can be captured in a CUDA graph (float experts: the quantized ones' loop syncs).
Checkpoints hold one tensor per expert; each family's `checkpoint_name` maps them to a
stacked parameter and an (expert, part) shard, and `stack_experts` builds it, once, at load.
"""
from __future__ import annotations

import re

import torch
from torch import nn

import engine.kernels as K
from engine.config import ModelConfig


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """[T, E] logits -> (weights [T, k] fp32, expert ids [T, k] int64), as transformers routes:
    softmax in fp32, the k largest, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoeBlock(nn.Module):
    def __init__(self, c: ModelConfig, backend: str, shared_expert: nn.Module | None = None):
        super().__init__()
        m = c.moe
        self.backend, self.top_k, self.renormalize = backend, m.top_k, m.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, m.num_experts, bias=False)
        self.experts = Experts(m.num_experts, c.hidden_size, m.intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if shared_expert else None

    def forward(self, x):
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if isinstance(self.experts, Experts):
            out = K.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                              backend=self.backend)
        else:   # quantized: engine.quant.linear.QuantExperts, a QuantLinear per expert
            out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def expert_names(block: str, parts: dict[str, tuple[str, int]]):
    """A mapper of one family's per-expert checkpoint names: `layers.N.<block>.experts.E.<part>
    .weight` (without `model.`) -> (`layers.N.mlp.experts.<stacked>`, (E, index)), where
    `parts` maps the part's name to the stacked parameter and its index within it; None for
    any other name."""
    pattern = re.compile(rf"^(layers\.\d+)\.{block}\.experts\.(\d+)\.({'|'.join(parts)})\.weight$")

    def target(name: str) -> tuple[str, tuple[int, int]] | None:
        m = pattern.match(name)
        if m is None:
            return None
        param, part = parts[m.group(3)]
        return f"{m.group(1)}.mlp.experts.{param}", (int(m.group(2)), part)
    return target


def stack_experts(name: str, parts: dict[tuple[int, int], torch.Tensor], num_experts: int) -> torch.Tensor:
    """{(expert, part): tensor} -> [E, 2I, H] (gate rows then up rows) or [E, H, I]."""
    n = 2 if name.endswith("gate_up_proj") else 1
    want = {(e, j) for e in range(num_experts) for j in range(n)}
    if set(parts) != want:
        missing = sorted(want - set(parts))[:4]
        raise ValueError(f"checkpoint has {len(parts)} of {len(want)} expert tensors of {name!r}"
                         f" (missing e.g. {missing}, as (expert, part))")
    return torch.stack([torch.cat([parts[e, j] for j in range(n)]) for e in range(num_experts)])
