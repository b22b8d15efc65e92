"""The versioned KV wire format. Everything is little-endian.

Every message is two transport messages: a fixed 96-byte HEADER, then a BODY of exactly
`header.body_bytes` bytes (omitted when 0). The receiver reads the header first, so it
always knows how much to read next, and can read and drop a body it does not want.

HEADER (struct "<4sHH64sIIIQI", 96 bytes)
  offset size field
       0    4 magic          b"PDKV"
       4    2 version        PROTOCOL_VERSION; a mismatch is rejected at the handshake
       6    2 msg_type       MsgType
       8   64 transfer_id    UTF-8, NUL-padded (empty for handshake messages)
      72    4 layer          layer index (LAYER)
      76    4 block_offset   index into the reserved block list of the first block sent (LAYER)
      80    4 num_blocks     blocks in this message (LAYER)
      84    8 body_bytes     size of the BODY message
      92    4 checksum       LAYER with "host" staging: the low 32 bits of XXH3-64 of the
                             BODY; the receiver fails the transfer on a mismatch, so a
                             corrupted body never reaches the cache (0 and unchecked with
                             "device" staging: the body never passes through host memory)

BODY by msg_type
  HELLO      JSON of the sender's CompatKey, "staging" and "token": the id of a transfer the
             receiver reserved (sender -> receiver, once; at most MAX_HELLO_BYTES)
  HELLO_ACK  JSON of the receiver's CompatKey plus "staging"     (receiver -> sender)
             staging: "host" | "device", where each side keeps LAYER bodies (staging.py);
             both sides must agree (a peer that omits it means "host")
  REJECT     JSON {"error": str, "compat": receiver's CompatKey} (then the receiver closes)
  KEEPALIVE  no body: the sender is alive and the transfer named in the header is queued
             behind other work (sender -> receiver, any number of times): the receiver
             counts it as progress of that transfer (its idle window restarts, its hard
             bound stays), so a prompt merely queued on a live prefill worker keeps its
             reservation
  LAYER      int32 dst block ids [num_blocks], zero-padded to a multiple of 64 bytes, then
             the payload: K and V of those blocks for one layer, shape
             [2, num_blocks, block_size, num_kv_heads, head_dim] in the cache dtype; for an
             8-bit cache (CompatKey.kv_scales SCALE_LAYOUT) followed by the blocks'
             scales, [2, num_blocks, num_kv_heads] float32.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import struct
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"PDKV"
PROTOCOL_VERSION = 4     # 2: CompatKey.kv_scales, scales after an 8-bit LAYER payload; 3: checksum;
                         # 4: KEEPALIVE
HEADER = struct.Struct("<4sHH64sIIIQI")
HEADER_BYTES = HEADER.size  # 96
MAX_TRANSFER_ID_BYTES = 64
IDS_ALIGN = 64
MAX_HELLO_BYTES = 4096


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    REJECT = 3
    LAYER = 4
    KEEPALIVE = 5


class WireError(ValueError):
    """A malformed message (bad magic, unknown type, inconsistent sizes)."""


class IncompatibleKV(RuntimeError):
    """The two sides' KV caches (or protocol versions) cannot exchange blocks."""


@dataclass(frozen=True)
class CompatKey:
    """What two KV caches must agree on to exchange blocks (mirrors proto KvCompat)."""

    model: str
    dtype: str               # torch dtype name without "torch.", e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    protocol_version: int = PROTOCOL_VERSION
    kv_scales: str = "none"  # "none" | SCALE_LAYOUT: scales per block, K|V and KV head, K shift
    # the cache layout by name (engine.config.ModelConfig.kv_layout): "gqa(kv_heads=8, ..)"
    # or "mla(kv_lora_rank=512, rope_dim=64)"; equal shapes of different layouts never mix
    layout: str = ""

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, model: str,
                   kv_scales: torch.Tensor | None = None, layout: str = "") -> "CompatKey":
        """Derive the key from an engine cache [layers, parts, blocks, block_size, heads, dim]
        (parts: 2 for K and V, 1 for MLA's latent) and, for an 8-bit cache, its scales
        [layers, parts, blocks, heads] fp32; `layout` names the layout (default: from the
        shape, "gqa(..)" for two parts, "latent(dim=..)" for one)."""
        check_cache_shape(kv_cache, kv_scales)
        layers, parts, _, bs, heads, dim = kv_cache.shape
        layout = layout or (f"gqa(kv_heads={heads}, head_dim={dim})" if parts == 2 else f"latent(dim={dim})")
        return cls(model, str(kv_cache.dtype).removeprefix("torch."), bs, layers, heads, dim,
                   kv_scales="none" if kv_scales is None else SCALE_LAYOUT, layout=layout)

    def check(self, other: "CompatKey", mine: str = "local", theirs: str = "remote") -> None:
        """Raise IncompatibleKV naming every differing field and both sides' values."""
        diffs = [f"{f.name}: {mine}={getattr(self, f.name)!r} {theirs}={getattr(other, f.name)!r}"
                 for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise IncompatibleKV(f"KV caches are incompatible ({'; '.join(diffs)}); "
                                 f"{mine}={self.describe()} {theirs}={other.describe()}")

    def describe(self) -> str:
        return ("{" + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)) + "}")

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, d: dict) -> "CompatKey":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d)
        if missing:
            raise WireError(f"compat key lacks {sorted(missing)}")
        return cls(**{k: d[k] for k in names})

    def hello(self, token: str, staging: str = "host") -> bytes:
        """A HELLO body: this key, where the sender stages LAYER bodies, and the token of a
        transfer the receiver reserved."""
        return json.dumps({**dataclasses.asdict(self), "token": token, "staging": staging},
                          sort_keys=True).encode()

    @staticmethod
    def parse_hello(data: bytes) -> dict:
        try:
            d = json.loads(bytes(data))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WireError(f"bad HELLO: {e}") from e
        if not isinstance(d, dict):
            raise WireError("bad HELLO: not a JSON object")
        return d

    @classmethod
    def from_json(cls, data: bytes) -> "CompatKey":
        try:
            return cls.from_dict(json.loads(bytes(data)))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise WireError(f"bad compat key: {e}") from e


