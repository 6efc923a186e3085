"""Validation of a training config: per-value types and ranges (before resolution) and the consistency of a
resolved config (parallel layout, batch arithmetic, precision, FP8, fusions, packing, containers, SLURM).
Each check returns a list of problems, one line each, naming the flag and the fix."""

from __future__ import annotations

import dataclasses
import math

from megatron_vlm.model.context_parallel import length_multiple, round_up
from megatron_vlm.model.fp8 import align_size as fp8_align_size
from megatron_vlm.model.fusions import BY_NAME as FUSIONS
from megatron_vlm.model.fusions import problems as fusion_problems
from megatron_vlm.model.layer_impl import choose_attention
from megatron_vlm.training.config.fields import STAGE_DEFAULTS, ConfigFields
from megatron_vlm.training.config.fields import flag as _flag


def join(problems: list[str]) -> str:
    return problems[0] if len(problems) == 1 else "\n".join(f"- {p}" for p in problems)


def check_types_and_ranges(cfg: ConfigFields) -> list[str]:
    p: list[str] = []
    for f in dataclasses.fields(cfg):  # nan and inf pass every comparison below
        v = getattr(cfg, f.name)
        if f.metadata["kind"] == "float" and isinstance(v, float) and v - v != 0:
            p.append(f"{f.metadata['flags'][0]} {v}: must be a finite number")
    positive = ["gpus", "nodes", "tp", "pp", "cp", "ep", "etp", "micro_batch_size", "global_batch_size", "train_iters",
                "seq_length", "save_interval", "save_total_limit", "log_interval", "eval_interval",
                "eval_generate_samples", "eval_generate_max_new_tokens",
                "gpus_per_node", "cpus_per_task", "ddp_bucket_size", "recompute_num_layers",
                "max_consecutive_skipped_samples", "packing_buffer_size", "packed_seq_length", "video_frames",
                "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"]
    for name in positive:
        v = getattr(cfg, name)
        if v is not None and v < 1:
            p.append(f"{_flag(name)} {v}: must be at least 1")
    for name in ("eval_iters", "eval_generate_interval", "num_workers", "min_lr", "weight_decay", "clip_grad", "seed", "image_token_id",
                 "pad_token_id", "ckpt_step"):
        v = getattr(cfg, name)
        if v is not None and v < 0:
            p.append(f"{_flag(name)} {v}: must not be negative")
    if cfg.stage not in STAGE_DEFAULTS:
        p.append(f"--stage {cfg.stage}: must be 1 (pretraining) or 2 (instruction tuning)")
    if cfg.device not in (None, "cuda", "cpu"):
        p.append(f"--device {cfg.device}: must be cuda or cpu")
    if cfg.precision not in (None, "bf16", "fp16", "fp32"):
        p.append(f"--precision {cfg.precision}: must be bf16, fp16 or fp32")
    if cfg.lr_decay_style not in ("cosine", "linear", "constant"):
        p.append(f"--lr-decay-style {cfg.lr_decay_style}: must be cosine, linear or constant")
    if cfg.lr is not None and cfg.lr <= 0:
        p.append(f"--lr {cfg.lr}: must be positive")
    if not cfg.video_fps > 0:
        p.append(f"--video-fps {cfg.video_fps}: must be positive")
    if cfg.gpu_memory_gb is not None and not cfg.gpu_memory_gb > 0:
        p.append(f"--gpu-memory-gb {cfg.gpu_memory_gb}: must be positive")
    if not 0 <= cfg.lr_warmup_fraction < 1:
        p.append(f"--lr-warmup-fraction {cfg.lr_warmup_fraction}: must be in [0, 1)")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            p.append(f"{_flag(name)} {getattr(cfg, name)}: must be in [0, 1)")
    if cfg.node_rank is not None and cfg.node_rank < 0:
        p.append(f"--rank {cfg.node_rank}: must not be negative")
    if cfg.master_port is not None and not 0 < cfg.master_port < 65536:
        p.append(f"--master-port {cfg.master_port}: must be a TCP port (1-65535)")
    if cfg.gpu_ids is not None:
        if not cfg.gpu_ids or min(cfg.gpu_ids) < 0 or len(set(cfg.gpu_ids)) != len(cfg.gpu_ids):
            p.append(f"--gpu-ids {','.join(map(str, cfg.gpu_ids))}: give distinct non-negative GPU indices")
    for a, b in cfg.skip_train_iteration_range:
        if a < 0 or b < a:
            p.append(f"--skip-train-iteration-range {a}-{b}: need 0 <= A <= B")
    if cfg.name is not None and (not cfg.name or "/" in cfg.name or cfg.name in (".", "..")):
        p.append(f"--name {cfg.name!r}: must be a plain directory name (no '/')")
    return p


