"""A merged LoRA export run in a process of its own: the request both ends read and write.

Folding adapters into their base needs torch and the whole model in memory
(`agent/worker/loramerge.py`). `coordinator start --export-merged` and `coordinator export
--merged` need it too, but the coordinator is torch-free and never imports the agent's code
(tests/dtfm/test_layering.py): it writes a `MergeRequest` to a private file and runs the merge
as a child process (`dtfm.launcher.run_merge`), as the agent runs its workers. One codec
here, so the two ends cannot disagree on a field.

The request is the caller's own (written by this process, read by its child): it is checked
for shape only, not treated as hostile input.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

from dtfm.core.hfexport import ExportSource, StageFile
from dtfm.core.spec import ModelSpec, TrainConfig
from protos.dtfm.v1 import common_pb2, coordinator_pb2

# the child's exit status for an ExportError: its message is the last line of its stderr
EXPORT_ERROR_EXIT = 2


@dataclass(frozen=True)
class MergeRequest:
    """Everything `write_merged_export` takes but the progress callback."""

    out: Path
    spec: ModelSpec
    cfg: TrainConfig
    files: tuple[StageFile, ...]
    source: ExportSource | None = None
    force: bool = False

    def dumps(self) -> str:
        def b64(msg: object) -> str:
            return base64.b64encode(msg.SerializeToString()).decode()  # type: ignore[attr-defined]

        return json.dumps({
            "out": str(self.out), "force": self.force,
            "spec": b64(self.spec.to_proto()), "cfg": b64(self.cfg.to_proto()),
            "source": b64(self.source.to_proto()) if self.source is not None else None,
            "files": [[f.stage, str(f.path)] for f in self.files]})

    @classmethod
    def loads(cls, text: str) -> MergeRequest:
        body = json.loads(text)
        spec = common_pb2.ModelSpec.FromString(base64.b64decode(body["spec"]))
        cfg = common_pb2.TrainConfig.FromString(base64.b64decode(body["cfg"]))
        source = None
        if body["source"] is not None:
            source = ExportSource.from_proto(
                coordinator_pb2.ExportSource.FromString(base64.b64decode(body["source"])))
        return cls(out=Path(body["out"]), spec=ModelSpec.from_proto(spec),
                   cfg=TrainConfig.from_proto(cfg),
                   files=tuple(StageFile(int(s), Path(p)) for s, p in body["files"]),
                   source=source, force=bool(body["force"]))
