"""The checkpoint layout on disk and its manifest: names, atomic writes, verification, pruning.

Both the worker (which writes a stage's checkpoints and resumes from them) and the agent
daemon (which serves them to peers and fetches the ones it lacks) must agree on this to the
byte, and the daemon may not import torch, so it lives here, with no torch and no grpc.

Layout under a checkpoint directory ROOT (the operator's `--checkpoint-dir`, or else the
agent's own `STATE_DIR/checkpoints`):

```
ROOT/<job id>/stage-<S>/step-<NNNNNNNN>.safetensors     the stage's weights, Hugging Face names
ROOT/<job id>/stage-<S>/step-<NNNNNNNN>.pt              optimizer, data position, layers, buffers
ROOT/<job id>/stage-<S>/step-<NNNNNNNN>.manifest.json   size and sha256 of the files above
```

The weights are a safetensors file under the tensor names and layout of the model's Hugging
Face class (`dtfm.core.hfconfig.part_tensors`), so an export (`dtfm.core.hfexport`) is the
stages' files plus an index and a config, and the agents' mirroring copies them like any
file a manifest lists. Checkpoints written before that hold the weights in the `.pt` itself
(its `model` entry) and load as they did.

- **Keyed by job** (`job_key`): a new job pointed at a directory an earlier job left starts
  from step 0; a recovering job (same id, new epoch) finds its own.
- **Atomic writes** (`atomic_write`): temp file, `fsync`, `os.replace`, `fsync` of the
  directory, so a crash never leaves a half-written file under a final name.
- **A manifest, written last** (`Manifest`): the size and sha256 of each file of a step. A
  step without one, or whose files disagree with it (`verify`), is never loaded, and never
  served to a peer; a file copied from a peer is installed only once it matches.
- **Pruned** (`prune`): the newest `KEEP` complete steps of a stage stay; older ones, steps
  newer than the newest one kept (a timeline the job abandoned), temp files of dead writers
  and stale partial downloads go.
- **Kept for a lagging mirror** (`write_floor`, `ROOT/<job id>/keep-from`): a stage with one
  replica survives its agent only as the copy the next stage's agent mirrors, every few
  seconds, so that copy may hold an older step than the other stages still keep. Every stage
  must hold the step a recovery resumes from, so while the coordinator names a floor (the
  oldest step any mirror holds as its newest) every step from it on is kept too, up to
  `MAX_HELD` steps (more while they fit in `MAX_HELD_BYTES`). Without the floor a fast job
  left a lost stage's mirror at step 10 while the survivors kept only 25 and 30, and the
  recovery restarted from step 0.

- **Bounded by the model** (`size_problem`): a step a peer lists may declare no more bytes
  than its layers' parameters take with their optimizer state (plus slack), so a lying or
  broken peer cannot fill the disk of an agent or exporter that copies it.

- **Read across a re-split** (`sources`): a job that changed its stage count (fewer stages
  after losing agents, more when growing back) resumes from checkpoints cut at the old
  stages. A new stage's layers then come from every old stage whose range overlaps its own;
  parameter names carry global layer indices, so the pieces fit together by name.

Every function takes a *job* directory (`job_dir(ROOT, job_id)`) as `root`, except `job_dir`
and `other_jobs`, which take ROOT.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dtfm.core.layout import layer_ranges
from dtfm.core.spec import ModelSpec

log = logging.getLogger(__name__)

KEEP = 2  # complete steps kept per stage: the newest, and one to fall back on
# Steps kept from the floor on, at most: a mirror that stops copying must not fill the disk.
# MAX_HELD steps, or more while they fit in MAX_HELD_BYTES (small models checkpoint often).
MAX_HELD = 16
MAX_HELD_BYTES = 2 * 1024**3
FLOOR_NAME = "keep-from"
MANIFEST_FORMAT = "dtfm-checkpoint/1"
MAX_STEP = 99_999_999  # step numbers have 8 digits in file names
DATA_RE = re.compile(r"^step-(\d{8})\.(?:pt|safetensors)$")
MANIFEST_RE = re.compile(r"^step-(\d{8})\.manifest\.json$")
TMP_RE = re.compile(r"^\.step-(\d{8})\.(pt|safetensors|manifest\.json)\.tmp\.")
# a download from a peer in progress, named by the sha256 it must end with, so that it is
# resumed only from a peer offering the very same file
PART_RE = re.compile(r"^\.step-(\d{8})\.(?:pt|safetensors)\.([0-9a-f]{16})\.part$")
STAGE_RE = re.compile(r"^stage-\d+$")
_SAFE_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


# ---- names ----


def job_key(job_id: str) -> str:
    """The folder name of `job_id`: the id itself when it is a safe file name (the
    coordinator's `job-1a2b3c4d`, `agent local`'s `local`), else a digest of it, so no job id
    (`../../etc`) can name a folder outside ROOT."""
    if _SAFE_JOB.match(job_id):
        return job_id
    return "job-" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


def job_dir(root: str | Path, job_id: str) -> Path:
    """Where job `job_id` keeps its stages' checkpoints under checkpoint directory `root`."""
    return Path(root) / job_key(job_id)


