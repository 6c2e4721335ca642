from protos.dtfm.v1 import agent_pb2 as _agent_pb2
from protos.dtfm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MeasureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEASURE_KIND_BOTH: _ClassVar[MeasureKind]
    MEASURE_KIND_LATENCY: _ClassVar[MeasureKind]
    MEASURE_KIND_BANDWIDTH: _ClassVar[MeasureKind]
    MEASURE_KIND_PUNCH: _ClassVar[MeasureKind]

class AgentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_STATE_UNSPECIFIED: _ClassVar[AgentState]
    AGENT_STATE_ALIVE: _ClassVar[AgentState]
    AGENT_STATE_LOST: _ClassVar[AgentState]
    AGENT_STATE_LEFT: _ClassVar[AgentState]
    AGENT_STATE_EXCLUDED: _ClassVar[AgentState]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_IDLE: _ClassVar[JobState]
    JOB_STATE_WAITING: _ClassVar[JobState]
    JOB_STATE_MEASURING: _ClassVar[JobState]
    JOB_STATE_SCHEDULING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RECOVERING: _ClassVar[JobState]
    JOB_STATE_DONE: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
MEASURE_KIND_BOTH: MeasureKind
MEASURE_KIND_LATENCY: MeasureKind
MEASURE_KIND_BANDWIDTH: MeasureKind
MEASURE_KIND_PUNCH: MeasureKind
AGENT_STATE_UNSPECIFIED: AgentState
AGENT_STATE_ALIVE: AgentState
AGENT_STATE_LOST: AgentState
AGENT_STATE_LEFT: AgentState
AGENT_STATE_EXCLUDED: AgentState
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_IDLE: JobState
JOB_STATE_WAITING: JobState
JOB_STATE_MEASURING: JobState
JOB_STATE_SCHEDULING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RECOVERING: JobState
JOB_STATE_DONE: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_CANCELLED: JobState

