"""The checkpoint layout's folders and bounds (`dtfm.core.checkpoints`): dtfm makes the folders
it creates private and leaves the mode of every other alone; a step a peer declares larger
than the model's layers take is refused before it is downloaded."""

from __future__ import annotations

import stat
from pathlib import Path

from dtfm.core import checkpoints as ondisk
from dtfm.core.checkpoints import FileEntry, Manifest
from dtfm.core.presets import get_preset

SPEC = get_preset("gpt-tiny")  # four layers, about 0.5 MB of fp32 weights per two layers
SHA = "0" * 64


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_only_the_folders_dtfm_creates_are_made_private(tmp_path: Path) -> None:
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o1777)  # like /tmp
    shared = world / "shared"
    shared.mkdir()
    shared.chmod(0o755)  # an operator's --checkpoint-dir, readable on purpose
    tmp_path.chmod(0o755)
    ondisk.private_dir(shared / "job-1" / "stage-0")
    ondisk.atomic_write(world / "job-2" / "stage-1" / "x", lambda f: f.write(b"x"))
    assert (mode(world), mode(shared), mode(tmp_path)) == (0o1777, 0o755, 0o755)
    for made in (shared / "job-1", shared / "job-1" / "stage-0", world / "job-2",
                 world / "job-2" / "stage-1"):
        assert mode(made) == 0o700, made
    ondisk.private_dir(shared / "job-1" / "stage-0")  # already there: left as it is
    (shared / "job-1").chmod(0o750)
    ondisk.write_floor(shared / "job-1", 5)
    assert mode(shared / "job-1") == 0o750 and ondisk.read_floor(shared / "job-1") == 5


def step(sizes: dict[str, int], layers: tuple[int, int] | None = (0, 2)) -> Manifest:
    return Manifest("j", 0, 4, layers, tuple(FileEntry(n, s, SHA) for n, s in sizes.items()))


def test_a_step_may_declare_what_its_layers_take_and_no_more() -> None:
    params = SPEC.stage_params(0, 2)
    weights, state = ondisk.weights_name(4), ondisk.data_name(4)
    # what a worker writes: fp32 weights, AdamW's two moments and an outer momentum
    assert ondisk.size_problem(step({weights: 4 * params, state: 12 * params}), SPEC) is None
    lie = ondisk.size_problem(step({weights: 10**12, state: 100}), SPEC)
    assert lie is not None and "weights file declares 1,000,000,000,000 bytes" in lie
    assert "layers [0, 2) of gpt-tiny" in lie and "refused before downloading" in lie
    huge_state = ondisk.size_problem(step({weights: 100, state: 10**12}), SPEC)
    assert huge_state is not None and "optimizer state" in huge_state
    # the bound is the step's own layers: the whole model's for a step that claims all
    big = ondisk.max_weights_bytes(SPEC, (0, 4))
    assert ondisk.size_problem(step({weights: big}), SPEC) is not None
    assert ondisk.size_problem(step({weights: big}, (0, 4)), SPEC) is None
    # no range recorded: the one expected, else the whole model's
    assert ondisk.size_problem(step({weights: big}, None), SPEC, (0, 2)) is not None
    assert ondisk.size_problem(step({weights: big}, None), SPEC) is None
    outside = ondisk.size_problem(step({weights: 1}, (2, 9)), SPEC)
    assert outside is not None and "outside gpt-tiny's 4" in outside
