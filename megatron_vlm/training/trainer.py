"""The training run on every rank: start-up (model, optimizer and data, fresh or resumed), the loop
(steps, logging, evaluation, held-out answers every ``--eval-generate-interval`` (:mod:`.answers`), checkpoints
every ``--save-interval``; the training curves drawn into
``<run dir>/loss.png`` at the end) and signals (SIGTERM/SIGINT save, then stop).

The parts live beside it: :mod:`.build` (model, mixed precision, DDP, optimizer, schedule), :mod:`.step`
(one training step, evaluation), :mod:`.resume` (what a resume restores), :mod:`.checkpointing` (save/load),
:mod:`.metrics` (the records and the console line), :mod:`.timers` (where each step's time goes) and
:mod:`.profiling` (``--profile``). The loop reads nothing back from the device per step: the losses and counts wait
on the device until a log interval or a checkpoint, and the stop flag is checked every ``STOP_CHECK_INTERVAL``
iterations and at every log, evaluation and save point.
``train(cfg)`` runs on every rank started by torchrun (see ``train/run.py``); ``cfg`` is the resolved
:class:`~megatron_vlm.training.config.TrainConfig`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.files import storage
from megatron_vlm.model import fp8
from megatron_vlm.model.context_parallel import length_multiple
from megatron_vlm.model.spec import VLMSpec, family_name
from megatron_vlm.training import batch_feed, checkpointing, step
from megatron_vlm.training.flops import StepFlops, peak_flops
from megatron_vlm.training.metrics import MetricsLogger
from megatron_vlm.training.profiling import StepProfiler
from megatron_vlm.training.timers import StepTimers

log = logging.getLogger("megatron_vlm.train")

# iterations between two checks of the stop flag (SIGTERM/SIGINT), which also runs at every log, evaluation and
# save point: each check is an all-reduce read back on the host
STOP_CHECK_INTERVAL = 10


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint at the end of the current iteration and exits."""

    def __init__(self):
        self.set = False
        self.pid = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if os.getpid() != self.pid:  # a forked data-loader worker inherits the handler: the rank alone decides
            return
        if not self.set:
            log.warning("received signal %d: saving a checkpoint after this iteration", signum)
        self.set = True

    def agreed(self, device) -> bool:
        t = torch.tensor([1 if self.set else 0], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def _source(cfg):
    """(spec, iteration dir to start or resume from or None, side-file dir, resume?); ``--ckpt-step`` picks the
    iteration of the run it resumes, else of ``--megatron-load-dir``."""
    from megatron_vlm.training.resume import resumes

    if resumes(cfg):
        it_dir = ckpt.resolve_iteration_dir(cfg.checkpoint_dir, cfg.ckpt_step)
        return VLMSpec.load(it_dir), it_dir, it_dir, True
    if cfg.init:
        spec = VLMSpec.from_hf_dir(cfg.tokenizer_load_dir) if cfg.megatron_load_dir is None else \
            VLMSpec.load(ckpt.resolve_iteration_dir(cfg.megatron_load_dir, cfg.ckpt_step))
        return spec, None, None, False
    it_dir = ckpt.resolve_iteration_dir(cfg.megatron_load_dir, cfg.ckpt_step)
    return VLMSpec.load(it_dir), it_dir, it_dir, False


def describe_moe(spec: VLMSpec, config, cfg, moe=None) -> str:
    """The start-up line of an MoE run: the routing the model was built with, its parallel layout, the
    load-balancing objective and its coefficient (``moe``: the run's
    :class:`~megatron_vlm.training.moe.orchestration.MoETraining`)."""
    from megatron_vlm.training.moe.objectives import describe_objective

    source = "the HF config's router_aux_loss_coef" if cfg.moe_aux_loss_coeff is None else "--moe-aux-loss-coeff"
    kind = moe.objective if moe is not None else config.moe_router_load_balancing_type
    coeff = moe.coeff if moe is not None else config.moe_aux_loss_coeff
    capacity = "no capacity (no token dropped)" if config.moe_expert_capacity_factor is None else \
        f"capacity factor {config.moe_expert_capacity_factor:g} over the positions of samples (tokens over it are " \
        "dropped)"
    experts = "TEGroupedMLP (grouped GEMM)" if config.moe_grouped_gemm else "SequentialMLP"
    return (f"{spec.num_moe_experts} experts of {spec.moe_ffn_hidden_size}, top {spec.moe_router_topk} per token "
            f"({'renormalised' if spec.moe_norm_topk_prob else 'not renormalised'}), {len(spec.moe_layers)} of "
            f"{spec.num_layers} layers; ep={config.expert_model_parallel_size} "
            f"etp={config.expert_tensor_parallel_size}"
            + (f", sequence parallel over tp={config.tensor_model_parallel_size}" if config.sequence_parallel else "")
            + f"; load balancing: {describe_objective(kind, coeff, source, len(spec.moe_layers))}"
            + (f"; z-loss {config.moe_z_loss_coeff:g}" if config.moe_z_loss_coeff else "")
            + f"; {config.moe_token_dispatcher_type} dispatcher; {capacity}; experts: {experts}")


def pad_multiple(cfg) -> int | None:
    """Batches are padded so the image-expanded length is a multiple of this: FP8 GEMMs need 16 (32 for
    mxfp8) tokens, sequence parallelism a multiple of the TP size, context parallelism of 2 x CP (x TP with
    sequence parallelism; :func:`megatron_vlm.model.context_parallel.length_multiple`)."""
    m = fp8.align_size(cfg.fp8_recipe) if cfg.fp8 else 1
    m = math.lcm(m, length_multiple(cfg.cp, cfg.tp, bool(cfg.sequence_parallel)))
    return m if m > 1 else None


@dataclass
class Run:
    """Everything the loop needs, made by :func:`start`."""

    rt: object
    spec: VLMSpec
    training: object  # megatron_vlm.training.build.Training
    encoder: object
    loader: object  # energon savable loader; None on ranks that do not read data (batch_feed.reads_data)
    iteration: int
    resumed: bool
    side_src: object
    answers: object = None  # .answers.InLoopAnswers with --eval-generate-interval


def _progress(rt, t_launch: float | None, what: str) -> None:
    """A start-up phase, on rank 0, with the seconds since the rank started: the time to the first iteration
    is spent in these."""
    if rt.rank == 0:
        since = f" ({time.time() - t_launch:.1f} s)" if t_launch is not None else ""
        log.info("start-up%s: %s", since, what)


def start(cfg, rt, t_launch: float | None = None) -> Run:
    """Model, optimizer and data for this rank: fresh from a checkpoint's weights, random, or resumed."""
    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.training import objective, resume
    from megatron_vlm.training.build import build_training
    from megatron_vlm.training.config.resolve import settle_with_spec

    _progress(rt, t_launch, f"{rt.world_size} rank(s) joined; reading the checkpoint's metadata")
    spec, load_dir, side_src, resuming = _source(cfg)
    spec.check_supported("training")  # before anything is written
    if cfg.image_token_id is not None and cfg.image_token_id != spec.image_token_id:
        raise ValueError(f"--image-token-id {cfg.image_token_id} differs from the checkpoint's {spec.image_token_id}")
    if load_dir is not None:  # a damaged iteration is refused before anything reads it (collective)
        resume.check_integrity(cfg, load_dir, resuming)
    if rt.rank == 0:
        resume.report_run_dir(cfg, load_dir if resuming else None)
    for note in settle_with_spec(cfg, spec):  # e.g. sequence parallelism for an MoE LM at --tp > 1
        if rt.rank == 0:
            log.info("%s", note)
    plan = resume.plan(cfg, load_dir, rt.tp, rt.pp, rt.dp) if resuming else None
    # the encoder first: it checks the image processor against the spec before the model is built
    kw = dict(image_token_id=spec.image_token_id, pad_token_id=cfg.pad_token_id,
              max_consecutive_skips=cfg.max_consecutive_skipped_samples, pad_to_multiple_of=pad_multiple(cfg))
    if cfg.packing:
        from megatron_vlm.data.packing import packing_task_encoder_for

        encoder = packing_task_encoder_for(spec, cfg.tokenizer_load_dir, cfg.seq_length, cfg.packed_seq_length,
                                           video_fps=cfg.video_fps, video_frames=cfg.video_frames,
                                           sample_multiple=length_multiple(cfg.cp), **kw)
    else:
        encoder = task_encoder_for(spec, cfg.tokenizer_load_dir, cfg.seq_length, video_fps=cfg.video_fps,
                                   video_frames=cfg.video_frames, **kw)
    _progress(rt, t_launch, "building the model, optimizer and schedule" + (
        f" (loading weights from {load_dir})" if load_dir is not None and not resuming else ""))
    training = build_training(cfg, spec, init_from=None if resuming else load_dir)
    if rt.rank == 0:
        log.info("transformer layers: %s (%s)%s", training.impl, training.impl_reason,
                 f"; FP8 {cfg.fp8_format}, recipe {cfg.fp8_recipe}" if cfg.fp8 else "")
        log.info("loss: %s (vocabulary %d, padded to %d)", objective.describe(bool(cfg.loss_over_padded_vocab)),
                 spec.vocab_size, spec.padded_vocab_size)
        log.info("precision %s (%s)", cfg.precision, "megatron Float16Module, fp32 main parameters in the "
                 "optimizer" if cfg.precision != "fp32" else "fp32 throughout")
        log.info("fusions: %s; overlap_grad_reduce=%s overlap_param_gather=%s", training.fusions.summary(),
                 cfg.overlap_grad_reduce, cfg.overlap_param_gather)
        if spec.is_moe:
            log.info("mixture of experts: %s", describe_moe(spec, training.config, cfg, training.moe))
        if cfg.cp > 1:
            from megatron_vlm.model.context_parallel import describe

            log.info("context parallelism: each sequence split over %d ranks (2 x %d load-balanced chunks, lengths "
                     "padded to a multiple of %d); attention: %s", cfg.cp, cfg.cp, pad_multiple(cfg),
                     describe(training.impl == "transformer_engine", cfg.cp_comm_type))
            if spec.is_qwen_vl and cfg.vision_cp_split:
                log.info("context parallelism: %s's vision encoder runs whole on every CP rank (--vision-cp-split "
                         "shares the tiles of the other families only)", family_name(spec.arch))
        if cfg.pp > 1:
            from megatron_vlm.model.pipeline_layout import describe

            vpp = len(training.models)
            log.info("pipeline: %s%s", describe(spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers), vpp),
                     f" ({vpp} virtual stages per rank: megatron-core's interleaved 1F1B schedule)" if vpp > 1 else "")
        log.info("data: read on TP rank 0 of the first and last pipeline stage, broadcast to the other TP ranks%s",
                 f"; sequence packing into {cfg.packed_seq_length} positions from buffers of "
                 f"{cfg.packing_buffer_size} samples" if cfg.packing else "")
        if load_dir is not None and not resuming:
            log.info("loaded model weights from %s", load_dir)
        elif not resuming:
            log.info("random initialisation (--init)")
    answers = None
    if cfg.eval_generate_interval:
        from megatron_vlm.training.answers import InLoopAnswers

        _progress(rt, t_launch, "reading the held-out samples of --eval-generate-interval")
        answers = InLoopAnswers(cfg, spec, training)
        if rt.rank == 0:
            log.info("held-out answers: %s", answers.describe())
    if resuming:
        _progress(rt, t_launch, f"loading the checkpoint {load_dir} (model" + (", optimizer" if plan.load_optim else "")
                  + (", RNG" if plan.load_rng else "") + (", data position" if plan.load_data else "") + ")")
    loader_state = resume.restore(training, plan) if resuming else None
    loader = None  # only the ranks that read data build a loader (batch_feed.reads_data)
    _progress(rt, t_launch, "building the data loader")
    if batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp):
        loader = build_train_loader(cfg.data_path, encoder, cfg.micro_batch_size, rt.dp_rank, rt.dp, cfg.num_workers,
                                    plan.loader_seed if plan else cfg.seed, packing_buffer_size=cfg.packing_buffer_size)
        if loader_state is not None:
            loader.restore_state_rank(loader_state)
    if resuming and rt.rank == 0:
        log.info("resumed from %s at iteration %d (optimizer %s, %s)", load_dir, plan.iteration,
                 "restored" if plan.load_optim else "fresh", "data position restored" if plan.load_data else
                 "data position reset")
        for note in plan.notes:
            log.warning("resume: %s", note)
    return Run(rt, spec, training, encoder, loader, plan.iteration if plan else 0, resuming, side_src, answers)


