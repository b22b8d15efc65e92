"""The mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, MiniMax-M2, and the
DeepSeek-V3 MoE) and how checkpoints' per-expert tensors are stacked at load.

    router   logits = x @ gate.T  [T, E]  ->  scores  ->  top-k  (-> renormalise) (x scale)
               softmax (fp32): Mixtral, Qwen
               sigmoid (fp32 router, DeepSeek's "noaux_tc"): the choice is made on the
               scores + e_score_correction_bias, within the topk_group best of n_group
               groups; the weights are the uncorrected scores of the chosen experts
    experts  engine.kernels.fused_moe over the stacked weights:
             gate_up_proj [E, 2I, H] = cat(gate, up) of each expert,  down_proj [E, H, I]
             (with --quantization: engine.quant.linear.QuantExperts, a quantized layer each)
    shared   + MLP(x), a dense expert every token takes: Qwen2-MoE's sigmoid-gated
             (x sigmoid(x @ shared_expert_gate.T)), DeepSeek's added as is
             (MoeConfig.shared_expert_gate); DeepSeek-style checkpoints name it
             `mlp.shared_experts` (shared_experts_name)

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


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                   scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                   n_group: int = 1, topk_group: int = 1, scaling: float = 1.0):
    """[T, E] logits -> (weights [T, k] fp32, expert ids [T, k] int64), as transformers routes.

    softmax: the k largest probabilities, divided by their sum when `renormalize`.
    sigmoid (DeepSeek-V3's noaux_tc, GLM-4.5, MiniMax-M2): scores = sigmoid(logits) in fp32;
    the choice is made on scores + `correction_bias` [E]; with `n_group` > 1 the experts are
    split into n_group equal groups, a group's score is the sum of its two best corrected
    scores, and only the `topk_group` best groups' experts can be chosen. The weights are the
    uncorrected scores of the chosen experts (renormalised when `renormalize`); then x
    `scaling` (routed_scaling_factor)."""
    if scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = torch.sigmoid(router_logits.float())                        # [T, E]
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, n_group, e // n_group)                  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)        # [T, G]
            kept = torch.topk(group_scores, topk_group, dim=-1).indices      # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
        ids = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids


class Router(nn.Linear):
    """The router: logits = x @ weight.T [T, E], and for DeepSeek-style routing its
    `e_score_correction_bias` [E] (a parameter, so the loader fills it from the checkpoint's
    `mlp.gate.e_score_correction_bias`). `fp32`: the weight and bias stay float32 whatever
    the model's dtype and the logits are computed in float32, as transformers keeps DeepSeek's
    and GLM's routers (`_keep_in_fp32_modules_strict`): a bfloat16 bias would move choices."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool = False, fp32: bool = False):
        super().__init__(hidden, num_experts, bias=False)
        self.fp32 = fp32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if correction_bias else None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.fp32:       # model.to(dtype) casts every parameter: put these back
            for p in (self.weight, self.e_score_correction_bias):
                if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                    p.data = p.data.float()
        return self

    def forward(self, x):
        if self.fp32:
            return nn.functional.linear(x.float(), self.weight.float())
        return super().forward(x)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoeBlock(nn.Module):
    """Router, routed experts and an optional shared expert (`shared_expert`: a dense MLP
    every token takes, sigmoid-gated when c.moe.shared_expert_gate)."""

    def __init__(self, c: ModelConfig, backend: str, shared_expert: nn.Module | None = None):
        super().__init__()
        m = c.moe
        self.backend, self.top_k, self.renormalize = backend, m.top_k, m.norm_topk_prob
        self.routing = dict(scoring=m.scoring, n_group=m.n_group, topk_group=m.topk_group,
                            scaling=m.routed_scaling_factor)
        self.gate = Router(c.hidden_size, m.num_experts, m.correction_bias, fp32=m.scoring == "sigmoid")
        self.experts = Experts(m.num_experts, c.hidden_size, m.intermediate_size)
        self.shared_expert = shared_expert
        gated = shared_expert is not None and m.shared_expert_gate
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if gated else None

    def route(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of each token (select_experts)."""
        return select_experts(self.gate(x), self.top_k, self.renormalize,
                              correction_bias=self.gate.e_score_correction_bias, **self.routing)

    def forward(self, x):
        weights, ids = self.route(x)
        if isinstance(self.experts, Experts):
            out = K.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                              backend=self.backend)
        else:   # quantized: engine.quant.linear.QuantExperts, a QuantLinear per expert
            out = self.experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out


def shared_experts_name(name: str) -> str:
    """DeepSeek-style checkpoints' `layers.N.mlp.shared_experts.*` -> our
    `layers.N.mlp.shared_expert.*` (the router's `mlp.gate.weight` and
    `mlp.gate.e_score_correction_bias` need no mapping)."""
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


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


# the two checkpoint namings of per-expert tensors the families use
MLP_EXPERTS = expert_names("mlp", {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                                   "down_proj": ("down_proj", 0)})          # Qwen-MoE, DeepSeek, GLM
BLOCK_SPARSE_EXPERTS = expert_names("block_sparse_moe", {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                                                         "w2": ("down_proj", 0)})   # Mixtral, MiniMax


def stack_experts(name: str, parts: dict[tuple[int, int], torch.Tensor], num_experts: int) -> torch.Tensor:
    """{(expert, part): tensor} -> [E, 2I, H] (gate rows then up rows) or [E, H, I]."""
    n = 2 if name.endswith("gate_up_proj") else 1
    want = {(e, j) for e in range(num_experts) for j in range(n)}
    if set(parts) != want:
        missing = sorted(want - set(parts))[:4]
        raise ValueError(f"checkpoint has {len(parts)} of {len(want)} expert tensors of {name!r}"
                         f" (missing e.g. {missing}, as (expert, part))")
    return torch.stack([torch.cat([parts[e, j] for j in range(n)]) for e in range(num_experts)])
