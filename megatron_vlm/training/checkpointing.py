"""Training checkpoints: model, optimizer, scheduler, RNG and data position, via megatron dist_checkpointing.

Layout and side files follow :mod:`megatron_vlm.checkpoint` (so ``convert/megatron_to_hf.py`` reads any
iteration). A save is collective: every rank writes into ``.iter_XXXXXXX.tmp``; rank 0 then adds the spec,
the HF-only tensors and the metadata, renames the directory, updates the tracker last and prunes old
iterations beyond ``save_total_limit``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from megatron_vlm import checkpoint as ckpt
from megatron_vlm.spec import VLMSpec

log = logging.getLogger(__name__)
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _rank_objects(loader_state, rng_state):
    """Per-rank objects as megatron ShardedObjects (RNG: one per rank; loader: one per data-parallel rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tp, pp, dp = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                  ps.get_data_parallel_world_size())
    tpr, ppr, dpr = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_data_parallel_rank())
    return {
        "rng_state": ShardedObject("rng_state", rng_state, (pp, tp, dp), (ppr, tpr, dpr), replica_id=0),
        "loader_state": ShardedObject("loader_state", loader_state, (dp,), (dpr,),
                                      replica_id=0 if (tpr == 0 and ppr == 0) else 1),
    }


def rng_state() -> dict:
    import random

    import numpy as np

    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _unwrap(model):
    """The LLaVAModel inside megatron's DDP wrapper (checkpoint keys never carry the wrapper's 'module.')."""
    return getattr(model, "module", model)


def _state_dict(model, optimizer, scheduler, iteration, loader_state, with_optim: bool, loading: bool):
    model_sd = _unwrap(model).sharded_state_dict(prefix="model.")
    sd = {"model": model_sd, "iteration": iteration, **_rank_objects(loader_state, None if loading else rng_state())}
    if with_optim:
        # 'fully_reshardable': the distributed optimizer's state resumes at any TP/PP/DP
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIM_METADATA)
        sd["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    return sd


def save(run_dir, iteration: int, model, optimizer, scheduler, loader_state, spec: VLMSpec, meta: ckpt.CheckpointMeta,
         side_src: Path | None, with_optim: bool, total_limit: int | None, config_yaml: str | None = None) -> Path:
    from megatron.core import dist_checkpointing

    run_dir = Path(run_dir)
    final = run_dir / ckpt.iter_dir_name(iteration)
    tmp = run_dir / f".{final.name}.tmp"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    sd = _state_dict(model, optimizer, scheduler, iteration, loader_state, with_optim, loading=False)
    dist_checkpointing.save(sd, str(tmp))
    torch.distributed.barrier()
    if rank0:
        if side_src is not None and (Path(side_src) / ckpt.EXTRA).is_file():
            ckpt.copy_side_files(side_src, tmp)
        else:
            ckpt.write_side_files(tmp, spec, {})
        spec.save(tmp)
        meta.iteration = iteration
        meta.extra["optimizer"] = with_optim
        meta.save(tmp)
        if config_yaml:
            (tmp / "config.yaml").write_text(config_yaml)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        spec.save(run_dir)  # like a converted checkpoint: the run directory itself says what it holds
        ckpt.write_tracker(run_dir, iteration)
        if total_limit:
            for old in ckpt.list_iterations(run_dir)[:-total_limit]:
                shutil.rmtree(run_dir / ckpt.iter_dir_name(old), ignore_errors=True)
        log.info("saved checkpoint %s", final)
    torch.distributed.barrier()
    return final


def load(iter_dir, model, optimizer, scheduler, with_optim: bool) -> dict:
    """Restore model (+ optimizer, scheduler) and return {'iteration', 'loader_state', 'rng_state'}."""
    from megatron.core import dist_checkpointing

    sd = _state_dict(model, optimizer, scheduler, 0, None, with_optim, loading=True)
    loaded = dist_checkpointing.load(sd, str(iter_dir))
    _unwrap(model).load_state_dict({k[len("model."):]: v for k, v in loaded["model"].items()}, strict=True)
    if with_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None and loaded.get("scheduler"):
            scheduler.load_state_dict(loaded["scheduler"])
    return {"iteration": loaded["iteration"], "loader_state": loaded["loader_state"], "rng_state": loaded["rng_state"]}
