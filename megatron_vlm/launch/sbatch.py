"""SLURM batch scripts: one task per node runs the launcher, which detects its node rank from SLURM.

``write_job(cfg, script, ...)`` writes ``JOB.sh`` and, beside it, ``JOB.yaml``: the resolved request without
what differs per node (node rank, node 0's address) or only concerns the submission. Inside the job every
node runs ``srun --ntasks-per-node=1 python train/run.py --config JOB.yaml``; ``slurm.detect_slurm`` then
supplies node count, rank, node 0's address and a port derived from the job id. ``--signal=TERM@180`` asks
SLURM to send SIGTERM three minutes before the time limit, which the launcher forwards so the trainer can
save. ``submit`` runs ``sbatch JOB.sh`` as an argument list.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from datetime import datetime
from pathlib import Path

from megatron_vlm.files.atomic import atomic_write_text
from megatron_vlm.training.config import ConfigError, TrainConfig

# Fields left out of the job's config: per-node values (from SLURM in the job) and submission-only settings.
JOB_DROP = ("node_rank", "master_addr", "dry_run", "sbatch", "submit", "gpus_per_node", "partition", "time",
            "account", "cpus_per_task")
SIGNAL_BEFORE_END_S = 180


def job_config_path(script: str | os.PathLike) -> Path:
    script = Path(script)
    path = script.with_suffix(".yaml")
    if path == script:
        raise ConfigError(f"--sbatch {script}: name the script something.sh (its config goes to {path})")
    return path


def job_config(cfg: TrainConfig) -> str:
    import yaml

    data = {k: v for k, v in cfg.to_dict().items() if k not in JOB_DROP}
    return ("# megatron-vlm SLURM job request (read by train/run.py inside the job; node rank and node 0's "
            "address come from SLURM)\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def render_sbatch(cfg: TrainConfig, config_path: str | os.PathLike, repo_root: str, python: str) -> str:
    directives = [
        ("job-name", cfg.name),
        ("nodes", cfg.nodes),
        ("ntasks-per-node", 1),
        ("gpus-per-node", cfg.gpus_per_node if cfg.device == "cuda" else None),
        ("cpus-per-task", cfg.cpus_per_task),
        ("exclusive", True if cfg.cpus_per_task is None else None),
        ("partition", cfg.partition),
        ("time", cfg.time),
        ("account", cfg.account),
        ("output", str(cfg.run_dir / "slurm-%j.out")),
        ("signal", f"TERM@{SIGNAL_BEFORE_END_S}"),
    ]
    lines = [
        "#!/bin/bash",
        f"# Written by megatron-vlm train/run.py on {datetime.now():%Y-%m-%d %H:%M}. Submit with: sbatch <this file>",
        "# One task per node runs the launcher; it starts one training process per GPU with torchrun.",
    ]
    for key, value in directives:
        if value is None:
            continue
        if "\n" in str(value):
            raise ConfigError(f"--{key} {value!r}: must be one line")
        lines.append(f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={value}")
    run_py = str(Path(repo_root) / "train" / "run.py")
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpu-bind=none",
            python, run_py, "--config", str(config_path)]
    lines += [
        "",
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
        f"cd {shlex.quote(repo_root)}",
        shlex.join(srun),
        "",
    ]
    return "\n".join(lines)


def write_job(cfg: TrainConfig, repo_root: str, python: str) -> tuple[Path, Path]:
    """Write the script and its config (and create the run directory for SLURM's output file)."""
    script = Path(cfg.sbatch)
    config = job_config_path(script)
    atomic_write_text(config, job_config(cfg))
    atomic_write_text(script, render_sbatch(cfg, config, repo_root, python))
    script.chmod(0o755)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return script, config


def submit(script: str | os.PathLike) -> str:
    """``sbatch SCRIPT``; returns sbatch's answer (``Submitted batch job N``)."""
    try:
        res = subprocess.run(["sbatch", str(script)], capture_output=True, text=True)
    except FileNotFoundError:
        raise ConfigError(f"sbatch not found on PATH; submit {script} from a SLURM login node "
                          f"(`sbatch {script}`)") from None
    if res.returncode:
        raise ConfigError(f"sbatch {script} failed (exit {res.returncode}): {res.stderr.strip()}")
    return res.stdout.strip()
