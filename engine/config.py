"""Typed configuration of the engine, in two layers:

  * what the user chooses: `EngineOptions` (device, dtype, kernel backend, context cap) with
    its `CacheConfig` and `SchedulerConfig` nested. Every option has its one default here;
    the workers' and `pdserve up`'s command-line options are generated from these fields
    (services/cli_args.py) and `LLMEngine.from_model_dir(d, block_size=..)` takes them by name;
  * what an engine is built from: `EngineConfig` = those options + the `ModelConfig` read from
    the model directory's config.json (`EngineConfig.build(model_dir, options)`).

Validation happens where each dataclass is built. This module does not import torch at
import time: the CLI (and so the gateway process, which never loads torch) imports it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from .paths import cache_dir  # noqa: F401  (re-exported: where pdserve keeps what it builds)
from .quant import AMX_WEIGHTS, QUANTIZATIONS
from .rope_config import rope, rotary_dim_of  # noqa: F401  (rotary_dim_of: the families' import)
from .spec_decode import SpeculativeConfig



@dataclass
class MoeConfig:
    """The mixture-of-experts part of a model (engine/models/moe.py): which layers route, to
    how many of how many experts, and how the chosen experts' weights are normalised. Each
    MoE family reads its own config.json names into it (engine/models/mixtral.py, ...)."""
    num_experts: int
    top_k: int
    intermediate_size: int            # of one expert
    norm_topk_prob: bool              # renormalise the top-k softmax weights to sum to 1
    shared_intermediate_size: int     # the shared expert's MLP (0: none)
    sparse_layers: list[int]          # the layers with an MoE block; the others are dense
    # DeepSeek-V3's "noaux_tc" routing (also GLM-4.5, MiniMax-M2); the defaults are softmax
    # top-k as Mixtral and Qwen route (engine/models/moe.py select_experts):
    scoring: str = "softmax"          # "softmax" | "sigmoid": how router logits become scores
    correction_bias: bool = False     # e_score_correction_bias [E]: added for the choice only
    n_group: int = 1                  # experts split into groups (a group scores its top-2 sum)
    topk_group: int = 1               # the best groups kept; top-k experts chosen among them
    routed_scaling_factor: float = 1.0    # times the chosen experts' weights
    shared_expert_gate: bool = True   # Qwen2-MoE's sigmoid gate on the shared expert (DeepSeek: none)

    @classmethod
    def checked(cls, path, hidden_act: str = "silu", **fields) -> "MoeConfig":
        """The config, or a ValueError naming `path` and the field for what the MoE block
        cannot run."""
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} in {path}: MoE experts are SiLU-gated")
        m = cls(**fields)
        if not 1 <= m.top_k <= m.num_experts:
            raise ValueError(f"num_experts_per_tok {m.top_k} must be in 1..{m.num_experts} "
                             f"(num_experts) in {path}")
        if m.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring_func {m.scoring!r} in {path}: softmax or sigmoid")
        if m.n_group < 1 or m.num_experts % m.n_group or (m.n_group > 1 and m.num_experts // m.n_group < 2):
            raise ValueError(f"n_group {m.n_group} in {path} must divide the {m.num_experts} experts "
                             f"into groups of at least 2")
        if not 1 <= m.topk_group <= m.n_group:
            raise ValueError(f"topk_group {m.topk_group} must be in 1..{m.n_group} (n_group) in {path}")
        if m.top_k > m.topk_group * (m.num_experts // m.n_group):
            raise ValueError(f"num_experts_per_tok {m.top_k} in {path} exceeds the experts of "
                             f"topk_group {m.topk_group} groups")
        return m


@dataclass
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; engine/models/deepseek.py): the
    query through an optional low-rank pair, keys and values from one shared latent of
    `kv_lora_rank` values per token plus a `qk_rope_head_dim` rotary key, which is all the KV
    cache stores: kv_lora_rank + qk_rope_head_dim values per token and layer."""
    q_lora_rank: int | None           # None: a full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int             # each head's query/key dims without rotary
    qk_rope_head_dim: int             # ... and with (shared by every head on the key side)
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    model_dir: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_model_len: int
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    moe: MoeConfig | None = None
    sliding_window: int | None = None     # tokens each one attends to (None: all)
    # per layer "full_attention" | "sliding_attention" (config.json's layer_types; None: every
    # layer the same, windowed when sliding_window is set)
    layer_types: list[str] | None = None
    rotary_dim: int | None = None         # rotary on the first rotary_dim of each head (None: all)
    hidden_act: str = "silu"              # the gated MLP's activation
    attention_sinks: bool = False         # a learned per-head logit in every softmax (GPT-OSS)
    mla: MlaConfig | None = None          # multi-head latent attention (DeepSeek-V3)
    extra: dict = field(default_factory=dict)   # a family's own scalars, read in its config_fields

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i in self.moe.sparse_layers

    def kv_block_shape(self) -> tuple[int, int, int]:
        """What one cached token of one layer holds, as (parts, heads, dim): K and V per KV
        head (2, num_kv_heads, head_dim), or MLA's one latent row (1, 1, latent_dim). The
        cache is [layers, parts, blocks, block_size, heads, dim] (engine/runner.py)."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.num_kv_heads, self.head_dim

    def kv_layout(self) -> str:
        """The cache layout by name, for the KV handshake (kvtransfer.wire.CompatKey): two
        workers exchange blocks only when theirs are equal."""
        if self.mla is not None:
            layout = f"mla(kv_lora_rank={self.mla.kv_lora_rank}, rope_dim={self.mla.qk_rope_head_dim}"
        else:
            layout = f"gqa(kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        windowed = [i for i in range(self.num_layers) if self.layer_window(i) is not None]
        if windowed:
            which = "all layers" if len(windowed) == self.num_layers else \
                "layers " + ",".join(map(str, windowed))
            layout += f", window={self.sliding_window} on {which}"
        return layout + (", sinks)" if self.attention_sinks else ")")

    def layer_window(self, i: int) -> int | None:
        """The keys layer i's queries see, themselves included (None: all): sliding_window on
        a "sliding_attention" layer, or on every layer when layer_types is None."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def check_layer_types(self, path) -> None:
        """ValueError naming `path` unless sliding_window is None or positive and layer_types
        None or one known type per layer."""
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window in {path} must be >= 1, got {self.sliding_window}")
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types in {path} has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers (num_hidden_layers)")
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)} in {path}: expected "
                             f"full_attention or sliding_attention")

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_model_len: int | None = None) -> "ModelConfig":
        """`model_dir`: a Hugging Face directory (config.json), or a GGUF file or a directory
        holding one (its metadata read as the config.json transformers would write)."""
        from .gguf import find_gguf, model_name, open_gguf
        d = Path(model_dir)
        if find_gguf(d) is not None:
            path, c = find_gguf(d), open_gguf(d).hf_config()
        else:
            if not d.is_dir():
                raise ValueError(f"model directory {str(d)!r} does not exist")
            path = d / "config.json"
            if not path.exists():
                raise ValueError(f"model directory {str(d)!r} has no config.json")
            c = json.loads(path.read_text())
        from .models import ARCHITECTURES, model_class
        # transformers writes no `architectures` for a model loaded from GGUF: use model_type
        archs = c.get("architectures") or [a for a, (t, _) in ARCHITECTURES.items()
                                           if t == c.get("model_type")]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or c.get('model_type')!r} in "
                             f"{path}: supported are {sorted(ARCHITECTURES)}")
        kind = ARCHITECTURES[arch][0]
        try:
            family = model_class(arch).config_fields(kind, c, path)
        except KeyError as e:
            raise ValueError(f"{path}: a {kind} config needs {e.args[0]!r}") from None
        heads = c["num_attention_heads"]
        max_pos = c.get("max_position_embeddings", 2048)
        eos = c.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        theta, scaling = rope(c, path)
        cfg = cls(
            model_dir=str(d), architecture=arch, vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=scaling, max_position_embeddings=max_pos,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_model_len=min(max_model_len or max_pos, max_pos),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, name=model_name(d),
            **family)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads")
        cfg.check_layer_types(path)
        return cfg


KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")    # what engine.kernels dispatches on
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")


def check_kernel_backend(name: str) -> str:
    """`name` if engine.kernels knows it, else ValueError."""
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}: expected auto, torch, triton or cpu")
    return name


@dataclass
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "KV cache blocks; unset: as many as kv_cache_memory_gb holds"})
    kv_cache_memory_gb: float = field(default=0.5, metadata={
        "help": "memory for the KV cache when num_blocks is unset"})
    gpu_memory_utilization: float = field(default=0.0, metadata={
        "help": "when num_blocks is unset: the KV cache takes this fraction (0-1) of the "
                "device memory free once the weights are loaded (CUDA only); 0: "
                "kv_cache_memory_gb"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of prompt prefixes already in the cache"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto (the model dtype) | fp8_e4m3 | int8: 8-bit KV with a scale per block and "
                "KV head, K stored minus a calibrated per-layer mean (engine/kv_calibration.py)"})
    # offload tiers under the pool (engine/kv_offload.py, engine/kv_tiers.py)
    kv_offload_host_gb: float = field(default=0.0, metadata={
        "help": "host-memory KV tier, GiB (0: off): cached blocks are copied there and a prefix "
                "found there is loaded back instead of recomputed, when that measures cheaper"})
    kv_offload_disk: str = field(default="", metadata={
        "help": "directory of a local-disk KV tier (empty: off): one checksummed file per "
                "block, reused by a restart with the same model and KV layout"})
    kv_offload_disk_gb: float = field(default=4.0, metadata={
        "help": "the disk tier's bound, GiB (oldest blocks deleted first)"})

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}: expected one "
                             f"of {KV_CACHE_DTYPES}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (unset: sized from kv_cache_memory_gb), "
                             f"got {self.num_blocks}")
        if not 0 <= self.gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization must be in [0, 1), got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_offload_host_gb < 0 or self.kv_offload_disk_gb <= 0:
            raise ValueError(f"kv_offload_host_gb must be >= 0 (0: off) and kv_offload_disk_gb "
                             f"> 0, got {self.kv_offload_host_gb} and {self.kv_offload_disk_gb}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "tokens computed per step, all requests together"})
    max_num_seqs: int = field(default=128, metadata={"help": "requests running at once"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split prompts longer than the step budget over several steps"})

    def __post_init__(self):
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass
class EngineOptions:
    """What the user chooses about an engine; the model's own shape comes from its directory."""
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda, cuda:1, ..."})
    dtype: str = field(default="auto", metadata={
        "help": "auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16"})
    kernel_backend: str = field(default="auto", metadata={
        "help": "auto (Triton on CUDA; on CPU the C kernels for a float32 model with a float32 "
                "KV cache where a C compiler builds them, else the torch references) | torch | "
                "triton | cpu"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length; unset: the model's (capped by it in any case)"})
    quantization: str = field(default="auto", metadata={
        "help": "weights: auto (as the checkpoint holds them: pre-quantized GGUF Q8_0/Q4_0/Q4_1 "
                "tensors or quantization_config stay quantized) | none (float; a pre-quantized "
                "checkpoint is dequantized) | int8 (per channel) | int8_g32 (GGUF Q8_0) | "
                "int4_g32 | int4_g128 (group-wise) | fp8 (per channel) | fp8_tensor; on a "
                "pre-quantized checkpoint the method must be the one it holds"})
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: str = field(default="", metadata={
        "help": "speculative decoding: ngram:n=3,k=4 | draft:MODEL_DIR,k=4 (also min_n=, "
                "disable_batch_size=); empty: off"})
    amx_weights: str = field(default="auto", metadata={
        "help": "bfloat16 copies of the quantized linears for matmuls of --amx-min-rows rows or "
                "more (prefill, batched decode), on the CPU's bf16 tiles through oneDNN: auto "
                "(default: on a CPU with amx_bf16 or avx512_bf16, when they fit "
                "--amx-weights-max-gb) | off | bf16"})
    amx_weights_max_gb: float = field(default=1.0, metadata={
        "help": "memory the bfloat16 copies may take under --amx-weights auto"})
    amx_min_rows: int = field(default=8, metadata={
        "help": "rows from which a quantized linear multiplies by its bfloat16 copy"})
    step_threads: int = field(default=0, metadata={
        "help": "threads of a CPU decode step run in one C call (engine/models/decode_plan.py): "
                "the stepping thread and helpers that share its matmuls and attention only "
                "while the OS runs them, so a busy core costs nothing (0: every core this "
                "process may run on; 1: none)"})

    def __post_init__(self):
        check_kernel_backend(self.kernel_backend)
        SpeculativeConfig.parse(self.speculative)     # ValueError now, not at engine start
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}: expected one of {DTYPES}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unsupported quantization {self.quantization!r}: expected one of "
                             f"{QUANTIZATIONS}")
        if self.step_threads < 0:
            raise ValueError(f"step_threads must be >= 0 (0: every core), got {self.step_threads}")
        if self.amx_weights not in AMX_WEIGHTS or self.amx_min_rows < 1 or self.amx_weights_max_gb < 0:
            raise ValueError(f"amx_weights must be one of {AMX_WEIGHTS} (got {self.amx_weights!r}), "
                             f"amx_min_rows >= 1 (got {self.amx_min_rows}), amx_weights_max_gb >= 0")

    @classmethod
    def of(cls, **options) -> "EngineOptions":
        """Options by flat name, each given to the dataclass that has it:
        `EngineOptions.of(block_size=8, max_num_seqs=4, device="cuda")`. Unknown names:
        TypeError, as for any call."""
        nested = {}
        for name, sub in (("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            mine = {f.name for f in fields(sub)}
            nested[name] = sub(**{k: options.pop(k) for k in list(options) if k in mine})
        return cls(**options, **nested)


@dataclass
class EngineConfig:
    """Everything an LLMEngine is built from (no defaults here: they are EngineOptions')."""
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    dtype: str
    kernel_backend: str
    speculative: SpeculativeConfig | None
    quantization: str = "auto"
    amx_weights: str = "auto"
    amx_weights_max_gb: float = 1.0
    amx_min_rows: int = 8
    step_threads: int = 0

    @classmethod
    def build(cls, model_dir: str | Path, options: EngineOptions) -> "EngineConfig":
        """Read the model's config.json and apply the options (ValueError on bad input)."""
        return cls(model=ModelConfig.from_dir(model_dir, options.max_model_len),
                   cache=options.cache, scheduler=options.scheduler, device=options.device,
                   dtype=options.dtype, kernel_backend=options.kernel_backend,
                   speculative=SpeculativeConfig.parse(options.speculative),
                   quantization=options.quantization, amx_weights=options.amx_weights,
                   amx_weights_max_gb=options.amx_weights_max_gb, amx_min_rows=options.amx_min_rows,
                   step_threads=options.step_threads)

    @property
    def torch_dtype(self):
        import torch
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError(f"unsupported dtype {self.dtype!r}") from None

    @property
    def kv_torch_dtype(self):
        """The KV cache's element type: the model dtype, or an 8-bit type with scales."""
        import torch
        return {"auto": self.torch_dtype, "fp8_e4m3": torch.float8_e4m3fn,
                "int8": torch.int8}[self.cache.kv_cache_dtype]
