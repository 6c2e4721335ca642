"""`agent prepare`: text in, the token directory `--data` trains on out.

Tokenizers are built here with the `tokenizers` library (nothing is downloaded); the ids in
the written files are compared with what the same tokenizer's own `encode` gives each
document, followed by the end-of-text id.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from agent.commands.prepare import Options, prepare
from agent.commands.textinput import PrepareError
from agent.worker.data import load_splits
from dtfm.core.tokenfiles import read_meta, tokenizer_hash
from tests.smalldisk import small_disk

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hex "
         "a jovial sphinx of black quartz").split()


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 5 + 3 * (k % 7)))
            for k in range(n)]


def bpe_dir(tmp: Path, vocab: int = 300, eot: str = "<|endoftext|>") -> Path:
    """A byte-level BPE saved as a Hugging Face tokenizer directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eot], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(200, seed=9), trainer=trainer)
    d = tmp / "bpe"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": eot}))
    return d


def wordlevel_dir(tmp: Path, n_words: int, specials: tuple[str, ...] = ("<|endoftext|>",),
                  config: dict | None = None, name: str = "wl") -> Path:
    """A word-level tokenizer: our WORDS first, then filler words up to `n_words` entries."""
    vocab = {t: i for i, t in enumerate(specials)}
    vocab["[UNK]"] = len(vocab)
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    for i in range(n_words - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if specials:
        tok.add_special_tokens(list(specials))
    d = tmp / name
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def write_inputs(tmp: Path, docs: list[str]) -> Path:
    """docs[0] as a .txt file, the rest as .jsonl lines (the reading order is the docs')."""
    d = tmp / "in"
    d.mkdir()
    (d / "a.txt").write_text(docs[0])
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                       for i, t in enumerate(docs[1:])))
    return d


def run(tmp: Path, inputs: list[Path], out: str = "out", **kw: object) -> Path:
    opts = Options(inputs=[str(p) for p in inputs], out=str(tmp / out), **kw)  # type: ignore
    prepare(opts, io.StringIO())
    return tmp / out


def expected(tok_dir: Path, docs: list[str], eot: int) -> list[list[int]]:
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return [tok.encode(d, add_special_tokens=False).ids + [eot] for d in docs]


def test_txt_and_jsonl_become_each_document_then_end_of_text(tmp_path: Path) -> None:
    docs = corpus(6)
    tok_dir = bpe_dir(tmp_path)
    (tok_dir / "added_tokens.json").write_text("{}")  # any of a tokenizer's files travels
    out = run(tmp_path, [write_inputs(tmp_path, docs)], tokenizer=str(tok_dir),
              val_fraction=0.5)
    meta = read_meta(out)
    assert meta is not None
    eot = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id("<|endoftext|>")
    want = expected(tok_dir, docs, eot)
    # document d goes to val when floor((d+1)/2) > floor(d/2): the odd ones
    train = [i for d in range(0, 6, 2) for i in want[d]]
    val = [i for d in range(1, 6, 2) for i in want[d]]
    assert np.fromfile(out / "train.bin", dtype="<u2").tolist() == train
    assert np.fromfile(out / "val.bin", dtype="<u2").tolist() == val
    assert (meta.dtype, meta.eot_id, meta.eot_token) == ("uint16", eot, "<|endoftext|>")
    assert meta.documents == {"train": 3, "val": 3}
    assert meta.tokens == {"train": len(train), "val": len(val)}
    assert meta.max_token_id == max(train + val)
    assert meta.vocab_size == Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    assert meta.val_split == "documents"
    assert [Path(s["path"]).name for s in meta.sources] == ["a.txt", "b.jsonl"]
    # the tokenizer files travel with the data, and the hash is that of their bytes
    for name in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json"):
        assert (out / name).read_bytes() == (tok_dir / name).read_bytes()
    assert meta.tokenizer_hash == hashlib.sha256(
        (tok_dir / "tokenizer.json").read_bytes()).hexdigest() == tokenizer_hash(tok_dir)
    # --data reads them back, checked against the model's vocabulary
    tr, va = load_splits(str(out), 300)
    assert tr.tolist() == train and va.tolist() == val


