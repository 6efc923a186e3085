"""Per-rank jobs of the Transformer Engine tests (tests/test_te.py), run in a local CPU world
(:func:`megatron_vlm.runtime.spawn.run_world`).

They build models with real Transformer Engine (TE) modules on CPU (the CPU shim
:func:`megatron_vlm.runtime.cpu_compat.te_construction`, around each build) and check what a GPU user's first steps do
before any kernel runs: the layer classes and their settings, converted checkpoints loading into TE layers (compared
with the local layers through megatron's sharded keys), checkpoints saved from TE layers, the FP8 recipe objects and the
trainer's set-up (mixed precision, DDP, distributed optimizer). TE's kernels cannot run here, so no forward.

Each job re-initialises megatron's parallel groups, so one 2-process world covers TP=1 (DP=2), TP=2 and PP=2.
Results are plain Python data, gathered on rank 0 (see each function).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.model.spec import VLMSpec

#: A GPU on which every FP8 recipe runs (B200: sm_100, CUDA 13.0): what fp8.check_recipe_runs would find there.
FP8_GPU = ((10, 0), "13.0", "GPU 0 (B200, as the tests assume)")


def _gather(obj) -> list:
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _class(module) -> str:
    return f"{type(module).__module__.split('.')[0]}.{type(module).__name__}"


# ---- what a model holds ----------------------------------------------------------------------------------------
def sharded_entries(model):
    """(tensors, objects): this rank's ShardedTensors as {(key, global offset): tensor} (factories applied, so a
    SwiGLU ``linear_fc1`` is its two halves) and the keys of its ShardedObjects (``_extra_state``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sharded = ckpt.model_sharded_state_dict(model)
    apply_factories(sharded)
    tensors, objects = {}, set()
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            tensors[(sh.key, tuple(sh.global_offset))] = sh.data
        elif isinstance(sh, ShardedObject):
            objects.add(sh.key)
    return tensors, objects


def compare_models(te_model, local_model) -> dict:
    """This rank's TE model against its local-layer model, through the sharded (checkpoint) keys: keys only one
    side has, tensors that differ (compared in the TE tensor's dtype: megatron's local norms are fp32 whatever the
    model's dtype, TE's are in it), tensors whose dtypes differ, TE parameters no sharded tensor covers."""
    te_t, te_o = sharded_entries(te_model)
    lo_t, lo_o = sharded_entries(local_model)
    both = set(te_t) & set(lo_t)
    covered = {t.untyped_storage().data_ptr() for t in te_t.values()}
    return dict(
        tensors=len(te_t),
        te_only_tensors=sorted(k for k, _ in set(te_t) - set(lo_t)),
        local_only_tensors=sorted(k for k, _ in set(lo_t) - set(te_t)),
        te_only_objects=sorted(te_o - lo_o),
        local_only_objects=sorted(lo_o - te_o),
        different=sorted(k for k, o in both if not torch.equal(te_t[k, o], lo_t[k, o].to(te_t[k, o].dtype))),
        dtypes_differ=sorted({(k, str(te_t[k, o].dtype), str(lo_t[k, o].dtype)) for k, o in both
                              if te_t[k, o].dtype != lo_t[k, o].dtype}),
        uncovered_params=sorted(n for n, p in te_model.named_parameters()
                                if p.untyped_storage().data_ptr() not in covered),
    )


def te_modules(model) -> dict:
    """What each role of the first layer of the language model and the ViT is (``package.Class``), with the
    settings that decide numerics: norm type and epsilon, attention mask, sequence parallelism; the final norm,
    the ViT's ln_pre and the projector. Roles a pipeline stage lacks are absent."""
    out = {}
    parts = [("language", getattr(model, "language_model", None)), ("vision", getattr(model, "vision_model", None))]
    for part, sub in parts:
        if sub is None or len(sub.decoder.layers) == 0:
            continue
        layer = sub.decoder.layers[0]
        attn, mlp = layer.self_attention, layer.mlp
        mlp_roles = (("experts", mlp.experts), ("router", mlp.router)) if hasattr(mlp, "experts") else \
            (("linear_fc1", mlp.linear_fc1), ("linear_fc2", mlp.linear_fc2))
        for role, m in (("linear_qkv", attn.linear_qkv), ("core_attention", attn.core_attention),
                        ("linear_proj", attn.linear_proj), *mlp_roles, ("input_layernorm", layer.input_layernorm),
                        ("pre_mlp_layernorm", layer.pre_mlp_layernorm)):
            info = {"class": _class(m)}
            for attr in ("normalization", "eps", "sequence_parallel", "attn_mask_type", "num_gqa_groups",
                         "deterministic"):
                if hasattr(m, attr):
                    v = getattr(m, attr)
                    info[attr] = v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
            out[f"{part}.{role}"] = info
        final = getattr(sub.decoder, "final_layernorm", None)
        if final is not None:
            out[f"{part}.final_layernorm"] = {"class": _class(final), "eps": getattr(final, "eps", None)}
    vit = getattr(model, "vision_model", None)
    if vit is not None:
        for name in ("ln_pre", "ln_post"):
            norm = getattr(vit, name, None)
            out[f"vision.{name}"] = None if norm is None else {"class": _class(norm)}
    proj = getattr(model, "vision_projection", None)
    if proj is not None:
        out["projector.linear_fc1"] = {"class": _class(proj.encoder.linear_fc1)}
        out["projector.linear_fc2"] = {"class": _class(proj.encoder.linear_fc2)}
    return out


# ---- checkpoints ------------------------------------------------------------------------------------------------
def _finish_checkpoint(src_iter_dir, run_dir: Path, fmt: str, tp: int, pp: int, spec: VLMSpec, ep: int = 1,
                       etp: int | None = None) -> None:
    """Side files, meta, spec, tokenizer and tracker of a checkpoint whose weights were just written (rank 0)."""
    it = run_dir / "release"
    meta = ckpt.CheckpointMeta.load(src_iter_dir)
    ckpt.copy_side_files(src_iter_dir, it)
    ckpt.CheckpointMeta(fmt, tp, pp, spec.check_parallelism(tp, pp), "release", meta.dtype, ep=ep, etp=etp).save(it)
    spec.save(run_dir)
    ckpt.copy_tokenizer(Path(src_iter_dir).parent / ckpt.TOKENIZER_DIR, run_dir)
    ckpt.write_tracker(run_dir, "release")


def save_te_checkpoint(te_model, src_iter_dir, run_dir, fmt: str) -> Path:
    """Save ``te_model`` (with TE's ``_extra_state``) as a complete checkpoint in ``run_dir``: torch_dist through
    dist_checkpointing, or legacy ``torch`` as Megatron-LM writes it (each rank's ``model.state_dict()``)."""
    from megatron.core import parallel_state as ps

    run_dir = Path(run_dir)
    it = run_dir / "release"
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if fmt == "torch_dist":
        ckpt.save_model_weights(te_model, it)
    elif ps.get_expert_data_parallel_rank() == 0:  # one file per (TP, PP, EP) rank, as Megatron-LM writes
        ckpt.save_legacy_rank(it, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), pp,
                              te_model.state_dict(), "release", ep_rank=ps.get_expert_model_parallel_rank(), ep=ep)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        _finish_checkpoint(src_iter_dir, run_dir, fmt, tp, pp, VLMSpec.load(src_iter_dir), ep, etp)
    torch.distributed.barrier()
    return it