def stage_dir(root: str | Path, stage: int) -> Path:
    """`root` is a job's directory (`job_dir`), as for every function below."""
    return Path(root) / f"stage-{stage}"


def data_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def path_for(root: str | Path, stage: int, step: int) -> Path:
    return stage_dir(root, stage) / data_name(step)


def weights_name(step: int) -> str:
    return f"step-{step:08d}.safetensors"


def weights_for(root: str | Path, stage: int, step: int) -> Path:
    """The stage's weights of `step` under Hugging Face names (absent in old checkpoints)."""
    return stage_dir(root, stage) / weights_name(step)


def manifest_for(root: str | Path, stage: int, step: int) -> Path:
    return stage_dir(root, stage) / f"step-{step:08d}.manifest.json"


def part_for(root: str | Path, stage: int, name: str, sha256: str) -> Path:
    """The partial download of file `name` (a `DATA_RE` name) that must end with `sha256`."""
    return stage_dir(root, stage) / f".{name}.{sha256[:16]}.part"


def step_of(name: str) -> int | None:
    """The step a data file name (`step-NNNNNNNN.pt` or `.safetensors`) belongs to, or None
    for any other name."""
    m = DATA_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Source:
    """One stage folder a worker reads at resume, and the layer range its checkpoints hold."""

    stage: int
    layers: tuple[int, int]


def sources(n_layers: int, stage: int, layers: tuple[int, int],
            checkpoint_splits: Sequence[int] = ()) -> list[Source]:
    """The stage folders stage `stage` (layers [begin, end)) resumes from, in stage order.

    Without `checkpoint_splits` (the checkpoints are cut as the job is now) that is its own
    folder. Otherwise every stage of that split whose range overlaps `layers`: the first
    stage's embedding is in old stage 0, the last stage's head in the old last stage, and
    each layer in the one old stage that held it. ValueError when the split is impossible."""
    begin, end = layers
    if not checkpoint_splits:
        return [Source(stage, (begin, end))]
    old = layer_ranges(n_layers, len(checkpoint_splits), list(checkpoint_splits))
    return [Source(j, r) for j, r in enumerate(old) if r[0] < end and begin < r[1]]


# ---- the manifest ----


@dataclass(frozen=True)
class FileEntry:
    """One file of a step, as its manifest vouches for it."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a step's manifest says: whose it is and the size and sha256 of each file."""

    job_id: str
    stage: int
    step: int
    layers: tuple[int, int] | None
    files: tuple[FileEntry, ...]

    def to_bytes(self) -> bytes:
        body = {
            "format": MANIFEST_FORMAT, "job_id": self.job_id, "stage": self.stage,
            "step": self.step, "layers": None if self.layers is None else list(self.layers),
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
        }
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_dict(cls, body: Any) -> Manifest:
        """Parse a manifest's JSON; ValueError says what is wrong with it. A file list may
        name only data files of its own step: a peer's manifest decides what we write where."""
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
        job_id, stage, step = body.get("job_id"), body.get("stage"), body.get("step")
        if not (isinstance(job_id, str) and _is_count(stage) and _is_count(step)):
            raise ValueError("its job, stage or step is malformed")
        files = body.get("files")
        if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str)
            and step_of(f["name"]) == step and _is_count(f.get("size"))
            and isinstance(f.get("sha256"), str) and _SHA256.match(f["sha256"])
            for f in files
        ):
            raise ValueError("its file list is malformed")
        return cls(job_id, stage, step, parse_layers(body.get("layers")),
                   tuple(FileEntry(f["name"], f["size"], f["sha256"]) for f in files))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_layers(layers: Any) -> tuple[int, int] | None:
    """A manifest's layer range `[begin, end]` (None: not recorded); ValueError if malformed."""
    if layers is None or (isinstance(layers, Sequence) and len(layers) == 0):
        return None
    if not (isinstance(layers, Sequence) and len(layers) == 2
            and all(_is_count(x) for x in layers) and layers[0] < layers[1]):
        raise ValueError("its layer range is malformed")
    return int(layers[0]), int(layers[1])


