"""The mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE, and how their expert
weights are stacked at load time.

    router   logits = x @ gate.T  [T, E]  ->  softmax (fp32)  ->  top-k  (-> renormalise)
    experts  engine.kernels.fused_moe over the stacked weights:
             gate_up_proj [E, 2I, H] = cat(gate, up) of each expert,  down_proj [E, H, I]
             (with --quantization: engine.quant.QuantExperts, one quantized layer per expert)
    shared   Qwen2-MoE only: + sigmoid(x @ shared_expert_gate.T) * dense MLP(x)

Routing is device-side tensor ops of shapes fixed by T (no host sync), so a decode step with
MoE layers can be captured in a CUDA graph (float experts: the quantized ones' loop syncs).
Checkpoints hold one tensor per expert (`experts.3.w1.weight` / `experts.3.gate_proj.weight`);
`expert_target` names where each goes and `stack_experts` builds the stacked parameter, once,
at load.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from . import kernels as K
from .config import ModelConfig


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """[T, E] logits -> (weights [T, k] fp32, expert ids [T, k] int64), as transformers routes:
    softmax in fp32, the k largest, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


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
        else:   # quantized: engine.quant.QuantExperts, a QuantLinear per expert
            out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


# Per-expert checkpoint tensors: Mixtral's w1 (gate) / w3 (up) / w2 (down) under
# block_sparse_moe, Qwen's gate_proj / up_proj / down_proj under mlp.
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0),
         "w3": ("gate_up_proj", 1), "up_proj": ("gate_up_proj", 1),
         "w2": ("down_proj", 0), "down_proj": ("down_proj", 0)}


def expert_target(name: str) -> tuple[str, tuple[int, int]] | None:
    """A checkpoint name without `model.` -> (our stacked parameter, (expert, part)), for one
    expert's weight; the router `block_sparse_moe.gate` -> (`mlp.gate.weight`, None); else None."""
    m = _EXPERT.match(name)
    if m:
        param, part = _PART[m.group(3)]
        return f"{m.group(1)}.mlp.experts.{param}", (int(m.group(2)), part)
    if ".block_sparse_moe.gate." in name:
        return name.replace(".block_sparse_moe.", ".mlp."), None
    return None


def stack_experts(name: str, parts: dict[tuple[int, int], torch.Tensor], num_experts: int) -> torch.Tensor:
    """{(expert, part): tensor} -> [E, 2I, H] (gate rows then up rows) or [E, H, I]."""
    n = 2 if name.endswith("gate_up_proj") else 1
    want = {(e, j) for e in range(num_experts) for j in range(n)}
    if set(parts) != want:
        missing = sorted(want - set(parts))[:4]
        raise ValueError(f"checkpoint has {len(parts)} of {len(want)} expert tensors of {name!r}"
                         f" (missing e.g. {missing}, as (expert, part))")
    return torch.stack([torch.cat([parts[e, j] for j in range(n)]) for e in range(num_experts)])