def hello_body(compat: CompatKey, staging: str) -> bytes:
    return json.dumps({**dataclasses.asdict(compat), "staging": staging}, sort_keys=True).encode()


def parse_hello(data) -> tuple[CompatKey, str]:
    """-> (the peer's CompatKey, its staging)."""
    key = CompatKey.from_json(data)
    staging = json.loads(bytes(data)).get("staging", "host")
    if staging not in ("host", "device"):
        raise WireError(f"unknown KV staging {staging!r}")
    return key, staging


# a scale per block, K|V and KV head; K stored minus the engine's calibrated K shift
# (engine/kv_calibration.py) where the layout allows one (K and V, no attention sinks)
SCALE_LAYOUT = "block_head_fp32+k_shift_v1"


def check_cache_shape(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] not in (1, 2):
        raise ValueError("kv_cache must have shape [num_layers, 2 (K, V) or 1 (a latent), "
                         f"num_blocks, block_size, heads, dim], got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    eight_bit = kv_cache.element_size() == 1
    if eight_bit != (kv_scales is not None):
        raise ValueError(f"a {kv_cache.dtype} kv_cache needs {'its' if eight_bit else 'no'} kv_scales")
    if kv_scales is not None:
        want = (*kv_cache.shape[:3], kv_cache.shape[4])
        if (tuple(kv_scales.shape) != want or kv_scales.dtype != torch.float32
                or not kv_scales.is_contiguous()):
            raise ValueError(f"kv_scales must be contiguous float32 {want}, got "
                             f"{kv_scales.dtype} {tuple(kv_scales.shape)}")


@dataclass(frozen=True)
class Header:
    msg_type: MsgType
    transfer_id: str = ""
    layer: int = 0
    block_offset: int = 0
    num_blocks: int = 0
    body_bytes: int = 0
    version: int = PROTOCOL_VERSION
    checksum: int = 0

    def pack(self) -> bytes:
        tid = self.transfer_id.encode()
        if len(tid) > MAX_TRANSFER_ID_BYTES:
            raise ValueError(f"transfer id longer than {MAX_TRANSFER_ID_BYTES} bytes: {self.transfer_id!r}")
        return HEADER.pack(MAGIC, self.version, int(self.msg_type), tid, self.layer,
                           self.block_offset, self.num_blocks, self.body_bytes, self.checksum)

    @classmethod
    def unpack(cls, data) -> "Header":
        if len(data) != HEADER_BYTES:
            raise WireError(f"header of {len(data)} bytes, expected {HEADER_BYTES}")
        magic, version, mtype, tid, layer, off, n, body, checksum = HEADER.unpack(bytes(data))
        if magic != MAGIC:
            raise WireError(f"bad magic {magic!r} (not a pdserve KV stream)")
        try:
            mtype = MsgType(mtype)
        except ValueError:
            raise WireError(f"unknown message type {mtype}") from None
        return cls(mtype, tid.rstrip(b"\0").decode(errors="replace"), layer, off, n, body, version,
                   checksum)


def body_checksum(body: torch.Tensor) -> int:
    """The header's checksum of a host LAYER body: the low 32 bits of its XXH3-64 (about
    10 GB/s on one core)."""
    return xxhash.xxh3_64_intdigest(body.view(-1).view(torch.uint8).numpy()) & 0xFFFFFFFF


def ids_bytes(num_blocks: int) -> int:
    """Bytes of the block-id prefix of a LAYER body (padded so the payload stays aligned)."""
    raw = 4 * num_blocks
    return (raw + IDS_ALIGN - 1) // IDS_ALIGN * IDS_ALIGN


def block_bytes(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> int:
    """Bytes of one block of one layer, every part (K and V, or the latent) together, with
    their scales if any."""
    _, parts, _, bs, heads, dim = kv_cache.shape
    return parts * (bs * heads * dim * kv_cache.element_size() + (0 if kv_scales is None else heads * 4))


def layer_body_bytes(kv_cache: torch.Tensor, num_blocks: int,
                     kv_scales: torch.Tensor | None = None) -> int:
    return ids_bytes(num_blocks) + num_blocks * block_bytes(kv_cache, kv_scales)


def payload_views(body: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                  n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KV [parts, n, bs, heads, dim] and scales [parts, n, heads] (or None) of a LAYER body."""
    _, parts, _, bs, heads, dim = kv_cache.shape
    off = ids_bytes(n)
    kv_end = off + n * parts * bs * heads * dim * kv_cache.element_size()
    kv = body[off:kv_end].view(kv_cache.dtype).view(parts, n, bs, heads, dim)
    if kv_scales is None:
        return kv, None
    return kv, body[kv_end:kv_end + n * parts * heads * 4].view(torch.float32).view(parts, n, heads)
