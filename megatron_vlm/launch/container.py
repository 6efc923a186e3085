"""Container wrapping: run a node's torchrun (and so all its ranks) inside Apptainer/Singularity or Docker.

Every directory the run touches is mounted at the SAME path inside the container (code, data, checkpoint,
tokenizer, run directory, tensorboard directory, plus ``--bind`` extras), so the resolved config's absolute
paths mean the same thing inside and outside. GPUs: ``--nv`` (Apptainer) or ``--gpus all`` (Docker) with
CUDA_VISIBLE_DEVICES choosing among them. Docker also gets ``--ipc=host`` (NCCL/dataloader shared memory),
``--network=host`` (rendezvous and NCCL between nodes), ``--init`` (signals reach torchrun) and the caller's
uid:gid (checkpoints are not owned by root).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from megatron_vlm.launch.torchrun import Command
from megatron_vlm.training.config import ConfigError, TrainConfig


# Host variables handed to a Docker container by name (docker reads the values; they never appear in argv).
# passed by name only (docker run -e KEY), so values such as AWS_SECRET_ACCESS_KEY never appear in a command line
DOCKER_PASS_ENV_PREFIXES = ("NCCL_", "GLOO_", "WANDB_", "HF_", "TORCH_", "CUDA_", "OMP_", "SLURM_", "MSC_", "AWS_")


@dataclass(frozen=True)
class Mount:
    src: str
    dst: str
    read_only: bool = False

    def spec(self) -> str:
        return f"{self.src}:{self.dst}" + (":ro" if self.read_only else "")


def parse_bind(text: str) -> Mount:
    """``SRC``, ``SRC:DST`` or ``SRC:DST:ro`` (SRC made absolute)."""
    parts = text.split(":")
    if not parts[0] or len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise ConfigError(f"--bind {text!r}: expected SRC, SRC:DST or SRC:DST:ro")
    src = str(Path(os.path.expanduser(parts[0])).absolute())
    dst = parts[1] if len(parts) > 1 and parts[1] else src
    return Mount(src, dst, len(parts) == 3 and parts[2] == "ro")


def mounts(cfg: TrainConfig, repo_root: str) -> list[Mount]:
    """The run's directories (same path inside) plus ``--bind`` extras; nested same-path mounts dropped."""
    paths = [repo_root, str(cfg.run_dir), cfg.tensorboard_dir, cfg.tokenizer_load_dir]
    if cfg.megatron_load_dir and "://" not in cfg.megatron_load_dir:
        paths.append(cfg.megatron_load_dir)
    if cfg.data_path and "://" not in cfg.data_path:
        data = Path(cfg.data_path)
        paths.append(str(data if data.is_dir() else data.parent))  # a metadataset .yaml: mount its folder
    remote = [p for p in (cfg.data_path, cfg.save_dir, cfg.megatron_load_dir) if p and "://" in p]
    if remote and os.environ.get("MSC_CONFIG"):  # the object-store profiles, at the same path inside
        paths.append(str(Path(os.environ["MSC_CONFIG"]).absolute()))
    same = sorted({str(Path(p)) for p in paths if p})
    kept: list[str] = []
    for p in same:
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    auto = [Mount(p, p) for p in kept]
    extra = [parse_bind(b) for b in cfg.bind]
    extra_dst = {m.dst for m in extra}
    return [m for m in auto if m.dst not in extra_dst] + extra


def find_runtime(cfg: TrainConfig, which: Callable[[str], str | None] = shutil.which,
                 required: bool = True) -> str:
    """The container program: apptainer (or singularity where only that exists) or docker."""
    names = ("apptainer", "singularity") if cfg.sif_path else ("docker",)
    for n in names:
        if which(n):
            return n
    if required:
        raise ConfigError(
            f"{' or '.join(names)} not found on PATH; load the module that provides it or drop "
            f"{'--sif-path' if cfg.sif_path else '--docker-image'}"
        )
    return names[0]


def wrap(cmd: Command, cfg: TrainConfig, repo_root: str, runtime: str,
         uid_gid: tuple[int, int] | None = None, base_env: Mapping[str, str] | None = None) -> Command:
    """``cmd`` (whose argv[0] is the container's ``python``) run inside the configured container."""
    cuda = cfg.device == "cuda"
    ms = mounts(cfg, repo_root)
    if cfg.sif_path:
        argv = [runtime, "exec"] + (["--nv"] if cuda else []) + ["--pwd", repo_root]
        for m in ms:
            argv += ["--bind", m.spec()]
        # Apptainer passes the host environment through, so cmd.env stays on the host process.
        return Command(argv + [cfg.sif_path] + cmd.argv, dict(cmd.env))
    uid, gid = uid_gid or (os.getuid(), os.getgid())
    argv = [runtime, "run", "--rm", "--init"] + (["--gpus", "all"] if cuda else []) + [
        "--ipc=host", "--network=host",
        "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
        "--user", f"{uid}:{gid}", "-e", "HOME=/tmp", "-w", repo_root,
    ]
    for m in ms:
        argv += ["-v", m.spec()]
    base = os.environ if base_env is None else base_env
    for k in sorted(base):
        if k.startswith(DOCKER_PASS_ENV_PREFIXES) and k not in cmd.env:
            argv += ["-e", k]
    for k, v in cmd.env.items():
        argv += ["-e", f"{k}={v}"]
    return Command(argv + [cfg.docker_image] + cmd.argv, {})
