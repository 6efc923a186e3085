"""SLURM job detection: what a launcher running as one task per node learns from its environment.

``detect_slurm(env)`` reads only environment variables (SLURM_JOB_ID, SLURM_STEP_NUM_NODES / SLURM_NNODES,
SLURM_NODEID / SLURM_PROCID, SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE, ...) and returns a
``SlurmJob``; ``defaults_from_slurm`` turns it into the values the config takes where the user gave none
(nodes, node rank, node 0's address, a rendezvous port derived from the job id, GPUs per node).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from megatron_vlm.launch.nodelist import expand_nodelist
from megatron_vlm.training.config import ConfigError

PORT_BASE, PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    nodes: int
    node_rank: int
    hosts: tuple[str, ...]
    tasks: int | None
    gpus_on_node: int | None
    in_step: bool  # running under srun (a job step), not in the batch script itself

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    @property
    def master_port(self) -> int:
        """A port shared by all nodes of the job, different for concurrent jobs."""
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + int(digits) % PORT_SPAN


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n, "").strip()
        if v:
            m = re.match(r"\d+", v)  # SLURM_NNODES / SLURM_TASKS_PER_NODE may read "2(x4)"
            if m:
                return int(m.group(0))
    return None


def _gpus(env: Mapping[str, str]) -> int | None:
    n = _int(env, "SLURM_GPUS_ON_NODE")
    if n is not None:
        return n
    per_node = env.get("SLURM_GPUS_PER_NODE", "")  # "8", "gpu:8" or "h100:8"
    m = re.search(r"(\d+)\s*$", per_node)
    return int(m.group(1)) if m else None


def detect_slurm(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The SLURM job this process runs in, or None outside SLURM."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    in_step = bool(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_STEP_ID"))
    nodelist = (env.get("SLURM_STEP_NODELIST") if in_step else None) or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST") or ""
    hosts = tuple(expand_nodelist(nodelist)) if nodelist else (env.get("SLURMD_NODENAME", "127.0.0.1"),)
    nodes = (_int(env, "SLURM_STEP_NUM_NODES") if in_step else None) or _int(
        env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or len(hosts)
    return SlurmJob(
        job_id=env["SLURM_JOB_ID"],
        nodes=nodes,
        node_rank=_int(env, "SLURM_NODEID", "SLURM_PROCID") or 0,
        hosts=hosts,
        tasks=_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if in_step else None,
        gpus_on_node=_gpus(env),
        in_step=in_step,
    )


def defaults_from_slurm(job: SlurmJob | None, requested_nodes: int | None) -> dict:
    """Config values a SLURM job supplies where the user gave none (``TrainConfig.resolved(env_defaults=)``).

    When the user asked for a different node count than the job step has, only the GPU count is taken.
    """
    if job is None:
        return {}
    out = {"gpus": job.gpus_on_node}
    if requested_nodes is not None and requested_nodes != job.nodes:
        return out
    if job.nodes > 1:
        if not job.in_step:
            raise ConfigError(
                f"this is the batch script of SLURM job {job.job_id} with {job.nodes} nodes, not a job step: "
                "start the launcher on every node with `srun --ntasks-per-node=1 python train/run.py ...` "
                "(or write the script with --sbatch), or pass --node 1 to train on this node only"
            )
        if job.tasks is not None and job.tasks != job.nodes:
            raise ConfigError(
                f"SLURM step runs {job.tasks} tasks on {job.nodes} nodes; run the launcher as ONE task per node "
                "(srun --ntasks-per-node=1): it starts one process per GPU itself"
            )
    out.update(nodes=job.nodes, node_rank=job.node_rank)
    if job.nodes > 1:  # one node keeps the local defaults: 127.0.0.1 and a free port
        out.update(master_addr=job.master_addr, master_port=job.master_port)
    return out
