"""The training loop on megatron-core: model per PP stage, freezing per stage, DDP, (distributed) optimizer,
cosine schedule, megatron's forward/backward schedules, energon data with exact resume, checkpoints, signals.

``train(cfg)`` runs on every rank started by torchrun (see ``train/run.py``); ``cfg`` is the resolved
:class:`~megatron_vlm.training.config.TrainConfig`.
"""

from __future__ import annotations

import logging
import signal
import time
from functools import partial

import torch

from megatron_vlm import checkpoint as ckpt
from megatron_vlm import fp8, layer_impl, storage
from megatron_vlm.spec import VLMSpec
from megatron_vlm.training import checkpointing
from megatron_vlm.training.flops import StepFlops, peak_flops
from megatron_vlm.training.metrics import MetricsLogger

log = logging.getLogger("megatron_vlm.train")


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint at the end of the current iteration and exits."""

    def __init__(self):
        self.set = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if not self.set:
            log.warning("received signal %d: saving a checkpoint after this iteration", signum)
        self.set = True

    def agreed(self, device) -> bool:
        t = torch.tensor([1 if self.set else 0], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def _source(cfg):
    """(spec, iteration dir to load model weights from or None, side-file dir, resume?)."""
    run_dir = cfg.checkpoint_dir
    if ckpt.read_tracker(run_dir) is not None:
        it_dir = ckpt.resolve_iteration_dir(run_dir)
        return VLMSpec.load(it_dir), it_dir, it_dir, True
    if cfg.init:
        spec = VLMSpec.from_hf_dir(cfg.tokenizer_load_dir) if cfg.megatron_load_dir is None else \
            VLMSpec.load(ckpt.resolve_iteration_dir(cfg.megatron_load_dir))
        return spec, None, None, False
    it_dir = ckpt.resolve_iteration_dir(cfg.megatron_load_dir)
    return VLMSpec.load(it_dir), it_dir, it_dir, False


def _freeze(model, cfg) -> tuple[bool, bool, bool]:
    """Freeze per stage and overrides; returns what trains: (vision encoder, projector, language model)."""
    freeze_vit = cfg.freeze_vit if cfg.freeze_vit is not None else True
    freeze_lm = cfg.freeze_lm if cfg.freeze_lm is not None else cfg.stage == 1
    model.freeze(freeze_language_model=freeze_lm, freeze_vision_model=freeze_vit, freeze_vision_projection=False)
    return not freeze_vit, True, not freeze_lm


def _loss_func(loss_mask, output):
    losses = output.float()
    mask = loss_mask.float()
    total = (losses * mask).sum()
    n = mask.sum()
    return total, n.int(), {"lm loss": torch.stack([total.detach(), n.detach()])}


def _forward_step(device, data_iterator, model):
    b = next(data_iterator)
    out, loss_mask = model(
        images=b.images.to(device), input_ids=b.tokens.to(device), position_ids=None, attention_mask=None,
        labels=b.labels.to(device), loss_mask=b.loss_mask.to(device), num_image_tiles=b.num_image_tiles.to(device),
    )
    return out, partial(_loss_func, loss_mask)


def evaluate(cfg, ddp, encoder, rt, fb, step) -> float | None:
    """Mean validation loss (per assistant token) over ``cfg.eval_iters`` batches of the 'val' split."""
    from megatron.core import parallel_state as ps

    from megatron_vlm.data.loader import build_eval_loader

    loader = build_eval_loader(cfg.data_path, encoder, cfg.micro_batch_size, rt.dp_rank, rt.dp, 0)
    batches = []
    for b in loader:
        batches.append(b)
        if len(batches) == cfg.eval_iters:
            break
    n = torch.tensor([len(batches)], device=rt.device)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
    batches = batches[: int(n.item())]
    if not batches:
        return None
    ddp.eval()
    with torch.no_grad():
        losses = fb(forward_step_func=step, data_iterator=iter(batches), model=[ddp], num_microbatches=len(batches),
                    seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size, forward_only=True)
    ddp.train()
    total = torch.zeros(2, device=rt.device)
    for d in losses:
        total += d["lm loss"].to(rt.device).float()
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group())
        return (total[0] / total[1].clamp(min=1)).item()
    return None


def train(cfg) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.data.task_encoder import VLMTaskEncoder
    from megatron_vlm.model import ModelOptions, build_model
    from megatron_vlm.runtime import distributed

    t_launch = time.time()
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    rt = distributed.setup(cfg.tp, cfg.pp, device=cfg.device, seed=cfg.seed)
    stop = _StopFlag()
    spec, load_dir, side_src, resume = _source(cfg)
    if cfg.image_token_id is not None and cfg.image_token_id != spec.image_token_id:
        raise ValueError(f"--image-token-id {cfg.image_token_id} differs from the checkpoint's {spec.image_token_id}")
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    impl, why = layer_impl.choose(cfg.transformer_impl, rt.device.type, cfg.fp8)
    if rt.rank == 0:
        log.info("transformer layers: %s (%s)%s", impl, why,
                 f"; FP8 {cfg.fp8_format}, recipe {cfg.fp8_recipe}" if cfg.fp8 else "")
    opts = ModelOptions(tp=cfg.tp, pp=cfg.pp, pp_layers=cfg.pp_layers, seq_length=cfg.seq_length, params_dtype=dtype,
                        bf16=cfg.bf16, fp16=cfg.fp16, use_te=impl == "transformer_engine", fp8=cfg.fp8,
                        fp8_recipe=cfg.fp8_recipe, fp8_format=cfg.fp8_format, deterministic=cfg.deterministic)
    model = build_model(spec, opts)
    if rt.device.type == "cuda":
        model.cuda()
    if load_dir is not None and not resume:
        ckpt.load_model_weights(model, load_dir)
        if rt.rank == 0:
            log.info("loaded model weights from %s", load_dir)
    elif not resume and rt.rank == 0:
        log.info("random initialisation (--init)")
    trained_parts = _freeze(model, cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    lang_cfg = model.config
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=cfg.dist_optim, bucket_size=None)
    ddp = DistributedDataParallel(config=lang_cfg, ddp_config=ddp_cfg, module=model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                              adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=cfg.clip_grad,
                              bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=dtype,
                              use_distributed_optimizer=cfg.dist_optim)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    warmup = int(cfg.lr_warmup_fraction * cfg.train_iters)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=cfg.train_iters, lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=cfg.train_iters, wd_incr_style="constant",
    )
    lang_cfg.finalize_model_grads_func = finalize_model_grads
    lang_cfg.grad_scale_func = optimizer.scale_loss
    lang_cfg.no_sync_func = ddp.no_sync
    lang_cfg.calculate_per_token_loss = True

    encoder = VLMTaskEncoder(cfg.tokenizer_load_dir, cfg.seq_length, image_token_id=spec.image_token_id,
                             pad_token_id=cfg.pad_token_id,
                             pad_to_multiple_of=fp8.align_size(cfg.fp8_recipe) if cfg.fp8 else None)
    loader = build_train_loader(cfg.data_path, encoder, cfg.micro_batch_size, rt.dp_rank, rt.dp, cfg.num_workers,
                                cfg.seed)
    iteration = 0
    if resume:
        meta = ckpt.CheckpointMeta.load(load_dir)
        with_optim = cfg.load_optim and meta.extra.get("optimizer", False)
        state = checkpointing.load(load_dir, ddp, optimizer, scheduler, with_optim)
        iteration = int(state["iteration"])
        if state["loader_state"] is None:
            raise RuntimeError(f"{load_dir} has no data-loader state for data-parallel rank {rt.dp_rank}")
        loader.restore_state_rank(state["loader_state"])
        checkpointing.set_rng_state(state["rng_state"])
        if rt.rank == 0:
            log.info("resumed from %s at iteration %d (optimizer %s, data position restored)", load_dir, iteration,
                     "restored" if with_optim else "fresh")
    data = iter(loader)
    if rt.rank == 0 and not (storage.path(cfg.checkpoint_dir) / ckpt.TOKENIZER_DIR).is_dir():
        ckpt.copy_tokenizer(cfg.tokenizer_load_dir, cfg.checkpoint_dir)  # so every checkpoint exports on its own
    meta_out = ckpt.CheckpointMeta("torch_dist", cfg.tp, cfg.pp, spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers),
                                   dtype=str(dtype).replace("torch.", ""))
    is_logger = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0
    metrics = MetricsLogger(cfg, cfg.train_iters, enabled=is_logger, start_iter=iteration,
                            flops=StepFlops(spec, *trained_parts), world_size=rt.world_size,
                            peak_flops=peak_flops(rt.device, cfg.fp8))
    if rt.rank == 0:
        log.info("model: %.2fM parameters on this rank, %.2fM trainable (stage %d); tp=%d pp=%d dp=%d, "
                 "micro batch %d x %d accumulation -> global batch %d", total / 1e6, trainable / 1e6, cfg.stage,
                 cfg.tp, cfg.pp, rt.dp, cfg.micro_batch_size, cfg.grad_accum, cfg.global_batch_size)
    fb = get_forward_backward_func()
    step = partial(_forward_step, rt.device)
    save_kw = dict(spec=spec, meta=meta_out, side_src=side_src, with_optim=cfg.save_optim,
                   total_limit=cfg.save_total_limit, config_yaml=cfg.to_yaml())
    first_iter_time = None
    last_saved = iteration if resume else None
    while iteration < cfg.train_iters:
        batches = [next(data) for _ in range(cfg.grad_accum)]
        iteration += 1
        if any(a <= iteration <= b for a, b in cfg.skip_train_iteration_range):
            scheduler.step(increment=1)
            if rt.rank == 0:
                log.info("iteration %d skipped (--skip-train-iteration-range)", iteration)
            metrics.step(iteration, 0.0, 0.0, 0, 0, 0, scheduler.get_lr(optimizer.param_groups[0]), None,
                         skipped=True)
        else:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            losses = fb(forward_step_func=step, data_iterator=iter(batches), model=[ddp],
                        num_microbatches=cfg.grad_accum, seq_length=cfg.seq_length,
                        micro_batch_size=cfg.micro_batch_size, forward_only=False)
            ok, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
            loss_sum = torch.zeros(2, device=rt.device)
            for d in losses:
                loss_sum += d["lm loss"].to(rt.device).float()
            counts = torch.tensor([sum(b.tokens.shape[0] for b in batches), sum(b.num_tokens for b in batches),
                                   sum(b.images.shape[0] for b in batches)], device=rt.device, dtype=torch.float64)
            if ps.is_pipeline_last_stage(ignore_virtual=True):
                torch.distributed.all_reduce(loss_sum, group=ps.get_data_parallel_group())
            torch.distributed.all_reduce(counts, group=ps.get_data_parallel_group())
            samples, tokens, images = (int(c) for c in counts.tolist())
            metrics.step(iteration, loss_sum[0].item(), loss_sum[1].item(), samples, tokens, images,
                         scheduler.get_lr(optimizer.param_groups[0]), grad_norm if ok else None)
        if cfg.eval_iters > 0 and (iteration % cfg.eval_interval == 0 or iteration == cfg.train_iters):
            val = evaluate(cfg, ddp, encoder, rt, fb, step)
            metrics.validation(iteration, val)
        if first_iter_time is None:
            first_iter_time = time.time() - t_launch
            if rt.rank == 0:
                log.info("time to first iteration: %.1f s", first_iter_time)
        stopping = stop.agreed(rt.device)
        due = cfg.save and (iteration % cfg.save_interval == 0 or iteration == cfg.train_iters or stopping)
        if due:
            checkpointing.save(cfg.checkpoint_dir, iteration, ddp, optimizer, scheduler, loader.save_state_rank(), **save_kw)
            last_saved = iteration
        if stopping:
            if rt.rank == 0:
                log.warning("stopped by signal at iteration %d (checkpoint saved)", iteration)
            break
    metrics.close()
    result = {"iteration": iteration, "last_saved": last_saved, "first_iter_s": first_iter_time}
    torch.distributed.barrier()
    return result