def check_consistency(cfg: ConfigFields) -> list[str]:
    p: list[str] = []
    if cfg.gpu_ids is not None:
        if cfg.device == "cpu":
            p.append("--gpu-ids is for --device cuda; drop it for a CPU run")
        elif len(cfg.gpu_ids) != cfg.gpus:
            p.append(f"--gpu-ids {','.join(map(str, cfg.gpu_ids))} names {len(cfg.gpu_ids)} GPUs but -g is "
                     f"{cfg.gpus}; give as many ids as --gpus (or leave -g out)")
    if cfg.node_rank >= cfg.nodes:
        p.append(f"--rank {cfg.node_rank} with --node {cfg.nodes}: node ranks run from 0 to {cfg.nodes - 1}")
    if cfg.nodes > 1 and not cfg.master_addr and not cfg.sbatch:
        p.append(f"--node {cfg.nodes}: give --master-addr (the address of node 0, reachable from every node)")
    mp = cfg.model_parallel
    if cfg.world_size % mp:
        per = f"-g {cfg.gpus}" + (f" --node {cfg.nodes}" if cfg.nodes > 1 else "") + f" --tp {cfg.tp}" + \
            (f" --pp {cfg.pp}" if cfg.pp > 1 else "") + (f" --cp {cfg.cp}" if cfg.cp > 1 else "")
        total = f"{cfg.world_size} GPUs" + (f" ({cfg.gpus} per node x {cfg.nodes} nodes)" if cfg.nodes > 1 else "")
        product, flags = ("tp*pp*cp", "--tp/--pp/--cp") if cfg.cp > 1 else ("tp*pp", "--tp/--pp")
        p.append(f"{per}: {total} is not a multiple of {product}={mp}; "
                 f"use a GPU count that is a multiple of {mp} or lower {flags}")
    elif cfg.world_size < mp:  # pragma: no cover - implied by the modulo check
        p.append(f"tp*pp={mp} exceeds {cfg.world_size} GPUs")
    else:
        unit = cfg.micro_batch_size * cfg.dp
        if cfg.global_batch_size % unit:
            src = "" if cfg.global_batch_size != STAGE_DEFAULTS[cfg.stage]["global_batch_size"] else \
                f" (stage {cfg.stage} default)"
            lo, hi = cfg.global_batch_size // unit * unit, (cfg.global_batch_size // unit + 1) * unit
            p.append(f"global batch {cfg.global_batch_size}{src} is not divisible by micro batch "
                     f"{cfg.micro_batch_size} x data-parallel {cfg.dp} = {unit}; pass --global-batch-size "
                     f"{lo or hi}" + (f" or {hi}" if lo else "") + " (or change --micro-batch-size)")
    p += _check_experts(cfg)
    p += _check_profile(cfg)
    p += _check_context_parallel(cfg)
    p += _check_attention(cfg)
    if cfg.pp_layers is not None and (len(cfg.pp_layers) != cfg.pp or min(cfg.pp_layers) < 1):
        p.append(f"--pp-layers {','.join(map(str, cfg.pp_layers))}: give {cfg.pp} positive layer counts, "
                 f"one per pipeline stage of --pp {cfg.pp}")
    p += _check_virtual_pipeline(cfg)
    p += _check_eval_generate(cfg)
    if cfg.lr is not None and cfg.min_lr > cfg.lr:
        p.append(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}")
    if cfg.fp8:
        if cfg.device == "cpu":
            p.append("--fp8 needs a CUDA GPU of compute capability 8.9+ (Hopper/Ada) with Transformer Engine; "
                     "drop --fp8 for --device cpu")
        elif cfg.precision == "fp32":
            p.append("--fp8 runs on top of bf16/fp16 weights; drop --precision fp32")
        if cfg.transformer_impl == "local":
            p.append("--fp8 needs --transformer-impl transformer_engine (FP8 GEMMs are Transformer Engine's); "
                     "drop --transformer-impl local or --fp8")
        align = fp8_align_size(cfg.fp8_recipe)
        if cfg.seq_length % align:
            up = -(-cfg.seq_length // align) * align
            p.append(f"--seq-length {cfg.seq_length}: with --fp8 (--fp8-recipe {cfg.fp8_recipe}) it must be a "
                     f"multiple of {align}, the token alignment of FP8 GEMMs; use --seq-length {up}")
    p += fusion_problems({n: getattr(cfg, n) for n in FUSIONS}, cfg.device)
    p += _check_packing(cfg)
    if cfg.transformer_impl == "transformer_engine" and cfg.device == "cpu":
        p.append("--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local (the "
                 "default on --device cpu)")
    if cfg.override_opt_param_scheduler and cfg.use_checkpoint_opt_param_scheduler:
        p.append("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler both given; choose one "
                 "(follow this command line's learning-rate schedule, or keep the checkpoint's)")
    if cfg.overlap_param_gather and not cfg.dist_optim:
        p.append("--overlap-param-gather needs --dist-optim (it overlaps the distributed optimizer's "
                 "parameter all-gather)")
    if cfg.sequence_parallel and cfg.tp == 1:
        p.append("--sequence-parallel needs --tp > 1 (it splits the sequence over tensor-parallel ranks)")
    if cfg.recompute_granularity != "full":
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(cfg, name) is not None:
                p.append(f"{_flag(name)} only applies with --recompute-granularity full")
    if cfg.loss_scale is not None and cfg.precision != "fp16":
        p.append(f"--loss-scale applies to --precision fp16 only (this run: {cfg.precision or 'the default'}); drop it")
    if cfg.train_iters is None:
        p.append("--train-iters is required: how many optimizer steps to train")
    if not cfg.data_path:
        p.append("--data-path is required: an energon dataset prepared with data_prep/")
    if not cfg.tokenizer_load_dir:
        p.append("--tokenizer-load-dir is required: the HF LLaVA directory from convert/build_llava.py")
    if not cfg.megatron_load_dir and not cfg.init:
        p.append("--megatron-load-dir is required (a checkpoint from convert/hf_to_megatron.py), "
                 "or pass --init to start from random weights")
    for name in ("log_dir", "tensorboard_dir", "tokenizer_load_dir", "sbatch", "sif_path"):
        v = getattr(cfg, name)
        if v and "://" in v:
            p.append(f"{_flag(name)} {v}: must be a local path (only --data-path, --save-dir and "
                     "--megatron-load-dir may be msc:// URLs)")
    if cfg.sif_path and cfg.docker_image:
        p.append("--sif-path and --docker-image both given; choose one container runtime")
    if cfg.bind and not cfg.container:
        p.append("--bind only applies with --sif-path or --docker-image")
    if cfg.submit and not cfg.sbatch:
        p.append("--submit needs --sbatch JOB.sh (the script to write and submit)")
    if not cfg.sbatch:
        for name in ("partition", "time", "account", "cpus_per_task"):
            if getattr(cfg, name) is not None:
                p.append(f"{_flag(name)} only applies with --sbatch JOB.sh")
        if cfg.gpus_per_node is not None and cfg.gpus_per_node != cfg.gpus:
            p.append(f"--gpus-per-node {cfg.gpus_per_node} disagrees with -g {cfg.gpus} (both count GPUs "
                     "per node); give one of them")
    elif cfg.gpus_per_node != cfg.gpus:
        p.append(f"--gpus-per-node {cfg.gpus_per_node} disagrees with -g {cfg.gpus} (both count GPUs per "
                 "node); give one of them")
    return p


def _check_experts(cfg: ConfigFields) -> list[str]:
    """Expert parallelism against the world (the experts themselves are checked against the model's spec before
    launch): megatron-core forms EP x expert-TP groups out of each pipeline stage's TP x DP ranks."""
    p: list[str] = []
    if cfg.ep < 1 or cfg.expert_tp < 1 or cfg.cp < 1 or cfg.world_size % cfg.model_parallel:
        return p
    stage_ranks, experts = cfg.tp * cfg.cp * cfg.dp, cfg.ep * cfg.expert_tp
    if stage_ranks % experts:
        cp = f" x cp {cfg.cp}" if cfg.cp > 1 else ""
        p.append(f"--ep {cfg.ep} x --etp {cfg.expert_tp} = {experts} ranks per expert group do not fit the "
                 f"{stage_ranks} ranks of a pipeline stage (tp {cfg.tp}{cp} x data-parallel {cfg.dp}): use a GPU count "
                 f"whose tp x{' cp x' if cp else ''} data-parallel size is a multiple of {experts}, or lower "
                 "--ep/--etp")
    if cfg.moe_token_dispatcher_type == "alltoall" and cfg.expert_tp > 1 and cfg.device == "cpu":
        p.append(f"--moe-token-dispatcher-type alltoall with --etp {cfg.expert_tp} on --device cpu: the dispatcher "
                 "all-gathers expert inputs of different sizes over the expert tensor-parallel ranks, which gloo "
                 "cannot; use --etp 1 or the allgather dispatcher on CPU (NCCL on GPUs does both)")
    if cfg.moe_pad_expert_input_to_capacity and cfg.moe_expert_capacity_factor is None:
        p.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity it pads to)")
    if cfg.moe_grouped_gemm and (cfg.transformer_impl == "local" or cfg.device == "cpu"):
        p.append("--moe-grouped-gemm needs Transformer Engine layers on a GPU (TEGroupedMLP); drop it for "
                 "--transformer-impl local or --device cpu")
    return p


