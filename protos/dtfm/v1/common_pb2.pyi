from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReachOverride(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REACH_OVERRIDE_AUTO: _ClassVar[ReachOverride]
    REACH_OVERRIDE_YES: _ClassVar[ReachOverride]
    REACH_OVERRIDE_NO: _ClassVar[ReachOverride]

class Reachability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REACHABILITY_UNKNOWN: _ClassVar[Reachability]
    REACHABILITY_EVERYWHERE: _ClassVar[Reachability]
    REACHABILITY_SOME_PEERS: _ClassVar[Reachability]
    REACHABILITY_NOWHERE: _ClassVar[Reachability]

class FrameProtection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAMES_MAC: _ClassVar[FrameProtection]
    FRAMES_ENCRYPT: _ClassVar[FrameProtection]
    FRAMES_OFF: _ClassVar[FrameProtection]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_IDLE: _ClassVar[WorkerState]
    WORKER_STATE_MEASURING: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_TRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DONE: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
REACH_OVERRIDE_AUTO: ReachOverride
REACH_OVERRIDE_YES: ReachOverride
REACH_OVERRIDE_NO: ReachOverride
REACHABILITY_UNKNOWN: Reachability
REACHABILITY_EVERYWHERE: Reachability
REACHABILITY_SOME_PEERS: Reachability
REACHABILITY_NOWHERE: Reachability
FRAMES_MAC: FrameProtection
FRAMES_ENCRYPT: FrameProtection
FRAMES_OFF: FrameProtection
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_IDLE: WorkerState
WORKER_STATE_MEASURING: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_TRAINING: WorkerState
WORKER_STATE_DONE: WorkerState
WORKER_STATE_FAILED: WorkerState
WORKER_STATE_STOPPED: WorkerState

class DeviceInfo(_message.Message):
    __slots__ = ("kind", "name", "memory_bytes", "flops", "cores", "free_memory_bytes", "flops_bf16", "memory_pool")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_BF16_FIELD_NUMBER: _ClassVar[int]
    MEMORY_POOL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    memory_bytes: int
    flops: float
    cores: int
    free_memory_bytes: int
    flops_bf16: float
    memory_pool: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., flops: _Optional[float] = ..., cores: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., flops_bf16: _Optional[float] = ..., memory_pool: _Optional[str] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("agent_id", "host", "port", "device", "version", "reachable", "data_port", "relay_port")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    host: str
    port: int
    device: DeviceInfo
    version: str
    reachable: ReachOverride
    data_port: int
    relay_port: int
    def __init__(self, agent_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., version: _Optional[str] = ..., reachable: _Optional[_Union[ReachOverride, str]] = ..., data_port: _Optional[int] = ..., relay_port: _Optional[int] = ...) -> None: ...

class DialResult(_message.Message):
    __slots__ = ("dialer", "ok", "error", "unix_s", "outvoted")
    DIALER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OUTVOTED_FIELD_NUMBER: _ClassVar[int]
    dialer: str
    ok: bool
    error: str
    unix_s: float
    outvoted: bool
    def __init__(self, dialer: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., unix_s: _Optional[float] = ..., outvoted: _Optional[bool] = ...) -> None: ...

class ReachStatus(_message.Message):
    __slots__ = ("verdict", "address", "dials", "overridden", "summary")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DIALS_FIELD_NUMBER: _ClassVar[int]
    OVERRIDDEN_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    verdict: Reachability
    address: str
    dials: _containers.RepeatedCompositeFieldContainer[DialResult]
    overridden: bool
    summary: str
    def __init__(self, verdict: _Optional[_Union[Reachability, str]] = ..., address: _Optional[str] = ..., dials: _Optional[_Iterable[_Union[DialResult, _Mapping]]] = ..., overridden: _Optional[bool] = ..., summary: _Optional[str] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("name", "vocab_size", "n_layers", "d_model", "n_heads", "seq_len", "d_ff", "arch", "n_kv_heads", "head_dim", "norm_eps", "activation", "rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions", "qkv_bias", "max_positions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    D_FF_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NORM_EPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    ROPE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ROPE_LOW_FREQ_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ROPE_HIGH_FREQ_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ROPE_ORIGINAL_MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    QKV_BIAS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    d_ff: int
    arch: str
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    activation: str
    rope_theta: float
    rope_type: str
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_positions: int
    qkv_bias: bool
    max_positions: int
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., n_layers: _Optional[int] = ..., d_model: _Optional[int] = ..., n_heads: _Optional[int] = ..., seq_len: _Optional[int] = ..., d_ff: _Optional[int] = ..., arch: _Optional[str] = ..., n_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., norm_eps: _Optional[float] = ..., activation: _Optional[str] = ..., rope_theta: _Optional[float] = ..., rope_type: _Optional[str] = ..., rope_factor: _Optional[float] = ..., rope_low_freq_factor: _Optional[float] = ..., rope_high_freq_factor: _Optional[float] = ..., rope_original_max_positions: _Optional[int] = ..., qkv_bias: _Optional[bool] = ..., max_positions: _Optional[int] = ...) -> None: ...

class TrainConfig(_message.Message):
    __slots__ = ("global_batch", "micro_batches", "steps", "seed", "schedule", "dp_mode", "lr", "warmup_steps", "grad_clip", "weight_decay", "data_path", "checkpoint_dir", "dtype", "checkpoint_every", "eval_batches", "eval_every", "pp_compress", "dp_compress", "moments_dtype", "init_from", "seq_len", "sync_every", "outer_lr", "outer_momentum", "outer_delay", "pipeline_delay", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_init", "verify")
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    DP_MODE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    PP_COMPRESS_FIELD_NUMBER: _ClassVar[int]
    DP_COMPRESS_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    OUTER_DELAY_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DELAY_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LORA_DROPOUT_FIELD_NUMBER: _ClassVar[int]
    LORA_TARGETS_FIELD_NUMBER: _ClassVar[int]
    LORA_INIT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    global_batch: int
    micro_batches: int
    steps: int
    seed: int
    schedule: str
    dp_mode: str
    lr: float
    warmup_steps: int
    grad_clip: float
    weight_decay: float
    data_path: str
    checkpoint_dir: str
    dtype: str
    checkpoint_every: int
    eval_batches: int
    eval_every: int
    pp_compress: str
    dp_compress: str
    moments_dtype: str
    init_from: str
    seq_len: int
    sync_every: int
    outer_lr: float
    outer_momentum: float
    outer_delay: int
    pipeline_delay: int
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: str
    lora_init: str
    verify: str
    def __init__(self, global_batch: _Optional[int] = ..., micro_batches: _Optional[int] = ..., steps: _Optional[int] = ..., seed: _Optional[int] = ..., schedule: _Optional[str] = ..., dp_mode: _Optional[str] = ..., lr: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., grad_clip: _Optional[float] = ..., weight_decay: _Optional[float] = ..., data_path: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ..., dtype: _Optional[str] = ..., checkpoint_every: _Optional[int] = ..., eval_batches: _Optional[int] = ..., eval_every: _Optional[int] = ..., pp_compress: _Optional[str] = ..., dp_compress: _Optional[str] = ..., moments_dtype: _Optional[str] = ..., init_from: _Optional[str] = ..., seq_len: _Optional[int] = ..., sync_every: _Optional[int] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., outer_delay: _Optional[int] = ..., pipeline_delay: _Optional[int] = ..., lora_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., lora_dropout: _Optional[float] = ..., lora_targets: _Optional[str] = ..., lora_init: _Optional[str] = ..., verify: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("job_id", "epoch", "master_addr", "master_port", "world_size", "rank", "stage", "replica", "stages", "replicas", "layer_begin", "layer_end", "dp_group_ranks", "prev_rank", "next_rank", "model", "train", "backend", "layer_splits", "bind_addr", "pp_compress_prev", "pp_compress_next", "dp_compress", "checkpoint_peers", "mirrors", "checkpoint_splits", "dp_shares", "checkpoint_pushes", "init_hash", "data_plane", "resume_before")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DP_GROUP_RANKS_FIELD_NUMBER: _ClassVar[int]
    PREV_RANK_FIELD_NUMBER: _ClassVar[int]
    NEXT_RANK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPLITS_FIELD_NUMBER: _ClassVar[int]
    BIND_ADDR_FIELD_NUMBER: _ClassVar[int]
    PP_COMPRESS_PREV_FIELD_NUMBER: _ClassVar[int]
    PP_COMPRESS_NEXT_FIELD_NUMBER: _ClassVar[int]
    DP_COMPRESS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PEERS_FIELD_NUMBER: _ClassVar[int]
    MIRRORS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SPLITS_FIELD_NUMBER: _ClassVar[int]
    DP_SHARES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PUSHES_FIELD_NUMBER: _ClassVar[int]
    INIT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    RESUME_BEFORE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    stage: int
    replica: int
    stages: int
    replicas: int
    layer_begin: int
    layer_end: int
    dp_group_ranks: _containers.RepeatedScalarFieldContainer[int]
    prev_rank: int
    next_rank: int
    model: ModelSpec
    train: TrainConfig
    backend: str
    layer_splits: _containers.RepeatedScalarFieldContainer[int]
    bind_addr: str
    pp_compress_prev: str
    pp_compress_next: str
    dp_compress: str
    checkpoint_peers: _containers.RepeatedScalarFieldContainer[str]
    mirrors: _containers.RepeatedCompositeFieldContainer[CheckpointMirror]
    checkpoint_splits: _containers.RepeatedScalarFieldContainer[int]
    dp_shares: _containers.RepeatedScalarFieldContainer[float]
    checkpoint_pushes: _containers.RepeatedCompositeFieldContainer[CheckpointMirror]
    init_hash: str
    data_plane: DataPlane
    resume_before: int
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., stage: _Optional[int] = ..., replica: _Optional[int] = ..., stages: _Optional[int] = ..., replicas: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., dp_group_ranks: _Optional[_Iterable[int]] = ..., prev_rank: _Optional[int] = ..., next_rank: _Optional[int] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., train: _Optional[_Union[TrainConfig, _Mapping]] = ..., backend: _Optional[str] = ..., layer_splits: _Optional[_Iterable[int]] = ..., bind_addr: _Optional[str] = ..., pp_compress_prev: _Optional[str] = ..., pp_compress_next: _Optional[str] = ..., dp_compress: _Optional[str] = ..., checkpoint_peers: _Optional[_Iterable[str]] = ..., mirrors: _Optional[_Iterable[_Union[CheckpointMirror, _Mapping]]] = ..., checkpoint_splits: _Optional[_Iterable[int]] = ..., dp_shares: _Optional[_Iterable[float]] = ..., checkpoint_pushes: _Optional[_Iterable[_Union[CheckpointMirror, _Mapping]]] = ..., init_hash: _Optional[str] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ..., resume_before: _Optional[int] = ...) -> None: ...

class DataPlane(_message.Message):
    __slots__ = ("listen", "relay", "secret", "pair_relays", "limited", "direct", "hole_punch", "gpu", "frames", "pair_keys")
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    PAIR_RELAYS_FIELD_NUMBER: _ClassVar[int]
    LIMITED_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    HOLE_PUNCH_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    PAIR_KEYS_FIELD_NUMBER: _ClassVar[int]
    listen: _containers.RepeatedScalarFieldContainer[str]
    relay: str
    secret: bytes
    pair_relays: _containers.RepeatedCompositeFieldContainer[PairRelay]
    limited: _containers.RepeatedScalarFieldContainer[int]
    direct: _containers.RepeatedCompositeFieldContainer[DirectDial]
    hole_punch: bool
    gpu: bool
    frames: FrameProtection
    pair_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, listen: _Optional[_Iterable[str]] = ..., relay: _Optional[str] = ..., secret: _Optional[bytes] = ..., pair_relays: _Optional[_Iterable[_Union[PairRelay, _Mapping]]] = ..., limited: _Optional[_Iterable[int]] = ..., direct: _Optional[_Iterable[_Union[DirectDial, _Mapping]]] = ..., hole_punch: _Optional[bool] = ..., gpu: _Optional[bool] = ..., frames: _Optional[_Union[FrameProtection, str]] = ..., pair_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DirectDial(_message.Message):
    __slots__ = ("dialer", "listener")
    DIALER_FIELD_NUMBER: _ClassVar[int]
    LISTENER_FIELD_NUMBER: _ClassVar[int]
    dialer: int
    listener: int
    def __init__(self, dialer: _Optional[int] = ..., listener: _Optional[int] = ...) -> None: ...

class PairRelay(_message.Message):
    __slots__ = ("rank_a", "rank_b", "relay")
    RANK_A_FIELD_NUMBER: _ClassVar[int]
    RANK_B_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    rank_a: int
    rank_b: int
    relay: str
    def __init__(self, rank_a: _Optional[int] = ..., rank_b: _Optional[int] = ..., relay: _Optional[str] = ...) -> None: ...

class CheckpointMirror(_message.Message):
    __slots__ = ("stage", "peer", "pushed")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    stage: int
    peer: str
    pushed: bool
    def __init__(self, stage: _Optional[int] = ..., peer: _Optional[str] = ..., pushed: _Optional[bool] = ...) -> None: ...

class LinkSample(_message.Message):
    __slots__ = ("peer_id", "delay_ms", "bandwidth_gbps", "reachable", "error", "measured_unix_s", "estimated", "estimate_note")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MEASURED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_NOTE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    delay_ms: float
    bandwidth_gbps: float
    reachable: bool
    error: str
    measured_unix_s: float
    estimated: bool
    estimate_note: str
    def __init__(self, peer_id: _Optional[str] = ..., delay_ms: _Optional[float] = ..., bandwidth_gbps: _Optional[float] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., measured_unix_s: _Optional[float] = ..., estimated: _Optional[bool] = ..., estimate_note: _Optional[str] = ...) -> None: ...

class LinkMatrix(_message.Message):
    __slots__ = ("agent_ids", "delay_ms", "bandwidth_gbps", "unreachable", "estimated", "estimate_notes", "relayed", "punched")
    AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_NOTES_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    PUNCHED_FIELD_NUMBER: _ClassVar[int]
    agent_ids: _containers.RepeatedScalarFieldContainer[str]
    delay_ms: _containers.RepeatedScalarFieldContainer[float]
    bandwidth_gbps: _containers.RepeatedScalarFieldContainer[float]
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    estimated: _containers.RepeatedScalarFieldContainer[str]
    estimate_notes: _containers.RepeatedScalarFieldContainer[str]
    relayed: _containers.RepeatedScalarFieldContainer[str]
    punched: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_ids: _Optional[_Iterable[str]] = ..., delay_ms: _Optional[_Iterable[float]] = ..., bandwidth_gbps: _Optional[_Iterable[float]] = ..., unreachable: _Optional[_Iterable[str]] = ..., estimated: _Optional[_Iterable[str]] = ..., estimate_notes: _Optional[_Iterable[str]] = ..., relayed: _Optional[_Iterable[str]] = ..., punched: _Optional[_Iterable[str]] = ...) -> None: ...

class TuningAdvice(_message.Message):
    __slots__ = ("setting", "current", "wanted", "why")
    SETTING_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    WANTED_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    setting: str
    current: str
    wanted: str
    why: str
    def __init__(self, setting: _Optional[str] = ..., current: _Optional[str] = ..., wanted: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class PlanStage(_message.Message):
    __slots__ = ("agent_ids", "dp_shares")
    AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    DP_SHARES_FIELD_NUMBER: _ClassVar[int]
    agent_ids: _containers.RepeatedScalarFieldContainer[str]
    dp_shares: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, agent_ids: _Optional[_Iterable[str]] = ..., dp_shares: _Optional[_Iterable[float]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("stages", "replicas", "grid", "cost", "dp_cost", "pp_cost", "seconds", "algorithm", "epoch", "placement", "predicted_step_s", "predicted_comm_s", "predicted_compute_s", "layer_splits", "sync_every", "sync_note", "outer_delay", "pipeline_delay", "predicted_breakdown")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    DP_COST_FIELD_NUMBER: _ClassVar[int]
    PP_COST_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COMM_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPLITS_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    SYNC_NOTE_FIELD_NUMBER: _ClassVar[int]
    OUTER_DELAY_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DELAY_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    stages: int
    replicas: int
    grid: _containers.RepeatedCompositeFieldContainer[PlanStage]
    cost: float
    dp_cost: float
    pp_cost: float
    seconds: float
    algorithm: str
    epoch: int
    placement: str
    predicted_step_s: float
    predicted_comm_s: float
    predicted_compute_s: float
    layer_splits: _containers.RepeatedScalarFieldContainer[int]
    sync_every: int
    sync_note: str
    outer_delay: int
    pipeline_delay: int
    predicted_breakdown: StepBreakdown
    def __init__(self, stages: _Optional[int] = ..., replicas: _Optional[int] = ..., grid: _Optional[_Iterable[_Union[PlanStage, _Mapping]]] = ..., cost: _Optional[float] = ..., dp_cost: _Optional[float] = ..., pp_cost: _Optional[float] = ..., seconds: _Optional[float] = ..., algorithm: _Optional[str] = ..., epoch: _Optional[int] = ..., placement: _Optional[str] = ..., predicted_step_s: _Optional[float] = ..., predicted_comm_s: _Optional[float] = ..., predicted_compute_s: _Optional[float] = ..., layer_splits: _Optional[_Iterable[int]] = ..., sync_every: _Optional[int] = ..., sync_note: _Optional[str] = ..., outer_delay: _Optional[int] = ..., pipeline_delay: _Optional[int] = ..., predicted_breakdown: _Optional[_Union[StepBreakdown, _Mapping]] = ...) -> None: ...

class StepBreakdown(_message.Message):
    __slots__ = ("step_s", "compute", "pipeline_wait", "norm_wait", "transfer", "latency_bubble", "sync_wait", "codec", "other")
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_WAIT_FIELD_NUMBER: _ClassVar[int]
    NORM_WAIT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LATENCY_BUBBLE_FIELD_NUMBER: _ClassVar[int]
    SYNC_WAIT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    OTHER_FIELD_NUMBER: _ClassVar[int]
    step_s: float
    compute: float
    pipeline_wait: float
    norm_wait: float
    transfer: float
    latency_bubble: float
    sync_wait: float
    codec: float
    other: float
    def __init__(self, step_s: _Optional[float] = ..., compute: _Optional[float] = ..., pipeline_wait: _Optional[float] = ..., norm_wait: _Optional[float] = ..., transfer: _Optional[float] = ..., latency_bubble: _Optional[float] = ..., sync_wait: _Optional[float] = ..., codec: _Optional[float] = ..., other: _Optional[float] = ...) -> None: ...