def test_a_long_text_file_is_one_document_in_pieces(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.commands.textinput as textinput

    monkeypatch.setattr(textinput, "PIECE_CHARS", 64)  # many pieces, and batches of several
    monkeypatch.setattr(textinput, "BATCH_CHARS", 200)
    text = "\n".join(corpus(60)) + "\n  indented\tand  spaced \n\n\nend" + " " * 150 + "x"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "long.txt").write_text(text)
    tok_dir = bpe_dir(tmp_path)  # byte-level: the pieces must encode as the whole text does
    out = run(tmp_path, [tmp_path / "in"], tokenizer=str(tok_dir))
    meta = read_meta(out)
    assert meta is not None
    # one document, too few to give val one: the last 0.5 % of the tokens are val instead
    (want,) = expected(tok_dir, [text], meta.eot_id)
    got = np.fromfile(out / "train.bin", "<u2").tolist() + np.fromfile(out / "val.bin",
                                                                        "<u2").tolist()
    assert got == want and want.count(meta.eot_id) == 1
    assert meta.val_split == "tail" and meta.tokens["val"] == math.ceil(len(want) * 0.005)
    assert meta.documents == {"train": 1, "val": 0}


def test_the_same_input_gives_the_same_bytes_and_a_trained_tokenizer_loads(
        tmp_path: Path) -> None:
    inp = write_inputs(tmp_path, corpus(300))
    a = run(tmp_path, [inp], "a", train_vocab=300)
    b = run(tmp_path, [inp], "b", train_vocab=300)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["meta.json", "tokenizer.json", "tokenizer_config.json", "train.bin",
                     "val.bin"]
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    meta = read_meta(a)
    assert meta is not None and 257 <= meta.vocab_size <= 300 and meta.documents["val"] == 1
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(a))
    assert hf.eos_token_id == meta.eot_id
    ids = np.fromfile(a / "train.bin", "<u2").tolist()
    first = ids[: ids.index(meta.eot_id)]
    assert hf.decode(first) == corpus(300)[0]


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path: Path) -> None:
    tok_dir = wordlevel_dir(tmp_path, 70_000)
    docs = ["the w69990 fox w12 w69000", "lazy w65600 dog", "w3 w4"]
    out = run(tmp_path, [write_inputs(tmp_path, docs)], tokenizer=str(tok_dir),
              val_fraction=0.5)
    meta = read_meta(out)
    assert meta is not None and meta.dtype == "uint32" and meta.vocab_size == 70_000
    want = expected(tok_dir, docs, meta.eot_id)
    assert np.fromfile(out / "train.bin", "<u4").tolist() == want[0] + want[2]
    assert (out / "val.bin").stat().st_size == 4 * len(want[1])
    assert meta.max_token_id == max(want[0]) > 65535
    train, val = load_splits(str(out), 70_000)
    assert train.tolist() == want[0] + want[2] and val.tolist() == want[1]
    with pytest.raises(ValueError, match=r"token id \d+ but the model's vocabulary is 65536"):
        load_splits(str(out), 65536)


