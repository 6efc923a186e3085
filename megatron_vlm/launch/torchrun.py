"""The torchrun command line and the environment of the ranks, for one node.

``torchrun_command(cfg, config_path, entrypoint)`` returns a ``Command``: an argument list (never a shell
string) and the environment variables to add. One node: static rendezvous on 127.0.0.1 with a free port
(``megatron_vlm.runtime.ports.free_port``) unless ``--master-port`` is given. Several nodes: static rendezvous at
``master_addr:master_port`` with this node's ``--node_rank``. ``python -m megatron_vlm.launch.elastic`` (torch's
``torch.distributed.run`` with one-line endings on a signal or a failed rank) is used instead of the ``torchrun``
script so that the ranks run under the same interpreter as the launcher. Where that command is this interpreter's
(no container), the launcher runs it in its own process instead (``Command.agent_args_here``): the same agent
and arguments without a second interpreter importing torch.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Mapping

from megatron_vlm.runtime.ports import free_port  # noqa: F401 - re-exported (tests, slurm)
from megatron_vlm.training.config import TrainConfig

DEFAULT_MULTINODE_PORT = 29500
ELASTIC_MODULE = "megatron_vlm.launch.elastic"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding megatron_vlm/
# Seconds torchrun waits after forwarding SIGTERM/SIGINT before it SIGKILLs the ranks (torch >= 2.9 reads it;
# older torch waits 30 s): the trainer's window to save a checkpoint on preemption.
SHUTDOWN_GRACE_S = 120


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment

    def display(self) -> str:
        """Shell-quoted, for printing only (the command is always run as an argument list)."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (prefix + " " if prefix else "") + shlex.join(self.argv)

    def agent_args_here(self) -> list[str] | None:
        """torchrun's arguments when this command is ``<this interpreter> -m megatron_vlm.launch.elastic ...``,
        which the launcher can then run in its own process; None for any other command (a container's)."""
        if self.argv[:3] == [sys.executable, "-m", ELASTIC_MODULE]:
            return self.argv[3:]
        return None


def rendezvous_port(cfg: TrainConfig) -> int:
    if cfg.master_port is not None:
        return cfg.master_port
    return free_port() if cfg.nodes == 1 else DEFAULT_MULTINODE_PORT


def rank_env(cfg: TrainConfig, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables the ranks need on top of ``base_env`` (values the user set there win)."""
    base = os.environ if base_env is None else base_env
    env: dict[str, str] = {}

    def setdefault(key: str, value: str) -> None:
        if key not in base:
            env[key] = value

    if cfg.interface:
        env["NCCL_SOCKET_IFNAME"] = cfg.interface
        env["GLOO_SOCKET_IFNAME"] = cfg.interface
    if cfg.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path runs only where CUDA is absent
        setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.gpus)))
    else:
        if cfg.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.gpu_ids))
        setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron's TP/SP communication overlap needs it
    if cfg.deterministic:
        setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        setdefault("NCCL_ALGO", "Ring")
    setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    # torchrun runs as ``-m megatron_vlm.launch.elastic``: this checkout first on the path (same path inside a
    # container, which mounts it there).
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else []))
    setdefault("PYTHONUNBUFFERED", "1")
    return env


def torchrun_command(cfg: TrainConfig, config_path: str, entrypoint: str, python: str = "python",
                     port: int | None = None, base_env: Mapping[str, str] | None = None,
                     trainer_args: list[str] | None = None) -> Command:
    """This node's command: torchrun starting ``entrypoint --config config_path`` once per GPU (``entrypoint
    *trainer_args`` instead when given: the settings as flags, for a command shown without its config file)."""
    port = port if port is not None else rendezvous_port(cfg)
    argv = [
        python, "-m", ELASTIC_MODULE,  # torch.distributed.run with one-line endings
        "--nnodes", str(cfg.nodes),
        "--node_rank", str(cfg.node_rank),
        "--nproc_per_node", str(cfg.gpus),
        "--rdzv_backend", "static",
        "--master_addr", cfg.master_addr,
        "--master_port", str(port),
        "--max_restarts", "0",
        entrypoint, *(trainer_args if trainer_args is not None else ["--config", str(config_path)]),
    ]
    return Command(argv, rank_env(cfg, base_env))
