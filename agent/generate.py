"""`agent generate`: a continuation from a Hugging Face model directory, by dtfm's own model.

The user's quick look at what they trained (an export) or imported (what `--init-from` takes),
and the proof that dtfm's forward pass is the checkpoint's: the tokens come from
`agent.worker.generate` (dtfm's parts, loaded with `agent.worker.hfload`), never from
`transformers`. Text goes through the directory's `tokenizer.json` (the `tokenizers` library);
a directory without one takes `--prompt-ids`. This module owns the flags, the tokenizer and
what is printed; torch is imported only when the command runs.
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="Hugging Face model directory: config.json and model.safetensors (or "
                   "shards with model.safetensors.index.json), tokenizer.json for text")
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
    p.add_argument("--temperature", type=flags.number(float, 0, above=True), default=1.0,
                   help="sampling temperature (default %(default)s; not with --greedy)")
    p.add_argument("--top-k", type=flags.number(int, 0), default=0, metavar="K",
                   help="sample among the K likeliest tokens (0: all, the default)")
    p.add_argument("--seed", type=flags.number(int, 0, maximum=2**63 - 1), default=0,
                   help="seeds sampling (default %(default)s)")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_ids": [...], "new_ids": [...], "text": "..."} only')


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, "
                                         f"got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected one or more token ids >= 0, got {text!r}")
    return ids


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


def run(args: argparse.Namespace) -> int:
    from agent.worker.generate import LoadedModel, greedy, sampler

    model_dir = Path(args.model_dir)
    try:
        tokenizer = load_tokenizer(model_dir, needed=args.prompt is not None)
        prompt = (args.prompt_ids if args.prompt is None
                  else tokenizer.encode(args.prompt).ids)
        model = LoadedModel.load(model_dir, log=_log)
        model.check_prompt(prompt, args.max_new_tokens)
        pick = greedy if args.greedy else sampler(args.temperature, args.top_k, args.seed)
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
