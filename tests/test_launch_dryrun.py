"""train/run.py --dry-run and pre-launch validation: the commands it would run and the errors it stops with."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

import pytest
import yaml
from .launch_helpers import IMAGE_ID, PAD_ID, REPO, base_args, make_ckpt, make_data, no_slurm_env, tiny_spec  # noqa: F401

from megatron_vlm.launch import cli

from .conftest import script
from megatron_vlm.training.config import TrainConfig

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="the launcher's --dry-run and pre-launch checks: it imports nothing heavier than PyYAML "
           "(docs/architecture.md)")


def dry(args, capsys):
    rc = cli.main([*args, "--dry-run"], repo_root=REPO)
    out = capsys.readouterr()
    return rc, out.out, out.err


def command_of(out: str) -> list[str]:
    return shlex.split(out.strip().splitlines()[-1])


def config_of(out: str) -> TrainConfig:
    text = out.split("# command on node")[0]
    return TrainConfig.from_dict(yaml.safe_load(text))


def test_single_node_cpu(tmp_path, capsys):
    rc, out, err = dry([*base_args(tmp_path), "-g", "2", "--gbs", "64", "--mbs", "4"], capsys)
    assert rc == 0, err
    argv = command_of(out)
    env = {a.split("=")[0]: a.split("=", 1)[1] for a in argv if "=" in a and not a.startswith("-")}
    assert env["CUDA_VISIBLE_DEVICES"] == "" and int(env["OMP_NUM_THREADS"]) >= 1
    i = argv.index("-m")
    assert argv[i:i + 2] == ["-m", "megatron_vlm.launch.elastic"]
    port = int(argv[argv.index("--master_port") + 1])
    entry = argv.index(str(REPO / "train" / "pretrain_vlm.py"))
    assert argv[argv.index("--nnodes"):entry + 1] == [
        "--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "2", "--rdzv_backend", "static",
        "--master_addr", "127.0.0.1", "--master_port", str(port), "--max_restarts", "0",
        str(REPO / "train" / "pretrain_vlm.py")]
    cfg = config_of(out)
    # a dry run writes no config file, so its command gives the trainer the printed config as flags
    assert "--config" not in argv[entry:]
    assert script("train/pretrain_vlm.py")._config(argv[entry + 1:]) == dataclasses.replace(cfg, dry_run=False)
    assert (cfg.dp, cfg.grad_accum, cfg.precision, cfg.master_port) == (2, 8, "fp32", port)
    assert (cfg.image_token_id, cfg.pad_token_id) == (IMAGE_ID, PAD_ID)
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_multi_node_cuda_with_interface_and_gpu_ids(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("megatron_vlm.launch.probe.run_probe", lambda *a, **k: {"device_count": 4})
    args = [*base_args(tmp_path), "--device", "cuda", "--gpu-ids", "0,1,2,3", "--node", "2", "--rank", "1",
            "--master-addr", "10.0.0.1", "--interface", "ib0", "--tp", "2", "--gbs", "32", "--mbs", "2"]
    rc, out, err = dry(args, capsys)
    assert rc == 0, err
    line = out.strip().splitlines()[-1]
    for kv in ("CUDA_VISIBLE_DEVICES=0,1,2,3", "NCCL_SOCKET_IFNAME=ib0", "GLOO_SOCKET_IFNAME=ib0",
               "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert kv in line.split()
    argv = command_of(out)
    i = argv.index("--nnodes")
    assert argv[i:i + 12] == ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "4", "--rdzv_backend",
                              "static", "--master_addr", "10.0.0.1", "--master_port", "29500"]
    assert argv[argv.index("--rank") + 1] == "1"  # node 1's settings (a launch writes them to config.node1.yaml)
    cfg = config_of(out)
    assert (cfg.world_size, cfg.dp, cfg.grad_accum, cfg.precision) == (8, 4, 4, "bf16")


def test_yaml_request_with_overrides(tmp_path, capsys):
    req = tmp_path / "run.yaml"
    args = base_args(tmp_path)
    req.write_text(yaml.safe_dump({"data_path": args[args.index("--data-path") + 1], "stage": 2, "gpus": 2,
                                   "micro_batch_size": 2, "global_batch_size": 16}))
    rc, out, err = dry([*args, "--config", str(req), "--mbs", "4"], capsys)
    assert rc == 0, err
    cfg = config_of(out)
    assert (cfg.stage, cfg.freeze_lm, cfg.lr, cfg.micro_batch_size, cfg.grad_accum) == (2, False, 2e-5, 4, 2)


@pytest.mark.parametrize("extra,expect", [
    (["-g", "3", "--tp", "2"], "-g 3 --tp 2: 3 GPUs is not a multiple of tp*pp=2"),
    (["-g", "2", "--gbs", "10", "--mbs", "4"], "global batch 10 is not divisible by micro batch 4 x data-parallel 2"),
    (["--fp8"], "--fp8 needs a CUDA GPU"),
    (["--tp", "3", "-g", "3", "--gbs", "16", "--mbs", "16"], "tp=3 does not divide num_attention_heads=4"),
    (["-g", "2", "--pp", "2", "--pp-layers", "2,1", "--gbs", "16", "--mbs", "16"], "--pp-layers 2,1 must give 2"),
    (["--seq-length", "16"], "--seq-length 16 cannot hold the 16 image tokens"),
    (["--no-add-class-token"], "--no-add-class-token: the clip vision encoder of"),
    (["-g", "3", "--cp", "2"], "-g 3 --tp 1 --cp 2: 3 GPUs is not a multiple of tp*pp*cp=2"),
    (["-g", "2", "--cp", "2", "--seq-length", "66", "--gbs", "16", "--mbs", "16"],
     "--seq-length 66 does not split over the context-parallel ranks: it must be a multiple of 4 (2 x --cp 2); "
     "use --seq-length 68"),
    # virtual pipeline stages (issue 51): the 2-layer model's ranks hold one layer each
    (["-g", "2", "--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--gbs", "32", "--mbs", "16"],
     "--num-virtual-stages-per-pipeline-rank 2: pipeline rank 0 holds 1 language layer (--pp 2), which do not split "
     "into 2 model chunks of equal size"),
    (["-g", "2", "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2", "--gbs", "32", "--mbs", "16"],
     "--num-layers-per-virtual-pipeline-stage 2 does not divide the 1 language layers of each pipeline rank"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "--num-layers-per-virtual-pipeline-stage needs pipeline "
     "parallelism"),
    (["-g", "2", "--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--gbs", "48", "--mbs", "16"],
     "a step has 3 (global batch 48 / (micro batch 16 x data-parallel 1)), not a multiple of 2; pass "
     "--global-batch-size 32 or 64"),
    (["-g", "2", "--pp", "2", "--pp-layers", "1,1", "--num-layers-per-virtual-pipeline-stage", "1", "--gbs", "32",
      "--mbs", "16"], "give the chunks per rank with --num-virtual-stages-per-pipeline-rank instead"),
])
def test_impossible_requests(tmp_path, capsys, extra, expect):
    rc, out, err = dry([*base_args(tmp_path), *extra], capsys)
    assert rc == 2 and out == ""
    assert expect in err


def test_context_parallel_request(tmp_path, capsys, monkeypatch):
    """--cp 2 (never --cpus-per-task): the config and the command carry it, the estimate splits the language
    model's positions over the CP ranks; on a GPU, --cp-comm-type a2a needs heads that divide over the CP ranks."""
    args = [*base_args(tmp_path), "--gbs", "16", "--mbs", "16"]
    rc, out, err = dry([*args, "-g", "2", "--cp", "2"], capsys)
    assert rc == 0, err
    cfg = config_of(out)
    assert (cfg.cp, cfg.dp, cfg.cpus_per_task) == (2, 1, None)
    assert "--cp" in command_of(out) or "--context-parallel-size" in command_of(out)
    assert "CP=2 DP=1" in out and "micro batch 16 x 64 positions (32 on this rank, CP=2)" in out
    monkeypatch.setattr("megatron_vlm.launch.probe.run_probe", lambda *a, **k: {"device_count": 4})
    rc, _, err = dry([*args, "--device", "cuda", "-g", "4", "--cp", "4", "--cp-comm-type", "a2a",
                      "--transformer-impl", "local"], capsys)
    assert rc == 2 and "--cp-comm-type a2a applies to Transformer Engine's attention" in err
    rc, _, err = dry([*args, "--device", "cuda", "-g", "4", "--cp", "4", "--cp-comm-type", "a2a"], capsys)
    assert rc == 2 and "--cp-comm-type a2a spreads attention heads over the CP ranks: the 4 heads and 2 KV heads " \
        "per TP rank of" in err and "do not divide by --cp 4; use --cp-comm-type p2p or allgather" in err
    rc, out, err = dry([*args, "--device", "cuda", "-g", "4", "--cp", "2", "--tp", "2", "--cp-comm-type", "a2a"],
                       capsys)
    assert rc == 2 and "the 2 heads and 1 KV heads" in err
    # a GPU runtime where Transformer Engine does not import: --cp is refused unless local layers are asked for,
    # and their estimate holds CP's reference attention (gathered keys and values, S/CP x S scores per head)
    from megatron_vlm.launch import sizing

    planned = []
    real = sizing.fused_attention
    monkeypatch.setattr(sizing, "fused_attention", lambda cfg, facts: planned.append(real(cfg, facts)) or planned[-1])
    for te, extra in ((True, []), (False, []), (False, ["--transformer-impl", "local"])):
        monkeypatch.setattr("megatron_vlm.launch.probe.run_probe", lambda *a, **k: {
            "device_count": 4, "transformer_engine": te, "transformer_engine_error": "ModuleNotFoundError: no TE"})
        rc, out, err = dry([*args, "--device", "cuda", "-g", "2", "--cp", "2", *extra], capsys)
        if te is False and not extra:
            assert rc == 2 and "--cp 2 on CUDA needs Transformer Engine's attention, and Transformer Engine does not " \
                "import here (ModuleNotFoundError: no TE); install it" in err and "--transformer-impl local" in err
            continue
        assert rc == 0, err
    assert planned == [True, False]  # TE's attention keeps no scores; the reference attention's are estimated