def test_the_end_of_text_token_is_found_or_must_be_named(tmp_path: Path) -> None:
    inp = write_inputs(tmp_path, corpus(3))
    none = wordlevel_dir(tmp_path, 40, specials=(), name="none")
    with pytest.raises(PrepareError, match="no end-of-text token.*--eot-token"):
        run(tmp_path, [inp], "o1", tokenizer=str(none))
    assert not (tmp_path / "o1").exists()
    out = run(tmp_path, [inp], "o2", tokenizer=str(none), eot_token="[UNK]")
    assert read_meta(out).eot_token == "[UNK]"  # type: ignore[union-attr]
    with pytest.raises(PrepareError, match="--eot-token 'nope' is not a token"):
        run(tmp_path, [inp], "o3", tokenizer=str(none), eot_token="nope")
    # no known separator: the eos_token its tokenizer_config.json names
    cfg = wordlevel_dir(tmp_path, 40, specials=("[EOS]",), config={"eos_token": {
        "content": "[EOS]"}}, name="cfg")
    meta = read_meta(run(tmp_path, [inp], "o4", tokenizer=str(cfg)))
    assert meta is not None and (meta.eot_token, meta.eot_id) == ("[EOS]", 0)
    # a known separator wins over an instruct model's configured eos
    both = wordlevel_dir(tmp_path, 40, specials=("<|im_end|>", "</s>"),
                         config={"eos_token": "<|im_end|>"}, name="both")
    meta = read_meta(run(tmp_path, [inp], "o5", tokenizer=str(both / "tokenizer.json")))
    assert meta is not None and (meta.eot_token, meta.eot_id) == ("</s>", 1)


def test_bad_input_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    tok = str(bpe_dir(tmp_path))
    (tmp_path / "in").mkdir()
    bad = tmp_path / "in" / "x.jsonl"
    bad.write_text(json.dumps({"text": "one", "body": "a b"}) + "\n\n"
                   + json.dumps({"body": "the end"}) + "\n")
    with pytest.raises(PrepareError, match=r"x.jsonl line 3: no field 'text' \(it has: body\)"):
        run(tmp_path, [bad], tokenizer=tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe", "in"]  # no partial dir left
    meta = read_meta(run(tmp_path, [bad], tokenizer=tok, text_field="body"))
    assert meta is not None and meta.documents["train"] + meta.documents["val"] == 2
    with pytest.raises(PrepareError, match="not a .txt, .jsonl, .parquet file"):
        run(tmp_path, [tmp_path / "bpe" / "tokenizer_config.json"], "o2", tokenizer=tok)
    with pytest.raises(PrepareError, match="no tokenizer.json there"):
        run(tmp_path, [bad], "o3", tokenizer=str(tmp_path / "in"))


def test_an_existing_out_is_kept_unless_forced(tmp_path: Path) -> None:
    inp = write_inputs(tmp_path, corpus(5))
    tok = str(bpe_dir(tmp_path))
    (tmp_path / "empty").mkdir()
    run(tmp_path, [inp], "empty", tokenizer=tok)  # an empty directory is fine
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(PrepareError, match="exists and is not empty.*--force"):
        run(tmp_path, [inp], "full", tokenizer=tok)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    run(tmp_path, [inp], "full", tokenizer=tok, force=True)
    assert not (tmp_path / "full" / "keep.txt").exists()
    assert (tmp_path / "full" / "train.bin").read_bytes() == \
        (tmp_path / "empty" / "train.bin").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(PrepareError, match="holds the input .*a.txt: choose an --out outside"):
        run(tmp_path, [inp], "in", tokenizer=tok, force=True)  # would delete the input
    assert (inp / "a.txt").exists()


def test_parquet_rows_are_documents(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = corpus(5)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"content": docs[:3] + [None] + docs[3:], "n": list(range(6))}),
                   tmp_path / "in" / "p.parquet")
    tok_dir = bpe_dir(tmp_path)
    with pytest.raises(PrepareError, match="no column 'text' \\(it has: content, n\\)"):
        run(tmp_path, [tmp_path / "in"], "o1", tokenizer=str(tok_dir))
    out = run(tmp_path, [tmp_path / "in"], tokenizer=str(tok_dir), text_field="content",
              val_fraction=0.5)
    meta = read_meta(out)
    assert meta is not None and meta.documents == {"train": 3, "val": 2}
    want = expected(tok_dir, docs, meta.eot_id)
    assert np.fromfile(out / "train.bin", "<u2").tolist() == want[0] + want[2] + want[4]
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(PrepareError, match="bad.parquet: not a parquet file pyarrow reads"):
        run(tmp_path, [tmp_path / "bad.parquet"], "o2", tokenizer=str(tok_dir))


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PrepareError, match="p.parquet: reading .parquet needs pyarrow: "
                                           "pip install pyarrow"):
        run(tmp_path, [tmp_path / "in"], tokenizer=str(bpe_dir(tmp_path)))
    assert not (tmp_path / "out").exists()


