"""`CausalLM`: a decoder-only model over a paged KV cache, and the hooks a family overrides.

    embed_tokens -> layers (make_layer: attention + make_mlp) -> norm -> lm_head (or tied)

A family (llama.py, mixtral.py, qwen_moe.py) subclasses it and says what differs: its
config.json fields (`config_fields`), its MLP or layer, and how its checkpoint names map onto
the parameters (`checkpoint_name`: nano-vllm's packed_modules_mapping; `assemble` builds the
fused and stacked parameters from the shards that names). The
loader asks these; it knows no architecture.

`backend` (auto | torch | triton | cpu) is the kernel backend every block hands to the ops
of engine.kernels: it belongs to the model, not to the process, and is settled once the KV
cache is bound (bind_kv_cache).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch
from torch import nn

import engine.kernels as K
from engine.config import ModelConfig, check_kernel_backend
from engine.kernels.rope import build_cos_sin_cache

from .decode_plan import DecodePlan
from .layers import MLP, AttentionMetadata, DecoderLayer, RMSNorm
from .moe import SparseMoeBlock, stack_experts

log = logging.getLogger(__name__)


def layer_types(c: dict, window: int | None, sliding) -> list[str] | None:
    """ModelConfig.layer_types of a family whose transformers model windows only some layers:
    config.json's `layer_types` where written (transformers 5 writes it), else
    transformers' rule `sliding(i)` (True: layer i is windowed); None when no window is on."""
    if window is None:
        return None
    n = c["num_hidden_layers"]
    return c.get("layer_types") or ["sliding_attention" if sliding(i) else "full_attention"
                                    for i in range(n)]


