"""Build this rank's training objects on megatron-core, as Megatron-LM does: the LLaVAModel chunk of this
pipeline stage (one per virtual stage with virtual pipeline parallelism), each wrapped for mixed precision (``Float16Module``: bf16/fp16 parameters, first-stage inputs such as
pixel values cast to the compute dtype, last-stage outputs back to fp32), megatron-core's
``DistributedDataParallel`` (fp32 gradient buffers, per-token loss normalisation over the whole global batch),
the loss objective (:mod:`.objective`: padded vocabulary rows masked out unless ``--loss-over-padded-vocab``),
the mixed-precision or distributed optimizer (fp32 main parameters; loss scaling for fp16) and the learning-rate
schedule.

``build_training(cfg, spec, init_from)`` is used by the trainer and by the tests and benchmarks that drive a
training step directly; ``cfg`` is a :class:`~megatron_vlm.training.config.TrainConfig` (only its model,
parallelism, precision and optimizer fields are read).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.model.spec import VLMSpec

log = logging.getLogger("megatron_vlm.train")


def compute_dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.precision == "bf16" else torch.float16 if cfg.precision == "fp16" else torch.float32


@dataclass
class Training:
    """One rank's model chunks, wrapped chunks, optimizer and schedule (everything a step and a checkpoint touch).
    A rank holds one model chunk, or one per virtual pipeline stage with ``--num-virtual-stages-per-pipeline-rank``
    / ``--num-layers-per-virtual-pipeline-stage`` (:mod:`megatron_vlm.model.pipeline_layout`): ``models[c]`` is chunk
    ``c``, in the order megatron-core's interleaved schedule takes them."""

    spec: VLMSpec
    models: list  # the LLaVAModel chunks of this rank (unwrapped)
    ddps: list  # DistributedDataParallel(Float16Module(chunk)) or DistributedDataParallel(chunk), per chunk
    optimizer: object  # megatron-core MegatronOptimizer
    scheduler: object  # megatron-core OptimizerParamScheduler
    trained_parts: tuple[bool, bool, bool]  # (vision encoder, projector, language model) trainable
    dtype: torch.dtype
    impl: str = "local"  # layer implementation: "transformer_engine" or "local"
    impl_reason: str = ""
    fusions: object = None  # megatron_vlm.model.fusions.Fusions in effect
    moe: object = None  # megatron_vlm.training.moe.orchestration.MoETraining of an MoE model

    @property
    def model(self) -> torch.nn.Module:
        """The rank's one model chunk (without virtual pipeline stages; with them, iterate :attr:`models`)."""
        return _only(self.models, "models")

    @property
    def ddp(self) -> torch.nn.Module:
        """The rank's one wrapped chunk (without virtual pipeline stages; with them, iterate :attr:`ddps`)."""
        return _only(self.ddps, "ddps")

    @property
    def config(self):
        """The language TransformerConfig, which megatron's schedules and DDP read (one for all chunks)."""
        return self.models[0].config

    def named_parameters(self):
        """(name, parameter) of every chunk: the chunk's own names, prefixed ``model<c>.`` with several chunks
        (Megatron-LM's checkpoint keys of chunk ``c``)."""
        for c, m in enumerate(self.models):
            for n, p in m.named_parameters():
                yield (f"model{c}.{n}" if len(self.models) > 1 else n), p

    def lr(self) -> float:
        return self.scheduler.get_lr(self.optimizer.param_groups[0])

    def overlapping_param_gather(self) -> bool:
        cfg = self.ddps[0].ddp_config
        return bool(cfg.use_distributed_optimizer and cfg.overlap_param_gather)

    def disable_forward_pre_hook(self) -> None:
        """Gather the parameters now and stop overlapping the gather with the forward (every chunk)."""
        for d in self.ddps:
            d.disable_forward_pre_hook(param_sync=True)

    def enable_forward_pre_hook(self) -> None:
        for d in self.ddps:
            d.enable_forward_pre_hook()


