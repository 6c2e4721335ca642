"""The job flags: what `coordinator start` and `coordinator submit` say about a job.

One definition for both commands, and for the daemon, which parses a submitted job's words
(`SubmitJobRequest.args`) with the very parser `coordinator submit` checked them with, so a
job submitted to a running coordinator means what the same flags mean at `start`.

A submission comes over the network from whoever holds the join token (every volunteer
agent holds it), so `parse_submitted` bounds the words and refuses the flags that name a path
on the coordinator's own machine (`COORDINATOR_PATHS`): a submitter could otherwise make the
coordinator read or write files there. The operator's `start` may name them.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence

from coordinator.daemon.config import DriftConfig, JobConfig
from dtfm import flags
from dtfm.core.limits import MAX_AGENTS
from dtfm.rpc import ConfigError

MAX_ARGS = 256  # words in one submission
MAX_ARG_BYTES = 4096  # bytes in one word
MAX_SUBMIT_BYTES = 64 * 1024  # bytes of all the words together
# flags naming a file or directory on the coordinator's machine; what to do instead
COORDINATOR_PATHS = {
    "--export-dir": "run `coordinator export --job ID --out DIR` once it is done",
    "--links": "leave it out: the coordinator measures, or plans on the links it has",
    "--init-from": "start the coordinator with it (`coordinator start --init-from`)",
}


def add_job_args(p: argparse.ArgumentParser) -> None:
    """Every flag that describes the job (not the daemon): --model, --agents, ..., and the
    training flags."""
    p.add_argument("--model", default="", help="model preset to train (empty: no job)")
    p.add_argument("--agents", type=flags.number(int, 0, maximum=MAX_AGENTS), default=0,
                   help="agents the job waits for")
    p.add_argument("--stages", type=flags.count, default=0, help="pipeline stages (0: choose)")
    p.add_argument("--replicas", type=flags.count, default=0,
                   help="data-parallel replicas (0: choose)")
    flags.add_search_seconds(p, JobConfig.search_seconds)
    _add_drift_flags(p)
    p.add_argument("--no-measure", action="store_true",
                   help="skip link measurement (plan as if all links were equal)")
    p.add_argument("--transport", default="auto", choices=["auto", "gloo", "dtfm"],
                   help="the workers' data plane: auto = gloo (CPU) / NCCL (GPU) when every "
                   "member accepts connections, else dtfm (dials out, relays; CPU only)")
    p.add_argument("--hole-punch", default="on", choices=["on", "off"],
                   help="two agents that meet at a relay first try a direct connection "
                   "through their NATs (TCP simultaneous open) and keep the relay only where "
                   "that fails (default on; off: always the relay)")
    p.add_argument("--frames", default="mac", choices=["mac", "encrypt", "off"],
                   help="how the dtfm data plane protects each frame between two ranks: mac "
                   "(default) = a per-pair MAC, so a relay cannot alter, replay or reorder "
                   "what it forwards unnoticed; encrypt = AES-256-GCM, the relay cannot read "
                   "it either; off = neither (docs/operations.md)")
    p.add_argument("--max-restarts", type=flags.count, default=3,
                   help="reschedules in a row without progress (a new checkpoint) before the "
                   "job fails; progress refills the budget")
    p.add_argument("--min-agents", type=flags.count, default=0,
                   help="when agents are lost and no spare is alive, continue on fewer "
                   "replicas down to this many agents (0: --agents, i.e. wait for a spare); "
                   "the job grows back at a checkpoint when agents join")
    p.add_argument("--placement", default="scheduled",
                   help="scheduled (the paper's search, default), rank-order (network-blind, "
                   "agents in address order), random[:SEED], or a plan file written by "
                   "`coordinator plan --json` (pinned)")
    p.add_argument("--layer-split", default="auto", metavar="auto|even|N,N,...",
                   help="layers per stage: auto (faster devices get more layers, and no stage "
                   "may outgrow its devices' memory; even when the devices are alike), even, "
                   "or explicit counts in stage order")
    p.add_argument("--links", default="", metavar="FILE",
                   help="plan on this matrix (as `coordinator links --json` writes it) instead "
                   "of measuring; it must cover the job's agents")
    p.add_argument("--export-dir", default="", metavar="DIR",
                   help="after the last step, write the trained model there as a Hugging Face "
                   "directory, gathered from the agents (as `coordinator export` does); a "
                   "LoRA job's is a peft adapter directory")
    p.add_argument("--export-merged", action="store_true",
                   help="with --export-dir and --lora-rank: write the base with the adapters "
                   "merged in (needs torch on the coordinator's machine) instead")
    p.add_argument("--sync-overhead", type=flags.number(float, 0, above=True, maximum=1.0),
                   default=JobConfig.sync_overhead, metavar="FRACTION",
                   help="with --sync-every auto: the share of a step the data-parallel "
                   "exchange, amortised over H steps, may cost; auto takes the smallest H "
                   "within it (default: %(default)s)")
    flags.add_train_args(p)  # --seed among them: it also seeds the placement search


def _add_drift_flags(p: argparse.ArgumentParser) -> None:
    """Watching the running job for drift and re-planning it (coordinator/job/drift.py,
    coordinator/job/replan.py); defaults from `DriftConfig`."""
    d = DriftConfig()
    p.add_argument("--no-replan", action="store_true",
                   help="watch the running job for network or device drift and report it, "
                   "but never move it to a new plan")
    p.add_argument("--drift-threshold", type=float, default=d.threshold,
                   help="a step this fraction slower than the plan's expected step is drift "
                   f"(default {d.threshold}: 30 %% slower)")
    p.add_argument("--drift-window", type=flags.count, default=d.window,
                   help="... when it lasts this many steps in a row; a shorter blip is "
                   f"ignored (default {d.window})")
    p.add_argument("--replan-margin", type=float, default=d.margin,
                   help="move to a new plan only when its predicted gain over the remaining "
                   f"steps exceeds this many times the cost of moving (default {d.margin})")
    p.add_argument("--remeasure-probe-seconds", type=flags.seconds, default=d.probe_seconds,
                   help="each bandwidth probe of the background re-measurement lasts about "
                   f"this long (default {d.probe_seconds} s)")


def job_config(args: argparse.Namespace) -> JobConfig:
    """The (unvalidated) `JobConfig` the job flags of `args` describe."""
    drift = DriftConfig(replan=not args.no_replan, threshold=args.drift_threshold,
                        window=args.drift_window, margin=args.replan_margin,
                        probe_seconds=args.remeasure_probe_seconds)
    return JobConfig(model=args.model, agents=args.agents, stages=args.stages,
                     replicas=args.replicas, train=flags.train_config_from_args(args),
                     measure_links=not args.no_measure, search_seconds=args.search_seconds,
                     seed=args.seed, max_restarts=args.max_restarts,
                     min_agents=args.min_agents,
                     placement=args.placement, links_file=args.links,
                     layer_split=args.layer_split, export_dir=args.export_dir,
                     export_merged=args.export_merged,
                     drift=drift, sync_overhead=args.sync_overhead,
                     transport=args.transport, hole_punch=args.hole_punch == "on",
                     frames=args.frames)


def job_parser(prog: str = "coordinator submit") -> flags.Parser:
    """A parser of the job flags alone (what a submission may say)."""
    p = flags.Parser(prog=prog, add_help=False)
    add_job_args(p)
    return p


def toml_args(path: str, parser: argparse.ArgumentParser,
              ignore: Collection[str] = ()) -> list[str]:
    """The words a TOML file of job flags (keys named like the flags) stands for, to go
    before the command line's (which win); keys in `ignore` (dests: the command's own flags,
    such as `coordinator`) are left out. ConfigError naming the file and key when bad."""
    data = flags.load_toml(path, "job file")
    known = {a.action.dest: a for a in flags.arguments_of(parser) if a.action.option_strings}
    words: list[str] = []
    for key, value in data.items():
        if key.replace("-", "_") in ignore:
            continue
        argument = known.get(key.replace("-", "_"))
        if argument is None:
            raise ConfigError(f"job file {path}: unknown key {key!r}; the keys are the job "
                              "flags of `coordinator submit -h`, named without the dashes")
        flag = max(argument.action.option_strings, key=len)
        if argument.kind in (flags.STORE_TRUE, flags.STORE_FALSE):
            if not isinstance(value, bool):
                raise ConfigError(f"job file {path}: {key} ({flag}) must be true or false")
            if value == (argument.kind == flags.STORE_TRUE):
                words.append(flag)
        elif isinstance(value, bool | int | float | str):
            words += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
        else:
            raise ConfigError(f"job file {path}: {key} ({flag}) must be a string or number")
    return words


def size_problem(args: Sequence[str]) -> str:
    """Why a submission's words are too many or too long ('' when they fit)."""
    if len(args) > MAX_ARGS:
        return f"a submission holds at most {MAX_ARGS} words of job flags, got {len(args)}"
    sizes = [len(a.encode(errors="replace")) for a in args]
    if sizes and max(sizes) > MAX_ARG_BYTES:
        return f"a job flag's value may hold {MAX_ARG_BYTES} bytes, one has {max(sizes)}"
    if sum(sizes) > MAX_SUBMIT_BYTES:
        return f"a submission's job flags may hold {MAX_SUBMIT_BYTES} bytes, got {sum(sizes)}"
    return ""


def parse_submitted(args: Sequence[str]) -> JobConfig:
    """The validated `JobConfig` of a submission's words; ConfigError naming the flag."""
    if problem := size_problem(args):
        raise ConfigError(problem)
    parsed = job_parser().parse_args(list(args))
    for flag, instead in COORDINATOR_PATHS.items():
        if getattr(parsed, flag.removeprefix("--").replace("-", "_"), ""):
            raise ConfigError(f"{flag} names a path on the coordinator's machine, which a "
                              f"submitted job may not: {instead}")
    if parsed.placement.split(":", 1)[0] not in ("scheduled", "rank-order", "random"):
        raise ConfigError("--placement: a plan file lives on the coordinator's machine, which "
                          "a submitted job may not name: submit scheduled, rank-order or "
                          "random[:SEED]")
    if not parsed.model:
        raise ConfigError("--model is required: the model preset the job trains")
    config = job_config(parsed)
    config.validate()
    return config