# ---- the layout jobs ---------------------------------------------------------------------------------------------
def layout_job(job: dict) -> dict:
    """Build the TE model of ``job`` and check it against the local layers; returns this rank's report.

    Job keys: ``name``, ``megatron_dir`` (a checkpoint converted from HF: local layout), ``tp``, ``pp``, and
    optionally ``ep`` (a mixture-of-experts model: TE's experts are TEGroupedMLP, the local ones SequentialMLP),
    ``sequence_parallel``, ``fp8_recipe`` (the trainer's FP8 settings, as on a GPU that runs every
    recipe) and ``save`` ({format: run dir}: save the TE model there, then load that into local layers).
    """
    from megatron.core import parallel_state as ps

    from megatron_vlm.model import fp8, layer_impl
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime import distributed

    distributed.setup(job["tp"], job["pp"], device="cpu", ep=job.get("ep", 1))
    iter_dir = ckpt.resolve_iteration_dir(job["megatron_dir"])
    spec = VLMSpec.load(iter_dir)
    opts = ModelOptions(tp=job["tp"], pp=job["pp"], seq_length=64, perform_initialization=False, ep=job.get("ep", 1))
    te_opts = dataclasses.replace(opts, use_te=True, sequence_parallel=job.get("sequence_parallel", False))
    report: dict = {"rank": torch.distributed.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                    "pp_rank": ps.get_pipeline_model_parallel_rank()}
    if job.get("fp8_recipe"):
        te_opts = dataclasses.replace(te_opts, params_dtype=torch.bfloat16, bf16=True, fp8=True,
                                      fp8_recipe=job["fp8_recipe"], fp8_format=job.get("fp8_format", "hybrid"))
        opts = dataclasses.replace(opts, params_dtype=torch.bfloat16, bf16=True)
        real_check = fp8.check_recipe_runs
        cap, cuda, gpu = FP8_GPU

        def check_on_gpu(recipe):  # the GPU query cannot run here: answer it for FP8_GPU
            problem = fp8.recipe_problem(recipe, cap, cuda, gpu)
            if problem:
                raise ValueError(problem)

        fp8.check_recipe_runs = check_on_gpu
        try:
            te = build_model(spec, te_opts)
        finally:
            fp8.check_recipe_runs = real_check
        report["fp8"] = fp8_context_report(te)
    else:
        te = build_model(spec, te_opts)
    report["modules"] = te_modules(te)
    te_keys = {getattr(v, "key", None) for v in ckpt.model_sharded_state_dict(te).values()} - {None}
    all_te_keys = set().union(*_gather(te_keys))
    have = layer_impl.checkpoint_keys(iter_dir)
    report["keys_absent_from_checkpoint"] = sorted(all_te_keys - have)
    report["checkpoint_keys_not_loaded"] = layer_impl.unexpected_keys(all_te_keys, have,
                                                                      {k.split(".", 1)[0] for k in all_te_keys})
    ckpt.load_model_weights(te, iter_dir)  # strict: every tensor of the TE model from the checkpoint
    local = build_model(spec, opts)
    ckpt.load_model_weights(local, iter_dir)
    report["compare"] = compare_models(te, local)
    report["te_modules_in_local_model"] = sorted({_class(m) for m in local.modules()
                                                   if type(m).__module__.startswith("transformer_engine")})
    report["saved"] = {}
    for fmt, run_dir in (job.get("save") or {}).items():
        out = save_te_checkpoint(te, iter_dir, run_dir, fmt)
        keys = layer_impl.checkpoint_keys(out) if fmt == "torch_dist" else None
        back = build_model(spec, opts)
        ckpt.load_model_weights(back, out)  # TE-written (with _extra_state) -> local layers
        report["saved"][fmt] = dict(extra_state_keys=None if keys is None else sorted(
            k for k in keys if layer_impl.is_extra_state(k)), compare=compare_models(back, local))
        if fmt == "torch":
            state = ckpt.load_legacy_rank(out, ps.get_tensor_model_parallel_rank(),
                                          ps.get_pipeline_model_parallel_rank(), job["pp"],
                                          ep_rank=ps.get_expert_model_parallel_rank(), ep=job.get("ep", 1))["model"]
            report["saved"][fmt]["grouped_expert_keys"] = sorted(k for k in state if ".mlp.experts.linear_fc" in k)
            report["saved"][fmt]["extra_state_keys"] = sorted(k for k in state if layer_impl.is_extra_state(k))
        del back
    return report