def _only(chunks: list, name: str):
    if len(chunks) != 1:
        raise AttributeError(f"this rank holds {len(chunks)} model chunks (virtual pipeline stages): use "
                             f"Training.{name}")
    return chunks[0]


def model_options(cfg, spec: VLMSpec, impl: str, fusions=None, attention: str | None = None):
    """megatron-core model options of a run: ``impl`` as :func:`megatron_vlm.model.layer_impl.choose` chose it,
    ``attention`` as :func:`~megatron_vlm.model.layer_impl.choose_attention` did (None: ``--attention-backend``)."""
    from megatron_vlm.model.build import ModelOptions

    dtype = compute_dtype(cfg)
    return ModelOptions(
        tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, cp_comm_type=cfg.cp_comm_type,
        vision_cp_split=cfg.vision_cp_split, pp_layers=cfg.pp_layers, vpp=cfg.vpp_size(spec),
        seq_length=cfg.lm_seq_length, params_dtype=dtype,
        bf16=cfg.precision == "bf16", fp16=cfg.precision == "fp16", use_te=impl == "transformer_engine",
        attention_backend=attention or getattr(cfg, "attention_backend", None) or "auto",
        fp8=cfg.fp8, fp8_recipe=cfg.fp8_recipe, fp8_format=cfg.fp8_format,
        deterministic=cfg.deterministic, recompute_granularity=cfg.recompute_granularity,
        recompute_method=cfg.recompute_method, recompute_num_layers=cfg.recompute_num_layers,
        sequence_parallel=cfg.sequence_parallel, per_token_loss=True, fusions=fusions,
        ep=cfg.ep, etp=cfg.etp, moe=cfg.moe_options(),
    )


def freeze(model, cfg) -> tuple[bool, bool, bool]:
    """Freeze per stage and overrides (``cfg.trained_parts``); returns what trains: (vision encoder, projector,
    language model)."""
    parts = cfg.trained_parts
    model.freeze(freeze_language_model=not parts["language"], freeze_vision_model=not parts["vision"],
                 freeze_vision_projection=False)
    return parts["vision"], True, parts["language"]


