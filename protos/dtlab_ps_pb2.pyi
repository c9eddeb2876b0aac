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
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Consistency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSISTENCY_UNSPECIFIED: _ClassVar[Consistency]
    ASP: _ClassVar[Consistency]
    SSP: _ClassVar[Consistency]
    BSP: _ClassVar[Consistency]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
CONSISTENCY_UNSPECIFIED: Consistency
ASP: Consistency
SSP: Consistency
BSP: Consistency

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "offset", "version")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    version: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("start", "data", "pad")
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    start: int
    data: bytes
    pad: bytes
    def __init__(self, start: _Optional[int] = ..., data: _Optional[bytes] = ..., pad: _Optional[bytes] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("chunks", "adler32")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ADLER32_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    adler32: int
    def __init__(self, chunks: _Optional[int] = ..., adler32: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "model", "model_size", "layout_crc32", "registration", "run_config", "partition", "previous_registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_CRC32_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    model: str
    model_size: int
    layout_crc32: int
    registration: int
    run_config: str
    partition: PartitionLayout
    previous_registration: int
    def __init__(self, worker_id: _Optional[int] = ..., model: _Optional[str] = ..., model_size: _Optional[int] = ..., layout_crc32: _Optional[int] = ..., registration: _Optional[int] = ..., run_config: _Optional[str] = ..., partition: _Optional[_Union[PartitionLayout, _Mapping]] = ..., previous_registration: _Optional[int] = ...) -> None: ...

class PartitionLayout(_message.Message):
    __slots__ = ("id", "count", "specs")
    ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    id: int
    count: int
    specs: str
    def __init__(self, id: _Optional[int] = ..., count: _Optional[int] = ..., specs: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("shard", "num_shards", "model_size", "meta", "consistency", "staleness_bound", "next_step", "max_message_bytes", "worker_id", "num_workers", "optim_config", "schedule_steps", "staleness_lr", "then_pull", "term", "outer_config", "clock")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    STALENESS_BOUND_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    OPTIM_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_LR_FIELD_NUMBER: _ClassVar[int]
    THEN_PULL_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    OUTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    model_size: int
    meta: TensorMeta
    consistency: Consistency
    staleness_bound: int
    next_step: int
    max_message_bytes: int
    worker_id: int
    num_workers: int
    optim_config: str
    schedule_steps: int
    staleness_lr: str
    then_pull: bool
    term: int
    outer_config: str
    clock: int
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., model_size: _Optional[int] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., consistency: _Optional[_Union[Consistency, str]] = ..., staleness_bound: _Optional[int] = ..., next_step: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., worker_id: _Optional[int] = ..., num_workers: _Optional[int] = ..., optim_config: _Optional[str] = ..., schedule_steps: _Optional[int] = ..., staleness_lr: _Optional[str] = ..., then_pull: _Optional[bool] = ..., term: _Optional[int] = ..., outer_config: _Optional[str] = ..., clock: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorLayout(_message.Message):
    __slots__ = ("name", "shape", "offset", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    size: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("model", "model_size", "layout_crc32", "layout_crc32_input", "layout_crc32_rule", "layout", "dtype", "consistency", "staleness_bound", "optimizer", "optim_config", "shard", "num_shards", "meta", "num_workers", "max_message_bytes", "run_config", "register_required", "registration_checked", "arithmetic", "takeover_allowed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_CRC32_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_CRC32_INPUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_CRC32_RULE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    STALENESS_BOUND_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIM_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    REGISTER_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_CHECKED_FIELD_NUMBER: _ClassVar[int]
    ARITHMETIC_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_size: int
    layout_crc32: int
    layout_crc32_input: str
    layout_crc32_rule: str
    layout: _containers.RepeatedCompositeFieldContainer[TensorLayout]
    dtype: DType
    consistency: Consistency
    staleness_bound: int
    optimizer: str
    optim_config: str
    shard: int
    num_shards: int
    meta: TensorMeta
    num_workers: int
    max_message_bytes: int
    run_config: str
    register_required: _containers.RepeatedScalarFieldContainer[str]
    registration_checked: bool
    arithmetic: str
    takeover_allowed: bool
    def __init__(self, model: _Optional[str] = ..., model_size: _Optional[int] = ..., layout_crc32: _Optional[int] = ..., layout_crc32_input: _Optional[str] = ..., layout_crc32_rule: _Optional[str] = ..., layout: _Optional[_Iterable[_Union[TensorLayout, _Mapping]]] = ..., dtype: _Optional[_Union[DType, str]] = ..., consistency: _Optional[_Union[Consistency, str]] = ..., staleness_bound: _Optional[int] = ..., optimizer: _Optional[str] = ..., optim_config: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., num_workers: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., run_config: _Optional[str] = ..., register_required: _Optional[_Iterable[str]] = ..., registration_checked: _Optional[bool] = ..., arithmetic: _Optional[str] = ..., takeover_allowed: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "registration", "partition")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    registration: int
    partition: int
    def __init__(self, worker_id: _Optional[int] = ..., registration: _Optional[int] = ..., partition: _Optional[int] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "shard", "known_version", "wait_timeout_s", "registration", "whole_bytes", "partition", "dtype")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    WHOLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    shard: int
    known_version: int
    wait_timeout_s: float
    registration: int
    whole_bytes: int
    partition: int
    dtype: DType
    def __init__(self, worker_id: _Optional[int] = ..., shard: _Optional[int] = ..., known_version: _Optional[int] = ..., wait_timeout_s: _Optional[float] = ..., registration: _Optional[int] = ..., whole_bytes: _Optional[int] = ..., partition: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("meta", "not_modified", "term")
    META_FIELD_NUMBER: _ClassVar[int]
    NOT_MODIFIED_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    not_modified: bool
    term: int
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., not_modified: _Optional[bool] = ..., term: _Optional[int] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "step", "shard", "meta", "registration", "partition", "ranges", "compressed", "step_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    shard: int
    meta: TensorMeta
    registration: int
    partition: int
    ranges: PushRanges
    compressed: PushCompressed
    step_s: float
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., shard: _Optional[int] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., registration: _Optional[int] = ..., partition: _Optional[int] = ..., ranges: _Optional[_Union[PushRanges, _Mapping]] = ..., compressed: _Optional[_Union[PushCompressed, _Mapping]] = ..., step_s: _Optional[float] = ...) -> None: ...

class PushCompressed(_message.Message):
    __slots__ = ("kind", "count")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PushCompressed.Kind]
        INDEXED: _ClassVar[PushCompressed.Kind]
        SIGN: _ClassVar[PushCompressed.Kind]
    KIND_UNSPECIFIED: PushCompressed.Kind
    INDEXED: PushCompressed.Kind
    SIGN: PushCompressed.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: PushCompressed.Kind
    count: int
    def __init__(self, kind: _Optional[_Union[PushCompressed.Kind, str]] = ..., count: _Optional[int] = ...) -> None: ...

class PushRanges(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("duplicate", "staleness", "version", "pending", "lr", "term", "fastest_step_s")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    FASTEST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    staleness: int
    version: int
    pending: bool
    lr: float
    term: int
    fastest_step_s: float
    def __init__(self, duplicate: _Optional[bool] = ..., staleness: _Optional[int] = ..., version: _Optional[int] = ..., pending: _Optional[bool] = ..., lr: _Optional[float] = ..., term: _Optional[int] = ..., fastest_step_s: _Optional[float] = ...) -> None: ...

class WholePush(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "then_pull")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    THEN_PULL_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    trailer: Trailer
    then_pull: PullRequest
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., then_pull: _Optional[_Union[PullRequest, _Mapping]] = ...) -> None: ...

class WholePull(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class PushPulled(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "pushed")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    trailer: Trailer
    pushed: PushReply
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., pushed: _Optional[_Union[PushReply, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "pull", "shm_request", "shm_attach", "shm_push", "shm_pull", "push_whole")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    SHM_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SHM_ATTACH_FIELD_NUMBER: _ClassVar[int]
    SHM_PUSH_FIELD_NUMBER: _ClassVar[int]
    SHM_PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_WHOLE_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    trailer: Trailer
    pull: PullRequest
    shm_request: ShmRequest
    shm_attach: ShmAttach
    shm_push: ShmPush
    shm_pull: PullRequest
    push_whole: WholePush
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., shm_request: _Optional[_Union[ShmRequest, _Mapping]] = ..., shm_attach: _Optional[_Union[ShmAttach, _Mapping]] = ..., shm_push: _Optional[_Union[ShmPush, _Mapping]] = ..., shm_pull: _Optional[_Union[PullRequest, _Mapping]] = ..., push_whole: _Optional[_Union[WholePush, _Mapping]] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "pushed", "shm_offer", "shm_ready", "shm_pulled", "pulled_whole", "push_pulled")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFER_FIELD_NUMBER: _ClassVar[int]
    SHM_READY_FIELD_NUMBER: _ClassVar[int]
    SHM_PULLED_FIELD_NUMBER: _ClassVar[int]
    PULLED_WHOLE_FIELD_NUMBER: _ClassVar[int]
    PUSH_PULLED_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    trailer: Trailer
    pushed: PushReply
    shm_offer: ShmOffer
    shm_ready: ShmReady
    shm_pulled: ShmPulled
    pulled_whole: WholePull
    push_pulled: PushPulled
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., pushed: _Optional[_Union[PushReply, _Mapping]] = ..., shm_offer: _Optional[_Union[ShmOffer, _Mapping]] = ..., shm_ready: _Optional[_Union[ShmReady, _Mapping]] = ..., shm_pulled: _Optional[_Union[ShmPulled, _Mapping]] = ..., pulled_whole: _Optional[_Union[WholePull, _Mapping]] = ..., push_pulled: _Optional[_Union[PushPulled, _Mapping]] = ...) -> None: ...

class ShmRequest(_message.Message):
    __slots__ = ("boot_id", "partition")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    partition: int
    def __init__(self, boot_id: _Optional[str] = ..., partition: _Optional[int] = ...) -> None: ...

class ShmOffer(_message.Message):
    __slots__ = ("path", "size", "data_offset", "refused")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    data_offset: int
    refused: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., data_offset: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class ShmAttach(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    def __init__(self, token: _Optional[bytes] = ...) -> None: ...

class ShmReady(_message.Message):
    __slots__ = ("refused",)
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    refused: str
    def __init__(self, refused: _Optional[str] = ...) -> None: ...

class ShmPush(_message.Message):
    __slots__ = ("header", "adler32", "then_pull")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADLER32_FIELD_NUMBER: _ClassVar[int]
    THEN_PULL_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    adler32: int
    then_pull: PullRequest
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., adler32: _Optional[int] = ..., then_pull: _Optional[_Union[PullRequest, _Mapping]] = ...) -> None: ...

class ShmPulled(_message.Message):
    __slots__ = ("header", "adler32", "pushed")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADLER32_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    adler32: int
    pushed: PushReply
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., adler32: _Optional[int] = ..., pushed: _Optional[_Union[PushReply, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("partition",)
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    partition: int
    def __init__(self, partition: _Optional[int] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("counts", "total", "sum", "max")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.ScalarMap[int, int]
    total: int
    sum: int
    max: int
    def __init__(self, counts: _Optional[_Mapping[int, int]] = ..., total: _Optional[int] = ..., sum: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("clock", "next_step", "active", "staleness", "expired", "late")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    clock: int
    next_step: int
    active: bool
    staleness: Histogram
    expired: bool
    late: int
    def __init__(self, clock: _Optional[int] = ..., next_step: _Optional[int] = ..., active: _Optional[bool] = ..., staleness: _Optional[_Union[Histogram, _Mapping]] = ..., expired: _Optional[bool] = ..., late: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("shard", "num_shards", "consistency", "version", "updates", "pushes", "duplicates", "rejected", "pulls", "pulls_not_modified", "bytes_received", "bytes_sent", "staleness", "workers", "max_clock_lead", "lr", "apply_seconds", "pushes_in_flight", "receive_seconds", "check_seconds", "workers_dropped", "expert_staleness", "late")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WorkersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: WorkerStats
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...
    class ExpertStalenessEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Histogram
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Histogram, _Mapping]] = ...) -> None: ...
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PULLS_NOT_MODIFIED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_LEAD_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    consistency: Consistency
    version: int
    updates: int
    pushes: int
    duplicates: int
    rejected: _containers.ScalarMap[str, int]
    pulls: int
    pulls_not_modified: int
    bytes_received: int
    bytes_sent: int
    staleness: Histogram
    workers: _containers.MessageMap[int, WorkerStats]
    max_clock_lead: int
    lr: float
    apply_seconds: float
    pushes_in_flight: int
    receive_seconds: float
    check_seconds: float
    workers_dropped: int
    expert_staleness: _containers.MessageMap[str, Histogram]
    late: int
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., consistency: _Optional[_Union[Consistency, str]] = ..., version: _Optional[int] = ..., updates: _Optional[int] = ..., pushes: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., pulls: _Optional[int] = ..., pulls_not_modified: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., staleness: _Optional[_Union[Histogram, _Mapping]] = ..., workers: _Optional[_Mapping[int, WorkerStats]] = ..., max_clock_lead: _Optional[int] = ..., lr: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., pushes_in_flight: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., check_seconds: _Optional[float] = ..., workers_dropped: _Optional[int] = ..., expert_staleness: _Optional[_Mapping[str, Histogram]] = ..., late: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ReplicaJoin(_message.Message):
    __slots__ = ("shard", "num_shards", "model", "model_size", "layout_crc32", "address", "config")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_CRC32_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    model: str
    model_size: int
    layout_crc32: int
    address: str
    config: str
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., model: _Optional[str] = ..., model_size: _Optional[int] = ..., layout_crc32: _Optional[int] = ..., address: _Optional[str] = ..., config: _Optional[str] = ...) -> None: ...

class ReplicaApplied(_message.Message):
    __slots__ = ("seq", "term", "beat")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    BEAT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    term: int
    beat: int
    def __init__(self, seq: _Optional[int] = ..., term: _Optional[int] = ..., beat: _Optional[int] = ...) -> None: ...

class ReplicaUp(_message.Message):
    __slots__ = ("join", "applied")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    join: ReplicaJoin
    applied: ReplicaApplied
    def __init__(self, join: _Optional[_Union[ReplicaJoin, _Mapping]] = ..., applied: _Optional[_Union[ReplicaApplied, _Mapping]] = ...) -> None: ...

class ReplicaState(_message.Message):
    __slots__ = ("seq", "nbytes", "adler32", "term")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ADLER32_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    seq: int
    nbytes: int
    adler32: int
    term: int
    def __init__(self, seq: _Optional[int] = ..., nbytes: _Optional[int] = ..., adler32: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...

class ReplicaEntry(_message.Message):
    __slots__ = ("seq", "kind", "worker_id", "registration")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ReplicaEntry.Kind]
        REGISTER: _ClassVar[ReplicaEntry.Kind]
        DEREGISTER: _ClassVar[ReplicaEntry.Kind]
        PUSH: _ClassVar[ReplicaEntry.Kind]
    KIND_UNSPECIFIED: ReplicaEntry.Kind
    REGISTER: ReplicaEntry.Kind
    DEREGISTER: ReplicaEntry.Kind
    PUSH: ReplicaEntry.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: ReplicaEntry.Kind
    worker_id: int
    registration: int
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[ReplicaEntry.Kind, str]] = ..., worker_id: _Optional[int] = ..., registration: _Optional[int] = ...) -> None: ...

class ReplicaHeartbeat(_message.Message):
    __slots__ = ("seq", "term", "beat")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    BEAT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    term: int
    beat: int
    def __init__(self, seq: _Optional[int] = ..., term: _Optional[int] = ..., beat: _Optional[int] = ...) -> None: ...

class ReplicaDown(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "entry", "state", "state_part", "heartbeat")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_PART_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    trailer: Trailer
    entry: ReplicaEntry
    state: ReplicaState
    state_part: Chunk
    heartbeat: ReplicaHeartbeat
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., entry: _Optional[_Union[ReplicaEntry, _Mapping]] = ..., state: _Optional[_Union[ReplicaState, _Mapping]] = ..., state_part: _Optional[_Union[Chunk, _Mapping]] = ..., heartbeat: _Optional[_Union[ReplicaHeartbeat, _Mapping]] = ...) -> None: ...

class ReplicaStatusRequest(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class ReplicaStatusReply(_message.Message):
    __slots__ = ("role", "primary", "backup", "seq", "acked", "version", "shard", "failovers", "term")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    role: str
    primary: str
    backup: str
    seq: int
    acked: int
    version: int
    shard: int
    failovers: int
    term: int
    def __init__(self, role: _Optional[str] = ..., primary: _Optional[str] = ..., backup: _Optional[str] = ..., seq: _Optional[int] = ..., acked: _Optional[int] = ..., version: _Optional[int] = ..., shard: _Optional[int] = ..., failovers: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...
