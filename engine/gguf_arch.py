"""llama.cpp's architectures in GGUF, torch-free: for each `general.architecture` the engine
serves, its metadata read back as the Hugging Face config.json and its tensors as the Hugging
Face checkpoint's (names, shapes, row order). engine/gguf.py parses the file and asks the
architecture's `GGUFArch` here.

    GGUF arch   Hugging Face architecture        what llama.cpp's converter did, undone here
    llama       Llama, Mistral; Mixtral (with    q/k rows permuted per head
                ffn_*_exps: MixtralForCausalLM)
    qwen2/3     Qwen2 / Qwen3                    nothing
    qwen2moe    Qwen2MoeForCausalLM              (stacked experts; the shared expert's gate
                                                 may be stored 1-D)
    qwen3moe    Qwen3MoeForCausalLM              (stacked experts)
    gemma3      Gemma3ForCausalLM (text)         every RMSNorm weight stored + 1
    deepseek2   DeepseekV3ForCausalLM (DeepSeek  kv_b_proj split into attn_k_b (per head,
                V3 / R1, Kimi K2)                transposed) and attn_v_b; head_count_kv
                                                 written as 1 (MLA read as MQA)

Stacked experts: the converter stores a layer's experts as one 3-D tensor per projection,
blk.N.ffn_{gate,up}_exps [E, I, H] and ffn_down_exps [E, H, I] (rows-first order; newer
files may fuse gate and up as ffn_gate_up_exps [E, 2I, H]). They come out as the per-expert
2-D tensors of a Hugging Face checkpoint (`model.layers.N.mlp.experts.E.gate_proj.weight`),
views of the file with quantized rows unchanged, so each family's `checkpoint_name` and
`stack_experts` (engine/models) read them as they read safetensors.

Where a layer is dense or sparse is read off the tensors (a layer with ffn_gate_inp routes),
so Qwen2-MoE's mlp_only_layers and DeepSeek's leading dense layers need no guessing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class RawTensor:
    """One tensor as stored, under its Hugging Face name, rows in Hugging Face order."""
    name: str                 # e.g. model.layers.0.self_attn.q_proj.weight
    type_name: str            # the GGML type: F32, Q8_0, Q4_1, ...
    shape: tuple[int, ...]    # the logical (Hugging Face) shape, e.g. (out, in)
    data: np.ndarray          # as stored: float rows, or uint8 rows of quantized blocks

    def dequantize(self) -> np.ndarray:
        if self.type_name == "F32":           # as stored (no `gguf` import: it takes a while)
            return self.data.reshape(self.shape).copy()
        from gguf import GGMLQuantizationType, quants
        out = quants.dequantize(self.data, GGMLQuantizationType[self.type_name]) \
            .astype(np.float32, copy=False).reshape(self.shape)
        return out if out.flags.writeable else out.copy()     # F32 is a view of the file


# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_EXPS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFArch:
    """The dense Llama-style map; a subclass per architecture says what differs."""
    hf_architecture = ""
    layer: dict = _LAYER
    expert_block = "mlp"                     # experts.E.<part> under this module
    expert_parts = dict(zip(_EXPS.values(), _EXPS.values()))   # HF part -> the family's name

    def config(self, g) -> dict:
        """The config.json transformers would write (g: the GGUFModel)."""
        c = base_config(g, self.hf_architecture)
        if g.arch_get("rope.scaling.type", "none") != "none":
            raise ValueError(f"{g.path.name}: unsupported rope scaling "
                             f"{g.arch_get('rope.scaling.type')!r} for {g.arch}")
        return c

    def tensors(self, g, c: dict) -> Iterator[RawTensor]:
        """Every tensor under its Hugging Face name (the stacked experts split per expert)."""
        for t in g.tensor_table:
            yield from self.convert(g, c, t)

    def convert(self, g, c: dict, t) -> Iterator[RawTensor]:
        kind = t.type_name
        if kind not in TENSOR_TYPES:
            raise ValueError(f"{g.path.name}: tensor {t.name} has unsupported type {kind}: "
                             f"supported are {', '.join(TENSOR_TYPES)}")
        shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists the fastest dim first
        m = _BLK.match(t.name)
        if m is not None and m.group(2) in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                            "ffn_gate_up_exps"):
            yield from self.experts(int(m.group(1)), m.group(2), RawTensor(t.name, kind, shape, t.data))
            return
        name = self.hf_name(t.name)
        if name is None:
            raise ValueError(f"{g.path.name}: unexpected tensor {t.name!r} for {g.arch}")
        yield RawTensor(name, kind, shape, t.data)

    def hf_name(self, gguf_name: str) -> str | None:
        base, _, suffix = gguf_name.rpartition(".")          # suffix: weight | bias
        if base in _GLOBAL:
            return f"{_GLOBAL[base]}.{suffix}"
        m = _BLK.match(gguf_name)
        if m is None or m.group(2) not in self.layer:
            return None
        return f"model.layers.{m.group(1)}.{self.layer[m.group(2)]}.{suffix}"

    def experts(self, layer: int, kind: str, t: RawTensor) -> Iterator[RawTensor]:
        """A stacked [E, rows, cols] tensor as E per-expert [rows, cols] tensors (views)."""
        parts = ([("gate_proj", slice(0, t.shape[1] // 2)), ("up_proj", slice(t.shape[1] // 2, None))]
                 if kind == "ffn_gate_up_exps" else [(_EXPS[kind], slice(None))])
        for part, rows in parts:
            n = len(range(t.shape[1])[rows])
            for e in range(t.shape[0]):
                yield RawTensor(f"model.layers.{layer}.{self.expert_block}.experts.{e}."
                                f"{self.expert_parts[part]}.weight", t.type_name,
                                (n, t.shape[2]), t.data[e, rows])


def base_config(g, architecture: str) -> dict:
    """The fields every architecture shares, from {arch}.* and tokenizer.ggml.* metadata."""
    names = {t.name for t in g.tensor_table}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{g.path.name}: rope frequency factors (Llama 3.1 rope "
                         "scaling) are not supported")
    heads, hidden = g.arch_get("attention.head_count"), g.arch_get("embedding_length")
    embd = next(t for t in g.tensor_table if t.name == "token_embd.weight")
    return {
        "architectures": [architecture], "model_type": g.arch,
        "vocab_size": int(g.arch_get("vocab_size") or int(embd.shape[1])
                          or len(g.get("tokenizer.ggml.tokens", []))),
        "hidden_size": hidden, "intermediate_size": g.arch_get("feed_forward_length"),
        "num_hidden_layers": g.arch_get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": g.arch_get("attention.head_count_kv", heads),
        "head_dim": g.arch_get("attention.key_length", hidden // heads),
        "rms_norm_eps": float(g.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g.arch_get("rope.freq_base", 10000.0)),
        "max_position_embeddings": g.arch_get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": g.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.get("tokenizer.ggml.eos_token_id"),
    }


def routed_layers(g) -> list[int]:
    """The layers whose tensors include a router (blk.N.ffn_gate_inp)."""
    return sorted(int(m.group(1)) for t in g.tensor_table
                  if (m := _BLK.match(t.name)) and m.group(2) == "ffn_gate_inp")


class Llama(GGUFArch):
    """llama, qwen2, qwen3; a llama file with experts is Mixtral."""

    def __init__(self, hf_architecture: str):
        self.hf_architecture = hf_architecture

    def config(self, g) -> dict:
        c = super().config(g)
        if g.arch == "llama" and g.arch_get("expert_count"):
            c.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                     num_local_experts=g.arch_get("expert_count"),
                     num_experts_per_tok=g.arch_get("expert_used_count"))
        return c

    def tensors(self, g, c: dict) -> Iterator[RawTensor]:
        mixtral = c["model_type"] == "mixtral"
        for t in super().tensors(g, c):
            if mixtral:
                t.name = t.name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            if g.arch == "llama" and (".q_proj." in t.name or ".k_proj." in t.name):
                heads = c["num_attention_heads" if ".q_proj." in t.name else "num_key_value_heads"]
                t.data = unpermute_rows(t.data, heads)
            yield t

    # Mixtral's experts: block_sparse_moe.experts.E.w1 (gate) / w3 (up) / w2 (down)
    expert_block = "block_sparse_moe"
    expert_parts = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order (0, d/2, 1, d/2+1, ...) -> (0, 1, ..., d-1)."""
    n = rows.shape[0]
    half = n // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)



