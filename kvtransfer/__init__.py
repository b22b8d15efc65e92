"""Moving KV cache blocks between processes (prefill -> decode). See kvtransfer/README.md.

`UcxTransport` lives in kvtransfer.ucx (the only module importing ucxx); import it from there.
"""
from .receiver import KVReceiver, TransferResult, TransferState
from .sender import KVSender, KVTransferTimeout, SendState, TransferHandle, TransferStats
from .transport import ConnectionClosed, Connection, LoopbackTransport, Transport, TransportError
from .wire import PROTOCOL_VERSION, CompatKey, IncompatibleKV, WireError

__all__ = ["KVReceiver", "TransferResult", "TransferState", "KVSender", "KVTransferTimeout",
           "SendState", "TransferHandle", "TransferStats", "ConnectionClosed", "Connection", "LoopbackTransport",
           "Transport", "TransportError", "PROTOCOL_VERSION", "CompatKey", "IncompatibleKV", "WireError"]
