"""`--lora-*`: one flag per setting on both commands, carried to the worker in the assignment,
validated at the edge with messages naming the flag (`dtfm.core.lora`, `TrainConfig`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser
from dtfm import flags
from dtfm.core import lora
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout
from dtfm.core.presets import PRESETS
from dtfm.core.spec import TrainConfig
from dtfm.rpc import ConfigError

LLAMA, GPT = PRESETS["llama-tiny"], PRESETS["gpt-tiny"]


def test_lora_flags_reach_train_config_on_both_commands() -> None:
    argv = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
            "--lora-targets", "q_proj,v_proj"]
    for parser in (coordinator_parser()[1]["start"], agent_parser()[1]["local"]):
        cfg = flags.train_config_from_args(parser.parse_args(argv))
        assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets) == (
            8, 16.0, 0.05, "q_proj,v_proj")
        assert flags.train_config_from_args(parser.parse_args(flags.train_argv(cfg))) == cfg
    defaults = TrainConfig()
    assert (defaults.lora_rank, defaults.lora_alpha, defaults.lora_dropout) == (0, 8.0, 0.0)
    with pytest.raises(ConfigError, match="--lora-rank"):
        agent_parser()[1]["local"].parse_args(["--lora-rank", "-1"])
    with pytest.raises(ConfigError, match="--lora-dropout"):
        agent_parser()[1]["local"].parse_args(["--lora-dropout", "1"])


def test_lora_settings_travel_in_the_assignment() -> None:
    cfg = TrainConfig(global_batch=4, lora_rank=4, lora_alpha=32.0, lora_dropout=0.1,
                      lora_targets="q_proj")
    (a,) = build_assignments(job_id="j", epoch=0, layout=Layout(1, 1), spec=LLAMA, train=cfg,
                             master_addr="127.0.0.1", master_port=1)
    back = TrainConfig.from_proto(a.train)
    assert back == cfg
    old = type(a.train)(global_batch=4)  # a peer that predates adapters: full fine-tuning
    assert TrainConfig.from_proto(old).lora_rank == 0
    assert TrainConfig.from_proto(old).lora_alpha == 8.0


@pytest.mark.parametrize(("change", "message"), [
    ({"lora_rank": -1}, r"--lora-rank must be in 0\.\.4294967295, got -1"),
    ({"lora_rank": 4, "lora_alpha": 0.0}, "--lora-alpha must be a finite number > 0"),
    ({"lora_rank": 4, "lora_dropout": 1.0}, r"--lora-dropout must be in \[0, 1\)"),
])
def test_bad_ranges_name_the_flag(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**change).validate()


def test_targets_must_name_a_module_of_the_family() -> None:
    with pytest.raises(ValueError, match=r"--lora-targets 'c_attn' names no module of a llama "
                                         r"layer.*q_proj, k_proj, v_proj, o_proj, gate_proj"):
        lora.check(TrainConfig(lora_rank=4, lora_targets="q_proj,c_attn"), LLAMA)
    with pytest.raises(ValueError, match="'q_proj' names no module of a gpt layer"):
        lora.check(TrainConfig(lora_rank=4, lora_targets="q_proj"), GPT)
    with pytest.raises(ValueError, match="--lora-targets applies with --lora-rank"):
        lora.check(TrainConfig(lora_targets="q_proj"), LLAMA)
    with pytest.raises(ValueError, match="'lm_head' names no module"):  # the head stays frozen
        build_assignments(job_id="j", epoch=0, layout=Layout(1, 1), spec=LLAMA,
                          train=TrainConfig(lora_rank=2, lora_targets="lm_head"),
                          master_addr="127.0.0.1", master_port=1)


def test_targets_match_as_peft_matches_them() -> None:
    ours = [p.ours for p in lora.targeted(LLAMA, "")]
    assert ours == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert [p.ours for p in lora.targeted(LLAMA, "self_attn.q_proj, v_proj")] == [
        "attn.q_proj", "attn.v_proj"]
    # GPT-2's c_proj is both the attention's and the MLP's output projection, as in peft
    assert [p.ours for p in lora.targeted(GPT, "c_proj")] == ["attn.proj", "mlp.proj"]
    # llama-tiny: d=64, ff=176, 4 heads of 16, 2 KV heads -> q 64, kv 32
    per_layer = 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 176) + (176 + 64))
    assert lora.layer_adapter_params(LLAMA, 4) == per_layer
    assert lora.stage_adapter_params(LLAMA, 1, 3, 4) == 2 * per_layer


def test_export_merged_needs_a_lora_job_with_an_export_dir() -> None:
    from tests.agent.worker.testlib import run_local

    run = run_local("--steps", "0", "--export-merged", timeout=60)
    assert run.rc == 2 and "--export-merged" in run.stderr and "--lora-rank" in run.stderr


def test_a_lora_jobs_export_settings_cross_the_status_and_bad_ones_are_refused() -> None:
    """`coordinator export` learns a LoRA job's settings from the status
    (`ExportSource.lora`): they come back as given, and ones the model cannot have are an
    ExportError, not a traceback in the exporter."""
    from coordinator.job.export import job_export_source
    from dtfm.core.hfexport import ExportError
    from dtfm.core.loraexport import config_from_source

    cfg = TrainConfig(lora_rank=4, lora_alpha=16.0, lora_dropout=0.1, lora_targets="q_proj",
                      seed=7)
    msg = job_export_source(cfg)
    assert msg.HasField("lora") and not job_export_source(TrainConfig()).HasField("lora")
    back = config_from_source(msg.lora, LLAMA)
    assert (back.lora_rank, back.lora_alpha, back.lora_dropout, back.lora_targets,
            back.seed, back.init_from) == (4, 16.0, 0.1, "q_proj", 7, "")
    with pytest.raises(ExportError, match="c_attn"):
        config_from_source(job_export_source(TrainConfig(lora_rank=4, lora_targets="c_attn"))
                           .lora, LLAMA)
    msg.lora.alpha = float("nan")
    with pytest.raises(ExportError, match="--lora-alpha"):
        config_from_source(msg.lora, LLAMA)


def test_coordinator_start_export_merged_needs_a_lora_job_and_export_dir(
        tmp_path: Path) -> None:
    from coordinator.daemon.config import JobConfig

    start = coordinator_parser()[1]["start"]
    for argv in (["--export-merged"], ["--export-merged", "--export-dir", str(tmp_path / "x")],
                 ["--export-merged", "--lora-rank", "4"]):
        args = start.parse_args(["--model", "llama-tiny", "--agents", "1", *argv])
        job = JobConfig(model=args.model, agents=args.agents,
                        train=flags.train_config_from_args(args), export_dir=args.export_dir,
                        export_merged=args.export_merged)
        with pytest.raises(ConfigError, match="--export-merged .* --export-dir and --lora-rank"):
            job.validate()
    args = start.parse_args(["--model", "llama-tiny", "--agents", "1", "--export-merged",
                             "--lora-rank", "4", "--export-dir", str(tmp_path / "x")])
    JobConfig(model=args.model, agents=args.agents, train=flags.train_config_from_args(args),
              export_dir=args.export_dir, export_merged=args.export_merged).validate()


def test_the_rank_is_bounded_by_the_adapted_projections_smaller_side() -> None:
    """issue 41: --lora-rank 100000 on a width-64 model was accepted and never finished a
    step. The bound is the smallest side among the projections the targets adapt."""
    bound, proj = lora.max_rank(GPT)
    assert (bound, proj.theirs) == (GPT.d_model, "attn.c_attn")
    lora.check(TrainConfig(lora_rank=bound), GPT)  # at the bound: fine
    with pytest.raises(ValueError, match=rf"--lora-rank {bound + 1} exceeds {bound}"):
        lora.check(TrainConfig(lora_rank=bound + 1), GPT)
    kv = LLAMA.kv_heads * LLAMA.head_size  # k_proj / v_proj are d_model x kv
    assert lora.max_rank(LLAMA)[0] == min(kv, LLAMA.d_model)
    assert lora.max_rank(LLAMA, "q_proj")[0] == LLAMA.d_model
    lora.check(TrainConfig(lora_rank=LLAMA.d_model, lora_targets="q_proj"), LLAMA)
