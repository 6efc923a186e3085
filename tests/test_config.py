"""TrainConfig: flags, YAML, stage defaults, derived values and validation messages."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron_vlm.training.config import ConfigError, TrainConfig, build_parser

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="TrainConfig's flags, YAML, defaults and messages: PyYAML and the standard library")

REQ = ["--data-path", "d", "--tokenizer-load-dir", "t", "--megatron-load-dir", "m", "--train-iters", "100"]


def cfg_of(*args, **kw) -> TrainConfig:
    return TrainConfig.from_args([*args, *REQ], **kw)


def error_of(*args) -> str:
    with pytest.raises(ConfigError) as e:
        cfg_of(*args)
    return str(e.value)


def test_stage_defaults():
    s1 = cfg_of("-g", "8")
    assert (s1.freeze_vit, s1.freeze_lm, s1.global_batch_size, s1.micro_batch_size, s1.lr) == (True, True, 256, 16, 1e-3)
    assert (s1.dp, s1.grad_accum, s1.world_size) == (8, 2, 8)
    s2 = cfg_of("-g", "8", "--stage", "2")
    assert (s2.freeze_vit, s2.freeze_lm, s2.global_batch_size, s2.micro_batch_size, s2.lr) == (True, False, 128, 1, 2e-5)
    assert s2.grad_accum == 16
    for c in (s1, s2):
        assert (c.lr_decay_style, c.lr_warmup_fraction, c.weight_decay, c.clip_grad) == ("cosine", 0.03, 0.0, 1.0)
    assert s2.name == "llava-stage2" and s2.run_dir.name == "llava-stage2"


def test_user_values_beat_stage_defaults():
    c = cfg_of("--stage", "2", "--unfreeze-vit", "--freeze-lm", "--lr", "5e-5", "--mbs", "2", "--gbs", "8")
    assert (c.freeze_vit, c.unfreeze_vit, c.freeze_lm, c.lr, c.micro_batch_size, c.global_batch_size) == (
        False, True, True, 5e-5, 2, 8)
    with pytest.raises(SystemExit):  # the two flags of one tri-state exclude each other
        cfg_of("--freeze-vit", "--unfreeze-vit")


def test_derived_parallel_sizes_and_precision():
    c = cfg_of("-g", "8", "--node", "2", "--rank", "1", "--master-addr", "n0", "--tp", "2", "--pp", "2",
               "--pp-layers", "3,1", "--gbs", "64", "--mbs", "2")
    assert (c.world_size, c.dp, c.grad_accum, c.pp_layers) == (16, 4, 8, [3, 1])
    assert (c.device, c.precision, c.bf16) == ("cuda", "bf16", True)
    cpu = cfg_of("--device", "cpu")
    assert cpu.precision == "fp32" and not cpu.bf16


def test_impossible_requests_name_input_and_fix():
    assert "-g 3 --tp 2: 3 GPUs is not a multiple of tp*pp=2" in error_of("-g", "3", "--tp", "2")
    msg = error_of("-g", "2", "--gbs", "10", "--mbs", "4")
    assert "global batch 10 is not divisible by micro batch 4 x data-parallel 2" in msg
    assert "--global-batch-size 8 or 16" in msg
    assert "(stage 1 default)" in error_of("-g", "3")
    assert "--fp8 needs a CUDA GPU" in error_of("--device", "cpu", "--fp8")
    assert "--rank 2 with --node 2" in error_of("--node", "2", "--rank", "2", "--master-addr", "x")
    assert "give --master-addr" in error_of("--node", "2")
    assert "names 2 GPUs but -g is 4" in error_of("-g", "4", "--gpu-ids", "0,1")
    assert "--pp-layers 3,1,1: give 2 positive" in error_of("-g", "2", "--pp", "2", "--pp-layers", "3,1,1")
    assert "--skip-train-iteration-range 9-3" in error_of("--skip-train-iteration-range", "9-3")
    assert "--submit needs --sbatch" in error_of("--submit")
    assert "--partition only applies with --sbatch" in error_of("--partition", "gpu")


def test_missing_required_inputs_listed_together():
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_args([])
    msg = str(e.value)
    for flag in ("--train-iters", "--data-path", "--tokenizer-load-dir", "--megatron-load-dir"):
        assert flag in msg
    assert "--init" in msg
    TrainConfig.from_args(["--init", *REQ[:4], "--train-iters", "1"])  # --init makes the checkpoint optional


def test_gpu_ids_set_gpu_count_and_cpu_rejects_them():
    assert cfg_of("--gpu-ids", "2,5").gpus == 2
    assert "--gpu-ids is for --device cuda" in error_of("--device", "cpu", "--gpu-ids", "0")


def test_debug_shrinks_and_says_so():
    c = cfg_of("-g", "4", "--tp", "2", "--pp", "2", "--debug")
    assert (c.tp, c.pp, c.micro_batch_size, c.global_batch_size, c.grad_accum, c.log_interval) == (1, 1, 1, 4, 1, 1)
    assert c.train_iters == 100  # given, kept
    assert "tp=1" in c.resolution_notes[0] and "global_batch_size=4" in c.resolution_notes[0]
    c = TrainConfig.from_args(["--debug", *REQ[:6]])
    assert c.train_iters == 10


def test_paths_made_absolute_and_tensorboard_under_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = cfg_of("--save-dir", "runs", "--name", "exp1")
    assert c.data_path == str(tmp_path / "d") and c.save_dir == str(tmp_path / "runs")
    assert c.tensorboard_dir == str(tmp_path / "runs" / "exp1" / "tensorboard")
    assert c.config_path == tmp_path / "runs" / "exp1" / "config.yaml"
    assert dataclasses.replace(c, node_rank=3).config_path.name == "config.node3.yaml"
    assert TrainConfig.from_args([*REQ, "--data-path", "msc://bucket/ds"]).data_path == "msc://bucket/ds"


def test_yaml_round_trip(tmp_path):
    c = cfg_of("-g", "4", "--tp", "2", "--pp-layers", "1,1", "--pp", "2", "--gbs", "8", "--mbs", "1",
               "--skip-train-iteration-range", "10-20", "30-31", "--bind", "/a", "--bind", "/b:/c:ro", "--sif-path", "img.sif",
               "--image-token-id", "7", "--unfreeze-vit", "--lr", "3e-4")
    p = tmp_path / "c.yaml"
    p.write_text(c.to_yaml())
    back = TrainConfig.from_yaml(p)
    assert back == c
    assert back.skip_train_iteration_range == [(10, 20), (30, 31)]
    data = yaml.safe_load(p.read_text())
    assert data["derived"] == {"world_size": 4, "run_dir": str(c.run_dir), "data_parallel": 1, "grad_accum": 8}
    assert back.resolved() == c  # resolving a resolved config changes nothing


def test_yaml_under_command_line(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("gpus: 4\nmicro-batch-size: 4\nglobal_batch_size: 32\nlr: 1e-4\nfp8: true\nstage: 2\n"
                 "pp: 2\npp_layers: [1, 1]\nskip_train_iteration_range: ['5-6', [8, 9]]\nunfreeze_vit: true\n")
    c = TrainConfig.from_args(["--config", str(p), "--mbs", "2", "--no-fp8", *REQ])
    assert (c.gpus, c.micro_batch_size, c.global_batch_size, c.lr, c.fp8, c.stage) == (4, 2, 32, 1e-4, False, 2)
    assert c.skip_train_iteration_range == [(5, 6), (8, 9)] and c.freeze_vit is False
    assert (c.dp, c.grad_accum) == (2, 8)


def test_yaml_errors_name_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("micro_batch_sise: 4\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'micro_batch_sise'; did you mean 'micro_batch_size'"):
        TrainConfig.from_args(["--config", str(p)])
    p.write_text("tp: two\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: tp:"):
        TrainConfig.from_args(["--config", str(p)])
    with pytest.raises(ConfigError, match="no such file"):
        TrainConfig.from_args(["--config", str(tmp_path / "missing.yaml")])


def test_every_field_has_a_flag_with_help():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(TrainConfig):
        assert f.name in actions, f.name
        assert len(f.metadata["help"]) > 10, f.name
    flags = {s for a in parser._actions for s in a.option_strings}
    for flag in ("-g", "--gpus", "--gpu-ids", "--device", "--node", "--rank", "--master-addr", "--interface",
                 "--tp", "--pp", "--pp-layers", "--stage", "--freeze-vit", "--unfreeze-vit", "--dry-run",
                 "--sif-path", "--docker-image", "--sbatch", "--submit", "--gpus-per-node", "--nodes"):
        assert flag in flags
    assert all(a.help for a in parser._actions)


def test_explicit_gpu_ids_beat_slurm_gpu_count():
    c = TrainConfig.from_args(["--gpu-ids", "0,1", *REQ], env_defaults={"gpus": 8, "nodes": 1})
    assert c.gpus == 2
    assert TrainConfig.from_args(REQ, env_defaults={"gpus": 8}).gpus == 8


def test_smoke_test_shrinks_and_debug_is_its_deprecated_alias(tmp_path, capsys):
    """The run-shrinking option is --smoke-test; --debug (its old name) still works but warns, and -v is the
    verbosity flag of train/run.py as of every other command (issue 27 item 7)."""
    c = cfg_of("-g", "2", "--tp", "2", "--smoke-test")
    assert (c.smoke_test, c.tp, c.micro_batch_size, c.global_batch_size, c.verbose) == (True, 1, 1, 2, False)
    assert c.resolution_notes == ["--smoke-test set tp=1, micro_batch_size=1, log_interval=1, global_batch_size=2"]
    assert capsys.readouterr().err == ""
    old = cfg_of("-g", "2", "--tp", "2", "--debug")
    assert old == c
    assert capsys.readouterr().err.strip() == (
        "train/run.py: warning: --debug is deprecated: it shrinks the run, as --smoke-test does; for verbose logs "
        "and tracebacks use -v")
    assert cfg_of("-v").verbose and cfg_of("--verbose").verbose and not cfg_of("-v").smoke_test
    p = tmp_path / "old.yaml"
    p.write_text("debug: true\n")  # a config.yaml written before the rename
    assert TrainConfig.from_args(["--config", str(p), *REQ]).smoke_test
    assert "smoke_test: true" in c.to_yaml() and "debug" not in c.to_yaml()


def test_scheduler_flags_are_megatron_lms_and_exclusive():
    for spelling in ("--override-opt-param-scheduler", "--override-opt_param-scheduler"):
        assert cfg_of(spelling).override_opt_param_scheduler
    for spelling in ("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        assert cfg_of(spelling).use_checkpoint_opt_param_scheduler
    assert error_of("--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler") == (
        "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler both given; choose one (follow "
        "this command line's learning-rate schedule, or keep the checkpoint's)")


def test_flags_of_a_config_give_the_same_config():
    c = cfg_of("-g", "4", "--tp", "2", "--stage", "2", "--unfreeze-vit", "--no-save-optim", "--lr", "3e-4",
               "--skip-train-iteration-range", "10-20", "30-31", "--pp-layers", "1,1", "--pp", "2", "--gbs", "8",
               "--no-bias-dropout-fusion", "--device", "cpu", "-v")
    argv = c.to_argv()
    assert TrainConfig.from_args(argv, resolve=False) == c
    assert "--no-save-optim" in argv and "--no-bias-dropout-fusion" in argv and "--dry-run" not in argv


COMMANDS = ("convert/build_llava.py", "convert/hf_to_megatron.py", "convert/megatron_to_hf.py",
            "data_prep/make_wds.py", "data_prep/stats.py", "train/run.py")


def test_every_command_has_the_same_verbosity_flag_and_debug_means_nothing_else(capsys):
    """Issue 27 item 7: -v/--verbose on every command (train/run.py included); --debug is not advertised anywhere
    (train/run.py's old --debug shrank the run, so it cannot also mean 'verbose' in the listing)."""
    import re

    from .conftest import script

    for rel in COMMANDS:
        mod = script(rel)
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert re.search(r"^\s+-v, --verbose\b", text, re.M), (rel, text[-2000:])
        assert "--debug" not in text.replace("(--debug is a deprecated alias", ""), rel
    # a converter still takes --debug, as -v, and says it is deprecated
    with pytest.raises(SystemExit):
        script("convert/hf_to_megatron.py").main(["--debug", "--help"])
    assert "--debug is deprecated, use -v/--verbose" in capsys.readouterr().err


def test_context_parallel_flags():
    """--cp and Megatron-LM's --context-parallel-size set one field (never --cpus-per-task, which argparse's prefix
    matching once took --cp for); data-parallel replicas are the world over TP x PP x CP; the YAML carries it."""
    c = cfg_of("-g", "8", "--cp", "2", "--tp", "2", "--sequence-parallel", "--seq-length", "2048", "--gbs", "8",
               "--mbs", "4")
    assert (c.cp, c.cpus_per_task, c.dp, c.grad_accum, c.model_parallel) == (2, None, 2, 1, 4)
    assert cfg_of("-g", "4", "--context-parallel-size", "4", "--gbs", "4", "--mbs", "4").cp == 4
    data = yaml.safe_load(c.to_yaml())
    assert data["cp"] == 2 and data["derived"]["data_parallel"] == 2
    assert TrainConfig.from_dict({k: v for k, v in data.items() if k != "derived"}).cp == 2


def test_impossible_context_parallel_requests_name_the_fix():
    assert "-g 3 --tp 1 --cp 2: 3 GPUs is not a multiple of tp*pp*cp=2; use a GPU count that is a multiple of 2 or " \
        "lower --tp/--pp/--cp" in error_of("-g", "3", "--cp", "2")
    assert "--seq-length 97 does not split over the context-parallel ranks: it must be a multiple of 4 (2 x --cp 2); " \
        "use --seq-length 100" in error_of("-g", "2", "--cp", "2", "--seq-length", "97", "--gbs", "4", "--mbs", "4")
    assert "it must be a multiple of 8 (2 x --cp 2 x --tp 2, with --sequence-parallel); use --seq-length 104" in \
        error_of("-g", "4", "--cp", "2", "--tp", "2", "--sequence-parallel", "--seq-length", "100", "--gbs", "4",
                 "--mbs", "4")
    assert "--packed-seq-length 130: with --cp it must be a multiple of 4; use --packed-seq-length 132" in error_of(
        "-g", "2", "--cp", "2", "--seq-length", "128", "--packing-buffer-size", "8", "--packed-seq-length", "130",
        "--gbs", "4")
    assert "--cp-comm-type a2a applies to Transformer Engine's attention with --cp > 1 on a GPU; local layers " \
        "all-gather keys and values: drop --cp-comm-type" in error_of("--device", "cpu", "-g", "2", "--cp", "2",
                                                                      "--cp-comm-type", "a2a", "--gbs", "4",
                                                                      "--mbs", "4")
    assert "--cp 0: must be at least 1" in error_of("--cp", "0")
    assert "tp x cp x data-parallel size is a multiple of 4" in error_of("-g", "2", "--cp", "2", "--ep", "4",
                                                                         "--gbs", "4", "--mbs", "4")
    assert cfg_of("-g", "2", "--cp", "2", "--seq-length", "128", "--gbs", "4", "--mbs", "4").cp == 2  # fine


def test_profile_ranges_and_timing_flags():
    """Megatron-LM's names; a range that records nothing or runs past the run, and ranks outside it, are refused
    in one line each (checked only with --profile: the defaults 10-12 need not fit a short run without it)."""
    c = cfg_of("-g", "2", "--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0,1",
               "--timing-log-level", "2", "--timing-log-option", "max", "--no-log-throughput", "--use-pytorch-profiler")
    assert (c.profile, c.profile_step_start, c.profile_step_end, c.profile_ranks) == (True, 2, 4, [0, 1])
    spaced = cfg_of("-g", "4", "--profile", "--profile-step-end", "12", "--profile-ranks", "1", "3")  # MLM's form
    assert spaced.profile_ranks == [1, 3]
    assert (c.timing_log_level, c.timing_log_option, c.log_throughput) == (2, "max", False)
    d = cfg_of("--train-iters", "5")
    assert (d.profile, d.profile_ranks, d.timing_log_level, d.timing_log_option, d.log_throughput) == (
        False, [0], 1, "minmax", True)
    assert error_of("--profile", "--profile-step-start", "5", "--profile-step-end", "5") == (
        "--profile-step-end 5 with --profile-step-start 5: the range records iterations A+1 to B; give B > A, e.g. "
        "--profile-step-end 6")
    assert "--profile-step-end 3 with --profile-step-start 5: " in error_of(
        "--profile", "--profile-step-start", "5", "--profile-step-end", "3")
    assert "--profile-step-start -1: must not be negative" in error_of("--profile", "--profile-step-start", "-1")
    assert error_of("--profile", "--profile-step-end", "101") == (
        "--profile-step-end 101: the run ends at --train-iters 100; give B <= 100")
    assert error_of("-g", "2", "--profile", "--profile-ranks", "0,2") == (
        "--profile-ranks 0,2: ranks run from 0 to 1; drop 2")
    for bad in (("--timing-log-level", "3"), ("--timing-log-option", "mean")):
        with pytest.raises(SystemExit):
            cfg_of(*bad)


def test_eval_generate_flags_and_the_layouts_they_refuse():
    """--eval-generate-*: Megatron-LM-style names, off by default; data without an interval, and the layouts
    megatron-core's static generation does not run, refused in one line each before launch."""
    c = cfg_of()
    assert (c.eval_generate_interval, c.eval_generate_samples, c.eval_generate_max_new_tokens,
            c.eval_generate_split, c.eval_generate_data) == (0, 64, 32, "val", None)
    c = cfg_of("--eval-generate-interval", "50", "--eval-generate-samples", "8", "--eval-generate-split", "test")
    assert (c.eval_generate_interval, c.eval_generate_samples, c.eval_generate_split) == (50, 8, "test")
    assert "pass --eval-generate-interval" in error_of("--eval-generate-data", "x")
    assert "--eval-generate-samples 0: must be at least 1" in error_of("--eval-generate-interval", "5",
                                                                       "--eval-generate-samples", "0")
    on = ("--eval-generate-interval", "5")
    assert "splits no sequence over context-parallel ranks" in error_of(*on, "-g", "2", "--cp", "2", "--gbs", "4",
                                                                         "--mbs", "4", "--seq-length", "128")
    assert "runs one model chunk per pipeline rank" in error_of(*on, "-g", "2", "--pp", "2",
                                                                "--num-virtual-stages-per-pipeline-rank", "2",
                                                                "--gbs", "4", "--mbs", "1")
    assert "drop --sequence-parallel or --eval-generate-interval" in error_of(*on, "-g", "2", "--tp", "2",
                                                                              "--sequence-parallel", "--gbs", "4")
    assert "at --tp > 1 with --ep > 1" in error_of(*on, "-g", "4", "--tp", "2", "--ep", "2", "--gbs", "4",
                                                   "--mbs", "2")
    assert "use --precision bf16" in error_of(*on, "--precision", "fp16")
