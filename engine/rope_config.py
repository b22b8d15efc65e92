"""Rotary settings read from a config.json (torch-free, as engine/config.py): rope theta and
scaling (default, llama3, linear, yarn, as transformers >= 5 writes them under
rope_parameters) and the rotary dimension of partial-rotary models."""
from __future__ import annotations


def rope(c: dict, path) -> tuple[float, dict | None]:
    """rope theta and scaling (None, llama3's, linear or yarn's); transformers >= 5 writes them under
    rope_parameters. A yarn dict comes back with its `original_max_position_embeddings` and
    `factor` filled as transformers fills them (a top-level original_max_position_embeddings
    wins, else max_position_embeddings; no factor: their ratio)."""
    rope = dict(c.get("rope_parameters") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        rtype = scaling.get("rope_type", scaling.get("type"))
        if rtype not in ("default", "llama3", "linear", "yarn"):
            raise ValueError(f"unsupported rope scaling {rtype!r} in {path}")
        if rtype == "default":
            scaling = None
        elif rtype == "yarn":
            scaling = yarn(dict(scaling), c, path)
    return float(theta), scaling


def yarn(scaling: dict, c: dict, path) -> dict:
    max_pos = c.get("max_position_embeddings", 2048)
    if "original_max_position_embeddings" in c:
        scaling["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    scaling.setdefault("original_max_position_embeddings", max_pos)
    for key in ("original_max_position_embeddings", "factor"):
        if key == "factor" and scaling.get("factor") is None:
            scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"yarn rope scaling needs a positive {key} in {path}, got {value!r}")
    return scaling


def rotary_dim_of(c: dict, path, default_factor: float = 1.0) -> int | None:
    """The rotary dimension of a config.json `c` with partial rotary (GLM-4.5, MiniMax-M2):
    its `rotary_dim`, else head_dim x partial_rotary_factor (under rope_parameters, as
    transformers >= 5 writes it, or at the top level; `default_factor` where neither says,
    the family's transformers default). None: the whole head rotates. ValueError naming the
    field for a dimension the rotary kernels cannot take (odd, zero, above head_dim)."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if c.get("rotary_dim") is not None:
        field_, dim = "rotary_dim", c["rotary_dim"]
    else:
        rope = c.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", default_factor))
        field_, dim = f"partial_rotary_factor {factor}", int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"{field_} in {path} gives rotary dimension {dim}: it must be even and "
                         f"in 2..head_dim ({head_dim})")
    return None if dim == head_dim else dim