def optimizer_config(cfg):
    """megatron-core's OptimizerConfig of a run: Adam (decoupled weight decay, i.e. AdamW, with megatron's defaults
    for what the run does not set, such as ``adam_eps``), fp32 main parameters, loss scaling for fp16. The outside
    reference (:mod:`tests.support.hf_reference`) reads its settings from here."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, clip_grad=cfg.clip_grad, bf16=cfg.precision == "bf16",
        fp16=cfg.precision == "fp16", params_dtype=compute_dtype(cfg), use_distributed_optimizer=cfg.dist_optim,
        loss_scale=cfg.loss_scale, initial_loss_scale=cfg.initial_loss_scale, min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
        overlap_param_gather=cfg.overlap_param_gather,
    )


def packing_note(impl: str, device: str, attention: str = "local") -> str | None:
    """What the log says once when packing runs a slow path: local layers on CUDA with ``--attention-backend local``
    run megatron's local attention once per packed sample, a Python loop over each pack's ``cu_seqlens`` (on CPU
    that is the default path; ``sdpa`` runs one masked call per pack)."""
    if impl == "transformer_engine" or device != "cuda" or attention == "sdpa":
        return None
    return ("sequence packing with local layers on CUDA: megatron's local attention runs once per packed sample (a "
            "Python loop over every pack's segments), far slower than Transformer Engine's fused 'thd' attention; "
            "use --attention-backend sdpa, or --transformer-impl transformer_engine where Transformer Engine is installed")


def build_training(cfg, spec: VLMSpec, init_from=None) -> Training:
    """Model (weights from the iteration dir ``init_from``, else random), DDP, optimizer and scheduler.

    Weights are loaded before the optimizer exists, so its fp32 main parameters start from them. Whatever
    changes model weights later must call :func:`weights_changed`.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_vlm.model.build import build_chunks

    from megatron_vlm.model import fusions as fusions_mod
    from megatron_vlm.model import layer_impl
    from megatron_vlm.data.packing import check_packing_supported
    from megatron_vlm.training import objective, schedule

    if spec.is_moe:
        from megatron_vlm.runtime.mcore_version import expert_layout_problem

        problem = expert_layout_problem(cfg.ep, cfg.expert_tp, cfg.tp)
        if problem:
            raise ValueError(problem)
    dtype = compute_dtype(cfg)
    device = "cuda" if cfg.device == "cuda" else "cpu"
    impl, why = layer_impl.choose(cfg.transformer_impl, device, cfg.fp8, cfg.cp)
    attention, attention_why = layer_impl.choose_attention(cfg.attention_backend, impl, device, cfg.cp)
    why = f"{why}; attention {attention} ({attention_why})"
    if cfg.packing:
        check_packing_supported(impl, device)
        note = packing_note(impl, device, attention)
        if note and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            log.warning(note)
    fusions = fusions_mod.resolve(fusions_mod.requested(cfg), device, impl)
    models = build_chunks(spec, model_options(cfg, spec, impl, fusions, attention))
    if torch.cuda.is_available() and cfg.device != "cpu":
        for m in models:
            m.cuda()
    if init_from is not None:
        ckpt.load_model_weights(models, init_from)
    trained = None
    for m in models:
        objective.apply(m, spec.vocab_size, spec.padded_vocab_size, bool(cfg.loss_over_padded_vocab))
        trained = freeze(m, cfg)
    config = models[0].config
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather, use_distributed_optimizer=cfg.dist_optim,
        bucket_size=cfg.ddp_bucket_size,
    )
    # config.calculate_per_token_loss is set at build time: DDP reads it here to leave gradients unscaled by
    # 1/DP, and finalize_model_grads then divides them by the global batch's loss-token count. With several
    # chunks, only the first keeps DDP's buckets (Megatron-LM's get_model): the others reduce in one bucket each.
    ddps = [DistributedDataParallel(config=config, ddp_config=ddp_cfg,
                                    module=Float16Module(config, m) if dtype != torch.float32 else m,
                                    disable_bucketing=c > 0)
            for c, m in enumerate(models)]
    optimizer = get_megatron_optimizer(optimizer_config(cfg), ddps)
    scheduler = schedule.build(cfg, optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
    moe = None
    if spec.is_moe:
        from megatron_vlm.model.build import aux_loss_coefficient
        from megatron_vlm.training.moe.orchestration import MoETraining

        opts = cfg.moe_options()
        moe = MoETraining(models, spec, config, opts.load_balancing_type, aux_loss_coefficient(spec, opts),
                          wrapped=ddps)
    return Training(spec, models, ddps, optimizer, scheduler, trained, dtype, impl, why, fusions, moe)


def release(training: Training) -> None:
    """Unhook a finished ``training`` from its model's TransformerConfig, for a process that goes on to build
    another (a test world running several jobs).

    :func:`build_training` points the config at the optimizer (``grad_scale_func``) and DDP (``no_sync_func``),
    as Megatron-LM does. With the distributed optimizer that link kept the whole job alive after it was dropped
    and collected (measured on megatron-core 0.16: its model, optimizer and the 17 process groups they hold, each
    with three gloo threads, for every such job of a world); without the link it is freed."""
    config = training.config
    config.finalize_model_grads_func = None
    config.grad_scale_func = None
    config.no_sync_func = None


def weights_changed(training: Training) -> None:
    """Model weights were replaced after the optimizer was built (a checkpoint loaded without optimizer
    state): copy them into the optimizer's fp32 main parameters, or its next step would bring the old
    weights back (Megatron-LM does the same)."""
    training.optimizer.reload_model_params()
