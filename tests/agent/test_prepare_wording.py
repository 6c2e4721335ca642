"""What `agent prepare` prints: val cut from the end of train is not "0 documents", and its
progress into a file or pipe is a few lines, not one per update."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.test_prepare import REPO, corpus, wordlevel_dir


@pytest.mark.timeout(120)
def test_val_cut_from_the_tail_is_not_called_zero_documents(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.txt").write_text("\n".join(corpus(300)))  # one document
    tok = wordlevel_dir(tmp_path, 200)
    done = subprocess.run([sys.executable, "-m", "agent", "prepare", "--input",
                           str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                           "--tokenizer", str(tok)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=100)
    assert done.returncode == 0, done.stderr
    assert "(0 documents)" not in done.stdout
    assert "tokens cut from the end of train (too few documents to hold one out whole)" \
        in done.stdout
    assert "train " in done.stdout and "(1 documents)" not in done.stdout
    # stderr is a pipe: the progress line is written a few times, never redrawn
    progress = [line for line in done.stderr.splitlines() if line.startswith("tokenizing:")]
    assert 1 <= len(progress) <= 3 and "\r" not in done.stderr
