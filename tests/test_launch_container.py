"""Container wrapping: apptainer/singularity and docker command lines, mounts, and the probe inside."""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap

import pytest
from .launch_helpers import REPO, STANDIN, base_args, no_slurm_env  # noqa: F401

from megatron_vlm.launch import cli
from megatron_vlm.launch.container import find_runtime, mounts, parse_bind, wrap
from megatron_vlm.launch.torchrun import Command, torchrun_command
from megatron_vlm.training.config import ConfigError, TrainConfig

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="the launcher's container command lines: it imports nothing heavier than PyYAML "
           "(docs/architecture.md)")


def dry_argv(args, capsys) -> tuple[list[str], str]:
    rc = cli.main([*args, "--dry-run"], repo_root=REPO)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return shlex.split(out.out.strip().splitlines()[-1]), out.err


def _sif(tmp_path):
    img = tmp_path / "vlm.sif"
    img.write_bytes(b"SIF")
    return img


def test_apptainer_dry_run(tmp_path, capsys):
    img = _sif(tmp_path)
    extra = tmp_path / "extra"
    extra.mkdir()
    argv, err = dry_argv([*base_args(tmp_path), "--device", "cuda", "-g", "2", "--sif-path", str(img),
                          "--bind", f"{extra}:/mnt/extra:ro"], capsys)
    env_end = next(i for i, a in enumerate(argv) if "=" not in a)
    argv = argv[env_end:]
    assert argv[:5] == ["apptainer", "exec", "--nv", "--pwd", str(REPO)]
    image_at = argv.index(str(img))  # (after it, the trainer's settings as flags: --bind is one of them)
    binds = [argv[i + 1] for i, a in enumerate(argv[:image_at]) if a == "--bind"]
    run_dir = tmp_path / "out" / "llava-stage1"
    expected = sorted(f"{p}:{p}" for p in (REPO, run_dir, tmp_path / "data", tmp_path / "ckpt", tmp_path / "tok"))
    assert binds == expected + [f"{extra}:/mnt/extra:ro"]  # tensorboard dir lies in the run dir: no own mount
    i = argv.index(str(img))
    assert argv[i + 1:i + 4] == ["python", "-m", "megatron_vlm.launch.elastic"]
    assert "GPU/FP8 checks run inside the apptainer container at launch" in err


def test_singularity_when_no_apptainer(tmp_path):
    cfg = TrainConfig.from_args([*base_args(tmp_path), "--sif-path", "x.sif"])
    assert find_runtime(cfg, which=lambda n: "/usr/bin/singularity" if n == "singularity" else None) == "singularity"
    assert find_runtime(cfg, which=lambda n: "/usr/bin/" + n) == "apptainer"
    with pytest.raises(ConfigError, match="apptainer or singularity not found on PATH"):
        find_runtime(cfg, which=lambda n: None)


