"""Distributed start-up: torch.distributed + megatron parallel_state, device choice and seeding.

``setup(tp, pp, device)`` is called once per process (after torchrun / mp.spawn set RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). On a machine without CUDA it uses gloo and turns on the CPU compatibility
layer; with CUDA it uses NCCL and binds the process to LOCAL_RANK's GPU.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    backend: str
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1  # expert-model-parallel size (mixture-of-experts models)
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def choose_device(device: str | None = None) -> str:
    """'cuda' when available (or asked for), else 'cpu'. Asking for cuda without one is an error."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA GPU is visible; use --device cpu")
    return device


def setup(tp: int = 1, pp: int = 1, device: str | None = None, seed: int = 1234, timeout_min: int = 30, ep: int = 1,
          etp: int | None = None) -> Runtime:
    """Initialise torch.distributed and megatron's model-parallel groups for this process (``ep``/``etp``: the
    expert-parallel groups of a mixture-of-experts model; ``etp`` defaults to ``tp``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    device = choose_device(device)
    if device == "cpu":
        from megatron_vlm.runtime import cpu_compat

        cpu_compat.enable()
    else:
        from megatron_vlm.runtime.cpu_compat import fix_without_te

        fix_without_te()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "nccl" if device == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(minutes=timeout_min),
        )
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp={tp * pp}")
    etp = tp if etp is None else etp
    if (world // pp) % (ep * etp):
        raise ValueError(f"world size {world} / pp={pp} is not a multiple of ep*etp={ep * etp}: each pipeline stage's "
                         f"{world // pp} ranks must hold whole expert-parallel groups")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    seed_everything(seed)
    model_parallel_cuda_manual_seed(seed)
    return current()


def current() -> Runtime:
    from megatron.core import parallel_state as ps

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return Runtime(
        device=dev,
        backend=torch.distributed.get_backend(),
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def teardown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    from megatron_vlm.ports import free_port

    return free_port()