def evaluate(cfg, run: Run) -> float | None:
    """Mean validation loss (per assistant token) over ``cfg.eval_iters`` batches of the 'val' split."""
    from megatron_vlm.data.loader import build_eval_loader

    rt = run.rt
    batches = []
    if run.loader is not None:  # this rank reads data (batch_feed.reads_data)
        for b in build_eval_loader(cfg.data_path, run.encoder, cfg.micro_batch_size, rt.dp_rank, rt.dp, 0,
                                   packing_buffer_size=cfg.packing_buffer_size):
            batches.append(b)
            if len(batches) == cfg.eval_iters:
                break
    n = torch.tensor([len(batches) if run.loader is not None else cfg.eval_iters], device=rt.device)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)  # as many batches on every rank
    n = int(n.item())
    if run.loader is not None:
        batches = [step.pad_micro_batch(b, cfg.micro_batch_size, run.spec.media_token_ids) for b in batches[:n]]
    else:
        batches = [None] * n
    return step.evaluate(run.training, batch_feed.distribute(batches, rt.device), cfg, rt.device)


def save(cfg, run: Run, iteration: int) -> None:
    training = run.training
    overlap = training.overlapping_param_gather()
    if overlap:  # the model's parameters must be current (gathered) when they are written
        training.disable_forward_pre_hook()
    meta = ckpt.CheckpointMeta("torch_dist", cfg.tp, cfg.pp, run.spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers),
                               dtype=str(training.dtype).replace("torch.", ""), ep=cfg.ep, etp=cfg.etp,
                               vpp=len(training.models))
    from megatron_vlm.training.resume import layout_extra

    meta.extra.update(layout_extra(cfg, run.rt.dp, iteration * cfg.global_batch_size, training.scheduler))
    # the data position: from the ranks that own a loader (TP rank 0 of the first stage is the saved replica)
    loader_state = run.loader.save_state_rank() if run.loader is not None else None
    checkpointing.save(cfg.checkpoint_dir, iteration, training.models, training.optimizer, training.scheduler,
                       loader_state, spec=run.spec, meta=meta, side_src=run.side_src, with_optim=cfg.save_optim,
                       total_limit=cfg.save_total_limit, config_yaml=cfg.to_yaml(),
                       verify_integrity=cfg.verify_integrity)
    if overlap:
        training.enable_forward_pre_hook()