def test_a_full_disk_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "64k") as disk:
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "big.txt").write_text(" ".join(corpus(3000)))  # ~150k tokens
        tok = str(wordlevel_dir(tmp_path, 64))
        with pytest.raises(PrepareError) as info:
            run(tmp_path, [tmp_path / "in"], "disk/out", tokenizer=tok)
        message = str(info.value)
        assert "train.bin" in message and f"({errno.errorcode[errno.ENOSPC]})" in message
        assert "free space there or choose --out on a larger disk" in message
        assert list(disk.iterdir()) == []


def test_the_command_line_refuses_clearly_and_trains_end_to_end(tmp_path: Path) -> None:
    """`agent prepare` then `agent local --data`: a model whose vocabulary holds the
    tokenizer's trains on it; one whose vocabulary is too small is refused before any worker
    starts, naming the data and both numbers."""
    docs = corpus(400)
    inp = write_inputs(tmp_path, docs)
    small = wordlevel_dir(tmp_path, 200, name="small")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def agent(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=100)

    done = agent("prepare", "--input", str(inp), "--out", str(tmp_path / "data"),
                 "--tokenizer", str(small), "--val-fraction", "0.1")
    assert done.returncode == 0, done.stderr
    assert "prepared" in done.stdout and "tokenizing:" in done.stderr
    again = agent("prepare", "--input", str(inp), "--out", str(tmp_path / "data"),
                  "--tokenizer", str(small))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
    both = agent("prepare", "--input", str(inp), "--out", str(tmp_path / "x"),
                 "--tokenizer", str(small), "--train-tokenizer", "300")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr

    trained = agent("local", "--model", "gpt-tiny", "--stages", "2", "--replicas", "1",
                    "--steps", "3", "--batch", "4", "--eval-batches", "1", "--threads", "1",
                    "--json", "--data", str(tmp_path / "data"))
    assert trained.returncode == 0, trained.stderr[-2000:]
    events = [json.loads(line) for line in trained.stdout.splitlines()]
    assert events[-1]["val_loss"] > 0 and len([e for e in events if "step" in e]) == 3

    big = wordlevel_dir(tmp_path, 300, name="big")
    assert agent("prepare", "--input", str(inp), "--out", str(tmp_path / "data300"),
                 "--tokenizer", str(big)).returncode == 0
    refused = agent("local", "--model", "gpt-tiny", "--steps", "1",
                    "--data", str(tmp_path / "data300"))
    assert refused.returncode == 2
    assert f"--data {tmp_path / 'data300'} was tokenized with a vocabulary of 300 but the " \
           f"model's vocabulary is 256" in refused.stderr


def test_a_vocabulary_with_gaps_is_sized_by_its_largest_id(tmp_path: Path) -> None:
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "fox": 70_000},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    out = run(tmp_path, [write_inputs(tmp_path, ["fox dog", "fox"])],
              tokenizer=str(tmp_path / "tok"))
    meta = read_meta(out)
    assert meta is not None and (meta.vocab_size, meta.dtype) == (70_001, "uint32")
    assert meta.max_token_id == 70_000


# ---- long documents: cut into pieces that encode as the whole (issue 31)

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def realistic_text(chars: int = 120_000) -> str:
    """Prose and code: this repository's docs and agent sources (Markdown tables, indented
    code, blank lines, punctuation before newlines), in sorted order."""
    files = sorted(REPO.glob("docs/*.md")) + sorted(REPO.glob("agent/*.py"))
    return "".join(p.read_text(encoding="utf-8") for p in files)[:chars]