def _check_attention(cfg: ConfigFields) -> list[str]:
    """--attention-backend against the layers it needs (where the command line fixes them: --transformer-impl, or
    --device cpu's local layers) and context parallelism (:func:`~megatron_vlm.model.layer_impl.choose_attention`;
    the build checks the rest once Transformer Engine's import is known)."""
    impl = cfg.transformer_impl or ("local" if cfg.device == "cpu" else None)
    if cfg.attention_backend in (None, "auto") or impl is None and cfg.attention_backend != "sdpa":
        return []
    try:
        choose_attention(cfg.attention_backend, impl or "local", cfg.device or "cuda", cfg.cp)
    except ValueError as e:
        return [str(e)]
    return []


def _check_context_parallel(cfg: ConfigFields) -> list[str]:
    """Context parallelism: the attention that exchanges keys and values, and the lengths it splits
    (:func:`check_sequence_length`)."""
    p: list[str] = []
    if cfg.cp_comm_type is not None and (cfg.cp == 1 or cfg.transformer_impl == "local" or cfg.device == "cpu"):
        p.append(f"--cp-comm-type {cfg.cp_comm_type} applies to Transformer Engine's attention with --cp > 1 on a "
                 "GPU" + ("" if cfg.cp > 1 else " (this run has --cp 1)") + "; local layers all-gather keys and "
                 "values: drop --cp-comm-type")
    return p + check_sequence_length(cfg)


