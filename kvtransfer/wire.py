"""The versioned KV wire format. Everything is little-endian.

Every message is two transport messages: a fixed 96-byte HEADER, then a BODY of exactly
`header.body_bytes` bytes (omitted when 0). The receiver reads the header first, so it
always knows how much to read next, and can read and drop a body it does not want.

HEADER (struct "<4sHH64sIIIQ4x", 96 bytes)
  offset size field
       0    4 magic          b"PDKV"
       4    2 version        PROTOCOL_VERSION; a mismatch is rejected at the handshake
       6    2 msg_type       MsgType
       8   64 transfer_id    UTF-8, NUL-padded (empty for handshake messages)
      72    4 layer          layer index (LAYER)
      76    4 block_offset   index into the reserved block list of the first block sent (LAYER)
      80    4 num_blocks     blocks in this message (LAYER)
      84    8 body_bytes     size of the BODY message
      92    4 (padding)

BODY by msg_type
  HELLO      JSON of the sender's CompatKey and "token": the id of a transfer the receiver
             reserved (sender -> receiver, once; at most MAX_HELLO_BYTES)
  HELLO_ACK  JSON of the receiver's CompatKey                    (receiver -> sender)
  REJECT     JSON {"error": str, "compat": receiver's CompatKey} (then the receiver closes)
  LAYER      int32 dst block ids [num_blocks], zero-padded to a multiple of 64 bytes, then
             the payload: K and V of those blocks for one layer, shape
             [2, num_blocks, block_size, num_kv_heads, head_dim] in the cache dtype.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import struct
from dataclasses import dataclass

import torch

MAGIC = b"PDKV"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sHH64sIIIQ4x")
HEADER_BYTES = HEADER.size  # 96
MAX_TRANSFER_ID_BYTES = 64
IDS_ALIGN = 64
MAX_HELLO_BYTES = 4096


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    REJECT = 3
    LAYER = 4


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

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, model: str) -> "CompatKey":
        """Derive the key from an engine cache [layers, 2, blocks, block_size, kv_heads, head_dim]."""
        check_cache_shape(kv_cache)
        layers, _, _, bs, heads, dim = kv_cache.shape
        return cls(model, str(kv_cache.dtype).removeprefix("torch."), bs, layers, heads, dim)

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

    def hello(self, token: str) -> bytes:
        """A HELLO body: this key and the token of a transfer the receiver reserved."""
        return json.dumps({**dataclasses.asdict(self), "token": token}, sort_keys=True).encode()

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


def check_cache_shape(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache must have shape [num_layers, 2, num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")


@dataclass(frozen=True)
class Header:
    msg_type: MsgType
    transfer_id: str = ""
    layer: int = 0
    block_offset: int = 0
    num_blocks: int = 0
    body_bytes: int = 0
    version: int = PROTOCOL_VERSION

    def pack(self) -> bytes:
        tid = self.transfer_id.encode()
        if len(tid) > MAX_TRANSFER_ID_BYTES:
            raise ValueError(f"transfer id longer than {MAX_TRANSFER_ID_BYTES} bytes: {self.transfer_id!r}")
        return HEADER.pack(MAGIC, self.version, int(self.msg_type), tid, self.layer,
                           self.block_offset, self.num_blocks, self.body_bytes)

    @classmethod
    def unpack(cls, data) -> "Header":
        if len(data) != HEADER_BYTES:
            raise WireError(f"header of {len(data)} bytes, expected {HEADER_BYTES}")
        magic, version, mtype, tid, layer, off, n, body = HEADER.unpack(bytes(data))
        if magic != MAGIC:
            raise WireError(f"bad magic {magic!r} (not a pdserve KV stream)")
        try:
            mtype = MsgType(mtype)
        except ValueError:
            raise WireError(f"unknown message type {mtype}") from None
        return cls(mtype, tid.rstrip(b"\0").decode(errors="replace"), layer, off, n, body, version)


def ids_bytes(num_blocks: int) -> int:
    """Bytes of the block-id prefix of a LAYER body (padded so the payload stays aligned)."""
    raw = 4 * num_blocks
    return (raw + IDS_ALIGN - 1) // IDS_ALIGN * IDS_ALIGN


def block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of one layer, K and V together."""
    _, _, _, bs, heads, dim = kv_cache.shape
    return 2 * bs * heads * dim * kv_cache.element_size()


def layer_body_bytes(kv_cache: torch.Tensor, num_blocks: int) -> int:
    return ids_bytes(num_blocks) + num_blocks * block_bytes(kv_cache)
