"""SLURM: nodelist expansion, job detection from the environment, batch script writing and submission."""

from __future__ import annotations

import shlex
import stat

import pytest
import yaml
from .launch_helpers import REPO, base_args, no_slurm_env  # noqa: F401

from megatron_vlm.launch import cli, sbatch
from megatron_vlm.launch.nodelist import NodelistError, expand_nodelist
from megatron_vlm.launch.slurm import defaults_from_slurm, detect_slurm
from megatron_vlm.training.config import ConfigError

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="SLURM node lists, environments and batch scripts: the launcher's standard-library code")


@pytest.mark.parametrize("text,hosts", [
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("node-1", ["node-1"]),
    ("r[1-2]n[01-02],login", ["r1n01", "r1n02", "r2n01", "r2n02", "login"]),
    ("dgx-a[1,3],dgx-b[002-003]", ["dgx-a1", "dgx-a3", "dgx-b002", "dgx-b003"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-04", "gpu]1", "gpu[4-1]", "gpu[a-b]", "n[[1]]", ""])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(NodelistError):
        expand_nodelist(bad)


STEP_ENV = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "4",
            "SLURM_STEP_NODELIST": "gpu[07-10]", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_NNODES": "4",
            "SLURM_NODEID": "2", "SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_GPUS_ON_NODE": "8"}


def test_detect_slurm_step():
    job = detect_slurm(STEP_ENV)
    assert (job.nodes, job.node_rank, job.master_addr, job.gpus_on_node, job.in_step) == (4, 2, "gpu07", 8, True)
    assert job.master_port == 20000 + 4242
    d = defaults_from_slurm(job, None)
    assert d == {"gpus": 8, "nodes": 4, "node_rank": 2, "master_addr": "gpu07", "master_port": 24242}
    assert defaults_from_slurm(job, 1) == {"gpus": 8}  # the user asked for one node: only the GPU count
    assert detect_slurm({}) is None


def test_detect_slurm_gpus_per_node_format_and_single_node():
    job = detect_slurm({"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n1",
                        "SLURM_GPUS_PER_NODE": "h100:4"})
    assert job.gpus_on_node == 4 and not job.in_step
    assert defaults_from_slurm(job, None) == {"gpus": 4, "nodes": 1, "node_rank": 0}  # keeps 127.0.0.1 + free port


def test_slurm_misuse_is_explained():
    batch = {k: v for k, v in STEP_ENV.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(ConfigError, match="not a job step: start the launcher on every node with `srun"):
        defaults_from_slurm(detect_slurm(batch), None)
    many = dict(STEP_ENV, SLURM_STEP_NUM_TASKS="32")
    with pytest.raises(ConfigError, match="ONE task per node"):
        defaults_from_slurm(detect_slurm(many), None)


def test_dry_run_inside_slurm_step(tmp_path, monkeypatch, capsys):
    for k, v in STEP_ENV.items():
        monkeypatch.setenv(k, v)
    rc = cli.main([*base_args(tmp_path), "--mbs", "1", "--gbs", "64", "--dry-run"], repo_root=REPO)
    out = capsys.readouterr()
    assert rc == 0, out.err
    argv = shlex.split(out.out.splitlines()[-1])
    i = argv.index("--nnodes")
    assert argv[i:i + 12] == ["--nnodes", "4", "--node_rank", "2", "--nproc_per_node", "8", "--rdzv_backend",
                              "static", "--master_addr", "gpu07", "--master_port", "24242"]
    assert argv[argv.index("--rank") + 1] == "2"  # node 2's settings (a launch writes them to config.node2.yaml)
    assert "SLURM job 4242" in out.err


def _sbatch_args(tmp_path):
    return [*base_args(tmp_path), "--device", "cuda", "--sbatch", str(tmp_path / "job.sh"), "--nodes", "4",
            "--gpus-per-node", "8", "--partition", "P", "--time", "12:00:00", "--account", "acc", "--tp", "2",
            "--gbs", "256", "--mbs", "4", "--name", "pre"]


def test_sbatch_script_and_job_config(tmp_path, capsys):
    rc = cli.main(_sbatch_args(tmp_path), repo_root=REPO)
    assert rc == 0, capsys.readouterr().err
    script = (tmp_path / "job.sh").read_text()
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for d in ("--job-name=pre", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=P",
              "--time=12:00:00", "--account=acc", "--exclusive", "--signal=TERM@180",
              f"--output={tmp_path / 'out' / 'pre'}/slurm-%j.out"):
        assert f"#SBATCH {d}" in lines
    srun = shlex.split(lines[-1])
    assert srun[:4] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpu-bind=none"]
    assert srun[5:] == [str(REPO / "train" / "run.py"), "--config", str(tmp_path / "job.yaml")]
    assert stat.S_IMODE((tmp_path / "job.sh").stat().st_mode) & 0o100
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert (job["nodes"], job["gpus"], job["tp"], job["global_batch_size"]) == (4, 8, 2, 256)
    for dropped in sbatch.JOB_DROP:
        assert dropped not in job
    assert (tmp_path / "out" / "pre").is_dir()  # SLURM's --output directory must exist at submission


def test_job_config_runs_inside_the_job(tmp_path, monkeypatch, capsys):
    assert cli.main(_sbatch_args(tmp_path), repo_root=REPO) == 0
    env = dict(STEP_ENV, SLURM_NODEID="3", SLURM_PROCID="3")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("megatron_vlm.launch.probe.run_probe", lambda *a, **k: {"device_count": 8})
    capsys.readouterr()
    assert cli.main(["--config", str(tmp_path / "job.yaml"), "--dry-run"], repo_root=REPO) == 0
    argv = shlex.split(capsys.readouterr().out.splitlines()[-1])
    i = argv.index("--nnodes")
    assert argv[i:i + 6] == ["--nnodes", "4", "--node_rank", "3", "--nproc_per_node", "8"]


def test_sbatch_dry_run_writes_nothing(tmp_path, capsys):
    assert cli.main([*_sbatch_args(tmp_path), "--dry-run"], repo_root=REPO) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=4" in out and "nodes: 4" in out
    assert not (tmp_path / "job.sh").exists() and not (tmp_path / "job.yaml").exists()


def test_submit_runs_sbatch_as_argument_list(tmp_path, monkeypatch, capsys):
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "Submitted batch job 99\n", ""

    monkeypatch.setattr(sbatch.subprocess, "run", lambda argv, **kw: calls.append(argv) or Done())
    assert cli.main([*_sbatch_args(tmp_path), "--submit"], repo_root=REPO) == 0
    assert calls == [["sbatch", str(tmp_path / "job.sh")]]
    assert "Submitted batch job 99" in capsys.readouterr().out


@pytest.mark.slow
def test_submit_without_sbatch_binary(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cli.main([*_sbatch_args(tmp_path), "--submit"], repo_root=REPO) == 2
    assert "sbatch not found on PATH" in capsys.readouterr().err