def fp8_context_report(model) -> dict:
    """The FP8 context megatron-core's TransformerBlock enters before the first layer's forward (built here, not
    entered: entering it asks the GPU), for the language model and the ViT."""
    from megatron.core.fp8_utils import get_fp8_context, get_fp8_recipe

    out = {}
    for part in ("language_model", "vision_model"):
        sub = getattr(model, part, None)
        if sub is None:
            continue
        cfg = sub.config
        context = get_fp8_context(cfg)  # what TransformerBlock.forward enters
        recipe = get_fp8_recipe(cfg) if cfg.fp8 else None  # the recipe that context carries
        out[part] = dict(
            config=dict(fp8=cfg.fp8, fp8_recipe=str(getattr(cfg.fp8_recipe, "value", cfg.fp8_recipe)),
                        amax_history_len=cfg.fp8_amax_history_len, amax_compute_algo=cfg.fp8_amax_compute_algo),
            context=type(context).__name__,
            recipe=None if recipe is None else [c.__name__ for c in type(recipe).__mro__],
            fp8_format=None if recipe is None else str(recipe.fp8_format),
            amax_history_len=getattr(recipe, "amax_history_len", None),
            amax_compute_algo=getattr(recipe, "amax_compute_algo", None),
        )
    return out


# ---- the trainer's set-up ----------------------------------------------------------------------------------------
def _param_keys(model) -> dict[int, str]:
    """id(parameter) -> its checkpoint key (the sharded state dict's, before factories)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    out = {}
    for sh in nested_values(ckpt.model_sharded_state_dict(model)):
        data = getattr(sh, "data", None)
        if isinstance(data, torch.nn.Parameter) and hasattr(sh, "key"):
            out[id(data)] = sh.key
    return out


def optimizer_report(training) -> dict:
    """The optimizer's parameter groups (their settings and the checkpoint keys of their parameters) and the
    frozen parameters, by checkpoint key; the wrappers' classes (collective over the data-parallel group)."""
    from megatron.core import parallel_state as ps

    keys = _param_keys(training.model)
    named = dict(training.model.named_parameters())
    missing = sorted(n for n, p in named.items() if id(p) not in keys)
    opt = training.optimizer
    parts = getattr(opt, "chained_optimizers", [opt])
    names = {id(p): n for n, p in named.items()}
    groups = []
    for part in parts:
        index = getattr(part, "model_param_group_index_map", None)
        if index is None:
            raise TypeError(f"expected megatron's DistributedOptimizer, got {type(part).__name__}")
        mine: dict[int, set[str]] = {}  # this DP rank's shard of each group; the union over DP is the group
        for p, (g, _) in index.items():
            mine.setdefault(g, set()).add(names[id(p)])
        shards: list = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(shards, mine, group=ps.get_data_parallel_group())
        for g, group in enumerate(part.optimizer.param_groups):
            members = set().union(*(shard.get(g, set()) for shard in shards))
            settings = {k: v for k, v in group.items() if k in ("wd_mult", "lr_mult", "weight_decay",
                                                              "is_decoupled_lr", "is_expert_parallel")}
            groups.append((tuple(sorted(keys[id(named[n])] for n in members)), tuple(sorted(settings.items()))))
    ddp = training.ddp
    return dict(
        impl=training.impl,
        wrappers=[type(ddp).__name__, type(ddp.module).__name__],
        optimizer=[type(p).__name__ for p in parts],
        groups=sorted(groups),
        frozen=sorted(keys[id(p)] for p in named.values() if not p.requires_grad),
        trainable=sorted(keys[id(p)] for p in named.values() if p.requires_grad),
        params_without_key=missing,
        dtypes=sorted({str(p.dtype) for p in named.values()}),
    )