def trained(kind: str, text: str) -> Tokenizer:
    """A BPE trained on `text` with the pre-tokenizer of GPT-2 (what --train-tokenizer
    makes), of Llama 3 (its split regex, then bytes), of SentencePiece-style Metaspace, or
    (llama2) with no pre-tokenizer and a normalizer that prepends U+2581 to every input."""
    from tokenizers import Regex, normalizers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind in ("metaspace", "llama2") else None))
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    byte_level = kind in ("gpt2", "llama3")
    trainer = trainers.BpeTrainer(
        vocab_size=1000, show_progress=False, special_tokens=["<|endoftext|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [])
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tok


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "metaspace"])
def test_a_document_cut_into_pieces_encodes_as_the_whole(kind: str) -> None:
    """Each cut lies before a word's leading space, where these pre-tokenizers split anyway:
    the pieces' ids, concatenated, are the whole text's, on prose and code alike."""
    from agent.commands.prepare import cuts_change_ids
    from agent.commands.textinput import cut

    text = realistic_text()
    pieces = list(cut(text, 1500))
    assert "".join(pieces) == text and len(pieces) > 80
    assert all(0 < len(p) <= 1500 for p in pieces)
    assert all(p[0] == " " and not p[1].isspace() for p in pieces[1:])  # the rule, every cut
    tok = trained(kind, text)
    whole = tok.encode(text, add_special_tokens=False).ids
    parts = tok.encode_batch(pieces, add_special_tokens=False)
    assert [i for enc in parts for i in enc.ids] == whole
    assert not cuts_change_ids(tok)


def test_text_without_spaces_is_cut_at_a_newline_else_at_the_limit() -> None:
    from agent.commands.textinput import cut

    text = "\u4e2d\u6587" * 40 + "\n\u6587" + "\u3002\n" + "\u5b57" * 30
    pieces = list(cut(text, 100))
    assert pieces[0] == "\u4e2d\u6587" * 40 and pieces[1].startswith("\n\u6587")
    assert "".join(pieces) == text and all(0 < len(p) <= 100 for p in pieces)
    blob = "x" * 250
    assert list(cut(blob, 100)) == ["x" * 100, "x" * 100, "x" * 50]
    assert list(cut("", 100)) == [""] and list(cut(" " + "y" * 99 + " z", 100))[0][0] == " "