def test_docker_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "s3cret")
    argv, _ = dry_argv([*base_args(tmp_path), "--device", "cuda", "--gpu-ids", "2,3", "--docker-image",
                        "nvcr.io/me/vlm:1", "--interface", "eth0"], capsys)
    assert argv[:9] == ["docker", "run", "--rm", "--init", "--gpus", "all", "--ipc=host", "--network=host",
                        "--ulimit"]
    assert argv[argv.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    assert argv[argv.index("-w") + 1] == str(REPO)
    vols = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert f"{tmp_path / 'data'}:{tmp_path / 'data'}" in vols and f"{REPO}:{REPO}" in vols
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    for e in ("CUDA_VISIBLE_DEVICES=2,3", "NCCL_SOCKET_IFNAME=eth0", "GLOO_SOCKET_IFNAME=eth0", "WANDB_API_KEY"):
        assert e in envs
    assert "s3cret" not in " ".join(argv)  # passed by name: docker reads the value, the printout never shows it
    i = argv.index("nvcr.io/me/vlm:1")
    assert argv[i + 1:i + 4] == ["python", "-m", "megatron_vlm.launch.elastic"]


def test_cpu_container_has_no_gpu_flags(tmp_path):
    cfg = TrainConfig.from_args([*base_args(tmp_path), "--docker-image", "img"])
    argv = wrap(Command(["python"]), cfg, str(REPO), "docker", uid_gid=(1, 2), base_env={}).argv
    assert "--gpus" not in argv and argv[-2:] == ["img", "python"]
    cfg = TrainConfig.from_args([*base_args(tmp_path), "--sif-path", "i.sif"])
    assert "--nv" not in wrap(Command(["python"]), cfg, str(REPO), "apptainer").argv


def test_the_launcher_runs_torchrun_itself_only_outside_a_container(tmp_path):
    cfg = TrainConfig.from_args([*base_args(tmp_path), "-g", "2"])
    local = torchrun_command(cfg, "c.yaml", "entry.py", python=sys.executable, port=1234)
    assert local.agent_args_here() == local.argv[3:] and local.argv[3:5] == ["--nnodes", "1"]
    assert local.argv[-3:] == ["entry.py", "--config", "c.yaml"]
    boxed = TrainConfig.from_args([*base_args(tmp_path), "-g", "2", "--docker-image", "img"])
    cmd = torchrun_command(boxed, "c.yaml", "entry.py", python="python", port=1234)
    assert wrap(cmd, boxed, str(REPO), "docker", uid_gid=(1, 2), base_env={}).agent_args_here() is None
    other = torchrun_command(cfg, "c.yaml", "entry.py", python="/another/python", port=1234)
    assert other.agent_args_here() is None  # another interpreter: its own process, as the command says


def test_bind_parsing_and_metadataset_mount(tmp_path):
    assert parse_bind("/a").spec() == "/a:/a"
    assert parse_bind("/a:/b:ro").spec() == "/a:/b:ro"
    with pytest.raises(ConfigError, match="expected SRC, SRC:DST or SRC:DST:ro"):
        parse_bind("/a:/b:xx")
    meta = tmp_path / "mix" / "blend.yaml"
    meta.parent.mkdir()
    meta.write_text("{}")
    cfg = TrainConfig.from_args([*base_args(tmp_path), "--data-path", str(meta), "--sif-path", "i.sif"])
    assert str(meta.parent) in [m.src for m in mounts(cfg, str(REPO))]


FAKE_APPTAINER = textwrap.dedent("""\
    #!{python}
    # Stand-in for apptainer: logs its argv, then runs the command after the image on the host.
    import json, os, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_CONTAINER_LOG"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    i = 1
    while args[i].startswith("--"):
        i += 2 if args[i] in ("--pwd", "--bind") else 1
    cmd = args[i + 1:]
    os.execv({python!r}, [{python!r}] + cmd[1:])
    """)


@pytest.mark.slow
def test_probe_runs_inside_the_container(tmp_path, capsys, monkeypatch):
    """Not a dry run: the GPU check is asked of the container's python (here: a logging stand-in)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "apptainer"
    fake.write_text(FAKE_APPTAINER.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "container.log"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CONTAINER_LOG", str(log))
    monkeypatch.setenv("MEGATRON_VLM_ENTRYPOINT", str(STANDIN))
    rc = cli.main([*base_args(tmp_path), "--device", "cuda", "--sif-path", str(_sif(tmp_path))], repo_root=REPO)
    err = capsys.readouterr().err
    assert rc == 2 and "no CUDA GPU is visible" in err
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 1 and calls[0][:2] == ["exec", "--nv"]
    assert calls[0][-6:] == [str(tmp_path / "vlm.sif"), "python", "-m", "megatron_vlm.launch.probe", "--cuda",
                             "--te"]  # the container's Transformer Engine decides the layers and CP's attention
    assert not (tmp_path / "out").exists()  # stopped before writing anything


@pytest.mark.slow
def test_image_build_installs_the_lane_of_the_images_python(tmp_path):
    """containers/filter_constraints.py picks constraints/pyXY.txt for the running Python (NGC: 3.12 -> 0.19)."""
    import importlib.util
    import subprocess

    script = REPO / "containers" / "filter_constraints.py"
    spec = importlib.util.spec_from_file_location("filter_constraints", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lane = "py%d%d.txt" % sys.version_info[:2]
    assert mod.lane_file(str(REPO / "constraints")) == str(REPO / "constraints" / lane)
    pins = dict(line.strip().split("==") for line in open(REPO / "constraints" / lane) if "==" in line)
    from megatron_vlm.runtime import mcore_version

    assert pins["megatron-core"] == mcore_version.installed()  # (0.19's megatron.core.__version__ has a +local)
    assert any(line.startswith("megatron-core==0.16.") for line in open(REPO / "constraints" / "py311.txt"))
    assert any(line.startswith("megatron-core==0.19.") for line in open(REPO / "constraints" / "py312.txt"))
    for name in ("Dockerfile", "apptainer.def"):
        assert "filter_constraints.py constraints " in (REPO / "containers" / name).read_text()
    other = tmp_path / "constraints"
    other.mkdir()
    (other / "py39.txt").write_text("megatron-core==0.1\n")
    r = subprocess.run([sys.executable, str(script), str(other)], capture_output=True, text=True)
    assert r.returncode != 0 and f"has no {lane}" in r.stderr and "Python 3.11 or 3.12" in r.stderr
