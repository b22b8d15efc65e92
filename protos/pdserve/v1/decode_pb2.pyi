from protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvFailurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FAILURE_POLICY_UNSPECIFIED: _ClassVar[KvFailurePolicy]
    KV_FAILURE_POLICY_FAIL: _ClassVar[KvFailurePolicy]
    KV_FAILURE_POLICY_RECOMPUTE: _ClassVar[KvFailurePolicy]
KV_FAILURE_POLICY_UNSPECIFIED: KvFailurePolicy
KV_FAILURE_POLICY_FAIL: KvFailurePolicy
KV_FAILURE_POLICY_RECOMPUTE: KvFailurePolicy

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_timeout_ms", "kv_failure_policy", "local_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    KV_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv_timeout_ms: int
    kv_failure_policy: KvFailurePolicy
    local_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_timeout_ms: _Optional[int] = ..., kv_failure_policy: _Optional[_Union[KvFailurePolicy, str]] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class KvReady(_message.Message):
    __slots__ = ("transfer_id", "kv_endpoint", "block_ids", "num_cached_tokens", "compat", "decode_worker_id", "expires_at_unix_ms", "idle_timeout_ms", "max_expires_at_unix_ms")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    kv_endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    compat: _common_pb2.KvCompat
    decode_worker_id: str
    expires_at_unix_ms: int
    idle_timeout_ms: int
    max_expires_at_unix_ms: int
    def __init__(self, transfer_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., compat: _Optional[_Union[_common_pb2.KvCompat, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., expires_at_unix_ms: _Optional[int] = ..., idle_timeout_ms: _Optional[int] = ..., max_expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("tokens", "finish_reason", "error", "usage")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    error: str
    usage: _common_pb2.Usage
    def __init__(self, tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "kv_ready", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_READY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_ready: KvReady
    tokens: TokenChunk
    def __init__(self, request_id: _Optional[str] = ..., kv_ready: _Optional[_Union[KvReady, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class SubmitFirstTokenRequest(_message.Message):
    __slots__ = ("request_id", "first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: _common_pb2.TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class SubmitFirstTokenResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("worker_id", "num_waiting", "num_waiting_for_kv", "num_running", "free_kv_blocks", "total_kv_blocks", "queued_prefill_tokens", "transfers", "compat", "kv_endpoint", "max_model_len", "prefill_cost")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_waiting: int
    num_waiting_for_kv: int
    num_running: int
    free_kv_blocks: int
    total_kv_blocks: int
    queued_prefill_tokens: int
    transfers: _common_pb2.TransferCounters
    compat: _common_pb2.KvCompat
    kv_endpoint: str
    max_model_len: int
    prefill_cost: _common_pb2.PrefillCost
    def __init__(self, worker_id: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., num_running: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., transfers: _Optional[_Union[_common_pb2.TransferCounters, _Mapping]] = ..., compat: _Optional[_Union[_common_pb2.KvCompat, _Mapping]] = ..., kv_endpoint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., prefill_cost: _Optional[_Union[_common_pb2.PrefillCost, _Mapping]] = ...) -> None: ...
