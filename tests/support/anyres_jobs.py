"""Per-rank jobs for anyres models (LLaVA-NeXT / OneVision) that tests run in one local world.

A job loads a converted checkpoint at a TP/PP layout, computes the fp32 logits of a reference batch (images
of several sizes in one batch), and optionally trains a few steps on fixed micro batches with the trainer's own
parts (``build_training``, ``train_step``), checking after every step that ``image_newline``'s gradient is
identical on every tensor-parallel rank; it can save the trained model as a training checkpoint and return
run after it loads that checkpoint (for an export check).
"""

from __future__ import annotations

import gc

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.convert.verify import ReferenceBatch, megatron_forward_logits
from megatron_vlm.model.spec import VLMSpec


def _gather_logits(logits):
    from megatron.core import parallel_state as ps

    mine = logits if (logits is not None and ps.get_tensor_model_parallel_rank() == 0
                      and ps.get_data_parallel_rank() == 0) else None
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return next(g for g in gathered if g is not None)


def _newline_grads_equal_over_tp(model) -> bool | None:
    """True when image_newline's gradient is bitwise equal on every TP rank (None on stages without it)."""
    from megatron.core import parallel_state as ps

    p = getattr(model, "image_newline", None)
    group = ps.get_tensor_model_parallel_group()
    if p is None:
        return None
    g = (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().float().clone()
    shards = [torch.empty_like(g) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(shards, g, group=group)
    return all(torch.equal(s, shards[0]) for s in shards) and bool(g.abs().sum() > 0)


def anyres_jobs(jobs: list[dict]) -> list | None:
    """Each job: {megatron_dir, tp, pp, batch (ReferenceBatch), train?: {micro_batches, steps, seq_length,
    precision?, save?}}. Returns per job {logits, losses?, newline_equal?} on rank 0 (None elsewhere)."""
    from tests.support.train_jobs import _setup, job_config
    from tests.support.worlds import _model_for
    from megatron_vlm.training import batch_feed, checkpointing, resume
    from megatron_vlm.training.build import build_training, release
    from megatron_vlm.training.step import train_step

    out = []
    for job in jobs:
        iter_dir = ckpt.resolve_iteration_dir(job["megatron_dir"])
        batch: ReferenceBatch = job["batch"]
        model = _model_for(iter_dir, job["tp"], job["pp"], batch.combined_length)
        result = {"logits": _gather_logits(megatron_forward_logits(model, batch))}
        del model
        train = job.get("train")
        if train:
            spec = VLMSpec.load(iter_dir)
            cfg = job_config(dict(tp=job["tp"], pp=job["pp"], seq_length=train["seq_length"],
                                  precision=train.get("precision", "fp32"),
                                  micro_batch_size=train["micro_batches"][0].tokens.shape[0]),
                             train["steps"], sum(b.tokens.shape[0] for b in train["micro_batches"]))
            rt = _setup(cfg)
            training = build_training(cfg, spec, init_from=iter_dir)
            losses, equal = [], []
            # as the trainer: TP rank 0 reads, the other TP ranks receive tiles, sizes and token counts by broadcast
            reads = batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp)
            for _ in range(train["steps"]):
                mine = train["micro_batches"] if reads else [None] * len(train["micro_batches"])
                losses.append(train_step(training, batch_feed.distribute(mine, rt.device), cfg, rt.device).loss)
                equal.append(_newline_grads_equal_over_tp(training.model))
            flags = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(flags, equal)
            result["losses"] = losses
            result["newline_equal"] = [f for f in flags if f[0] is not None]
            if train.get("save"):
                meta = ckpt.CheckpointMeta("torch_dist", cfg.tp, cfg.pp, spec.check_parallelism(cfg.tp, cfg.pp),
                                           dtype="float32")
                meta.extra.update(resume.layout_extra(cfg, rt.dp, train["steps"] * cfg.global_batch_size))
                checkpointing.save(train["save"], train["steps"], training.model, training.optimizer,
                                   training.scheduler, None, spec=spec, meta=meta, side_src=iter_dir,
                                   with_optim=False, total_limit=None)
            release(training)
            del training
        out.append(result)
        gc.collect()
    return out if torch.distributed.get_rank() == 0 else None