def trainer_job(job: dict, megatron_dir, hf_dir) -> dict:
    """The trainer's set-up (:func:`megatron_vlm.training.build.build_training`) for one TrainConfig, stopped
    before the first forward; returns this rank's :func:`optimizer_report`.

    Job keys: TrainConfig fields, plus ``name`` and ``step`` (run one training step; local layers only: TE's
    kernels cannot run here) and ``packing_samples`` (with packing: encode that many samples, pack them and return
    the PackedSeqParams the training step would pass to TE attention, as every TP rank receives them).
    A TE job says ``device='cuda'``, as a GPU user's config does; the world itself runs on CPU.
    """
    from megatron_vlm.runtime import distributed
    from megatron_vlm.training.build import build_training, release
    from megatron_vlm.training.config import TrainConfig

    fields = {k: v for k, v in job.items() if k not in ("name", "step", "packing_samples")}
    base = dict(seq_length=96, precision="bf16", dist_optim=True, global_batch_size=2, micro_batch_size=1,
                train_iters=2, lr=2e-2, min_lr=0.0, lr_warmup_fraction=0.0, lr_decay_style="constant",
                clip_grad=1.0, deterministic=True, gpus=int(os.environ["WORLD_SIZE"]))  # set by run_world
    cfg = TrainConfig(**{**base, **fields})
    rt = distributed.setup(cfg.tp, cfg.pp, device="cpu", seed=cfg.seed)
    iter_dir = ckpt.resolve_iteration_dir(megatron_dir)
    spec = VLMSpec.load(iter_dir)
    training = build_training(cfg, spec, init_from=iter_dir)
    report = optimizer_report(training)
    report["sequence_parallel"] = bool(training.config.sequence_parallel)
    report["deterministic_attention"] = sorted({getattr(m, "deterministic", None) for n, m in
                                                training.model.named_modules()
                                                if n.endswith("self_attention.core_attention")}, key=str)
    report["attention"] = sorted({_class(m) for n, m in training.model.named_modules()
                                  if n.endswith("self_attention.core_attention")})
    # gradient-accumulation fusion (issue 63): TE's linears fused (fuse_wgrad_accumulation), megatron's own
    # linears (the output layer) as their gradient_accumulation_fusion says
    report["wgrad_fusion"] = sorted({(_class(m), bool(getattr(m, "fuse_wgrad_accumulation",
                                                              getattr(m, "gradient_accumulation_fusion", False))))
                                     for m in training.model.modules()
                                     if hasattr(m, "fuse_wgrad_accumulation") or
                                     hasattr(m, "gradient_accumulation_fusion")})
    if job.get("packing_samples"):
        report["packing"] = _packing_report(cfg, spec, hf_dir, job["packing_samples"], training, rt)
    if job.get("step"):
        report["step"] = _one_step(cfg, training, hf_dir, rt)
    release(training)
    del training
    return report


