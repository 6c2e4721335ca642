"""`agent generate`: a continuation from a Hugging Face model directory, by dtfm's own model.

The user's quick look at what they trained (an export) or imported (what `--init-from` takes),
and the proof that dtfm's forward pass is the checkpoint's: the tokens come from
`agent.worker.generate` (dtfm's parts, loaded with `agent.worker.hfload`), never from
`transformers`. Text goes through the directory's `tokenizer.json` (the `tokenizers` library);
a directory without one takes `--prompt-ids`. A `peft` adapter directory (`agent local
--export-dir` of a LoRA job) runs on its base with the adapters merged in. This module owns
the flags, the tokenizer and what is printed; torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dtfm import flags
from dtfm.core.tokenfiles import TOKENIZER_NAME

DEFAULT_TEMPERATURE = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="Hugging Face model directory: config.json and model.safetensors (or "
                   "shards with model.safetensors.index.json), tokenizer.json for text; or a "
                   "peft LoRA adapter directory, run on the base its adapter_config.json names")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="text to continue (needs "
                        f"{TOKENIZER_NAME} in --model-dir)")
    prompt.add_argument("--prompt-ids", metavar="ID,ID,...", type=_ids,
                        help="token ids to continue, comma-separated")
    p.add_argument("--max-new-tokens", type=flags.number(int, 0, maximum=1_000_000), default=32,
                   metavar="N", help="tokens to generate at most (default %(default)s); fewer "
                   "when the model emits its end-of-sequence token")
    p.add_argument("--greedy", action="store_true",
                   help="take the likeliest token each step (what transformers' greedy "
                   "generate does) instead of sampling")
    p.add_argument("--temperature", type=flags.number(float, 0, above=True), default=None,
                   help=f"sampling temperature (default {DEFAULT_TEMPERATURE}; not with "
                   "--greedy)")
    p.add_argument("--top-k", type=flags.number(int, 0), default=0, metavar="K",
                   help="sample among the K likeliest tokens (0: all, the default; not with "
                   "--greedy)")
    p.add_argument("--seed", type=flags.number(int, 0, maximum=2**63 - 1), default=0,
                   help="seeds sampling (default %(default)s)")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_ids": [...], "new_ids": [...], "text": "..."} only')


def _ids(text: str) -> list[int]:
    """--prompt-ids: every comma separates two ids; an empty item ("1,,2", a trailing comma)
    is a typo, refused rather than guessed at."""
    items = text.replace(" ", "").split(",")
    for n, item in enumerate(items, 1):
        if not item:
            raise argparse.ArgumentTypeError(
                f"item {n} of {text!r} is empty (two commas in a row, or one at an end): give "
                f"comma-separated token ids such as 1,2,3")
        if not item.isdigit():
            raise argparse.ArgumentTypeError(
                f"item {n} of {text!r}, {item!r}, is not a token id (an integer >= 0): give "
                f"comma-separated token ids such as 1,2,3")
    return [int(x) for x in items]


def check_sampling(args: argparse.Namespace) -> None:
    """--greedy takes the arg-max token, so sampling flags beside it would be silently
    ignored: refuse the contradiction instead."""
    given = [f for f, on in (("--temperature", args.temperature is not None),
                             ("--top-k", args.top_k > 0)) if on]
    if args.greedy and given:
        names = " and ".join(given)
        raise ValueError(f"--greedy contradicts {names}: --greedy always takes the likeliest "
                         f"token, {names} only shape{'s' if len(given) == 1 else ''} "
                         f"sampling; drop --greedy to sample, or drop {names}")


def load_tokenizer(model_dir: Path, needed: bool) -> Any:
    """The directory's tokenizers.Tokenizer, or None where there is none and none is needed."""
    path = model_dir / TOKENIZER_NAME
    if not path.is_file():
        if needed:
            raise ValueError(f"--prompt needs {path}, which is missing: put the model's "
                             f"tokenizer.json there, or give --prompt-ids")
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception type
        raise ValueError(f"{path} is not a tokenizer the tokenizers library reads: {e}") from None


def tokenizer_dir(model_dir: Path) -> Path:
    """Where the tokenizer is: the directory, or, for a peft adapter directory without one,
    its base (adapter_config.json's base_model_name_or_path)."""
    from dtfm.core import lora

    if (model_dir / TOKENIZER_NAME).is_file() or not lora.is_adapter_dir(model_dir):
        return model_dir
    config = lora.read_adapter_config(model_dir, "--model-dir")  # bad JSON: names the file
    base = config.get("base_model_name_or_path")
    return Path(base) if isinstance(base, str) and base else model_dir


def check_model_dir(model_dir: Path) -> None:
    """Name a --model-dir that is not there before anything looks for a file inside it."""
    if not model_dir.exists():
        raise ValueError(f"--model-dir {model_dir}: no such directory; give a Hugging Face "
                         f"model directory (config.json, model.safetensors), such as one "
                         f"`agent local --export-dir` wrote")
    if not model_dir.is_dir():
        raise ValueError(f"--model-dir {model_dir} is a file, not a directory; give the "
                         f"directory that holds config.json and model.safetensors")


def run(args: argparse.Namespace) -> int:
    from agent.worker.generate import LoadedModel, greedy, sampler

    model_dir = Path(args.model_dir)
    try:
        check_sampling(args)
        check_model_dir(model_dir)
        tokenizer = load_tokenizer(tokenizer_dir(model_dir), needed=args.prompt is not None)
        prompt = (args.prompt_ids if args.prompt is None
                  else tokenizer.encode(args.prompt).ids)
        model = LoadedModel.load(model_dir, log=_log)
        model.check_prompt(prompt, args.max_new_tokens)
        temperature = DEFAULT_TEMPERATURE if args.temperature is None else args.temperature
        pick = greedy if args.greedy else sampler(temperature, args.top_k, args.seed)
        t0 = time.perf_counter()
        new = model.continue_ids(prompt, args.max_new_tokens, pick)
    except ValueError as e:  # the config, checkpoint, tokenizer, prompt or weights: said what
        return flags.fail(str(e))
    seconds = time.perf_counter() - t0
    _log(f"generated {len(new)} tokens in {seconds:.1f} s "
         f"({len(new) / max(seconds, 1e-9):.1f} tokens/s)")
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else ""
    if args.json:
        print(json.dumps({"prompt_ids": list(prompt), "new_ids": new, "text": text}))
    elif tokenizer is not None:
        print((args.prompt if args.prompt is not None else tokenizer.decode(prompt)) + text)
    else:
        print(" ".join(map(str, new)))
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