def read_manifest(root: str | Path, stage: int, step: int) -> Manifest:
    """The manifest of `step`; OSError when it cannot be read, ValueError when malformed."""
    return Manifest.from_dict(
        json.loads(manifest_for(root, stage, step).read_text(encoding="utf-8")))


def write_manifest(root: str | Path, manifest: Manifest) -> Path:
    """Write `manifest` atomically. Call it only once every file it names is in place."""
    path = manifest_for(root, manifest.stage, manifest.step)
    data = manifest.to_bytes()
    atomic_write(path, lambda f: f.write(data))
    return path


# ---- writing ----


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write `path` through `write` so readers see the old file or the complete new one.

    The temp name has a random part, so two writers (a stale worker still running elsewhere)
    never share one. Errors propagate as raised (the worker turns an OSError into its
    `StorageError`); the temp file never stays behind.
    """
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        private_dir(path.parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(d: Path) -> None:
    """Make a rename in `d` durable (a crash after it must not undo it)."""
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def private_dir(d: Path) -> None:
    """Create folder `d` and whichever of its parents are missing, each 0700: weights are
    private to the user. Folders that already exist keep their mode: dtfm makes its own
    folders private and never changes one it did not create (an export's temporary job
    folder sits beside `--out`, whose parent may be a 1777 /tmp; a `--checkpoint-dir` may be
    shared on purpose). A job folder dtfm created is enough: nothing under it can be reached
    without passing it."""
    missing = []
    p = Path(d)
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for part in reversed(missing):
        try:
            part.mkdir(mode=0o700)
        except FileExistsError:  # another writer made it meanwhile: theirs, left as it is
            continue
        os.chmod(part, 0o700)  # mkdir's mode passed through the umask


def write_floor(root: str | Path, step: int) -> None:
    """Ask `prune` to keep every complete step from `step` on (0: forget the floor). The file
    is advisory and rewritten on every heartbeat, so a plain replace is durable enough."""
    path = Path(root) / FLOOR_NAME
    if step <= 0:
        path.unlink(missing_ok=True)
        return
    private_dir(Path(root))
    tmp = path.with_name(f".{FLOOR_NAME}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, path)


def writes(shared: bool, replica: int) -> bool:
    """Whether `replica`'s worker writes its stage's checkpoints: in an agent's own directory
    every replica does (after a reschedule any of them may be the one that needs it); in a
    shared --checkpoint-dir only replica 0, since two machines replacing one file could pair
    one's manifest with the other's file."""
    return not shared or replica == 0


def floor_dir(own_root: str | Path, job_id: str, shared_root: str, every: int,
              replica: int) -> Path | None:
    """The job directory whose floor (`write_floor`) the pruning of this agent's worker reads:
    the agent's own, or with a shared --checkpoint-dir (`shared_root`) that one, from the
    agent whose worker writes it (`writes`): without it there, the writer kept only its
    newest KEEP steps and a rollback to an older one found none. None: checkpoints are off,
    or another replica's agent writes it."""
    if every == 0 or not writes(bool(shared_root), replica):
        return None
    return job_dir(shared_root or own_root, job_id)