def _packing_report(cfg, spec, hf_dir, n: int, training, rt) -> dict:
    from megatron_vlm.data.packing import PackingTaskEncoder, packed_seq_params
    from tests.support.packing_check import _samples
    from megatron_vlm.training import batch_feed

    batch = None
    if batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp):
        enc = PackingTaskEncoder(hf_dir, cfg.seq_length, image_token_id=spec.image_token_id, spec=spec,
                                 packed_seq_length=cfg.packed_seq_length)
        samples = _samples(enc, n)
        (group,) = enc.select_samples_to_pack(samples)
        batch = enc.batch([enc.pack_selected_samples(group)])
    (got,) = batch_feed.distribute([batch], rt.device)
    params = packed_seq_params(got.cu_seqlens, got.max_seqlen)  # what step.forward_step passes the model
    attn = next(m for n, m in training.model.named_modules() if n.endswith("self_attention.core_attention"))
    kept = sorted(getattr(attn, "kept_packed_seq_params", ()))
    return dict(qkv_format=params.qkv_format, cu_seqlens_q=params.cu_seqlens_q.tolist(),
                cu_seqlens_kv=params.cu_seqlens_kv.tolist(), dtype=str(params.cu_seqlens_q.dtype),
                max_seqlen_q=params.max_seqlen_q, max_seqlen_kv=params.max_seqlen_kv,
                tokens=int(got.tokens.shape[1]), num_tokens=int(got.num_tokens),
                lm_seq_length=training.model.language_model.max_sequence_length
                if hasattr(training.model.language_model, "max_sequence_length") else None,
                attention_kept_params=kept)


def _one_step(cfg, training, hf_dir, rt) -> dict:
    """One training step of local layers on CPU, with megatron-core picking its kernels as it does with TE
    installed: loss and grad norm, and how many trainable / frozen parameters changed."""
    from tests.support.train_jobs import micro_batches, variable_length_batches
    from megatron_vlm.data.task_encoder import VLMTaskEncoder
    from megatron_vlm.training import batch_feed
    from megatron_vlm.training.step import train_step

    before = {n: p.detach().float().clone() for n, p in training.model.named_parameters()}
    enc = VLMTaskEncoder(hf_dir, 96)
    (gb,) = variable_length_batches(hf_dir, 1, size=cfg.global_batch_size)
    reads = batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp)
    mine = micro_batches(enc.batch, gb, rt.dp, rt.dp_rank, cfg.micro_batch_size) if reads else \
        [None] * cfg.grad_accum
    r = train_step(training, batch_feed.distribute(mine, rt.device), cfg, rt.device)
    changed = {n: not torch.equal(before[n], p.detach().float()) for n, p in training.model.named_parameters()}
    trainable = {n for n, p in training.model.named_parameters() if p.requires_grad}
    return dict(loss=r.loss, grad_norm=r.grad_norm, optimizer=[type(o).__name__ for o in
                                                                _torch_optimizers(training.optimizer)],
                trainable_changed=sum(changed[n] for n in trainable), trainable=len(trainable),
                frozen_changed=sum(v for n, v in changed.items() if n not in trainable),
                finite=math.isfinite(r.loss) and math.isfinite(r.grad_norm))


def _torch_optimizers(opt) -> list:
    return [p.optimizer for p in getattr(opt, "chained_optimizers", [opt])]


# ---- the world -------------------------------------------------------------------------------------------------
def run(layout_jobs: list[dict], trainer_jobs: list[dict], megatron_dir, hf_dir) -> dict | None:
    """Every job of one world: {'layouts': {name: [report per rank]}, 'trainer': {name: [report per rank]}}
    on rank 0 (None elsewhere). The TE modules are constructed through the CPU shim (by build_model)."""
    out: dict = {"layouts": {}, "trainer": {}}
    for job in layout_jobs:
        out["layouts"][job["name"]] = _gather(layout_job(job))
    for job in trainer_jobs:
        out["trainer"][job["name"]] = _gather(trainer_job(job, megatron_dir, hf_dir))
    return out if torch.distributed.get_rank() == 0 else None
