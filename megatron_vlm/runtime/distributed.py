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
    cp: int = 1  # context-parallel size (dp counts data-parallel replicas without it)
    cp_rank: int = 0
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank

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
          etp: int | None = None, cp: int = 1, vpp: int = 1) -> Runtime:
    """Initialise torch.distributed and megatron's model-parallel groups for this process (``ep``/``etp``: the
    expert-parallel groups of a mixture-of-experts model; ``etp`` defaults to ``tp``; ``cp``: context parallelism,
    megatron-core's rank order tp-cp-ep-dp-pp; ``vpp``: virtual pipeline stages per pipeline rank, which makes
    megatron-core's schedule the interleaved one)."""
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
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp*cp={tp * pp * cp}")
    etp = tp if etp is None else etp
    if (world // pp) % (ep * etp):
        raise ValueError(f"world size {world} / pp={pp} is not a multiple of ep*etp={ep * etp}: each pipeline stage's "
                         f"{world // pp} ranks must hold whole expert-parallel groups")
    destroy_parallel_groups()  # a world that runs several jobs: the previous job's groups and their threads
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                 context_parallel_size=cp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
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
        cp=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def destroy_parallel_groups() -> None:
    """Destroy megatron's model-parallel groups and every other process group but the default one.

    ``parallel_state.destroy_model_parallel`` only forgets its groups; each gloo group keeps its two worker
    threads (``pt_gloo_runloop``) and its TCP loop (``gloo_tcp_loop``) for the life of the process. megatron-core
    makes ~17 groups per ``initialize_model_parallel``, so a test world re-initialised for every job grew by ~51
    threads per job per rank (measured: 422 threads per rank after 8 jobs). ``destroy_process_group(group)``
    shuts a group down, but its threads end only when nothing holds the group any more: call this after the
    job's model and optimizer are dropped (the collection here frees what only cycles still hold). Collective: every rank must call it (the default group survives)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if not torch.distributed.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    for name, value in vars(ps).items():  # groups destroy_model_parallel forgets to forget (0.16: the partial-DP ones)
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(ps, name, None)
    _clear_module_caches()
    _clear_moe_tracker()

    world = c10d.GroupMember.WORLD
    groups = [g for g in c10d._world.pg_map if g is not world and g is not c10d.GroupMember.NON_GROUP_MEMBER]
    for group in groups:
        torch.distributed.destroy_process_group(group)
    if groups:
        import gc

        del groups
        gc.collect()  # a finished job's modules and hooks reference its groups in cycles


def _clear_module_caches() -> None:
    """megatron-core memoizes ``RotaryEmbedding.forward`` (and YaRN's) with a class-level ``functools.lru_cache``
    keyed on the module: it keeps up to 32 finished jobs' rotary modules alive, with their cached frequencies
    and the process groups they hold (``cp_group``)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    classes = [getattr(rotary_pos_embedding, "RotaryEmbedding", None)]
    try:
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding

        classes.append(getattr(yarn_rotary_pos_embedding, "YarnRotaryEmbedding", None))
    except ImportError:
        pass
    for cls in classes:
        clear = getattr(getattr(cls, "forward", None), "cache_clear", None)
        if clear is not None:
            clear()


def _clear_moe_tracker() -> None:
    """megatron-core's MoE metrics tracker (a module global) keeps each metric's reduction group: a finished job's."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # megatron-core 0.16: a module-level dict
        from megatron.core.transformer.moe import moe_utils

        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def teardown() -> None:
    destroy_parallel_groups()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    from megatron_vlm.runtime.ports import free_port

    return free_port()
