"""Tiny random Hugging Face models and byte-token data for the import/export tests (built
with `transformers`; nothing is downloaded)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file

VOCAB = 256  # byte-valued tokens: the bundled corpus and the val.bin below fit


def tiny_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3,
                                      n_head=2)
        return transformers.GPT2LMHeadModel(cfg)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **common, tie_word_embeddings=False, rope_theta=500000.0))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **common, tie_word_embeddings=True))


def saved(tmp: Path, kind: str, eos: int | None = None) -> tuple[Path, torch.nn.Module]:
    """A tiny random model saved under `tmp/kind`; with `eos`, its config names that id as
    bos and eos, and a tokenizer whose end-of-text token has it lies beside the weights."""
    model = tiny_model(kind).eval()
    out = tmp / kind
    if eos is not None:
        model.config.bos_token_id = model.config.eos_token_id = eos
        model.generation_config.bos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    if eos is not None:
        save_tokenizer(out, eos)
    return out, model


EOT = "<|endoftext|>"
# An end-of-text id no byte of the (UTF-8) text trained on has: greedy generation on a model
# fine-tuned on that text runs its full length, so it compares token for token.
EOT_ID = 0xFF


def save_tokenizer(d: Path, eos: int) -> None:
    """A word-level tokenizer of VOCAB entries (id `eos` the end-of-text token) that
    `transformers` loads from `d` (tokenizer.json and tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab = {(EOT if i == eos else w): i for w, i in vocab.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1" if eos != 1 else "w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOT])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT}))


def exported_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.exists() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(out / name))
    return tensors


# this repository's docs/*.md as of 81e680b, frozen: read live, every docs edit changed the
# tests' data, and one such edit put an honest job's batches on a loss spike that its
# replicas' gradient check took for an attack (stop 54's CI)
CORPUS = Path(__file__).parent / "data" / "docs-corpus.md.gz"


def byte_data(tmp: Path) -> Path:
    """train.bin / val.bin of byte tokens (uint16), from a frozen copy of this repository's
    own text (`CORPUS`)."""
    text = gzip.decompress(CORPUS.read_bytes())
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    d = tmp / "data"
    d.mkdir()
    cut = int(len(tokens) * 0.9)
    tokens[:cut].tofile(d / "train.bin")
    tokens[cut:].tofile(d / "val.bin")
    return d


def hf_val_loss(model: torch.nn.Module, data: Path, seq: int = 32, batches: int = 8) -> float:
    val = np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64)
    ids = torch.from_numpy(val[: batches * (seq + 1)].reshape(batches, seq + 1))
    with torch.no_grad():
        return float(model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)




def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """The ids `transformers`' greedy `generate` appends to `prompt`."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def agent_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """The ids `python -m agent generate --greedy` appends to `prompt`, run as a user would (a
    fresh interpreter, dtfm's own model code on the directory)."""
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "generate", "--model-dir", str(model_dir),
         "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(new_tokens),
         "--greedy", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == prompt, out
    return list(out["new_ids"])


def val_prompt(data: Path, length: int = 8) -> list[int]:
    """The first `length` ids of val.bin: a prompt from text the model was not trained on."""
    return np.fromfile(data / "val.bin", dtype=np.uint16, count=length).astype(int).tolist()