def read_floor(root: str | Path) -> int:
    """The floor `write_floor` set, or 0 (none, or unreadable: then only KEEP are kept)."""
    try:
        text = (Path(root) / FLOOR_NAME).read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def prune(root: str | Path, stage: int, newest: int) -> list[int]:
    """Keep the newest KEEP complete steps up to `newest`, and those from the floor on (at
    most MAX_HELD; see `write_floor`); remove every other step's files (older ones,
    incomplete ones, and any newer than `newest`: an abandoned timeline), temp files of
    writers that died, and partial downloads of steps up to `newest` (one of a newer step may
    still be resumed). Returns the steps kept."""
    d = stage_dir(root, stage)
    done = [m for m in complete_steps(root, stage) if m.step <= newest]
    keep = {m.step for m in done[-KEEP:]}
    if floor := read_floor(root):
        held = [m for m in done if m.step >= floor]
        allowed = _held_allowance(held)
        if len(held) > allowed:
            log.warning(
                "checkpoint: stage %d keeps only its newest %d steps, not all %d from step %d, "
                "the floor the coordinator names (the oldest step a mirror holds as its newest, "
                "or the known-good step a rollback would resume from): a recovery or rollback "
                "to an older step may now resume from an older common step or from 0. A mirror "
                "is failing to copy (see its agent's log), checkpoints come faster than mirrors "
                "copy them (raise --checkpoint-every, or lower the agents' --mirror-interval), "
                "or a member's integrity evidence is not reaching the coordinator (see "
                "`coordinator status`)", stage, allowed, len(held), floor)
        keep.update(m.step for m in held[-allowed:])
    for p in d.iterdir():
        m = DATA_RE.match(p.name) or MANIFEST_RE.match(p.name) or TMP_RE.match(p.name)
        if m and int(m.group(1)) not in keep:
            p.unlink(missing_ok=True)
        elif (part := PART_RE.match(p.name)) and int(part.group(1)) <= newest:
            p.unlink(missing_ok=True)
    return sorted(keep)


def _held_allowance(held: Sequence[Manifest]) -> int:
    """How many of the steps `held` (ascending) `prune` may keep: MAX_HELD, or the newest
    ones that fit in MAX_HELD_BYTES when that is more."""
    total, fit = 0, 0
    for m in reversed(held):
        total += sum(f.size for f in m.files)
        if total > MAX_HELD_BYTES:
            break
        fit += 1
    return max(MAX_HELD, fit)


# ---- what a step may weigh ----

# Bytes per parameter a stage's step may hold, at most: fp32 weights (the safetensors file, or
# the `.pt` of checkpoints from before it), AdamW's two fp32 moments, and the outer momentum of
# local steps (`agent/worker/outer.py`). A quarter more, and a fixed allowance per file for
# headers, parameter names and the data position, is the slack; nothing else is that big.
WEIGHT_BYTES = 4
STEP_BYTES = WEIGHT_BYTES + 8 + 4
SLACK = 1.25
FILE_SLACK = 16 * 1024**2


def max_weights_bytes(spec: ModelSpec, layers: tuple[int, int]) -> int:
    """The most a stage's weights file (layers [begin, end) of `spec`) may declare."""
    return int(spec.stage_params(*layers) * WEIGHT_BYTES * SLACK) + FILE_SLACK


def max_step_bytes(spec: ModelSpec, layers: tuple[int, int]) -> int:
    """The most all of a stage's files of one step may declare together."""
    return int(spec.stage_params(*layers) * STEP_BYTES * SLACK) + 2 * FILE_SLACK


def size_problem(m: Manifest, spec: ModelSpec, layers: tuple[int, int] | None = None
                 ) -> str | None:
    """Why step `m`, as a peer declares it, is larger than the model allows and must not be
    downloaded, or None. Its own layer range bounds it (`layers`, the range expected, when it
    records none; else the whole model): a peer that lists a 10^12-byte file for a
    half-megabyte stage is refused before one byte of it is written. The download then checks
    each file against the declared size and sha256, so what is fetched stays within this."""
    span = m.layers or layers or (0, spec.n_layers)
    if not 0 <= span[0] < span[1] <= spec.n_layers:
        return (f"it claims layers [{span[0]}, {span[1]}), outside {spec.name}'s "
                f"{spec.n_layers}")
    where = f"layers [{span[0]}, {span[1]}) of {spec.name}"
    weights = next((f for f in m.files if f.name == weights_name(m.step)), None)
    if weights is not None and weights.size > (most := max_weights_bytes(spec, span)):
        return (f"its weights file declares {weights.size:,} bytes for {where}, whose weights "
                f"take at most {most:,}: refused before downloading")
    if (total := sum(f.size for f in m.files)) > (most := max_step_bytes(spec, span)):
        return (f"it declares {total:,} bytes for {where}, which hold at most {most:,} "
                f"(weights, optimizer state and slack): refused before downloading")
    return None


# ---- reading ----


def steps_available(root: str | Path, stage: int) -> list[int]:
    """Steps this stage has a file or a manifest for, ascending (intact or not: `verify`)."""
    d = stage_dir(root, stage)
    if not d.is_dir():
        return []
    found = {int(m.group(1)) for p in d.iterdir()
             if (m := DATA_RE.match(p.name) or MANIFEST_RE.match(p.name))}
    return sorted(found)


