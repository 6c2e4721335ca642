from protos.dtfm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PingRequest(_message.Message):
    __slots__ = ("nonce", "from_agent_id")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    FROM_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    from_agent_id: str
    def __init__(self, nonce: _Optional[int] = ..., from_agent_id: _Optional[str] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("nonce", "agent_id")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    agent_id: str
    def __init__(self, nonce: _Optional[int] = ..., agent_id: _Optional[str] = ...) -> None: ...

class ProbeChunk(_message.Message):
    __slots__ = ("payload", "window_s")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    window_s: float
    def __init__(self, payload: _Optional[bytes] = ..., window_s: _Optional[float] = ...) -> None: ...

class ProbeWindow(_message.Message):
    __slots__ = ("bytes", "seconds", "total_bytes")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    total_bytes: int
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class AgentStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentStatusReply(_message.Message):
    __slots__ = ("info", "coordinator", "connected", "job_id", "step", "loss", "worker_state", "reach")
    INFO_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    REACH_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AgentInfo
    coordinator: str
    connected: bool
    job_id: str
    step: int
    loss: float
    worker_state: _common_pb2.WorkerState
    reach: _common_pb2.ReachStatus
    def __init__(self, info: _Optional[_Union[_common_pb2.AgentInfo, _Mapping]] = ..., coordinator: _Optional[str] = ..., connected: _Optional[bool] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., worker_state: _Optional[_Union[_common_pb2.WorkerState, str]] = ..., reach: _Optional[_Union[_common_pb2.ReachStatus, _Mapping]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job_id", "stage")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage: int
    def __init__(self, job_id: _Optional[str] = ..., stage: _Optional[int] = ...) -> None: ...

class CheckpointFile(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class CheckpointEntry(_message.Message):
    __slots__ = ("stage", "step", "layers", "files")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    step: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    def __init__(self, stage: _Optional[int] = ..., step: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ...) -> None: ...

class CheckpointList(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[CheckpointEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[CheckpointEntry, _Mapping]]] = ...) -> None: ...

class FetchCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "stage", "step", "name", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage: int
    step: int
    name: str
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class CheckpointPush(_message.Message):
    __slots__ = ("job_id", "entry", "data", "newest")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    entry: CheckpointEntry
    data: bytes
    newest: int
    def __init__(self, job_id: _Optional[str] = ..., entry: _Optional[_Union[CheckpointEntry, _Mapping]] = ..., data: _Optional[bytes] = ..., newest: _Optional[int] = ...) -> None: ...

class CheckpointPushReply(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...
