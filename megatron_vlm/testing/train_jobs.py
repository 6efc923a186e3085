"""Per-rank training jobs that tests and benchmarks run in a local world (see runtime.spawn.run_world).

A job trains a few steps of a fixed sequence of global batches with the trainer's own parts
(:func:`megatron_vlm.training.build.build_training`, :func:`megatron_vlm.training.step.train_step`, checkpoint
save/resume) at one TP/PP/DP layout and precision, and returns the loss and grad norm of every step. One
world runs many jobs (megatron's parallel groups are re-initialised per job), so a 2-process world covers
TP=2, PP=2 and DP=2 in fp32 and bf16 without paying process start-up for each.

Global batches are lists of encoded samples (``VLMSample``); each job splits every global batch over its
data-parallel ranks and micro batches with the task encoder's own ``batch()``, so the same global batch is
trained whatever the layout.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from megatron_vlm import checkpoint as ckpt
from megatron_vlm.runtime.spawn import thread_names
from megatron_vlm.spec import VLMSpec

#: what every job's TrainConfig has unless the job says otherwise
BASE = dict(device="cpu", stage=2, freeze_vit=False, lr=2e-3, min_lr=0.0, lr_warmup_fraction=0.0,
            lr_decay_style="constant", clip_grad=1.0, weight_decay=0.0, seq_length=96, precision="fp32",
            deterministic=True)


#: questions and answers of different lengths (so per-token loss normalisation matters)
QUESTIONS = ["what colour is the shape ?", "describe the picture in a few words please", "what ?",
             "is there a square in the image , and what colour is it ?"]
ANSWERS = ["red", "a red square on a smooth gradient background", "a shape", "yes"]


#: image sizes (h, w) the samples cycle through: anyres models tile them differently (one tile to a 2x2 grid)
IMAGE_SIZES = [(40, 30), (20, 52), (64, 64), (12, 18)]


def encoder_for(hf_dir, seq_length: int = BASE["seq_length"], spec: VLMSpec | None = None,
                pad_to_multiple_of: int | None = None):
    """The trainer's task encoder of ``hf_dir``'s architecture (plain LLaVA or anyres); ``pad_to_multiple_of``: as
    the trainer pads batches for sequence parallelism (TP) or FP8."""
    from megatron_vlm.data.anyres_encoder import task_encoder_for

    spec = spec or VLMSpec.from_hf_dir(hf_dir)
    return task_encoder_for(spec, hf_dir, seq_length, image_token_id=spec.image_token_id,
                            pad_to_multiple_of=pad_to_multiple_of)


def variable_length_batches(hf_dir, n: int, size: int = 8, seq_length: int = BASE["seq_length"],
                            uniform: bool = False) -> list[list]:
    """``n`` global batches of ``size`` encoded samples of different lengths (and, for anyres models, image
    sizes), the same on every call; ``uniform``: every sample has the first question and answer (one length, the
    images differ)."""
    from megatron.energon import VQASample
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array

    enc = encoder_for(hf_dir, seq_length)
    sizes = IMAGE_SIZES if enc.spec.is_anyres or enc.spec.is_internvl else IMAGE_SIZES[:1]
    meta = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    out = []
    for b in range(n):
        samples = []
        for i in range(size):
            j = 0 if uniform else (b + i) % len(QUESTIONS)
            image = Image.fromarray(image_array(sizes[0 if uniform else (b + i) % len(sizes)], 8 * b + i))
            s = VQASample(__key__=f"{b}-{i}", image=image, context=QUESTIONS[j],
                          answers=ANSWERS[0 if uniform else (j + b) % len(ANSWERS)], answer_weights=None, **meta)
            samples.append(enc.encode_sample(s))
        out.append(samples)
    return out


def job_config(job: dict, n_steps: int, global_batch_size: int):
    from megatron_vlm.training.config import TrainConfig

    fields = {k: v for k, v in job.items()
              if k not in ("name", "steps", "start", "save", "save_after", "resume", "reload_weights",
                           "reference_grads", "grads", "megatron_dir", "hf_dir", "batches")}
    cfg = TrainConfig(**{**BASE, "train_iters": max(n_steps, 1), "global_batch_size": global_batch_size, **fields})
    cfg.precision = cfg.precision or "fp32"
    # a resume job trains fewer steps than the job that saved (another --train-iters): keep the checkpoint's
    # schedule, as megatron-core's scheduler did by default before the two Megatron-LM flags were adopted
    cfg.use_checkpoint_opt_param_scheduler = bool(job.get("resume"))
    return cfg


def micro_batches(collate, samples: list, dp: int, dp_rank: int, micro_batch_size: int) -> list:
    """This DP rank's micro batches of one global batch (a contiguous 1/dp slice, in micro batches)."""
    per_rank = len(samples) // dp
    mine = samples[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [collate(mine[i:i + micro_batch_size]) for i in range(0, len(mine), micro_batch_size)]


def _setup(cfg):
    from megatron_vlm.runtime import distributed

    return distributed.setup(cfg.tp, cfg.pp, device="cpu", seed=cfg.seed, ep=cfg.ep, etp=cfg.etp)


def weights_digest(model) -> str:
    """sha256 of this rank's parameters (names, dtypes and bytes, in the model's order): equal digests are
    bit-identical weights."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reduced_main_grads(training, rt) -> dict:
    """This rank's gradients of the global batch, reduced over data-parallel ranks (megatron DDP's fp32 ``main_grad``
    buffers; with the distributed optimizer each DP rank reduced only its shard of each bucket, so the shards are
    gathered first). Call between the backward passes and the optimizer step."""
    from megatron.core import parallel_state as ps

    ddp = training.ddp
    if ddp.ddp_config.use_distributed_optimizer and rt.dp > 1:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                shards = list(bucket.grad_data.chunk(rt.dp))
                mine = shards[rt.dp_rank].clone()
                torch.distributed.all_gather(shards, mine, group=group)  # the chunks are views: gathered in place
    return {n: p.main_grad for n, p in training.model.named_parameters() if p.requires_grad}


def grad_differences(training, rt, spec: VLMSpec, cfg, reference: dict) -> dict[str, float]:
    """``|g - g_ref| / |g_ref|`` of every trained tensor of this rank against ``reference`` (global Megatron name ->
    full tensor, e.g. :func:`megatron_vlm.testing.hf_reference.mcore_grads`), each compared on its own TP shard of
    its own PP stage; keys are the global names (``@last`` for the last stage's copy of tied embeddings)."""
    from megatron_vlm.convert import mapping

    grads = reduced_main_grads(training, rt)
    layers = spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers)
    out = {}
    for rule in mapping.rules(spec):
        if rule.mcore not in reference:
            continue
        for stage in mapping.stages_of(rule, spec, layers):
            g = grads.get(mapping.local_name(rule, stage, layers)) if stage == rt.pp_rank else None
            if g is None:
                continue
            ref = mapping.tp_shard(rule, reference[rule.mcore], rt.tp, rt.tp_rank).to(g)
            key = rule.mcore + ("@last" if stage and rule.placement == "first" else "")
            out[key] = float((g - ref).norm() / ref.norm().clamp(min=1e-30))
    return out