def complete_manifest(root: str | Path, stage: int, step: int,
                      job_id: str | None = None) -> Manifest | None:
    """`step`'s manifest when the step is complete and, given `job_id`, that job's and this
    stage's and step's; else None. Complete is the cheap check (no data file is read): a
    manifest whose files exist with the sizes it names. Pruning and listing for peers use
    it; loading uses `verify`."""
    try:
        m = read_manifest(root, stage, step)
        if (m.stage, m.step) != (stage, step) or (job_id is not None and m.job_id != job_id):
            return None
        if all((stage_dir(root, stage) / f.name).stat().st_size == f.size for f in m.files):
            return m
    except (OSError, ValueError):
        pass
    return None


def complete_steps(root: str | Path, stage: int, job_id: str | None = None) -> list[Manifest]:
    """The manifests of this stage's complete steps (`complete_manifest`), oldest first."""
    found = (complete_manifest(root, stage, s, job_id) for s in steps_available(root, stage))
    return [m for m in found if m is not None]


def verify(root: str | Path, stage: int, step: int, *, job_id: str | None = None,
           layers: Iterable[int] | None = None) -> str | None:
    """Why this stage's checkpoint of `step` must not be loaded, or None when it is intact.

    Checks the manifest (present, readable, for this job, stage and step, and `layers`), then
    each file's size and sha256 (reading it once).
    """
    path = path_for(root, stage, step)
    if not manifest_for(root, stage, step).exists():
        if not path.exists():
            return "it is missing"
        return ("it has no manifest (the write did not finish, or the file was put there by "
                "hand)")
    try:
        m = read_manifest(root, stage, step)
    except (OSError, ValueError) as e:
        return f"its manifest {manifest_for(root, stage, step).name} is unreadable ({e})"
    if (job_id is not None and m.job_id != job_id) or (m.stage, m.step) != (stage, step):
        return (f"its manifest is for job {m.job_id!r} stage {m.stage} step {m.step}, not job "
                f"{job_id!r} stage {stage} step {step}")
    want = None if layers is None else tuple(layers)
    if want is not None and m.layers is not None and m.layers != want:
        return (f"it holds layers [{m.layers[0]}, {m.layers[1]}) but this stage now has "
                f"[{want[0]}, {want[1]}) (the job was split differently)")
    for f in m.files:
        reason = check_file(stage_dir(root, stage) / f.name, f.size, f.sha256)
        if reason:
            return reason
    return None


def check_file(p: Path, size: int, sha256: str) -> str | None:
    """Why file `p` is not the one a manifest names (size, then sha256), or None."""
    try:
        actual = p.stat().st_size
        if actual != size:
            how = "truncated" if actual < size else "longer than written"
            return f"{p.name} is {actual} bytes, its manifest says {size} ({how})"
        got = sha256_file(p)
    except OSError as e:
        return f"{p.name} cannot be read ({e})"
    if got != sha256:
        return (f"{p.name} fails its checksum (sha256 {got[:16]}..., its manifest says "
                f"{sha256[:16]}...): it changed after it was written")
    return None


def sha256_file(p: Path) -> str:
    with open(p, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def other_jobs(root: str | Path, job_id: str) -> list[str]:
    """Folders under checkpoint directory `root` holding other jobs' stages (and
    `stage-*` folders of the layout before checkpoints were keyed by job, as `(unkeyed)`)."""
    root, mine = Path(root), job_key(job_id)
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    found = []
    for p in entries:
        if p.name == mine or not p.is_dir():
            continue
        if STAGE_RE.match(p.name):
            if "(unkeyed)" not in found:
                found.append("(unkeyed)")
        elif any(STAGE_RE.match(c.name) for c in _children(p)):
            found.append(p.name)
    return found


def _children(p: Path) -> list[Path]:
    try:
        return list(p.iterdir())
    except OSError:
        return []


def newest_intact(root: str | Path, stage: int, job_id: str, layers: tuple[int, int],
                  below: int = 0) -> int:
    """The newest step of `stage` that passes the worker's own check (sha256 included), before
    `below` where that is > 0 (a rollback's bound, `Assignment.resume_before`)."""
    for step in reversed(steps_available(root, stage)):
        if step < (below or step + 1) and verify(root, stage, step, job_id=job_id,
                                                 layers=layers) is None:
            return step
    return 0
