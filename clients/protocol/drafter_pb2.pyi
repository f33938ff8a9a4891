from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]

class SharedMemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARED_MEMORY_KIND_UNSPECIFIED: _ClassVar[SharedMemoryKind]
    SYSTEM: _ClassVar[SharedMemoryKind]
    CUDA_IPC: _ClassVar[SharedMemoryKind]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT32: DType
INT64: DType
SHARED_MEMORY_KIND_UNSPECIFIED: SharedMemoryKind
SYSTEM: SharedMemoryKind
CUDA_IPC: SharedMemoryKind

class SharedMemoryRef(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "raw", "shm")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    shm: SharedMemoryRef
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "seed", "return_logprobs", "top_k_probs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_PROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    seed: int
    return_logprobs: bool
    top_k_probs: int
    def __init__(self, temperature: _Optional[float] = ..., seed: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_k_probs: _Optional[int] = ...) -> None: ...

class SequenceStep(_message.Message):
    __slots__ = ("sequence_id", "start_position", "num_tokens", "next_token", "num_drafts", "sampling", "predraft_branches")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    start_position: int
    num_tokens: int
    next_token: int
    num_drafts: int
    sampling: SamplingParams
    predraft_branches: int
    def __init__(self, sequence_id: _Optional[str] = ..., start_position: _Optional[int] = ..., num_tokens: _Optional[int] = ..., next_token: _Optional[int] = ..., num_drafts: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., predraft_branches: _Optional[int] = ...) -> None: ...

