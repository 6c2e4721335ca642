"""Continue a token sequence with dtfm's own model code, from a Hugging Face directory.

Owns the decode loop behind `agent generate`: build every part of the model the directory's
config.json describes (empty, on the meta device, so nothing is initialised only to be
overwritten), load the checkpoint into them with `agent.worker.hfload`, and run the parts in
order on one process with a key/value cache per layer (the prompt in one pass, then one token
per step). Greedy decoding is what `transformers`' `generate(do_sample=False)` does with no
logits processors: the arg-max token each step, stopping after an end-of-sequence token (kept
in the output) or after `max_new` tokens. Sampling (temperature, top-k) is seeded and local.
A `peft` adapter directory runs on its base with the adapters merged in, as the merged export
merges them (`lora.merge_adapters`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from agent.worker import lora
from agent.worker.hfload import load_parts_from_hf
from agent.worker.model import EMBEDDING_INDEX, HEAD_INDEX, KVCache, make_part, param_count
from dtfm.core import lora as spec_lora
from dtfm.core.hfconfig import (
    GENERATION_CONFIG_FILE,
    eos_token_ids,
    part_tensors,
    read_hf_config,
    spec_from_hf_config,
)
from dtfm.core.hfdir import check_weights
from dtfm.core.loradir import check_adapter_dir
from dtfm.core.spec import ModelSpec, TrainConfig


class GenerateError(ValueError):
    """A request the model cannot serve (prompt ids out of range, too long a continuation)."""


@dataclass
class LoadedModel:
    """Every part of a Hugging Face directory's model, loaded, and what generation needs."""

    spec: ModelSpec
    parts: dict[int, nn.Module]
    eos_ids: list[int] = field(default_factory=list)

    @classmethod
    def load(cls, model_dir: str | Path, log: Callable[[str], None] = lambda _: None
             ) -> LoadedModel:
        root, adapters, cfg = Path(model_dir), None, None
        if spec_lora.is_adapter_dir(root):  # a peft adapter directory: its base, merged
            cfg = spec_lora.from_adapter_dir(TrainConfig(init_from=str(root)), "--model-dir")
            log(f"{root} is a LoRA adapter (rank {cfg.lora_rank}) of {cfg.init_from}")
            root = Path(cfg.init_from)
        config = read_hf_config(root)
        spec = spec_from_hf_config(config)
        check_weights(spec, root, "--model-dir")  # before allocating what config.json says
        if cfg is not None:  # its tensors must be the adapters its config says, on this base
            check_adapter_dir(cfg.lora_init, spec, cfg, "--model-dir")
            adapters = cfg, lora.read_adapter_dir(cfg.lora_init)
        gen_path = root / GENERATION_CONFIG_FILE
        gen = read_json(gen_path) if gen_path.is_file() else None
        t0 = time.perf_counter()
        with torch.device("meta"):
            parts = {i: make_part(spec, i)
                     for i in (EMBEDDING_INDEX, *range(spec.n_layers), HEAD_INDEX)}
        parts = {i: p.to_empty(device="cpu").eval() for i, p in parts.items()}
        log(f"loading {sum(param_count(p) for p in parts.values()):,} parameters "
            f"({spec.arch}, {spec.n_layers} layers) from {root}")
        load_parts_from_hf(parts, spec, root)
        if adapters is not None:
            lora.merge_adapters({i: parts[i] for i in range(spec.n_layers)}, adapters[1],
                                spec, adapters[0])
        log(f"loaded in {time.perf_counter() - t0:.1f} s")
        return cls(spec, parts, eos_token_ids(gen, config))

    def check_prompt(self, prompt: Sequence[int], max_new: int) -> None:
        if not prompt:
            raise GenerateError("the prompt is empty: give --prompt text that encodes to at "
                                "least one token, or --prompt-ids")
        bad = [i for i in prompt if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise GenerateError(f"prompt token id {bad[0]} is outside the model's vocabulary "
                                f"of {self.spec.vocab_size}")
        if self.spec.arch == "gpt" and len(prompt) + max_new > self.spec.positions:
            raise GenerateError(
                f"{len(prompt)} prompt tokens + --max-new-tokens {max_new} exceed the "
                f"{self.spec.positions} positions this model has learned; ask for at most "
                f"{max(self.spec.positions - len(prompt), 0)} new tokens")

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, caches: list[KVCache] | None = None,
               start: int = 0, last_only: bool = False) -> torch.Tensor:
        """Logits of every position of `ids` (batch x tokens; `last_only`: of the last), the
        first at `start`; with `caches` (one per layer), attending to the positions they
        already hold."""
        x = self.parts[EMBEDDING_INDEX](ids, start)
        for i in range(self.spec.n_layers):
            x = self.parts[i](x, None if caches is None else caches[i])
        return self.parts[HEAD_INDEX](x[:, -1:] if last_only else x)

    def continue_ids(self, prompt: Sequence[int], max_new: int,
                     pick: Callable[[torch.Tensor], int]) -> list[int]:
        """Up to `max_new` tokens after `prompt`, each chosen by `pick` from the next-token
        logits (fp32, vocabulary-long); stops after an end-of-sequence token."""
        self.check_prompt(prompt, max_new)
        caches = [KVCache() for _ in range(self.spec.n_layers)]
        ids, start, new = torch.tensor([list(prompt)]), 0, []
        for _ in range(max_new):
            logits = self.logits(ids, caches, start, last_only=True)[0, -1].float()
            if not bool(torch.isfinite(logits).all()):
                raise GenerateError(self._why_not_finite(len(new)))
            token = pick(logits)
            new.append(token)
            if token in self.eos_ids:
                break
            start += ids.shape[1]
            ids = torch.tensor([[token]])
        return new

    def _why_not_finite(self, position: int) -> str:
        """What to say when the next-token logits hold NaN or inf (sampling cannot draw from
        them, and an arg-max of NaN is a meaningless token 0): which weights are to blame."""
        bad = [_checkpoint_name(self.spec, i, name) for i, part in self.parts.items()
               for name, t in part.named_parameters()
               if not bool(torch.isfinite(t).all())]
        where = (f"these weights hold NaN or inf values: {', '.join(bad[:4])}"
                 + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
                 + " (a diverged or damaged checkpoint: export it again from a good step)"
                 if bad else "the weights are finite, but the computation overflowed "
                 "(values too large for fp32)")
        return (f"the model's next-token scores after {position} new token(s) are not finite "
                f"numbers, so no token can be chosen: {where}")


def _checkpoint_name(spec: ModelSpec, index: int, name: str) -> str:
    """A part's parameter by its tensor's name in the directory's checkpoint."""
    tensor = part_tensors(spec, index).get(name)
    return tensor.name if tensor is not None else f"part {index}'s {name}"


def read_json(path: Path) -> dict:
    """A JSON object file of the directory (generation_config.json)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GenerateError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(value, dict):
        raise GenerateError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def sampler(temperature: float, top_k: int, seed: int) -> Callable[[torch.Tensor], int]:
    """Sample from softmax(logits / temperature), among the `top_k` likeliest (0: all)."""
    gen = torch.Generator().manual_seed(seed)

    def pick(logits: torch.Tensor) -> int:
        scores = logits / temperature
        if 0 < top_k < scores.numel():
            kth = torch.topk(scores, top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))

    return pick