def loop(cfg, run: Run, stop: _StopFlag, t_launch: float) -> dict:
    from megatron.core import parallel_state as ps

    rt, training = run.rt, run.training
    iteration = run.iteration
    if rt.rank == 0 and not (storage.path(cfg.checkpoint_dir) / ckpt.TOKENIZER_DIR).is_dir():
        ckpt.copy_tokenizer(cfg.tokenizer_load_dir, cfg.checkpoint_dir)  # so every checkpoint exports on its own
    is_logger = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    timers = StepTimers(rt.device, cfg.timing_log_level)
    metrics = MetricsLogger(cfg, cfg.train_iters, enabled=is_logger, start_iter=iteration,
                            flops=StepFlops(run.spec, *training.trained_parts), world_size=rt.world_size,
                            peak_flops=peak_flops(rt.device, cfg.fp8), timers=timers, device=rt.device)
    profiler = StepProfiler(cfg, rt.rank, iteration, timers)
    if rt.rank == 0:
        trainable = sum(p.numel() for _, p in training.named_parameters() if p.requires_grad)
        total = sum(p.numel() for _, p in training.named_parameters())
        vpp = len(training.models)
        log.info("model: %.2fM parameters on this rank, %.2fM trainable (stage %d); tp=%d pp=%d%s%s dp=%d, "
                 "micro batch %d x %d accumulation -> global batch %d", total / 1e6, trainable / 1e6, cfg.stage,
                 cfg.tp, cfg.pp, f" vpp={vpp}" if vpp > 1 else "", f" cp={cfg.cp}" if cfg.cp > 1 else "", rt.dp,
                 cfg.micro_batch_size, cfg.grad_accum, cfg.global_batch_size)
    _progress(rt, t_launch, "first iteration (the data loader's workers start)")
    data = iter(run.loader) if run.loader is not None else None
    first_iter_time = None
    last_saved = iteration if run.resumed else None
    while iteration < cfg.train_iters:
        profiler.before(iteration + 1)
        timers.begin()
        fetched = [next(data) if data is not None else None for _ in range(cfg.grad_accum)]
        timers.mark("batch-load")
        batches = batch_feed.distribute(fetched, rt.device)
        timers.mark("batch-distribute")
        iteration += 1
        if any(a <= iteration <= b for a, b in cfg.skip_train_iteration_range):
            training.scheduler.step(increment=1)
            timers.discard()
            if rt.rank == 0:
                log.info("iteration %d skipped (--skip-train-iteration-range)", iteration)
            metrics.step(iteration, None, training.lr(), skipped=True)
        else:
            r = step.train_step(training, batches, cfg, rt.device, timers)
            timers.end()
            if r.grad_norm is None and rt.rank == 0:  # fp16: megatron's scaler found inf/nan gradients
                log.warning("iteration %d skipped: fp16 gradients overflowed at loss scale %g; the scaler backs off "
                            "(loss scale now %g)", iteration, r.loss_scale, training.optimizer.get_loss_scale().item())
            metrics.step(iteration, r, training.lr())
        profiler.after(iteration)
        last = iteration == cfg.train_iters
        log_point = iteration % cfg.log_interval == 0 or last
        eval_point = cfg.eval_iters > 0 and (iteration % cfg.eval_interval == 0 or last)
        answer_point = run.answers is not None and (iteration % cfg.eval_generate_interval == 0 or last)
        save_point = cfg.save and (iteration % cfg.save_interval == 0 or last)
        if log_point:
            metrics.log(iteration)
        if eval_point:
            metrics.validation(iteration, evaluate(cfg, run))
        if answer_point:
            metrics.flush()  # the iterations before it first, in order
            metrics.answers(iteration, *run.answers(iteration, progress=is_logger))
        if first_iter_time is None:
            first_iter_time = time.time() - t_launch
            if rt.rank == 0:
                log.info("time to first iteration: %.1f s", first_iter_time)
        # the signal check is a collective with a host sync: every STOP_CHECK_INTERVAL iterations and wherever the
        # loop stops to log, evaluate or save anyway
        stopping = (log_point or eval_point or answer_point or save_point or iteration % STOP_CHECK_INTERVAL == 0) and \
            stop.agreed(rt.device)
        if save_point or (cfg.save and stopping):
            metrics.flush()  # the records of every iteration the checkpoint holds
            save(cfg, run, iteration)
            last_saved = iteration
        if stopping:
            if rt.rank == 0:
                log.warning("stopped by signal at iteration %d (checkpoint saved)", iteration)
            break
    profiler.close()
    metrics.close()
    if is_logger:  # the rank that wrote metrics.jsonl draws it (rank 0 unless PP > 1); never fails the run
        from megatron_vlm.eval.plot import write_run_figure

        write_run_figure(cfg.run_dir)
    torch.distributed.barrier()
    return {"iteration": iteration, "last_saved": last_saved, "first_iter_s": first_iter_time}


def train(cfg) -> dict:
    """Run ``cfg`` on this rank (torchrun started it): start-up, resume, then the loop."""
    from megatron_vlm.runtime import distributed
    from megatron_vlm.runtime.gc_freeze import freeze_long_lived

    t_launch = time.time()
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    vpp = cfg.vpp_size(_source(cfg)[0]) if cfg.virtual_pipeline else 1  # the model's layers decide the chunks
    rt = distributed.setup(cfg.tp, cfg.pp, device=cfg.device, seed=cfg.seed, ep=cfg.ep, etp=cfg.etp, cp=cfg.cp,
                             vpp=vpp)
    stop = _StopFlag()
    run = start(cfg, rt, t_launch)
    freeze_long_lived()  # the model, optimizer, loader and imports live until exit: no collection walks them again
    return loop(cfg, run, stop, t_launch)
