"""dtfm's model is the checkpoint's: tiny random `transformers` models, saved to disk, give the
same logits through dtfm's parts (loaded by agent/worker/hfload.py) and the same greedy
continuation through `agent generate`; and a directory dtfm cannot load says what is wrong.

Nothing is downloaded: every model and tokenizer is built here. fp32 throughout.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agent import cli  # noqa: E402
from agent.worker.generate import LoadedModel, greedy  # noqa: E402
from agent.worker.hfload import (  # noqa: E402
    CheckpointError,
    load_parts_from_hf,
    stage_tensors_hf,
    unexpected_tensors,
)
from agent.worker.model import HEAD_INDEX, build_part  # noqa: E402
from agent.worker.stage import Stage  # noqa: E402
from dtfm.core.hfconfig import (  # noqa: E402
    hf_config_from_spec,
    read_hf_config,
    spec_from_hf_config,
)

VOCAB = 320  # byte-level BPE: 256 bytes, 3 specials, some merges
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun"


def _gpt2() -> transformers.PreTrainedModel:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64,
        bos_token_id=3, eos_token_id=3))


def _llama() -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0))


def _qwen2() -> transformers.PreTrainedModel:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=1e6, tie_word_embeddings=True, eos_token_id=5))


def _mistral() -> transformers.PreTrainedModel:
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, sliding_window=None,
        max_position_embeddings=128))


MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "gpt2": _gpt2, "llama": _llama, "qwen2": _qwen2, "mistral": _mistral}


def _randomize(model: transformers.PreTrainedModel, seed: int) -> None:
    """Every weight random, norms and biases included, so none is loaded by luck."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """name -> (directory, the transformers model), each saved once."""
    out: dict[str, tuple[Path, object]] = {}
    for i, (name, make) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = make().eval()
        _randomize(model, i)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        _tokenizer(path)
        out[name] = (path, model)
    sharded = tmp_path_factory.mktemp("llama-sharded")
    out["llama"][1].save_pretrained(sharded, max_shard_size="40KB")
    out["llama-sharded"] = (sharded, out["llama"][1])
    return out


def _dtfm_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    spec = spec_from_hf_config(read_hf_config(path))
    stage = Stage(spec, 0, spec.n_layers, seed=0).eval()
    load_parts_from_hf(stage.parts(), spec, path)
    with torch.no_grad():
        return stage(ids)


@pytest.mark.parametrize("name", [*MODELS, "llama-sharded"])
def test_logits_equal_transformers(saved: dict, name: str) -> None:
    path, model = saved[name]
    if name == "llama-sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("model-*.safetensors"))) > 1
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    got = _dtfm_logits(path, ids)
    assert want.abs().max() > 1.0  # logits that are not all near zero
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert unexpected_tensors(spec_from_hf_config(read_hf_config(path)), path) == []


@pytest.mark.parametrize("name", list(MODELS))
def test_agent_generate_greedy_equals_transformers_generate(saved: dict, name: str,
                                                            capsys: pytest.CaptureFixture
                                                            ) -> None:
    path, model = saved[name]
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(path / "tokenizer.json")).encode(TEXT[:30]).ids
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    want_new = want[0, len(prompt):].tolist()
    assert cli.main(["generate", "--model-dir", str(path), "--prompt", TEXT[:30],
                     "--max-new-tokens", "12", "--greedy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == prompt
    assert out["new_ids"] == want_new
    assert out["text"] == Tokenizer.from_file(str(path / "tokenizer.json")).decode(want_new)


def test_generation_stops_at_eos_as_transformers_does(saved: dict) -> None:
    """Make the model's first greedy token its eos: both stop after emitting it."""
    path, model = saved["llama"]
    loaded = LoadedModel.load(path)
    prompt = [7, 8, 9, 10]
    first = loaded.continue_ids(prompt, 1, greedy)[0]
    loaded.eos_ids = [first]
    assert loaded.continue_ids(prompt, 10, greedy) == [first]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                              eos_token_id=first)
    assert want[0, len(prompt):].tolist() == [first]


