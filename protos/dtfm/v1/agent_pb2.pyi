from protos.dtfm.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
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
    __slots__ = ("info", "coordinator", "connected", "worker_state", "job_id", "step", "loss")
    INFO_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AgentInfo
    coordinator: str
    connected: bool
    worker_state: str
    job_id: str
    step: int
    loss: float
    def __init__(self, info: _Optional[_Union[_common_pb2.AgentInfo, _Mapping]] = ..., coordinator: _Optional[str] = ..., connected: _Optional[bool] = ..., worker_state: _Optional[str] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...
