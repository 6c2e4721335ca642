"""The coordinator's configuration: one dataclass tree, validated once at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.daemon.operator import check_operator_token
from coordinator.daemon.pace import DEFAULT_BUDGET, check_budget
from coordinator.scheduler.placement import Placement
from dtfm.core import lora
from dtfm.core.loradir import check_adapter_dir
from dtfm.core.spec import ModelSpec, TrainConfig
from dtfm.core.words import stages_x_replicas
from dtfm.flags import LIVENESS_TIMEOUT_S, check_directory
from dtfm.rpc import ConfigError, Security, split_hostport


@dataclass
class DriftConfig:
    """Watching a running job for network or device drift and re-planning when it pays
    (coordinator/job/drift.py, coordinator/job/replan.py)."""

    replan: bool = True  # --no-replan: watch and report, never move
    threshold: float = 0.3  # --drift-threshold: a step this much slower than expected is drift
    window: int = 6  # --drift-window: ... for this many steps in a row (a blip is shorter)
    margin: float = 2.0  # --replan-margin: move when the predicted gain exceeds margin x cost
    probe_seconds: float = 0.5  # --remeasure-probe-seconds: each background bandwidth probe

    def validate(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ConfigError(f"--drift-threshold must be a fraction > 0 (0.3: 30 % slower), "
                              f"got {self.threshold}")
        if self.window < 2:
            raise ConfigError(f"--drift-window must be >= 2 steps, got {self.window}")
        if not (math.isfinite(self.margin) and self.margin >= 1):
            raise ConfigError(f"--replan-margin must be >= 1, got {self.margin}")
        if not (math.isfinite(self.probe_seconds) and self.probe_seconds > 0):
            raise ConfigError(f"--remeasure-probe-seconds must be > 0, got "
                              f"{self.probe_seconds}")


@dataclass
class JobConfig:
    """The training job the coordinator drives once enough agents are alive.

    `model` empty means no job: the coordinator only keeps the registry and measures links.
    `stages`/`replicas` 0 means: chosen from the number of agents. With `train.init_from`
    the model comes from that directory's config.json (`validate` names it `hf:<dir name>`
    unless `--model` names a preset of the same shape) and `init_hash` identifies it.
    """

    model: str = ""
    agents: int = 0
    stages: int = 0
    replicas: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    measure_links: bool = True
    search_seconds: float = 5.0
    seed: int = 0
    max_restarts: int = 3  # restarts in a row without progress (a new checkpoint) before failing
    min_agents: int = 0  # below this many agents the job waits instead of shrinking; 0: --agents
    placement: str = "scheduled"  # scheduled, rank-order, random[:SEED] or a plan file
    links_file: str = ""  # plan on this measured matrix instead of measuring
    layer_split: str = "auto"  # auto (by device speed and memory), even, or counts "4,2"
    export_dir: str = ""  # write the trained model there as a Hugging Face directory
    export_merged: bool = False  # a LoRA job's export_dir: the base with the adapters merged
    init_hash: str = ""  # set by validate: dtfm.core.hfdir.dir_hash of train.init_from
    drift: DriftConfig = field(default_factory=DriftConfig)
    # --sync-overhead: with --sync-every auto, the share of a step the amortised exchange
    # may cost (coordinator/scheduler/sync_auto.py)
    sync_overhead: float = 0.10
    # --transport: the workers' backend; auto: gloo/NCCL when every member accepts
    # connections, else dtfm (coordinator/job/dataplane.py)
    transport: str = "auto"
    # --hole-punch: dial-only pairs at a relay try a direct connection through their NATs
    # first (dtfm/net/punch.py); off: they always stay on the relay
    hole_punch: bool = True
    # --frames: how the dtfm data plane protects each frame (dtfm/net/framemac.py)
    frames: str = "mac"
    _spec: ModelSpec | None = field(default=None, repr=False, compare=False)

    def model_spec(self) -> ModelSpec:
        """What the job trains: preset `model`, or the model `train.init_from` names."""
        if self._spec is None:
            from dtfm.core.hfdir import resolve_spec

            preset = "" if self.model.startswith("hf:") else self.model
            self._spec = resolve_spec(preset, self.train.init_from, self.train.seq_len)
        return self._spec

    def parsed_split(self) -> list[int] | None:
        """The `--layer-split` counts, or None for auto/even."""
        if self.layer_split in ("auto", "even"):
            return None
        try:
            counts = [int(x) for x in self.layer_split.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            raise ConfigError(f"--layer-split must be auto, even or layer counts >= 1 such as "
                              f"4,2, got {self.layer_split!r}")
        return counts

    def parsed_placement(self) -> Placement:
        try:
            return Placement.parse(self.placement)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def validate(self) -> None:
        self._check_ranges()
        if self.transport not in ("auto", "gloo", "dtfm"):
            raise ConfigError(f"--transport must be auto, gloo or dtfm, got {self.transport!r}")
        if self.train.init_from:
            self._check_init_from()
        if self.export_merged and not (self.export_dir and self.train.lora_rank):
            raise ConfigError("--export-merged writes a LoRA job's base with its adapters "
                              "merged: give it with --export-dir and --lora-rank")
        if self.export_dir:
            self._check_export_dir()
        self.drift.validate()
        if not self.model:
            return
        if self.links_file:
            from coordinator.links.store import load_links_file

            try:
                load_links_file(self.links_file)
            except ValueError as exc:
                raise ConfigError(f"--links: {exc}") from None
        placement = self.parsed_placement()
        if placement.pinned is not None:
            self._check_pinned(placement)
        try:
            spec = self.model_spec()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.agents < 1:
            raise ConfigError("--agents must be >= 1 when --model is given")
        if self.stages and self.replicas and self.stages * self.replicas != self.agents:
            raise ConfigError(
                f"--stages {self.stages} x --replicas {self.replicas} = "
                f"{self.stages * self.replicas}, but --agents is {self.agents}"
            )
        if self.stages > spec.n_layers:
            raise ConfigError(
                f"--stages {self.stages} exceeds the {spec.n_layers} layers of {self.model}"
            )
        for flag, value in (("--stages", self.stages), ("--replicas", self.replicas)):
            if value and self.agents % value:
                raise ConfigError(f"{flag} {value} does not divide --agents {self.agents}")
        from dtfm.core.shape import choose_layout

        layout = choose_layout(self.agents, spec.n_layers, self.stages, self.replicas)
        counts = self.parsed_split()
        if counts is not None and (len(counts) != layout.stages or sum(counts) != spec.n_layers):
            raise ConfigError(f"--layer-split {self.layer_split} must give {layout.stages} "
                              f"stages layer counts summing to {spec.n_layers} ({self.model})")
        try:
            self.train.validate(layout.replicas)
            lora.check(self.train, spec)
            if self.train.lora_init and Path(self.train.lora_init).exists():  # else: workers'
                check_adapter_dir(self.train.lora_init, spec, self.train)
        except ValueError as exc:
            raise ConfigError(f"{exc} (the job runs {layout.text})") from None
        self._check_data(spec.vocab_size)

    def _check_data(self, vocab_size: int) -> None:
        """`--data` against the model from its meta.json, where this machine holds it (each
        agent's worker checks the token files themselves before it joins)."""
        from dtfm.core.hfdir import model_tokenizer_hash
        from dtfm.core.tokenfiles import check_data_path

        try:
            check_data_path(self.train.data_path, vocab_size,
                            model_tokenizer_hash(self.train.init_from))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


    def _check_export_dir(self) -> None:
        """--export-dir, before any training: new or empty, writable, and not the base model
        (nor a directory holding it or inside it), which the export would replace."""
        from dtfm.core.hfexport import ExportError, check_destination, check_not_base, make_parent

        try:
            check_not_base(self.export_dir, self.train.init_from, "--export-dir")
            check_destination(self.export_dir, False, "--export-dir")
            make_parent(self.export_dir, "--export-dir")
        except ExportError as exc:
            raise ConfigError(str(exc)) from None

    def _check_init_from(self) -> None:
        """--init-from: the spec from config.json (refusing a --model that disagrees), the
        hash every worker's copy must match, and an absolute path (workers run elsewhere)."""
        from dtfm.core.hfdir import dir_hash

        self.train.init_from = str(Path(self.train.init_from).absolute())
        self._spec = None
        try:
            spec = self.model_spec()
            self.init_hash = dir_hash(self.train.init_from)
        except (ValueError, OSError) as exc:
            raise ConfigError(str(exc)) from None
        if not self.model:
            self.model = spec.name

    def _check_ranges(self) -> None:
        for flag, value in (("--agents", self.agents), ("--stages", self.stages),
                            ("--replicas", self.replicas), ("--max-restarts", self.max_restarts),
                            ("--seed", self.seed), ("--min-agents", self.min_agents)):
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0, got {value}")
        if self.min_agents > self.agents:
            raise ConfigError(f"--min-agents {self.min_agents} exceeds --agents {self.agents}: "
                              f"the job could never start; lower --min-agents")
        if not (math.isfinite(self.search_seconds) and self.search_seconds > 0):
            raise ConfigError(f"--search-seconds must be a finite number > 0, got "
                              f"{self.search_seconds}")
        if not (math.isfinite(self.sync_overhead) and 0 < self.sync_overhead <= 1):
            raise ConfigError(f"--sync-overhead must be a fraction in (0, 1] (0.1: the "
                              f"exchange may cost 10 % of a step), got {self.sync_overhead}")

    def _check_pinned(self, placement: Placement) -> None:
        pinned = placement.pinned
        assert pinned is not None
        n = pinned.stages * pinned.replicas
        if self.agents != n:
            raise ConfigError(f"--placement {placement.path} places {n} agents "
                              f"({stages_x_replicas(pinned.stages, pinned.replicas)}), but "
                              f"--agents is {self.agents}")
        for flag, value, want in (("--stages", self.stages, pinned.stages),
                                  ("--replicas", self.replicas, pinned.replicas)):
            if value and value != want:
                raise ConfigError(f"{flag} {value} disagrees with the {want} of the pinned "
                                  f"plan {placement.path}: drop the flag or fix the plan")
        self.stages, self.replicas = pinned.stages, pinned.replicas


@dataclass
class CoordinatorConfig:
    listen: str = "127.0.0.1:7070"
    security: Security = field(default_factory=lambda: Security(token=""))
    # --operator-token-file: what SubmitJob, CancelJob and Admit need on top of the join
    # token (coordinator/daemon/operator.py); empty: none, the join token suffices
    operator_token: str = ""
    heartbeat_interval_s: float = 1.0
    liveness_timeout_s: float = LIVENESS_TIMEOUT_S  # dtfm/flags.py says why
    # --heartbeat-budget: heartbeats a second past which the interval stretches
    # (coordinator/daemon/pace.py says why); 0: a fixed interval
    heartbeat_budget: float = DEFAULT_BUDGET
    measure_timeout_s: float = 120.0
    measure_every_s: float = 0.0  # re-measure all links this often while no job trains; 0: off
    evict_after_s: float = 600.0  # drop agents lost or left this long from the registry
    state_dir: str = ""
    metrics_listen: str = ""  # HOST:PORT of the Prometheus endpoint; empty: off
    web_listen: str = ""  # --web HOST:PORT of the web view (coordinator/web); empty: off
    tensorboard_dir: str = ""  # --tensorboard DIR: the job's scalars as event files; empty: off
    # --relay-port: the data-plane relay for agents that cannot accept connections; None:
    # on the gRPC port itself (dtfm/net/front.py sorts the connections); a port: its own
    # listener on the --listen host; 0: off
    relay_port: int | None = None
    # --checkpoint-store-mib: the most the copies of last resort (stages of a job no member of
    # which can be dialled, pushed here: coordinator/job/checkpointcopies.py) may take
    checkpoint_store_bytes: int = 4096 * 2**20
    job: JobConfig = field(default_factory=JobConfig)

    def validate(self) -> None:
        split_hostport(self.listen, "--listen")
        if self.metrics_listen:
            split_hostport(self.metrics_listen, "--metrics-listen")
        if self.web_listen:
            split_hostport(self.web_listen, "--web")
        if self.tensorboard_dir:
            from coordinator.daemon.tblog import check_installed

            check_directory(self.tensorboard_dir, "--tensorboard")
            check_installed()
        self.security.validate()
        check_operator_token(self.operator_token, self.security.token)
        for flag, value in (("--heartbeat-interval", self.heartbeat_interval_s),
                            ("--liveness-timeout", self.liveness_timeout_s),
                            ("--measure-timeout", self.measure_timeout_s),
                            ("--evict-after", self.evict_after_s)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a finite number of seconds > 0, got {value}")
        if problem := check_budget(self.heartbeat_budget):
            raise ConfigError(problem)
        if self.liveness_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"--liveness-timeout ({self.liveness_timeout_s} s) must exceed the heartbeat "
                f"interval ({self.heartbeat_interval_s} s), or live agents would be marked lost"
            )
        if not (math.isfinite(self.measure_every_s) and self.measure_every_s >= 0):
            raise ConfigError("--measure-every must be >= 0 seconds (0 turns it off)")
        if self.state_dir:
            check_directory(self.state_dir, "--state-dir")
        if self.relay_port is not None and not 0 <= self.relay_port <= 65535:
            raise ConfigError(f"--relay-port must be a TCP port (1-65535) or 0 (off), got "
                              f"{self.relay_port}")
        self.job.validate()

    @property
    def relay_shared(self) -> bool:
        """Whether the relay serves on the gRPC port (the default: one port to open)."""
        return self.relay_port is None

    def relay_address(self) -> tuple[str, int] | None:
        """(host, port) of the relay's own listener (`--relay-port PORT`), None when it is
        off or shares the gRPC port."""
        if not self.relay_port:
            return None
        return split_hostport(self.listen, "--listen")[0], self.relay_port