def test_a_tokenizer_that_cuts_change_is_named(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A normalizer that prepends U+2581 to every input (older Llama 2 tokenizer.json files)
    gives a cut document other ids: `agent prepare` says so, with how many cuts."""
    import agent.commands.textinput as textinput
    from agent.commands.prepare import CUT_PROBE, CUT_PROBE_PIECE, cuts_change_ids

    probe = list(textinput.cut(CUT_PROBE, CUT_PROBE_PIECE))  # cut by the rule alone
    assert len(probe) > 5 and all(p[0] == " " and not p[1].isspace() for p in probe[1:])
    text = " ".join(corpus(60))
    tok = trained("llama2", text)
    assert cuts_change_ids(tok)
    d = tmp_path / "l2"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text(text)
    monkeypatch.setattr(textinput, "PIECE_CHARS", 1000)
    log = io.StringIO()
    prepare(Options(inputs=[str(tmp_path / "doc.txt")], out=str(tmp_path / "out"),
                    tokenizer=str(d)), log)
    cuts = len(list(textinput.cut(text, 1000))) - 1
    assert f"so the ids at its {cuts:,} cuts differ" in log.getvalue()
    monkeypatch.setattr(textinput, "PIECE_CHARS", 1 << 20)
    log = io.StringIO()  # nothing to say where nothing was cut
    prepare(Options(inputs=[str(tmp_path / "doc.txt")], out=str(tmp_path / "out2"),
                    tokenizer=str(d)), log)
    assert "note:" not in log.getvalue()


def test_a_long_jsonl_document_or_parquet_row_is_encoded_in_pieces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One .jsonl line (and one .parquet row) holding a long document reaches the tokenizer
    in pieces of at most PIECE_CHARS characters, as a .txt does, so memory does not grow with
    the document; the ids are those of the whole document, the same as from the .txt."""
    import agent.commands.textinput as textinput

    monkeypatch.setattr(textinput, "PIECE_CHARS", 2000)
    monkeypatch.setattr(textinput, "BATCH_CHARS", 9000)
    text = realistic_text()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.jsonl").write_text(json.dumps({"id": 7, "text": text}) + "\n")
    (tmp_path / "doc.txt").write_text(text)
    sources = textinput.find_sources([str(tmp_path / "in")])
    reader = textinput.Reader(sources, "text")
    pieces = list(reader.pieces())
    assert max(len(p.text) for p in pieces) <= 2000 and reader.cuts == len(pieces) - 1 > 50
    assert "".join(p.text for p in pieces) == text and [p.ends for p in pieces][-1]

    out = run(tmp_path, [tmp_path / "in"], "j", train_vocab=1000)  # the bundled tokenizer
    meta = read_meta(out)
    assert meta is not None and meta.documents == {"train": 1, "val": 0}
    (want,) = expected(out, [text], meta.eot_id)
    got = np.fromfile(out / "train.bin", "<u2").tolist() + np.fromfile(out / "val.bin",
                                                                        "<u2").tolist()
    assert got == want
    txt = run(tmp_path, [tmp_path / "doc.txt"], "t", tokenizer=str(out))
    for name in ("train.bin", "val.bin"):
        assert (txt / name).read_bytes() == (out / name).read_bytes()

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [text]}), tmp_path / "row.parquet")
    rows = list(textinput.Reader(textinput.find_sources([str(tmp_path / "row.parquet")]),
                                 "text").pieces())
    assert max(len(p.text) for p in rows) <= 2000 and "".join(p.text for p in rows) == text
    par = run(tmp_path, [tmp_path / "row.parquet"], "p", tokenizer=str(out))
    assert (par / "train.bin").read_bytes() == (out / "train.bin").read_bytes()


def test_invalid_utf8_in_jsonl_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(PrepareError) as exc:
        run(tmp_path, [bad], tokenizer=str(bpe_dir(tmp_path)))
    assert str(exc.value).startswith(f"{bad} line 3: not UTF-8 (invalid continuation byte "
                                     f"at byte 14 of the line); a .jsonl must be UTF-8")
    assert "iconv -f LATIN1 -t UTF-8" in str(exc.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    # valid JSON, no text: a lone surrogate escape (a pair is one character, and fine)
    half = tmp_path / "half.jsonl"
    half.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "cut \\ud83d here"}\n')
    with pytest.raises(PrepareError, match=r"half.jsonl line 2: field 'text' holds a lone "
                                           r"surrogate \(\\ud83d at character 5\)"):
        run(tmp_path, [half], tokenizer=str(tmp_path / "bpe"))


HOLD_MID_RUN = """
import sys
import agent.commands.textinput as textinput
from agent.cli import main

reads = textinput.Reader.pieces

def pieces(self):  # the real reader, held after its first piece until the test signals
    for n, piece in enumerate(reads(self)):
        yield piece
        if n == 0:
            print("reading", flush=True)
            sys.stdin.readline()

textinput.Reader.pieces = pieces
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(60)
def test_sigterm_mid_run_removes_the_partial_directory(tmp_path: Path) -> None:
    """SIGTERM (a service manager's or `kill`'s stop) unwinds as Ctrl-C does: the hidden
    partial directory is removed, `--out` never appears, exit status 143."""
    import signal

    inp = write_inputs(tmp_path, corpus(50))
    tok = bpe_dir(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_MID_RUN, "prepare", "--input", str(inp), "--out",
         str(tmp_path / "out"), "--tokenizer", str(tok)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "reading\n"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
        child.send_signal(signal.SIGTERM)  # stdin stays open: only the signal ends the hold
        child.wait(timeout=30)
        assert child.stderr is not None
        err = child.stderr.read()
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 143, err
    assert f"agent prepare: terminated (SIGTERM); nothing was written to {tmp_path / 'out'}" \
        in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe", "in"]
