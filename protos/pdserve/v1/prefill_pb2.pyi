from protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDestination(_message.Message):
    __slots__ = ("decode_worker_id", "kv_endpoint", "transfer_id", "dst_block_ids", "num_cached_tokens", "compat", "expires_at_unix_ms", "idle_timeout_ms", "max_expires_at_unix_ms")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    kv_endpoint: str
    transfer_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    compat: _common_pb2.KvCompat
    expires_at_unix_ms: int
    idle_timeout_ms: int
    max_expires_at_unix_ms: int
    def __init__(self, decode_worker_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., transfer_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., compat: _Optional[_Union[_common_pb2.KvCompat, _Mapping]] = ..., expires_at_unix_ms: _Optional[int] = ..., idle_timeout_ms: _Optional[int] = ..., max_expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "peer_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    PEER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    destination: KvDestination
    peer_prefix: PeerPrefix
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ..., peer_prefix: _Optional[_Union[PeerPrefix, _Mapping]] = ...) -> None: ...

class PeerPrefix(_message.Message):
    __slots__ = ("worker_address", "num_blocks")
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_address: str
    num_blocks: int
    def __init__(self, worker_address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ExportPrefixRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "first_block", "kv_endpoint", "transfer_id", "dst_block_ids", "compat", "expires_at_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    kv_endpoint: str
    transfer_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    compat: _common_pb2.KvCompat
    expires_at_unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., transfer_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., compat: _Optional[_Union[_common_pb2.KvCompat, _Mapping]] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class ExportPrefixResponse(_message.Message):
    __slots__ = ("blocks_sent", "bytes_sent")
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    blocks_sent: int
    bytes_sent: int
    def __init__(self, blocks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "finish_reason", "prompt_logprobs", "num_prompt_tokens", "num_cached_tokens", "blocks_transferred", "bytes_transferred", "compute_ms", "transfer_wait_ms", "energy_joules", "timings", "peer_fetched_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: _common_pb2.TokenLogprob
    finish_reason: _common_pb2.FinishReason
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_prompt_tokens: int
    num_cached_tokens: int
    blocks_transferred: int
    bytes_transferred: int
    compute_ms: float
    transfer_wait_ms: float
    energy_joules: float
    timings: _common_pb2.PhaseTimings
    peer_fetched_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., blocks_transferred: _Optional[int] = ..., bytes_transferred: _Optional[int] = ..., compute_ms: _Optional[float] = ..., transfer_wait_ms: _Optional[float] = ..., energy_joules: _Optional[float] = ..., timings: _Optional[_Union[_common_pb2.PhaseTimings, _Mapping]] = ..., peer_fetched_tokens: _Optional[int] = ...) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("worker_id", "num_waiting", "num_running", "queued_prefill_tokens", "free_kv_blocks", "total_kv_blocks", "transfers", "compat", "max_model_len", "prefill_cost")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_waiting: int
    num_running: int
    queued_prefill_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    transfers: _common_pb2.TransferCounters
    compat: _common_pb2.KvCompat
    max_model_len: int
    prefill_cost: _common_pb2.PrefillCost
    def __init__(self, worker_id: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., transfers: _Optional[_Union[_common_pb2.TransferCounters, _Mapping]] = ..., compat: _Optional[_Union[_common_pb2.KvCompat, _Mapping]] = ..., max_model_len: _Optional[int] = ..., prefill_cost: _Optional[_Union[_common_pb2.PrefillCost, _Mapping]] = ...) -> None: ...