class CausalLM(nn.Module):
    # checkpoint module name -> (our fused module, its index among the fused parts)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # the linears a quantization scheme may hold (routers and gates stay float)
    quantizable = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    step_threads = 1         # the decode plan's threads (LLMEngine sets EngineOptions.step_threads)

    def __init__(self, c: ModelConfig, backend: str = "auto"):
        super().__init__()
        self.config = c
        self.backend = check_kernel_backend(backend)
        # on the meta device (the loader's build, which then fills every tensor) nothing is
        # drawn or computed: torch's first meta normal_ and meta arithmetic cost ~1 s each
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(
            c.vocab_size, c.hidden_size) if meta else None)
        self.layers = nn.ModuleList(self.make_layer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("cos_sin", torch.empty(c.max_model_len + 1, c.rotary_dim or c.head_dim)
                             if meta else self.rotary_table(), persistent=False)
        self.decode_plan = None      # a decode step in one C call (decode_plan.py), from bind_kv_cache

    # -- what a family overrides ----------------------------------------------------------
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        """ModelConfig fields this family reads its own way from config.json `c` (`kind`: its
        model_type): qkv_bias, qk_norm, sliding_window, layer_types, moe, ... (ModelConfig)."""
        return dict(qkv_bias=bool(c.get("attention_bias", False)), qk_norm=False,
                    sliding_window=c.get("sliding_window") if c.get("use_sliding_window") else None)

    def make_mlp(self, c: ModelConfig, layer: int) -> nn.Module:
        """The dense MLP, or on an MoE layer (ModelConfig.is_moe_layer) the MoE block with
        its shared expert when the config has one."""
        if not c.is_moe_layer(layer):
            return MLP(c, self.backend)
        shared = c.moe.shared_intermediate_size
        return SparseMoeBlock(c, self.backend, MLP(c, self.backend, shared) if shared else None)

    def make_layer(self, c: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(c, self.backend, self.make_mlp(c, layer), layer=layer)

    def checkpoint_name(self, name: str) -> tuple[str, object]:
        """A checkpoint tensor's name (without `model.`) -> (our parameter, its shard within a
        fused parameter, or None). model.layers.0.self_attn.q_proj.weight -> qkv_proj, 0."""
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p in self.packed_modules:
                fused, shard = self.packed_modules[p]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return name, None

    def skips(self, name: str) -> bool:
        """Whether the loader passes over checkpoint tensor `name` (without `model.`): tensors
        the engine does not run, such as GLM's multi-token-prediction layers. None here."""
        return False

    def assemble(self, name: str, shards: dict):
        """Parameter `name` from its checkpoint shards {shard: tensor or QuantWeight}: an MoE
        block's experts stacked ((expert, part) shards: moe.stack_experts); else the fused rows
        in order, parts stored in different layouts dequantized (the fused layer is then float)."""
        if ".experts." in name:
            return stack_experts(name, shards, self.config.moe.num_experts)
        fused = name.split(".")[-2]
        n = sum(1 for f, _ in self.packed_modules.values() if f == fused)
        if len(shards) != n:
            raise ValueError(f"checkpoint has {len(shards)} of {n} parts of {name!r}")
        parts = [shards[i] for i in range(n)]
        if len({"float" if isinstance(p, torch.Tensor) else p.method for p in parts}) > 1:
            parts = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
        return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else type(parts[0]).cat(parts)

    def rotary_table(self, device=None) -> torch.Tensor:
        """[max_model_len + 1, R] cos/sin of the rotary dimension R (ModelConfig.rotary_dim,
        default head_dim): the rotary ops rotate the first R values of each head, as wide as
        this table, and pass the rest through (partial rotary)."""
        c = self.config
        return build_cos_sin_cache(c.rotary_dim or c.head_dim, c.max_model_len + 1, c.rope_theta,
                                   c.rope_scaling, device)

    # -- what the engine asks --------------------------------------------------------------
    def quantizable_linears(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        """(path, parent, name, module) of each decoder linear a scheme may hold: attention,
        dense MLPs and shared experts (`quantizable`)."""
        for prefix, parent in self.layers.named_modules(prefix="layers"):
            for name in self.quantizable:
                if isinstance(child := getattr(parent, name, None), nn.Module):
                    yield f"{prefix}.{name}", parent, name, child

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.layers.modules() if isinstance(m, SparseMoeBlock)]

    def set_backend(self, backend: str) -> None:
        """Every block hands `backend` to its ops; quantized layers repack where their kernel
        for it stores the weight otherwise (engine.quant.linear.set_backend)."""
        from engine.quant.linear import set_backend
        for m in self.modules():
            if isinstance(vars(m).get("backend"), str):
                m.backend = backend
        set_backend(self, backend)

    def bind_kv_cache(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
        """kv_cache: [num_layers, parts, num_blocks, block_size, heads, dim] (parts: K and V,
        or MLA's one latent); kv_scales [num_layers, parts, num_blocks, heads] fp32 when the
        cache is 8-bit; each layer keeps views.
        Here the backend is settled (settle_backend), unless the build already did."""
        asked = self.backend
        self.settle_backend(kv_cache.device, kv_cache.dtype)
        log.info("kernel backend %s (asked: %s)", self.backend if self.backend != "auto" else
                 ("triton" if kv_cache.is_cuda else "torch"), asked)
        for i, layer in enumerate(self.layers):    # K, V[, their scales]; MLA: latent[, scales]
            layer.self_attn.bind_kv_cache(*kv_cache[i], *(() if kv_scales is None else kv_scales[i]))
        self.plan_decode()

    def settle_backend(self, kv_device, kv_dtype: torch.dtype) -> None:
        """On CPU, "auto" becomes "cpu" (the C kernels, each quantized layer repacked into
        their layouts) for a float32 model and KV cache where they build; "cpu" asked for
        elsewhere is a ValueError. Called by bind_kv_cache, and before it by an engine whose
        build is cached (so the cache holds the layouts: no repack at each start); once
        settled on "cpu" a second call changes nothing."""
        cpu_ok = (torch.device(kv_device).type == "cpu" and kv_dtype == torch.float32
                  and self.norm.weight.dtype == torch.float32 and K.cpu.library() is not None)
        if self.backend == "cpu" and not cpu_ok:
            raise ValueError("kernel backend 'cpu' runs a float32 model with a float32 KV cache on "
                             "CPU, and needs a C compiler to build its kernels (engine/kernels/cpu.py)")
        if self.backend == "cpu" or (self.backend == "auto" and cpu_ok):
            self.set_backend("cpu")

    def plan_decode(self) -> None:
        """(Re)build the decode plan (decode_plan.py) from the model's tensors as they are now:
        after the backend is settled and whenever a layer's weights change (amx.attach)."""
        self.decode_plan = DecodePlan.build(self) if self.backend == "cpu" else None

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """[T] ids -> [T, hidden] final hidden states. `layer_hook(i)` runs once layer i's KV
        is in the cache (the prefill worker ships it while later layers compute). The layers
        run through their `forward` (layers.py: no hooks inside the model); a decode step
        on the cpu backend in one C call where the model has a plan (decode_plan.py)."""
        if layer_hook is None and self.one_call(meta):
            return self.decode_plan.forward(self.embed_tokens(input_ids), positions, meta)
        h, residual = self.embed_tokens(input_ids), None
        rows = K.rope_rows(positions, self.cos_sin, backend=self.backend)     # once, every layer
        for i, layer in enumerate(self.layers):
            h, residual = layer.forward(positions, h, residual, meta, self.cos_sin, rows)
            if layer_hook is not None:
                layer_hook(i)
        h, _ = self.norm(h, residual)
        return h

    def one_call(self, meta: AttentionMetadata) -> bool:
        """Whether a forward pass of `meta` without a layer hook runs as one C call (the
        decode plan's step: decode only, a batch it takes), with no layer boundary to stop at."""
        plan = self.decode_plan
        return plan is not None and meta.decode_only and plan.takes(meta.context_lens.shape[0])

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        plan = self.decode_plan
        if plan is not None and plan.has_head:     # the head's kernel, shared with its helpers
            return plan.logits(h)
        if self.lm_head is None:
            return nn.functional.linear(h, self.embed_tokens.weight).float()
        return self.lm_head(h).float()      # nn.Linear, or engine.quant's QuantLinear