def test_cached_decoding_equals_full_forward(saved: dict) -> None:
    for name in ("gpt2", "mistral"):
        loaded = LoadedModel.load(saved[name][0])
        ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
        full = loaded.logits(ids)
        from agent.worker.model import KVCache

        caches = [KVCache() for _ in range(loaded.spec.n_layers)]
        steps = [loaded.logits(ids[:, :7], caches, 0), loaded.logits(ids[:, 7:15], caches, 7)]
        steps += [loaded.logits(ids[:, t:t + 1], caches, t) for t in range(15, 20)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_stage_tensors_round_trip_through_transformers(saved: dict, tmp_path: Path) -> None:
    """A dtfm stage's tensors under HF names, with the exported config, load in transformers
    strictly and compute the same logits (the tied GPT-2 exported untied)."""
    from safetensors.torch import save_file

    path, model = saved["gpt2"]
    config = read_hf_config(path)
    spec = spec_from_hf_config(config)
    stage = Stage(spec, 0, spec.n_layers, seed=0).eval()
    load_parts_from_hf(stage.parts(), spec, path)
    tensors = stage_tensors_hf(stage.parts(), spec)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_spec(spec, source=config)))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.lm_head.weight.data_ptr() != back.transformer.wte.weight.data_ptr()
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def _copy(path: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(path, out)
    return out


def _edit_weights(path: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_and_misshaped_tensors_are_named_with_their_file(saved: dict,
                                                                 tmp_path: Path) -> None:
    path = _copy(saved["qwen2"][0], tmp_path)
    spec = spec_from_hf_config(read_hf_config(path))
    _edit_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    stage = Stage(spec, 0, spec.n_layers, seed=0)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias is "
                       r"missing from .*model\.safetensors"):
        load_parts_from_hf(stage.parts(), spec, path)
    # A stage without layer 1 does not need the tensor and loads.
    load_parts_from_hf(Stage(spec, 0, 1, seed=0).parts(), spec, path)

    def shrink(t: dict) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
        t["model.layers.0.extra.weight"] = torch.zeros(2)
    _edit_weights(path, shrink)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight in "
                       r".*model\.safetensors has shape \(63, 48\) .* needs \(64, 48\)"):
        load_parts_from_hf(Stage(spec, 0, 1, seed=0).parts(), spec, path)
    assert unexpected_tensors(spec, path) == ["model.layers.0.extra.weight"]
    # Untied in config.json, so a checkpoint without lm_head.weight lacks the head.
    config = read_hf_config(path)
    (path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    with pytest.raises(CheckpointError, match="lm_head.weight is missing .*tie_word_embeddings"):
        load_parts_from_hf({HEAD_INDEX: build_part(spec, HEAD_INDEX, seed=0)}, spec, path)


def test_index_naming_a_missing_shard_is_named(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["llama-sharded"][0], tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    spec = spec_from_hf_config(read_hf_config(path))
    with pytest.raises(CheckpointError, match=f"names shard {shard.name} .*which is not in"):
        load_parts_from_hf(Stage(spec, 0, 1, seed=0).parts(), spec, path)


def test_gpt2_names_without_prefix_and_old_mask_buffers_load(saved: dict,
                                                             tmp_path: Path) -> None:
    path, model = saved["gpt2"]
    path = _copy(path, tmp_path)

    def old_style(t: dict) -> None:
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
        t["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    _edit_weights(path, old_style)
    ids = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(_dtfm_logits(path, ids), want, rtol=1e-5, atol=1e-5)
    assert unexpected_tensors(spec_from_hf_config(read_hf_config(path)), path) == []


def test_bad_directories_fail_the_command_with_what_to_fix(saved: dict, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture
                                                           ) -> None:
    def run(model_dir: Path, *extra: str) -> str:
        assert cli.main(["generate", "--model-dir", str(model_dir), "--prompt-ids", "1,2",
                         "--greedy", *extra]) == 2
        return capsys.readouterr().err

    assert "config.json is missing" in run(tmp_path)
    path = _copy(saved["gpt2"][0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, architectures=["T5Model"])))
    err = run(path)
    assert "T5Model is not supported" in err and "Qwen2ForCausalLM" in err
    (path / "config.json").write_text(json.dumps(config))
    assert "exceed the 64 positions" in run(path, "--max-new-tokens", "63")
    assert cli.main(["generate", "--model-dir", str(path), "--prompt-ids", f"1,{VOCAB}",
                     "--greedy"]) == 2
    assert f"token id {VOCAB} is outside" in capsys.readouterr().err
    (path / "model.safetensors").unlink()
    assert "holds neither model.safetensors nor" in run(path)
    (path / "tokenizer.json").unlink()
    assert cli.main(["generate", "--model-dir", str(path), "--prompt", "hi"]) == 2
    assert "--prompt needs" in capsys.readouterr().err


def test_exported_llama_config_loads_in_transformers_and_computes_the_same(
        saved: dict, tmp_path: Path) -> None:
    """hf_config_from_spec's llama3-scaled config, read by transformers, is the same model."""
    path, model = saved["llama"]
    spec = spec_from_hf_config(read_hf_config(path))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_spec(spec)))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (1, 64))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_agent_generate_entry_point_with_prompt_ids(saved: dict, tmp_path: Path) -> None:
    """The real command (`python -m agent generate`) on a directory without a tokenizer."""
    import subprocess
    import sys

    path, model = saved["qwen2"]
    path = _copy(path, tmp_path)
    (path / "tokenizer.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "agent", "generate", "--model-dir", str(path),
                           "--prompt-ids", "4,9,16,25", "--max-new-tokens", "6", "--greedy",
                           "--json"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    with torch.no_grad():
        want = model.generate(torch.tensor([[4, 9, 16, 25]]), max_new_tokens=6, do_sample=False)
    assert out == {"prompt_ids": [4, 9, 16, 25], "new_ids": want[0, 4:].tolist(), "text": ""}
    assert "loading" in proc.stderr and "tokens/s" in proc.stderr


def test_bf16_checkpoint_loads_into_fp32_parts(saved: dict, tmp_path: Path) -> None:
    """Hub checkpoints are mostly bf16: dtfm's fp32 parameters take the stored values exactly."""
    import copy

    _, model = saved["qwen2"]
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        want = back.eval()(ids).logits
    torch.testing.assert_close(_dtfm_logits(tmp_path, ids), want, rtol=1e-5, atol=1e-5)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# RoPE keys as configs in the wild combine them, each resolved the way transformers 5 does
# (dtfm.core.hfconfig.rope_settings): a top-level rope_theta fills in for rope_parameters; a
# llama3 block without original_max_position_embeddings takes max_position_embeddings, and a
# top-level one overrides the block's; rope_scaling and rope_parameters that agree load.
ROPE_VARIANTS = {
    "parameters-theta-from-top": {"rope_parameters": {"rope_type": "default"},
                                  "rope_theta": 1000.0},
    "llama3-original-defaults": {"rope_parameters": dict(LLAMA3, rope_theta=5e5)},
    "llama3-original-from-top": {"rope_scaling": dict(LLAMA3, original_max_position_embeddings=64),
                                 "rope_theta": 5e5, "original_max_position_embeddings": 16},
    "both-keys-agree": {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 300.0,
                        "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 300.0}},
}


def _with_rope(path: Path, tmp_path: Path, rope: dict) -> Path:
    out = _copy(path, tmp_path)
    config = read_hf_config(out)
    for key in ("rope_scaling", "rope_parameters", "rope_theta"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps({**config, **rope}))
    return out


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_settings_compute_what_transformers_computes(saved: dict, tmp_path: Path,
                                                          variant: str) -> None:
    path = _with_rope(saved["llama"][0], tmp_path, ROPE_VARIANTS[variant])
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(_dtfm_logits(path, ids), want, rtol=1e-5, atol=1e-5)


def test_conflicting_rope_keys_are_refused_naming_both(saved: dict, tmp_path: Path) -> None:
    """The issue's config: rope_parameters says plain RoPE, rope_scaling yarn. transformers
    applies the yarn (another model than the plain one); dtfm refuses, naming both keys."""
    plain = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    both = {**plain, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(3))
    logits = []
    for i, rope in enumerate((plain, both)):
        path = _with_rope(saved["llama"][0], tmp_path / str(i), rope)
        with torch.no_grad():
            logits.append(transformers.AutoModelForCausalLM.from_pretrained(path)(ids).logits)
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)  # the yarn part matters
    with pytest.raises(ValueError, match=r"config\.json: rope_scaling \{.*yarn.*\} and "
                       r"rope_parameters \{.*default.*\} disagree; transformers applies "
                       r"rope_scaling .*delete the key"):
        _dtfm_logits(path, ids)
    only_yarn = _with_rope(saved["llama"][0], tmp_path / "yarn", {"rope_scaling": both[
        "rope_scaling"]})
    with pytest.raises(ValueError, match="rope_scaling rope_type 'yarn' is not supported"):
        _dtfm_logits(only_yarn, ids)


def test_absurd_sizes_fail_agent_generate_in_one_line_before_allocating(
        saved: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """16 TB of layers by config.json, a few KB on disk: refused from the headers (before
    the fix the allocator's RuntimeError escaped as a traceback)."""
    path = _copy(saved["llama"][0], tmp_path)
    config = read_hf_config(path)
    (path / "config.json").write_text(json.dumps(
        {**config, "hidden_size": 1_000_000, "intermediate_size": 4_000_000, "head_dim": 8}))
    assert cli.main(["generate", "--model-dir", str(path), "--prompt-ids", "1,2",
                     "--greedy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --model-dir {path}: the embedding's tensors ") and \
        err.endswith("config.json does not describe these weights") and "\n" not in err, err


def test_an_integer_tensor_is_refused_not_cast(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["qwen2"][0], tmp_path)
    name = "model.layers.1.self_attn.q_proj.bias"
    _edit_weights(path, lambda t: t.update({name: t[name].round().to(torch.int64)}))
    spec = spec_from_hf_config(read_hf_config(path))
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} in .*model"
                       r"\.safetensors holds torch\.int64 values, not a weight"):
        load_parts_from_hf(Stage(spec, 1, 2, seed=0).parts(), spec, path)
    load_parts_from_hf(Stage(spec, 0, 1, seed=0).parts(), spec, path)  # layer 0 does not read it