class StepColumns(_message.Message):
    __slots__ = ("sequence_ids", "start_positions", "num_tokens", "next_tokens", "num_drafts", "temperatures", "seeds", "predraft_branches", "return_logprobs", "top_k_probs")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_PROBS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    start_positions: Tensor
    num_tokens: Tensor
    next_tokens: Tensor
    num_drafts: Tensor
    temperatures: Tensor
    seeds: Tensor
    predraft_branches: Tensor
    return_logprobs: bool
    top_k_probs: int
    def __init__(self, sequence_ids: _Optional[_Iterable[str]] = ..., start_positions: _Optional[_Union[Tensor, _Mapping]] = ..., num_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., next_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., num_drafts: _Optional[_Union[Tensor, _Mapping]] = ..., temperatures: _Optional[_Union[Tensor, _Mapping]] = ..., seeds: _Optional[_Union[Tensor, _Mapping]] = ..., predraft_branches: _Optional[_Union[Tensor, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., top_k_probs: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("namespace", "steps", "columns", "token_ids", "hidden_states", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    steps: _containers.RepeatedCompositeFieldContainer[SequenceStep]
    columns: StepColumns
    token_ids: Tensor
    hidden_states: Tensor
    request_id: int
    def __init__(self, namespace: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[SequenceStep, _Mapping]]] = ..., columns: _Optional[_Union[StepColumns, _Mapping]] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class ProposeChunk(_message.Message):
    __slots__ = ("request", "offset", "data", "part")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    request: ProposeRequest
    offset: int
    data: bytes
    part: UploadPart
    def __init__(self, request: _Optional[_Union[ProposeRequest, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., part: _Optional[_Union[UploadPart, _Mapping]] = ...) -> None: ...

class UploadPart(_message.Message):
    __slots__ = ("namespace", "upload_id", "index", "count")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    upload_id: str
    index: int
    count: int
    def __init__(self, namespace: _Optional[str] = ..., upload_id: _Optional[str] = ..., index: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SequenceResult(_message.Message):
    __slots__ = ("sequence_id", "status", "num_drafts", "accepted_drafts", "committed_length", "predrafted")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    status: Status
    num_drafts: int
    accepted_drafts: int
    committed_length: int
    predrafted: bool
    def __init__(self, sequence_id: _Optional[str] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., num_drafts: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., committed_length: _Optional[int] = ..., predrafted: _Optional[bool] = ...) -> None: ...

class ResultColumns(_message.Message):
    __slots__ = ("status_codes", "num_drafts", "accepted_drafts", "committed_lengths", "predrafted", "problems")
    STATUS_CODES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    status_codes: Tensor
    num_drafts: Tensor
    accepted_drafts: Tensor
    committed_lengths: Tensor
    predrafted: Tensor
    problems: _containers.RepeatedCompositeFieldContainer[IndexedStatus]
    def __init__(self, status_codes: _Optional[_Union[Tensor, _Mapping]] = ..., num_drafts: _Optional[_Union[Tensor, _Mapping]] = ..., accepted_drafts: _Optional[_Union[Tensor, _Mapping]] = ..., committed_lengths: _Optional[_Union[Tensor, _Mapping]] = ..., predrafted: _Optional[_Union[Tensor, _Mapping]] = ..., problems: _Optional[_Iterable[_Union[IndexedStatus, _Mapping]]] = ...) -> None: ...

class IndexedStatus(_message.Message):
    __slots__ = ("index", "status")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: Status
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results", "result_columns", "draft_token_ids", "draft_logprobs", "request_id", "error", "draft_top_k_ids", "draft_top_k_probs")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RESULT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_PROBS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    result_columns: ResultColumns
    draft_token_ids: Tensor
    draft_logprobs: Tensor
    request_id: int
    error: Status
    draft_top_k_ids: Tensor
    draft_top_k_probs: Tensor
    def __init__(self, results: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., result_columns: _Optional[_Union[ResultColumns, _Mapping]] = ..., draft_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., draft_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[int] = ..., error: _Optional[_Union[Status, _Mapping]] = ..., draft_top_k_ids: _Optional[_Union[Tensor, _Mapping]] = ..., draft_top_k_probs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("namespace", "sequence_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "not_found")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    released: int
    not_found: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, released: _Optional[int] = ..., not_found: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("live_sequences", "grace_seconds")
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    live_sequences: int
    grace_seconds: float
    def __init__(self, live_sequences: _Optional[int] = ..., grace_seconds: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("server_version", "model_name", "method", "hidden_size", "hidden_states_width", "hidden_states_source", "target_layer_ids", "vocab_size", "max_draft_tokens", "max_model_len", "accepted_hidden_dtypes", "accepted_token_dtypes", "model_dtype", "device", "kv_capacity_tokens", "kv_block_size", "kv_free_tokens", "max_message_bytes", "shared_memory_supported", "draft_vocab_size", "parallel_drafting", "max_top_k_probs", "shared_memory_kinds", "shared_memory_lease_seconds", "step_channel_socket", "predraft_supported", "max_predraft_branches", "step_columns_supported", "max_upload_parts", "engine_applies_fc")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_WIDTH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_HIDDEN_DTYPES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_DTYPES_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_DRAFTING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_PROBS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_KINDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_CHANNEL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    MAX_PREDRAFT_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    STEP_COLUMNS_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_PARTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_APPLIES_FC_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    model_name: str
    method: str
    hidden_size: int
    hidden_states_width: int
    hidden_states_source: str
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    max_draft_tokens: int
    max_model_len: int
    accepted_hidden_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    accepted_token_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    model_dtype: str
    device: str
    kv_capacity_tokens: int
    kv_block_size: int
    kv_free_tokens: int
    max_message_bytes: int
    shared_memory_supported: bool
    draft_vocab_size: int
    parallel_drafting: bool
    max_top_k_probs: int
    shared_memory_kinds: _containers.RepeatedScalarFieldContainer[SharedMemoryKind]
    shared_memory_lease_seconds: int
    step_channel_socket: str
    predraft_supported: bool
    max_predraft_branches: int
    step_columns_supported: bool
    max_upload_parts: int
    engine_applies_fc: bool
    def __init__(self, server_version: _Optional[str] = ..., model_name: _Optional[str] = ..., method: _Optional[str] = ..., hidden_size: _Optional[int] = ..., hidden_states_width: _Optional[int] = ..., hidden_states_source: _Optional[str] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., accepted_hidden_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., accepted_token_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., model_dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., shared_memory_supported: _Optional[bool] = ..., draft_vocab_size: _Optional[int] = ..., parallel_drafting: _Optional[bool] = ..., max_top_k_probs: _Optional[int] = ..., shared_memory_kinds: _Optional[_Iterable[_Union[SharedMemoryKind, str]]] = ..., shared_memory_lease_seconds: _Optional[int] = ..., step_channel_socket: _Optional[str] = ..., predraft_supported: _Optional[bool] = ..., max_predraft_branches: _Optional[int] = ..., step_columns_supported: _Optional[bool] = ..., max_upload_parts: _Optional[int] = ..., engine_applies_fc: _Optional[bool] = ...) -> None: ...

class SystemSharedMemory(_message.Message):
    __slots__ = ("key", "offset")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaSharedMemory(_message.Message):
    __slots__ = ("ipc_handle", "offset", "device_id")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    offset: int
    device_id: int
    def __init__(self, ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("namespace", "name", "byte_size", "system", "cuda", "lease_seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    byte_size: int
    system: SystemSharedMemory
    cuda: CudaSharedMemory
    lease_seconds: int
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., byte_size: _Optional[int] = ..., system: _Optional[_Union[SystemSharedMemory, _Mapping]] = ..., cuda: _Optional[_Union[CudaSharedMemory, _Mapping]] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class SharedMemoryRegion(_message.Message):
    __slots__ = ("name", "kind", "byte_size", "device", "pinned", "lease_seconds", "expires_in_seconds", "references_read", "bytes_read")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: SharedMemoryKind
    byte_size: int
    device: str
    pinned: bool
    lease_seconds: int
    expires_in_seconds: float
    references_read: int
    bytes_read: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[SharedMemoryKind, str]] = ..., byte_size: _Optional[int] = ..., device: _Optional[str] = ..., pinned: _Optional[bool] = ..., lease_seconds: _Optional[int] = ..., expires_in_seconds: _Optional[float] = ..., references_read: _Optional[int] = ..., bytes_read: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: SharedMemoryRegion
    def __init__(self, region: _Optional[_Union[SharedMemoryRegion, _Mapping]] = ...) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("namespace", "names")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ("unregistered", "not_found")
    UNREGISTERED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    unregistered: _containers.RepeatedScalarFieldContainer[str]
    not_found: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unregistered: _Optional[_Iterable[str]] = ..., not_found: _Optional[_Iterable[str]] = ...) -> None: ...

class SharedMemoryStatusRequest(_message.Message):
    __slots__ = ("namespace", "names")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class SharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[SharedMemoryRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[SharedMemoryRegion, _Mapping]]] = ...) -> None: ...