def test_data_checks(tmp_path, capsys):
    args = base_args(tmp_path)
    rc, _, err = dry([*args, "--data-path", str(tmp_path / "nothere")], capsys)
    assert rc == 2 and f"--data-path {tmp_path / 'nothere'}: no such file or directory" in err
    raw = make_data(tmp_path / "raw", prepared=False)
    rc, _, err = dry([*args, "--data-path", str(raw)], capsys)
    assert rc == 2 and "is not a prepared energon dataset (no .nv-meta/dataset.yaml)" in err
    meta = tmp_path / "blend.yaml"
    meta.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits: {}\n")
    rc, _, err = dry([*args, "--data-path", str(meta)], capsys)  # an empty blend (issue 18)
    assert rc == 2 and f"--data-path {meta}: no 'splits' in the metadataset" in err
    prepared = make_data(tmp_path / "ok")
    meta.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                    f"    - {{weight: 1.0, path: {prepared}, split_part: train}}\n")
    assert dry([*args, "--data-path", str(meta)], capsys)[0] == 0


def test_checkpoint_checks(tmp_path, capsys):
    args = base_args(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = dry([*args, "--megatron-load-dir", str(empty)], capsys)
    assert rc == 2 and "has no vlm_spec.json" in err and "has no latest_checkpointed_iteration.txt" in err
    ck = make_ckpt(tmp_path / "c2", tracker="100")
    (ck / "iter_0000100").rmdir()
    rc, _, err = dry([*args, "--megatron-load-dir", str(ck)], capsys)
    assert rc == 2 and "points at iter_0000100/, which does not exist" in err
    rc, _, err = dry([*args, "--megatron-load-dir", str(empty), "--init"], capsys)
    assert rc == 0, err  # --init needs no checkpoint


def test_no_add_class_token_accepted_for_siglip(tmp_path, capsys):
    args = base_args(tmp_path)
    siglip = make_ckpt(tmp_path / "siglip", tiny_spec(vision_family="siglip", vision_feature_select_strategy="full"))
    rc, _, err = dry([*args, "--megatron-load-dir", str(siglip), "--no-add-class-token"], capsys)
    assert rc == 0, err


def test_moe_sequence_parallel_lengths_are_checked_before_launch(tmp_path, capsys):
    """An MoE checkpoint at --tp 2 trains with sequence parallelism (turned on once the spec is read): the sequence
    must then split into 2 x CP x TP chunks (and into TP chunks with --pp, where every micro batch is --seq-length
    long). --seq-length 1028 at --cp 2 passed every pre-launch check and failed in the ranks: refused in one line."""
    moe = make_ckpt(tmp_path / "moe", tiny_spec(text_family="qwen3_moe", num_moe_experts=4, moe_router_topk=2,
                                                moe_ffn_hidden_size=32))
    args = [*base_args(tmp_path), "--megatron-load-dir", str(moe), "--mbs", "1", "--gbs", "8"]
    rc, out, err = dry([*args, "-g", "8", "--tp", "2", "--cp", "2", "--ep", "2", "--seq-length", "1028"], capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert ("--seq-length 1028 does not split over the context-parallel ranks: it must be a multiple of 8 (2 x --cp 2 "
            "x --tp 2, with --sequence-parallel, which the mixture-of-experts language model turns on at --tp 2); use "
            "--seq-length 1032") in err
    rc, out, err = dry([*args, "-g", "8", "--tp", "2", "--pp", "2", "--ep", "2", "--seq-length", "1027"], capsys)
    assert rc == 2 and ("--seq-length 1027 does not split over the sequence-parallel ranks (with --pp 2 every micro "
                        "batch is --seq-length long): it must be a multiple of 2 (--tp 2, with --sequence-parallel, "
                        "which the mixture-of-experts language model turns on at --tp 2); use --seq-length 1028") in err
    rc, out, err = dry([*args, "-g", "8", "--tp", "2", "--cp", "2", "--ep", "2", "--seq-length", "1032"], capsys)
    assert rc == 0 and "sequence parallelism on" in err + out and config_of(out).sequence_parallel, err


def test_token_ids_must_match_checkpoint(tmp_path, capsys):
    rc, _, err = dry([*base_args(tmp_path), "--image-token-id", "5"], capsys)
    assert rc == 2 and "image token id 5 (--image-token-id/--pad-token-id) differs from 301" in err


def test_cuda_request_without_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("megatron_vlm.launch.probe.run_probe",
                        lambda *a, **k: {"device_count": 0, "torch": "2.13.0+cpu"})
    rc, _, err = dry([*base_args(tmp_path), "--device", "cuda"], capsys)
    assert rc == 2 and "no CUDA GPU is visible (torch 2.13.0+cpu); run on a GPU node, or pass --device cpu" in err
    monkeypatch.setattr("megatron_vlm.launch.probe.run_probe", lambda *a, **k: {"device_count": 2})
    rc, _, err = dry([*base_args(tmp_path), "--device", "cuda", "-g", "4", "--mbs", "1", "--gbs", "4"], capsys)
    assert rc == 2 and "-g 4 but only 2 CUDA GPU(s) are visible" in err


def test_fp8_needs_transformer_engine_and_sm89(tmp_path, capsys, monkeypatch):
    facts = {"device_count": 1, "transformer_engine": False, "transformer_engine_error": "ModuleNotFoundError",
             "capabilities": [[8, 0]]}
    monkeypatch.setattr("megatron_vlm.launch.probe.run_probe", lambda *a, **k: facts)
    rc, _, err = dry([*base_args(tmp_path), "--device", "cuda", "--fp8"], capsys)
    assert rc == 2 and "--fp8 needs Transformer Engine" in err and "GPU 0 is sm_80" in err
    facts.update(transformer_engine=True, capabilities=[[9, 0]])
    assert dry([*base_args(tmp_path), "--device", "cuda", "--fp8"], capsys)[0] == 0
    rc, _, err = dry([*base_args(tmp_path), "--device", "cuda", "--fp8", "--fp8-recipe", "mxfp8"], capsys)
    assert rc == 2 and "--fp8-recipe mxfp8 needs compute capability 10.x" in err and "GPU 0 is sm_90" in err


def test_device_auto_falls_back_to_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("megatron_vlm.launch.probe.run_probe", lambda *a, **k: {"device_count": 0})
    args = [a for a in base_args(tmp_path) if a not in ("--device", "cpu")]
    rc, out, err = dry(args, capsys)
    assert rc == 0, err
    assert config_of(out).device == "cpu" and "no CUDA GPU visible: running on CPU" in err


@pytest.mark.slow
def test_real_probe_reads_token_ids_from_tokenizer(tmp_path, capsys):
    """The ids come from a real tokenizer and are checked against the spec: a CPU launch on the host reads them in
    the launcher; a CUDA or container launch asks the probe subprocess, which reads the same ids."""
    from tests.support.tiny import train_tokenizer
    from megatron_vlm.model.tokenizer import add_vlm_tokens, special_token_ids

    tok = train_tokenizer(tmp_path / "tok_real")
    add_vlm_tokens(tok)
    tok.save_pretrained(str(tmp_path / "tok_real"))
    ids = special_token_ids(tok)
    ckpt = make_ckpt(tmp_path / "c", spec=tiny_spec(image_token_id=ids.image, pad_token_id=ids.pad))
    args = [*base_args(tmp_path, ids=False), "--tokenizer-load-dir", str(tmp_path / "tok_real"),
            "--megatron-load-dir", str(ckpt)]
    rc, out, err = dry(args, capsys)
    assert rc == 0, err
    cfg = config_of(out)
    assert (cfg.image_token_id, cfg.pad_token_id) == (ids.image, ids.pad) == (300, 301)  # <image>, then <pad>
    from megatron_vlm.launch.probe import run_probe

    facts = run_probe([sys.executable], dict(os.environ), str(REPO), False, False, str(tmp_path / "tok_real"))
    assert facts == {"tokenizer": {"image": 300, "pad": 301}}


def test_virtual_pipeline_stages_on_the_command_line_yaml_and_sbatch(tmp_path, capsys):
    """Megatron-LM's two flags for virtual pipeline parallelism (issue 51) with a 4-layer model at PP2: the dry run
    passes, the estimate names VPP and counts the interleaved schedule's chunk passes in flight, the resolved config
    carries the flag, a YAML request gives the same, and the --sbatch job's YAML keeps it for every node."""
    args = base_args(tmp_path)
    args[args.index("--megatron-load-dir") + 1] = str(make_ckpt(tmp_path / "four", spec=tiny_spec(num_layers=4)))
    flags = ["-g", "2", "--pp", "2", "--gbs", "32", "--mbs", "16"]
    rc, out, err = dry([*args, *flags, "--num-layers-per-virtual-pipeline-stage", "1"], capsys)
    assert rc == 0, err
    head = out.splitlines()[0]
    assert "TP=1 PP=2 VPP=2 DP=1" in head, head
    assert "up to 4 chunk passes in flight (2 chunks of 1 layer(s): the interleaved schedule)" in out, out
    assert config_of(out).num_layers_per_virtual_pipeline_stage == 1
    req = tmp_path / "run.yaml"
    req.write_text(yaml.safe_dump({"num_virtual_stages_per_pipeline_rank": 2, "pp": 2, "gpus": 2}))
    rc, out, err = dry([*args, "--config", str(req), "--gbs", "32", "--mbs", "16"], capsys)
    assert rc == 0, err
    assert config_of(out).num_virtual_stages_per_pipeline_rank == 2 and "VPP=2" in out
    job = tmp_path / "job.sh"
    assert cli.main([*args, *flags, "--num-virtual-stages-per-pipeline-rank", "2", "--device", "cuda", "--sbatch",
                     str(job)], repo_root=REPO) == 0, capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "job.yaml").read_text())["num_virtual_stages_per_pipeline_rank"] == 2
