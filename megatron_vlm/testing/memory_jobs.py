"""What a built training rank really allocates for weights, gradient buffers and optimizer state, next to
:mod:`megatron_vlm.training.memory`'s estimate of it (the memory tests; also in a multi-process world)."""

from __future__ import annotations

import torch


def measure(training) -> dict:
    """Bytes of this rank's parameters, DDP gradient buffers and optimizer state (fp32 main parameters that are
    not the model's own, Adam's moments: created by one optimizer step on zero gradients)."""
    params = [p for _, p in training.named_parameters()]  # every model chunk of the rank
    weights = sum(p.numel() * p.element_size() for p in params)
    buffers = [b for d in training.ddps for b in list(d.buffers) + list(getattr(d, "expert_parallel_buffers", []) or [])]
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    for p in params:
        if p.requires_grad:
            p.main_grad.zero_()
    training.optimizer.step()
    own = {id(p) for p in params}
    opt = 0
    for o in getattr(training.optimizer, "chained_optimizers", [training.optimizer]):
        inner = o.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    opt += p.numel() * p.element_size()
                for v in inner.state[p].values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        opt += v.numel() * v.element_size()
    return {"weights": weights, "gradients": grads, "optimizer": opt}


def measured_and_estimated(spec, cfg) -> dict:
    """Build this rank's training objects for ``cfg`` (a world already set up) and return both numbers."""
    from megatron.core import parallel_state as ps

    from megatron_vlm.training import memory
    from megatron_vlm.training.build import build_training

    training = build_training(cfg, spec)
    stage = ps.get_pipeline_model_parallel_rank()
    layout = memory.Layout.of_config(cfg, spec=spec)
    est = memory.estimate(spec, layout)[stage]
    return {"stage": stage, "measured": measure(training),
            "estimated": {"weights": est.weights, "gradients": est.gradients, "optimizer": est.optimizer}}


def memory_jobs(spec_json: str, jobs: list[dict]) -> list[dict]:
    """Each job (TrainConfig fields over :data:`~megatron_vlm.testing.train_jobs.BASE`) on this rank."""
    from megatron_vlm.runtime import distributed
    from megatron_vlm.spec import VLMSpec
    from megatron_vlm.testing.train_jobs import BASE
    from megatron_vlm.training.config import TrainConfig

    spec = VLMSpec.from_json(spec_json)
    out = []
    for job in jobs:
        cfg = TrainConfig(**{**BASE, "train_iters": 1, "micro_batch_size": 1, **job})
        distributed.setup(cfg.tp, cfg.pp, device="cpu", seed=cfg.seed, ep=cfg.ep, etp=cfg.etp, vpp=cfg.vpp_size(spec))
        cfg.gpus = torch.distributed.get_world_size()
        cfg.global_batch_size = cfg.dp
        out.append(measured_and_estimated(spec, cfg))
    return out