def check_sequence_length(cfg: ConfigFields, sequence_parallel_origin: str = "") -> list[str]:
    """--seq-length against the chunks megatron-core's LLaVAModel splits every sequence into
    (:func:`~megatron_vlm.model.context_parallel.length_multiple`: 2 x CP, x TP with sequence parallelism, and the
    FP8 alignment): under context parallelism, and under sequence parallelism with pipeline parallelism (every micro
    batch is --seq-length long there). Packed sequences: :func:`_check_packing`. ``sequence_parallel_origin``: why
    sequence parallelism is on when the user did not ask for it (``resolve.settle_with_spec``)."""
    if cfg.tp < 1 or cfg.cp < 1 or cfg.packing or not (cfg.cp > 1 or (cfg.sequence_parallel and cfg.pp > 1)):
        return []
    m = length_multiple(cfg.cp, cfg.tp, bool(cfg.sequence_parallel))
    parts = ([f"2 x --cp {cfg.cp}"] if cfg.cp > 1 else []) + \
        ([f"--tp {cfg.tp}, with --sequence-parallel{sequence_parallel_origin}"] if cfg.sequence_parallel else [])
    why = " x ".join(parts)
    if cfg.fp8 and math.lcm(m, fp8_align_size(cfg.fp8_recipe)) != m:
        m = math.lcm(m, fp8_align_size(cfg.fp8_recipe))
        why += ", and the FP8 token alignment"
    if m <= 1 or cfg.seq_length % m == 0:
        return []
    ranks = "context-parallel ranks" if cfg.cp > 1 else \
        f"sequence-parallel ranks (with --pp {cfg.pp} every micro batch is --seq-length long)"
    return [f"--seq-length {cfg.seq_length} does not split over the {ranks}: it must be a multiple of {m} ({why}); "
            f"use --seq-length {round_up(cfg.seq_length, m)}"]