class Gemma3(GGUFArch):
    """Gemma 3 (text): llama.cpp's converter stores every RMSNorm weight plus one (Gemma's
    norms scale by 1 + w; subtracted back here) and keeps no layer pattern or query scale in
    the file: llama.cpp's gemma3 has every 6th layer global and scales queries by
    head_dim^-1/2, by (hidden / heads)^-1/2 for the 27B (62 layers), so that is what the
    config says. Linear rope scaling applies to the global layers, freq_base_swa to the local."""
    hf_architecture = "Gemma3ForCausalLM"
    layer = {**_LAYER, "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

    def config(self, g) -> dict:
        c = base_config(g, self.hf_architecture)
        scaling = g.arch_get("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"{g.path.name}: unsupported rope scaling {scaling!r} for {g.arch}")
        full = {"rope_type": "default", "rope_theta": c["rope_theta"]}
        if scaling == "linear":
            full.update(rope_type="linear", factor=float(g.arch_get("rope.scaling.factor")))
        big = c["num_hidden_layers"] == 62
        c.update(model_type="gemma3_text", sliding_window=g.arch_get("attention.sliding_window"),
                 sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh",
                 query_pre_attn_scalar=c["hidden_size"] // c["num_attention_heads"] if big else c["head_dim"],
                 final_logit_softcapping=g.arch_get("final_logit_softcapping"),
                 rope_parameters={"full_attention": full, "sliding_attention": {
                     "rope_type": "default", "rope_theta": float(g.arch_get("rope.freq_base_swa", 10000.0))}})
        return c

    def tensors(self, g, c: dict) -> Iterator[RawTensor]:
        for t in super().tensors(g, c):
            if t.name.endswith("norm.weight"):
                t.type_name, t.data = "F32", t.dequantize() - np.float32(1.0)
            yield t
