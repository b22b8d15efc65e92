"""Peer fetch, the holding side (issue 31): `ExportPrefix` pushes this worker's cached KV
blocks of a prompt prefix into a reservation on the calling prefill worker's receiver
(peer_fetch.py draws the whole exchange).

    validate     token ids whole blocks, first_block inside them, one destination block per
                 block pushed (INVALID_ARGUMENT); the caller's KvCompat equals ours
                 (FAILED_PRECONDITION); with the internal credential, a transfer id not
                 signed with its expiry is PERMISSION_DENIED; an expired one DEADLINE_EXCEEDED;
                 a UCX endpoint on another host than the caller's is PERMISSION_DENIED (a
                 worker may only direct KV to itself)
    pin          (engine thread) the blocks of hashes [first_block, n) looked up in the
                 prefix cache, those past the device pool's hits revived from this worker's
                 host or disk tier (engine/kv_offload.py: loaded into free device blocks, as
                 a local prefix hit is), all touched (a reference each: not evicted while
                 they are read); any still missing: NOT_FOUND, nothing sent
    push         KVSender.open(transfer id, the caller's endpoint, our blocks, theirs), every
                 layer queued, finish() by the reservation's deadline (DEADLINE_EXCEEDED /
                 UNAVAILABLE on a timeout or transport error)
    unpin        (engine thread) on every path, once the sends completed or were cancelled

Nothing is computed here: a held block's KV is final (hashed blocks are never rewritten).
"""
from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import grpc

from engine.block_hash import prefix_block_hashes
from kvtransfer.sender import KVTransferTimeout
from kvtransfer.transport import TransportError
from kvtransfer.wire import IncompatibleKV
from protos.pdserve.v1 import prefill_pb2
from services import protoconv
from services.security import transfer_id_signed
from services.worker_server import RpcStatus

from .peer_fetch import call_undoable

BAD = grpc.StatusCode.INVALID_ARGUMENT


def _peer_host(peer: str) -> str:
    """The host of a grpc context.peer() string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return rest.rpartition(":")[0] if kind == "ipv4" else ""


class PeerExport:
    def __init__(self, ae, push, token: str):
        self.ae, self.push, self.token = ae, push, token     # push: this worker's KVPush
        self.block_size = ae.block_size
        self.exports = self.refused = 0

    def _validate(self, r: prefill_pb2.ExportPrefixRequest, caller: str) -> int:
        bs, n_tok = self.block_size, len(r.token_ids)
        n = n_tok // bs
        if n_tok == 0 or n_tok % bs or r.first_block >= n:
            raise RpcStatus(BAD, f"token_ids ({n_tok}) must be whole blocks of {bs} past "
                                 f"first_block={r.first_block}")
        if len(r.dst_block_ids) != n - r.first_block:
            raise RpcStatus(BAD, f"{len(r.dst_block_ids)} destination blocks for "
                                 f"{n - r.first_block} blocks to push")
        if not r.kv_endpoint or not r.transfer_id:
            raise RpcStatus(BAD, "kv_endpoint and transfer_id are required")
        try:
            self.push.compat.check(protoconv.compat_from_proto(r.compat), "exporter", "fetcher")
        except IncompatibleKV as e:
            raise RpcStatus(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        if self.token and not transfer_id_signed(self.token, r.transfer_id, r.expires_at_unix_ms):
            raise RpcStatus(grpc.StatusCode.PERMISSION_DENIED, "transfer_id is not signed by a "
                            "worker of this deployment")
        if r.expires_at_unix_ms and r.expires_at_unix_ms <= time.time() * 1000:
            raise RpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "the reservation has expired")
        url = urlsplit(r.kv_endpoint)
        host = _peer_host(caller)
        if url.scheme == "ucx" and host and url.hostname != host:
            raise RpcStatus(grpc.StatusCode.PERMISSION_DENIED,
                            f"kv_endpoint {r.kv_endpoint} is not on the caller's host {host}")
        return n

    async def export(self, r: prefill_pb2.ExportPrefixRequest, caller: str,
                     rpc_left: float | None) -> prefill_pb2.ExportPrefixResponse:
        n = self._validate(r, caller)
        hashes = prefix_block_hashes(list(r.token_ids), self.block_size, n)[r.first_block:]
        blocks = await call_undoable(self.ae, self._pin, lambda b: b and self._unpin(b), hashes)
        if blocks is None:
            self.refused += 1
            raise RpcStatus(grpc.StatusCode.NOT_FOUND, "the prefix's blocks are no longer cached here")
        left = [x for x in (rpc_left, r.expires_at_unix_ms / 1000 - time.time() if
                            r.expires_at_unix_ms else None) if x is not None]
        try:
            stats = await self._push(r, blocks, max(0.1, min(left)) if left else 30.0)
        finally:
            await asyncio.shield(self.ae.call(self._unpin, blocks))
        self.exports += 1
        return prefill_pb2.ExportPrefixResponse(blocks_sent=len(blocks), bytes_sent=stats.bytes_sent)

    async def _push(self, r, blocks: list[int], timeout: float):
        sender, handle = self.push.sender, None
        try:
            handle = await asyncio.wait_for(
                sender.open(r.transfer_id, r.kv_endpoint, blocks, list(r.dst_block_ids)), timeout)
            for layer in range(sender.compat.num_layers):
                sender.push_layer_threadsafe(handle, layer)
            stats = await sender.finish(handle, timeout=timeout)
            handle = None
            return stats
        except IncompatibleKV as e:
            raise RpcStatus(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except (KVTransferTimeout, asyncio.TimeoutError) as e:
            raise RpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED, f"pushing the prefix: {e}") from None
        except (TransportError, ValueError) as e:
            raise RpcStatus(grpc.StatusCode.UNAVAILABLE, f"pushing the prefix: {e}") from None
        finally:
            if handle is not None:
                sender.cancel(handle)
                stream = getattr(sender, "_stream", None)    # CUDA: queued gathers read the
                if stream is not None:                       # blocks; done before the unpin
                    await asyncio.to_thread(stream.synchronize)

    # ------------------------------------------------------------ engine thread
    def _pin(self, hashes: list[bytes]) -> list[int] | None:
        kv = self.ae.engine.kv
        found = kv.cached_prefix(hashes)
        if len(found) < len(hashes):
            return None
        kv.pool.touch(found)
        return [b.block_id for b in found]

    def _unpin(self, blocks: list[int]) -> None:
        pool = self.ae.engine.kv.pool
        pool.free([pool.blocks[b] for b in reversed(blocks)])