def _check_virtual_pipeline(cfg: ConfigFields) -> list[str]:
    """Virtual pipeline parallelism against the run (the layers of each chunk are checked against the model's spec
    before launch, :meth:`ConfigFields.vpp_size`): megatron-core's interleaved schedule runs the micro batches of a
    step in groups of PP (its default ``microbatch_group_size_per_vp_stage``), so their number must be a multiple of
    PP, in training and in evaluation."""
    from megatron_vlm.model.pipeline_layout import LAYERS_FLAG, STAGES_FLAG

    if not cfg.virtual_pipeline:
        return []
    p: list[str] = []
    given = [f for f, v in ((LAYERS_FLAG, cfg.num_layers_per_virtual_pipeline_stage),
                            (STAGES_FLAG, cfg.num_virtual_stages_per_pipeline_rank)) if v is not None]
    if len(given) == 2:
        p.append(f"{LAYERS_FLAG} and {STAGES_FLAG} both given; give one of them (Megatron-LM takes one)")
    if cfg.pp < 2:
        p.append(f"{given[0]} needs pipeline parallelism: virtual stages interleave the model chunks of several "
                 "pipeline ranks; use --pp 2 or more, or drop it")
        return p
    if cfg.world_size % (cfg.tp * cfg.pp) or cfg.global_batch_size % (cfg.micro_batch_size * cfg.dp):
        return p  # the batch arithmetic is refused on its own
    m = cfg.grad_accum
    if m % cfg.pp:
        unit = cfg.micro_batch_size * cfg.dp * cfg.pp
        lo, hi = cfg.global_batch_size // unit * unit, (cfg.global_batch_size // unit + 1) * unit
        p.append(f"{given[0]} with --pp {cfg.pp}: megatron-core's interleaved schedule runs micro batches in groups of "
                 f"--pp, but a step has {m} (global batch {cfg.global_batch_size} / (micro batch "
                 f"{cfg.micro_batch_size} x data-parallel {cfg.dp})), not a multiple of {cfg.pp}; pass "
                 f"--global-batch-size {lo or hi}" + (f" or {hi}" if lo else "") + " (or drop the virtual stages)")
    if cfg.eval_iters and cfg.eval_iters % cfg.pp:
        up = -(-cfg.eval_iters // cfg.pp) * cfg.pp
        p.append(f"--eval-iters {cfg.eval_iters} with {given[0]}: the interleaved schedule evaluates micro batches in "
                 f"groups of --pp {cfg.pp}; use --eval-iters {up}")
    return p


def _check_eval_generate(cfg: ConfigFields) -> list[str]:
    """``--eval-generate-*``: the layouts and precisions the in-loop answers run at (megatron-core's static
    generation over the trained model, :mod:`megatron_vlm.training.answers`); the model's family and the
    sequence parallelism a spec turns on are checked at start-up."""
    if not cfg.eval_generate_interval:
        if cfg.eval_generate_data is not None:
            return [f"--eval-generate-data {cfg.eval_generate_data} is answered only every --eval-generate-interval "
                    "N iterations; pass --eval-generate-interval (e.g. 500)"]
        return []
    why = "--eval-generate-interval answers with megatron-core's static generation, which "
    p: list[str] = []
    if cfg.cp > 1:
        p.append(f"{why}splits no sequence over context-parallel ranks; drop --eval-generate-interval at --cp "
                 f"{cfg.cp} (score an export with eval/evaluate.py)")
    if cfg.virtual_pipeline:
        p.append(f"{why}runs one model chunk per pipeline rank; drop --eval-generate-interval with virtual pipeline "
                 "stages (score an export with eval/evaluate.py)")
    if cfg.sequence_parallel:
        p.append(f"{why}does not run sequence-parallel layers; drop --sequence-parallel or --eval-generate-interval")
    if cfg.ep > 1 and cfg.tp > 1:
        p.append(f"{why}turns MoE layers to sequence parallelism at TP x EP (GPT models only); drop "
                 "--eval-generate-interval at --tp > 1 with --ep > 1")
    if cfg.precision == "fp16":
        p.append(f"{why}runs here in bf16 or fp32; use --precision bf16 (or drop --eval-generate-interval)")
    if cfg.fp8:
        p.append(f"{why}has not run on FP8 layers here; drop --fp8 or --eval-generate-interval (score an export "
                 "with eval/evaluate.py)")
    return p


def _check_packing(cfg: ConfigFields) -> list[str]:
    p: list[str] = []
    if not cfg.packing:
        if cfg.packed_seq_length is not None:
            p.append("--packed-seq-length only applies with --packing-buffer-size N (packing is on only with a "
                     "buffer of samples to pack from)")
        return p
    if cfg.micro_batch_size != 1:
        p.append(f"--micro-batch-size {cfg.micro_batch_size} with --packing-buffer-size: a micro batch is one packed "
                 "sequence; use --micro-batch-size 1 (more samples per step: a larger --packed-seq-length or "
                 "--global-batch-size)")
    if cfg.packed_seq_length < cfg.seq_length:
        p.append(f"--packed-seq-length {cfg.packed_seq_length} is below --seq-length {cfg.seq_length}: every "
                 f"sample (up to --seq-length) must fit in a pack; use --packed-seq-length {cfg.seq_length} or more")
    align = fp8_align_size(cfg.fp8_recipe) if cfg.fp8 else 1
    if cfg.sequence_parallel or cfg.cp > 1:
        align = math.lcm(align, length_multiple(cfg.cp, cfg.tp, bool(cfg.sequence_parallel)))
    if align > 1 and cfg.packed_seq_length % align:
        up = -(-cfg.packed_seq_length // align) * align
        why = "--cp" if cfg.cp > 1 else "--fp8" if cfg.fp8 else "--sequence-parallel"
        p.append(f"--packed-seq-length {cfg.packed_seq_length}: with {why} it must be a multiple of {align}; use "
                 f"--packed-seq-length {up}")
    return p


def _check_profile(cfg) -> list[str]:
    """Bad ``--profile*`` values (:mod:`megatron_vlm.training.profiling`), one line each."""
    if not cfg.profile:
        return []
    p = []
    a, b = cfg.profile_step_start, cfg.profile_step_end
    if a < 0:
        p.append(f"--profile-step-start {a}: must not be negative (the profile starts after iteration A)")
    if b <= a:
        p.append(f"--profile-step-end {b} with --profile-step-start {a}: the range records iterations A+1 to B; "
                 f"give B > A, e.g. --profile-step-end {a + 1}")
    elif cfg.train_iters is not None and b > cfg.train_iters:
        p.append(f"--profile-step-end {b}: the run ends at --train-iters {cfg.train_iters}; give B <= "
                 f"{cfg.train_iters}")
    world = getattr(cfg, "world_size", None)
    bad = [r for r in cfg.profile_ranks if r < 0 or (world is not None and r >= world)]
    if bad:
        p.append(f"--profile-ranks {','.join(map(str, cfg.profile_ranks))}: ranks run from 0 to "
                 f"{(world or 1) - 1}; drop {','.join(map(str, bad))}")
    return p

