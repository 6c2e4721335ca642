"""Careless input to `agent local` and `agent generate` is refused up front, saying what is
wrong and what to do (issue 31): a missing --data before any worker starts, a missing
--model-dir by its own name (not as a missing tokenizer.json inside it), `--prompt-ids 1,,2`,
and --greedy beside the flags that only shape sampling."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent import cli
from agent.commands import local as local_cmd
from agent.commands.generate import _ids


def _local(tmp_path: Path, *flags: str, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    work = tmp_path / "work"
    rc = local_cmd.main(["--workdir", str(work), "--steps", "1", *flags])
    # refused before launching: no worker was given an assignment
    assert not work.exists() or not list(work.glob("*.assignment.pb"))
    return rc, capsys.readouterr().err


def test_agent_local_refuses_missing_data_before_starting_workers(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc, err = _local(tmp_path, "--data", str(tmp_path / "missing"), capsys=capsys)
    assert rc == 2
    assert f"--data {tmp_path / 'missing'}: no such file or directory" in err
    assert "agent prepare" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.bin").write_bytes(b"\0\0" * 100)
    rc, err = _local(tmp_path, "--data", str(empty), capsys=capsys)
    assert rc == 2 and "the directory holds no val.bin" in err, err


def test_prompt_ids_with_an_empty_item_are_refused() -> None:
    assert _ids("1, 2,3") == [1, 2, 3]
    for text, what in (("1,,2", "item 2 of '1,,2' is empty"), ("1,2,", "item 3"),
                       (",1", "item 1"), ("", "item 1 of '' is empty"),
                       ("1,-2", "'-2', is not a token id"), ("1,x", "'x', is not")):
        with pytest.raises(argparse.ArgumentTypeError, match=what):
            _ids(text)


def test_generate_names_a_missing_model_dir(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing"
    assert cli.main(["generate", "--model-dir", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"--model-dir {missing}: no such directory" in err and "tokenizer.json" not in err
    afile = tmp_path / "file"
    afile.write_text("x")
    assert cli.main(["generate", "--model-dir", str(afile), "--prompt-ids", "1"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--temperature", "0.5"], ["--top-k", "3"]])
def test_greedy_with_a_sampling_flag_is_refused(tmp_path: Path, extra: list[str],
                                                capsys: pytest.CaptureFixture) -> None:
    # refused before the directory is even read: the flags contradict each other
    assert cli.main(["generate", "--model-dir", str(tmp_path), "--prompt-ids", "1",
                     "--greedy", *extra]) == 2
    err = capsys.readouterr().err
    assert f"--greedy contradicts {extra[0]}" in err and "drop --greedy to sample" in err