class SubmitJobRequest(_message.Message):
    __slots__ = ("args",)
    ARGS_FIELD_NUMBER: _ClassVar[int]
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, args: _Optional[_Iterable[str]] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job_id", "position", "message")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    position: int
    message: str
    def __init__(self, job_id: _Optional[str] = ..., position: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobEntry(_message.Message):
    __slots__ = ("job_id", "state", "model", "agents", "step", "total_steps", "loss", "message", "submitted_unix_s", "args")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    model: str
    agents: int
    step: int
    total_steps: int
    loss: float
    message: str
    submitted_unix_s: float
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., model: _Optional[str] = ..., agents: _Optional[int] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., message: _Optional[str] = ..., submitted_unix_s: _Optional[float] = ..., args: _Optional[_Iterable[str]] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobEntry]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobEntry, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobReply(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("agent_id",)
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    def __init__(self, agent_id: _Optional[str] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Evidence(_message.Message):
    __slots__ = ("kind", "step", "detail", "reporter", "at_unix_s", "confirmed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    step: int
    detail: str
    reporter: str
    at_unix_s: float
    confirmed: bool
    def __init__(self, kind: _Optional[str] = ..., step: _Optional[int] = ..., detail: _Optional[str] = ..., reporter: _Optional[str] = ..., at_unix_s: _Optional[float] = ..., confirmed: _Optional[bool] = ...) -> None: ...

class Exclusion(_message.Message):
    __slots__ = ("reason", "step", "at_unix_s", "evidence")
    REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    step: int
    at_unix_s: float
    evidence: _containers.RepeatedCompositeFieldContainer[Evidence]
    def __init__(self, reason: _Optional[str] = ..., step: _Optional[int] = ..., at_unix_s: _Optional[float] = ..., evidence: _Optional[_Iterable[_Union[Evidence, _Mapping]]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("agent", "agent_secret")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    AGENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    agent: _common_pb2.AgentInfo
    agent_secret: str
    def __init__(self, agent: _Optional[_Union[_common_pb2.AgentInfo, _Mapping]] = ..., agent_secret: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("agent_id", "heartbeat_interval_s", "liveness_timeout_s", "agent_secret")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    heartbeat_interval_s: float
    liveness_timeout_s: float
    agent_secret: str
    def __init__(self, agent_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., liveness_timeout_s: _Optional[float] = ..., agent_secret: _Optional[str] = ...) -> None: ...

class PeerTarget(_message.Message):
    __slots__ = ("agent_id", "address")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    address: str
    def __init__(self, agent_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class MeasureLinksCommand(_message.Message):
    __slots__ = ("round_id", "peers", "ping_count", "probe_seconds", "probe_max_bytes", "kind", "ping_spread_s", "punch")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PING_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROBE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROBE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PING_SPREAD_S_FIELD_NUMBER: _ClassVar[int]
    PUNCH_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerTarget]
    ping_count: int
    probe_seconds: float
    probe_max_bytes: int
    kind: MeasureKind
    ping_spread_s: float
    punch: PunchProbe
    def __init__(self, round_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerTarget, _Mapping]]] = ..., ping_count: _Optional[int] = ..., probe_seconds: _Optional[float] = ..., probe_max_bytes: _Optional[int] = ..., kind: _Optional[_Union[MeasureKind, str]] = ..., ping_spread_s: _Optional[float] = ..., punch: _Optional[_Union[PunchProbe, _Mapping]] = ...) -> None: ...

class PunchProbe(_message.Message):
    __slots__ = ("relay", "job", "secret", "rank", "peer_rank")
    RELAY_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_RANK_FIELD_NUMBER: _ClassVar[int]
    relay: str
    job: str
    secret: bytes
    rank: int
    peer_rank: int
    def __init__(self, relay: _Optional[str] = ..., job: _Optional[str] = ..., secret: _Optional[bytes] = ..., rank: _Optional[int] = ..., peer_rank: _Optional[int] = ...) -> None: ...

class StopCommand(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckpointCommand(_message.Message):
    __slots__ = ("job_id", "epoch", "step", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    step: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("seq", "welcome", "measure", "assign", "stop", "checkpoint", "reach", "dial")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    REACH_FIELD_NUMBER: _ClassVar[int]
    DIAL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    welcome: Welcome
    measure: MeasureLinksCommand
    assign: _common_pb2.Assignment
    stop: StopCommand
    checkpoint: CheckpointCommand
    reach: _common_pb2.ReachStatus
    dial: DialCommand
    def __init__(self, seq: _Optional[int] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., measure: _Optional[_Union[MeasureLinksCommand, _Mapping]] = ..., assign: _Optional[_Union[_common_pb2.Assignment, _Mapping]] = ..., stop: _Optional[_Union[StopCommand, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointCommand, _Mapping]] = ..., reach: _Optional[_Union[_common_pb2.ReachStatus, _Mapping]] = ..., dial: _Optional[_Union[DialCommand, _Mapping]] = ...) -> None: ...

class DialCommand(_message.Message):
    __slots__ = ("round_id", "peer", "timeout_s")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    peer: PeerTarget
    timeout_s: float
    def __init__(self, round_id: _Optional[str] = ..., peer: _Optional[_Union[PeerTarget, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DialReport(_message.Message):
    __slots__ = ("agent_id", "agent_secret", "round_id", "peer_id", "ok", "error")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    agent_secret: str
    round_id: str
    peer_id: str
    ok: bool
    error: str
    def __init__(self, agent_id: _Optional[str] = ..., agent_secret: _Optional[str] = ..., round_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class LinkReport(_message.Message):
    __slots__ = ("agent_id", "round_id", "samples", "agent_secret")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AGENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    round_id: str
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.LinkSample]
    agent_secret: str
    def __init__(self, agent_id: _Optional[str] = ..., round_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.LinkSample, _Mapping]]] = ..., agent_secret: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "message", "keep_checkpoints_from", "heartbeat_interval_s")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHECKPOINTS_FROM_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    keep_checkpoints_from: int
    heartbeat_interval_s: float
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., keep_checkpoints_from: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("agent_id", "job_id", "epoch", "step", "loss", "tokens_per_s", "error", "total_steps", "step_s", "compute_s", "pp_wait_s", "dp_s", "error_kind", "agent_secret", "worker_state", "pp_bytes_sent", "dp_bytes_sent", "mirrored_steps", "resumed_step", "tuning", "checkpoint_step", "sync_every", "sync_round", "drift", "relay_forwarded_bytes", "relay_refused_bytes", "validations", "integrity", "integrity_through", "breakdown", "link_windows")
    class MirroredStepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PP_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    DP_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    AGENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    PP_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DP_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_STEP_FIELD_NUMBER: _ClassVar[int]
    TUNING_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    SYNC_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    RELAY_FORWARDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAY_REFUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VALIDATIONS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_THROUGH_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    LINK_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    job_id: str
    epoch: int
    step: int
    loss: float
    tokens_per_s: float
    error: str
    total_steps: int
    step_s: float
    compute_s: float
    pp_wait_s: float
    dp_s: float
    error_kind: str
    agent_secret: str
    worker_state: _common_pb2.WorkerState
    pp_bytes_sent: int
    dp_bytes_sent: int
    mirrored_steps: _containers.ScalarMap[int, int]
    resumed_step: int
    tuning: _containers.RepeatedCompositeFieldContainer[_common_pb2.TuningAdvice]
    checkpoint_step: int
    sync_every: int
    sync_round: int
    drift: float
    relay_forwarded_bytes: int
    relay_refused_bytes: int
    validations: _containers.RepeatedCompositeFieldContainer[Validation]
    integrity: _containers.RepeatedCompositeFieldContainer[IntegrityEvidence]
    integrity_through: int
    breakdown: _common_pb2.StepBreakdown
    link_windows: _containers.RepeatedCompositeFieldContainer[LinkWindow]
    def __init__(self, agent_id: _Optional[str] = ..., job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., error: _Optional[str] = ..., total_steps: _Optional[int] = ..., step_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., pp_wait_s: _Optional[float] = ..., dp_s: _Optional[float] = ..., error_kind: _Optional[str] = ..., agent_secret: _Optional[str] = ..., worker_state: _Optional[_Union[_common_pb2.WorkerState, str]] = ..., pp_bytes_sent: _Optional[int] = ..., dp_bytes_sent: _Optional[int] = ..., mirrored_steps: _Optional[_Mapping[int, int]] = ..., resumed_step: _Optional[int] = ..., tuning: _Optional[_Iterable[_Union[_common_pb2.TuningAdvice, _Mapping]]] = ..., checkpoint_step: _Optional[int] = ..., sync_every: _Optional[int] = ..., sync_round: _Optional[int] = ..., drift: _Optional[float] = ..., relay_forwarded_bytes: _Optional[int] = ..., relay_refused_bytes: _Optional[int] = ..., validations: _Optional[_Iterable[_Union[Validation, _Mapping]]] = ..., integrity: _Optional[_Iterable[_Union[IntegrityEvidence, _Mapping]]] = ..., integrity_through: _Optional[int] = ..., breakdown: _Optional[_Union[_common_pb2.StepBreakdown, _Mapping]] = ..., link_windows: _Optional[_Iterable[_Union[LinkWindow, _Mapping]]] = ...) -> None: ...

class LinkWindow(_message.Message):
    __slots__ = ("step", "act_out", "act_in", "grad_out", "grad_in")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ACT_OUT_FIELD_NUMBER: _ClassVar[int]
    ACT_IN_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_IN_FIELD_NUMBER: _ClassVar[int]
    step: int
    act_out: float
    act_in: float
    grad_out: float
    grad_in: float
    def __init__(self, step: _Optional[int] = ..., act_out: _Optional[float] = ..., act_in: _Optional[float] = ..., grad_out: _Optional[float] = ..., grad_in: _Optional[float] = ...) -> None: ...

class IntegrityEvidence(_message.Message):
    __slots__ = ("step", "kind", "suspect_rank", "score", "detail", "reporter_rank")
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_RANK_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REPORTER_RANK_FIELD_NUMBER: _ClassVar[int]
    step: int
    kind: str
    suspect_rank: int
    score: float
    detail: str
    reporter_rank: int
    def __init__(self, step: _Optional[int] = ..., kind: _Optional[str] = ..., suspect_rank: _Optional[int] = ..., score: _Optional[float] = ..., detail: _Optional[str] = ..., reporter_rank: _Optional[int] = ...) -> None: ...

class Validation(_message.Message):
    __slots__ = ("step", "loss")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("agent_id", "agent_secret", "reason")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    agent_secret: str
    reason: str
    def __init__(self, agent_id: _Optional[str] = ..., agent_secret: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("info", "state", "last_seen_unix_s", "joined_unix_s", "progress", "reach", "relay_distrusted", "exclusion", "evidence")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    JOINED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    REACH_FIELD_NUMBER: _ClassVar[int]
    RELAY_DISTRUSTED_FIELD_NUMBER: _ClassVar[int]
    EXCLUSION_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AgentInfo
    state: AgentState
    last_seen_unix_s: float
    joined_unix_s: float
    progress: ProgressReport
    reach: _common_pb2.ReachStatus
    relay_distrusted: str
    exclusion: Exclusion
    evidence: _containers.RepeatedCompositeFieldContainer[Evidence]
    def __init__(self, info: _Optional[_Union[_common_pb2.AgentInfo, _Mapping]] = ..., state: _Optional[_Union[AgentState, str]] = ..., last_seen_unix_s: _Optional[float] = ..., joined_unix_s: _Optional[float] = ..., progress: _Optional[_Union[ProgressReport, _Mapping]] = ..., reach: _Optional[_Union[_common_pb2.ReachStatus, _Mapping]] = ..., relay_distrusted: _Optional[str] = ..., exclusion: _Optional[_Union[Exclusion, _Mapping]] = ..., evidence: _Optional[_Iterable[_Union[Evidence, _Mapping]]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "model", "agents_wanted", "epoch", "step", "total_steps", "loss", "tokens_per_s", "message", "placement", "predicted_step_s", "measured_step_s", "agents_min", "stages", "replicas", "checkpoint_step", "restarts", "recoveries", "model_spec", "replans", "state_save_failures", "state_save_error", "state_saved_unix_s", "relayed_bytes", "relay_refused_bytes", "coordinator_checkpoints", "rollback_before", "exclusions", "export_source", "held_agents", "share")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AGENTS_WANTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    AGENTS_MIN_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLANS_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVE_ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAY_REFUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_BEFORE_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIONS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    HELD_AGENTS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    model: str
    agents_wanted: int
    epoch: int
    step: int
    total_steps: int
    loss: float
    tokens_per_s: float
    message: str
    placement: str
    predicted_step_s: float
    measured_step_s: float
    agents_min: int
    stages: int
    replicas: int
    checkpoint_step: int
    restarts: int
    recoveries: _containers.RepeatedCompositeFieldContainer[Recovery]
    model_spec: _common_pb2.ModelSpec
    replans: _containers.RepeatedCompositeFieldContainer[Replan]
    state_save_failures: int
    state_save_error: str
    state_saved_unix_s: float
    relayed_bytes: int
    relay_refused_bytes: int
    coordinator_checkpoints: _containers.RepeatedCompositeFieldContainer[HeldCheckpoint]
    rollback_before: int
    exclusions: int
    export_source: ExportSource
    held_agents: _containers.RepeatedScalarFieldContainer[str]
    share: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., model: _Optional[str] = ..., agents_wanted: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., message: _Optional[str] = ..., placement: _Optional[str] = ..., predicted_step_s: _Optional[float] = ..., measured_step_s: _Optional[float] = ..., agents_min: _Optional[int] = ..., stages: _Optional[int] = ..., replicas: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., restarts: _Optional[int] = ..., recoveries: _Optional[_Iterable[_Union[Recovery, _Mapping]]] = ..., model_spec: _Optional[_Union[_common_pb2.ModelSpec, _Mapping]] = ..., replans: _Optional[_Iterable[_Union[Replan, _Mapping]]] = ..., state_save_failures: _Optional[int] = ..., state_save_error: _Optional[str] = ..., state_saved_unix_s: _Optional[float] = ..., relayed_bytes: _Optional[int] = ..., relay_refused_bytes: _Optional[int] = ..., coordinator_checkpoints: _Optional[_Iterable[_Union[HeldCheckpoint, _Mapping]]] = ..., rollback_before: _Optional[int] = ..., exclusions: _Optional[int] = ..., export_source: _Optional[_Union[ExportSource, _Mapping]] = ..., held_agents: _Optional[_Iterable[str]] = ..., share: _Optional[str] = ...) -> None: ...

class ExportSource(_message.Message):
    __slots__ = ("config_json", "generation_json", "tokenizer", "lora")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    generation_json: str
    tokenizer: str
    lora: LoraSource
    def __init__(self, config_json: _Optional[str] = ..., generation_json: _Optional[str] = ..., tokenizer: _Optional[str] = ..., lora: _Optional[_Union[LoraSource, _Mapping]] = ...) -> None: ...

class LoraSource(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "targets", "base", "seed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    targets: str
    base: str
    seed: int
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., targets: _Optional[str] = ..., base: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class HeldCheckpoint(_message.Message):
    __slots__ = ("stage", "step", "bytes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    step: int
    bytes: int
    def __init__(self, stage: _Optional[int] = ..., step: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Replan(_message.Message):
    __slots__ = ("at_unix_s", "at_step", "trigger", "suspects", "links", "devices", "step_before_s", "step_drifted_s", "predicted_stay_s", "predicted_new_s", "gain_s", "cost_s", "decision", "why", "measure_s", "outcome", "stalled_s", "step_after_s", "grid_before", "grid_after")
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STEP_BEFORE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_DRIFTED_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STAY_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_NEW_S_FIELD_NUMBER: _ClassVar[int]
    GAIN_S_FIELD_NUMBER: _ClassVar[int]
    COST_S_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    MEASURE_S_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    STEP_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    GRID_BEFORE_FIELD_NUMBER: _ClassVar[int]
    GRID_AFTER_FIELD_NUMBER: _ClassVar[int]
    at_unix_s: float
    at_step: int
    trigger: str
    suspects: _containers.RepeatedScalarFieldContainer[str]
    links: _containers.RepeatedCompositeFieldContainer[LinkChange]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceChange]
    step_before_s: float
    step_drifted_s: float
    predicted_stay_s: float
    predicted_new_s: float
    gain_s: float
    cost_s: float
    decision: str
    why: str
    measure_s: float
    outcome: str
    stalled_s: float
    step_after_s: float
    grid_before: str
    grid_after: str
    def __init__(self, at_unix_s: _Optional[float] = ..., at_step: _Optional[int] = ..., trigger: _Optional[str] = ..., suspects: _Optional[_Iterable[str]] = ..., links: _Optional[_Iterable[_Union[LinkChange, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceChange, _Mapping]]] = ..., step_before_s: _Optional[float] = ..., step_drifted_s: _Optional[float] = ..., predicted_stay_s: _Optional[float] = ..., predicted_new_s: _Optional[float] = ..., gain_s: _Optional[float] = ..., cost_s: _Optional[float] = ..., decision: _Optional[str] = ..., why: _Optional[str] = ..., measure_s: _Optional[float] = ..., outcome: _Optional[str] = ..., stalled_s: _Optional[float] = ..., step_after_s: _Optional[float] = ..., grid_before: _Optional[str] = ..., grid_after: _Optional[str] = ...) -> None: ...

class LinkChange(_message.Message):
    __slots__ = ("src", "dst", "delay_ms_before", "delay_ms_after", "gbps_before", "gbps_after")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_AFTER_FIELD_NUMBER: _ClassVar[int]
    GBPS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    GBPS_AFTER_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    delay_ms_before: float
    delay_ms_after: float
    gbps_before: float
    gbps_after: float
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., delay_ms_before: _Optional[float] = ..., delay_ms_after: _Optional[float] = ..., gbps_before: _Optional[float] = ..., gbps_after: _Optional[float] = ...) -> None: ...

class DeviceChange(_message.Message):
    __slots__ = ("agent", "compute_s_before", "compute_s_after")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_BEFORE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_AFTER_FIELD_NUMBER: _ClassVar[int]
    agent: str
    compute_s_before: float
    compute_s_after: float
    def __init__(self, agent: _Optional[str] = ..., compute_s_before: _Optional[float] = ..., compute_s_after: _Optional[float] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("at_unix_s", "reason", "layout_before", "layout_after", "last_step", "resumed_step", "steps_lost", "stalled_s", "planned")
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_AFTER_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    at_unix_s: float
    reason: str
    layout_before: str
    layout_after: str
    last_step: int
    resumed_step: int
    steps_lost: int
    stalled_s: float
    planned: bool
    def __init__(self, at_unix_s: _Optional[float] = ..., reason: _Optional[str] = ..., layout_before: _Optional[str] = ..., layout_after: _Optional[str] = ..., last_step: _Optional[int] = ..., resumed_step: _Optional[int] = ..., steps_lost: _Optional[int] = ..., stalled_s: _Optional[float] = ..., planned: _Optional[bool] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("agents", "job", "plan", "links", "now_unix_s", "jobs", "jobs_omitted")
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    JOBS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    agents: _containers.RepeatedCompositeFieldContainer[AgentStatus]
    job: JobStatus
    plan: _common_pb2.Plan
    links: _common_pb2.LinkMatrix
    now_unix_s: float
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    jobs_omitted: int
    def __init__(self, agents: _Optional[_Iterable[_Union[AgentStatus, _Mapping]]] = ..., job: _Optional[_Union[JobStatus, _Mapping]] = ..., plan: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ..., links: _Optional[_Union[_common_pb2.LinkMatrix, _Mapping]] = ..., now_unix_s: _Optional[float] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., jobs_omitted: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MeasureRequest(_message.Message):
    __slots__ = ("timeout_s", "sampled", "ping_spread_s")
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    PING_SPREAD_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    sampled: bool
    ping_spread_s: float
    def __init__(self, timeout_s: _Optional[float] = ..., sampled: _Optional[bool] = ..., ping_spread_s: _Optional[float] = ...) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class HistoryPoint(_message.Message):
    __slots__ = ("epoch", "step", "loss", "step_s", "tokens_per_s", "unix_s", "val_loss")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    loss: float
    step_s: float
    tokens_per_s: float
    unix_s: float
    val_loss: float
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., step_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., unix_s: _Optional[float] = ..., val_loss: _Optional[float] = ...) -> None: ...

class JobHistory(_message.Message):
    __slots__ = ("job_id", "model", "state", "total_steps", "predicted_step_s", "restarts", "points", "replans")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    REPLANS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    state: JobState
    total_steps: int
    predicted_step_s: float
    restarts: int
    points: _containers.RepeatedCompositeFieldContainer[HistoryPoint]
    replans: _containers.RepeatedCompositeFieldContainer[Replan]
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., total_steps: _Optional[int] = ..., predicted_step_s: _Optional[float] = ..., restarts: _Optional[int] = ..., points: _Optional[_Iterable[_Union[HistoryPoint, _Mapping]]] = ..., replans: _Optional[_Iterable[_Union[Replan, _Mapping]]] = ...) -> None: ...