def _save(job, step: int, cfg, rt, spec, training, iter_dir, global_batch_size: int) -> None:
    from megatron_vlm.training import checkpointing, resume

    meta = ckpt.CheckpointMeta("torch_dist", cfg.tp, cfg.pp, spec.check_parallelism(cfg.tp, cfg.pp),
                               dtype=str(training.dtype).replace("torch.", ""), ep=cfg.ep, etp=cfg.etp)
    meta.extra.update(resume.layout_extra(cfg, rt.dp, step * global_batch_size))
    checkpointing.save(Path(job["save"]), step, training.model, training.optimizer, training.scheduler, None,
                       spec=spec, meta=meta, side_src=iter_dir, with_optim=cfg.save_optim, total_limit=None)


def train_jobs(jobs: list[dict], megatron_dir, hf_dir, global_batches: list[list]) -> list | None:
    """Run each job; returns per job {'loss': [...], 'grad_norm': [...] (None: a skipped fp16 step),
    'loss_scale': [...], 'readers': [global ranks that read data], 'weights':
    [every rank's :func:`weights_digest` after the last step], 'threads': [every rank's
    :func:`~megatron_vlm.runtime.spawn.thread_names` once the job's objects are dropped]} (on rank 0; None
    elsewhere).

    Job keys: TrainConfig fields (tp, pp, precision, dist_optim, micro_batch_size, overlap_grad_reduce, ...),
    plus ``steps`` (default: all global batches), ``start`` (the first global batch, default 0), ``save`` (a
    run dir to save a checkpoint to after the last step, or after step ``save_after`` of the job, with optimizer
    state unless save_optim=False) and
    ``resume`` (an iteration dir to restore before the first step, the way the trainer resumes; with
    ``reload_weights=False`` the optimizer's main params are deliberately not refreshed, the defect the resume
    must avoid); ``reference_grads`` (global Megatron name -> full tensor: the first step's gradients are compared
    with them tensor by tensor, :func:`grad_differences`; the result's ``grad_rel`` holds each tensor's relative
    difference, over all ranks).
    ``grads``: also return, as 'grads', every rank's (coordinates, local gradients) of the first step
    (:mod:`megatron_vlm.testing.grad_reference`); an MoE model's routing numbers of each step come as 'moe'.
    ``megatron_dir``, ``hf_dir`` and ``batches`` give a job its own model and global batches (default: the
    arguments), so one world trains several models: ``global_batches`` is then a dict and ``batches`` names one;
    a value of that dict may be a recipe, ``(hf_dir, n, uniform, repeat)``, which every rank makes with
    :func:`variable_length_batches` (``repeat`` times over), so that no tensor crosses to the ranks.
    """
    from megatron_vlm.training import batch_feed, checkpointing, resume
    from megatron_vlm.training.build import build_training, release
    from megatron_vlm.training.step import train_step

    out = []
    default, made = (megatron_dir, hf_dir, global_batches), {}
    for job in jobs:
        megatron_dir, hf_dir = job.get("megatron_dir", default[0]), job.get("hf_dir", default[1])
        global_batches = default[2][job["batches"]] if "batches" in job else default[2]
        if isinstance(global_batches, tuple):
            recipe, global_batches = global_batches, made.get(global_batches)
            if global_batches is None:
                global_batches = made[recipe] = variable_length_batches(recipe[0], recipe[1],
                                                                        uniform=recipe[2]) * recipe[3]
        iter_dir = ckpt.resolve_iteration_dir(megatron_dir)
        spec = VLMSpec.load(iter_dir)
        steps = job.get("steps", len(global_batches) - job.get("start", 0))
        cfg = job_config(job, steps, len(global_batches[0]))
        # for batch() only; sequence parallelism splits the image-expanded length over TP, as the trainer pads it
        encoder = encoder_for(hf_dir, spec=spec, pad_to_multiple_of=cfg.tp if cfg.sequence_parallel else None)
        rt = _setup(cfg)
        if job.get("resume"):  # as the trainer: the plan (which fixes the loss objective) before the model
            plan = resume.plan(cfg, job["resume"], rt.tp, rt.pp, rt.dp)
            plan.load_data = False  # the job feeds its own batches
        training = build_training(cfg, spec, init_from=None if job.get("resume") else iter_dir)
        if job.get("resume"):
            if job.get("reload_weights", True):
                resume.restore(training, plan)
            else:  # the defect: weights loaded, the optimizer's fp32 main params left as they were
                checkpointing.load(plan.iter_dir, training.model, training.optimizer, training.scheduler, False,
                                   with_rng=False, with_data=False)
        if job.get("grads"):
            from megatron_vlm.testing import grad_reference

            captured = grad_reference.capture(training)
        losses, norms, scales, moe = [], [], [], []
        first = job.get("start", 0)
        # as the trainer: only the ranks batch_feed.reads_data names read (batch) the data; distribute() hands
        # it to the other TP ranks of the first/last stage
        reads = batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp)
        save_after = job.get("save_after", steps) if job.get("save") else None
        rel: dict = {}
        reference = job.get("reference_grads")
        for k, gb in enumerate(global_batches[first:first + steps], 1):
            mine = micro_batches(encoder.batch, gb, rt.dp, rt.dp_rank, cfg.micro_batch_size) if reads else \
                [None] * (len(gb) // rt.dp // cfg.micro_batch_size)
            inspect = (lambda t: rel.update(grad_differences(t, rt, spec, cfg, reference))) if reference and k == 1 \
                else None
            r = train_step(training, batch_feed.distribute(mine, rt.device), cfg, rt.device, inspect)
            losses.append(r.loss)
            norms.append(r.grad_norm)
            scales.append(r.loss_scale)
            moe.append(r.moe)
            if k == save_after:
                _save(job, first + k, cfg, rt, spec, training, iter_dir, len(gb))
        world = torch.distributed.get_world_size()
        readers: list = [None] * world
        torch.distributed.all_gather_object(readers, reads)
        digests: list = [None] * world
        torch.distributed.all_gather_object(digests, weights_digest(training.model))
        rels: list = [None] * world
        torch.distributed.all_gather_object(rels, rel)
        result = {"name": job.get("name"), "loss": losses, "grad_norm": norms, "loss_scale": scales,
                  "readers": [r for r, x in enumerate(readers) if x], "weights": digests, "moe": moe,
                  "grad_rel": {k: max(d[k] for d in rels if k in d) for d in rels for k in d}}
        if job.get("grads"):
            ranks: list = [None] * world
            torch.distributed.all_gather_object(ranks, (grad_reference.coordinates(), captured[0]))
            result.update(grads=ranks, layers=spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers))
        out.append(result)
        release(training)
        del training
        gc.collect()
        threads: list = [None] * world
        torch.distributed.all_gather_object(threads, thread_names())
        out[-1]["threads"] = threads
    return out if torch.distributed.get_rank() == 0 else None


