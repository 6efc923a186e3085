"""The one per-tensor gradient reference: the trainer's gradient of every trained tensor against HF's, in HF's
on-disk tensor names, at any TP / PP / DP / EP / ETP layout.

Three steps, each one function:

1. :func:`capture` (on every rank of a training job, before its first step) snapshots, at each optimizer step, this
   rank's gradient of every trained parameter: megatron-core's ``main_grad``, reduced over data-parallel ranks
   (the expert parameters over the expert-data-parallel ranks) and divided by the global batch's loss tokens by
   ``finalize_model_grads``, before clipping. With the distributed optimizer each DP rank holds only its shard of a
   bucket reduced, so the shards are gathered first. :func:`coordinates` gives the rank's place in the layout.
   :func:`tests.support.train_jobs.train_jobs` does both for a job with ``grads=True`` and returns every
   rank's ``(coordinates, {local name: gradient})`` of the first step as ``"grads"`` and the job's layout as
   ``"layout"``.
2. :func:`assemble` puts the ranks' shards together into full tensors with the conversion's own mapping rules
   (pipeline stage, expert-parallel rank, tensor-parallel merge; each expert under its local index) and turns them
   into HF tensors with :func:`megatron_vlm.convert.mapping.to_hf`, as an export turns weights. A tensor that some
   rank trained but whose other shards are missing is an error (it names the tensor), never left out.
3. :func:`compare` gives each tensor's difference relative to the norm of HF's gradient, where HF's gradients come
   from :func:`tests.support.hf_reference.train` with ``grads=True`` (HF's own model, loss and, for a
   mixture-of-experts model, HF's own ``load_balancing_loss_func``; the names are those HF's ``save_pretrained``
   writes, of the parameters the stage trains: :func:`saved_gradients`). It covers every tensor: a tensor HF trains
   that the trainer's side lacks (a tensor no rank returned, which :func:`assemble` cannot tell from a frozen one)
   fails the comparison naming it, and so does one the trainer returned that HF does not train. Only a tensor whose
   HF gradient is exactly zero may be absent: a parameter HF's loss never reaches (the CLIP layers after
   ``vision_feature_layer``, SigLIP's head), which the Megatron model does not hold.

A test therefore reads::

    ref = hf_reference.train(hf_dir, batches, cfg, steps=1, grads=True)
    mine = grad_reference.assemble(result["grads"], spec, **result["layout"])
    worst = max(grad_reference.compare(mine, ref["grads"]).values())
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from megatron_vlm.model.spec import VLMSpec


class MissingShard(ValueError):
    """A trained tensor whose shards did not all come back from the ranks."""


class MissingGradient(ValueError):
    """Tensors HF trains (with a gradient) that the trainer's gradients do not hold: left out of a comparison."""


def _gather_distributed_optimizer_shards(ddp) -> None:
    """With the distributed optimizer, each DP rank reduced only its shard of each bucket: gather the shards in
    place over each buffer's own data-parallel group (the expert buffers' is the expert-data-parallel group)."""
    if not ddp.ddp_config.use_distributed_optimizer:
        return
    for buffer in [*ddp.buffers, *getattr(ddp, "expert_parallel_buffers", [])]:
        group = buffer.data_parallel_group
        size = group.size()
        if size == 1:
            continue
        rank = torch.distributed.get_rank(group)
        for bucket in buffer.buckets:
            shards = list(bucket.grad_data.chunk(size))
            mine = shards[rank].clone()
            torch.distributed.all_gather(shards, mine, group=group)  # the chunks are views: gathered in place


def capture(training) -> list:
    """Install the snapshot on ``training``'s optimizer: the returned list gets one entry per optimizer step,
    ``{local parameter name: gradient}`` of this rank's trained parameters (float32 copies)."""
    steps: list = []
    step = training.optimizer.step

    def snapshot_then_step(*args, **kwargs):
        _gather_distributed_optimizer_shards(training.ddp)
        steps.append({n: p.main_grad.detach().float().clone() for n, p in training.model.named_parameters()
                      if p.requires_grad and getattr(p, "main_grad", None) is not None})
        return step(*args, **kwargs)

    training.optimizer.step = snapshot_then_step
    return steps


def coordinates() -> dict:
    """This rank's parallel coordinates (tensor, pipeline, expert, expert-tensor and data parallel ranks)."""
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank(),
                dp=ps.get_data_parallel_rank())


def assemble(ranks: list[tuple[dict, dict]], spec: VLMSpec, tp: int = 1, pp: int = 1, layers: list[int] | None = None,
             ep: int = 1, etp: int | None = None) -> dict[str, torch.Tensor]:
    """HF-named full gradients from ``ranks``: (coordinates, {local name: gradient}) of every rank of a world at
    ``tp``/``pp``/``ep``/``etp`` (expert TP, default ``tp``) with ``layers`` language layers per stage. Tensors no
    rank returned are left out (frozen parts, or a trained tensor that went missing: :func:`compare` tells them
    apart against HF's trained tensors); a tensor with some of its shards missing raises :class:`MissingShard`."""
    from megatron_vlm.convert import mapping

    layers = layers or spec.check_parallelism(tp, pp)
    per_rank = spec.num_moe_experts // ep if spec.is_moe else None
    out = {}
    for rule in mapping.rules(spec):
        stage = mapping.stages_of(rule, spec, layers)[0]
        e = mapping.ep_rank_of(rule, spec, ep)
        name = mapping.local_name(rule, stage, layers, per_rank)
        key = "etp" if rule.expert is not None else "tp"
        shards = []
        for t in range(mapping.split_size(rule, tp, etp)):
            found = [g[name] for c, g in ranks if c["pp"] == stage and c[key] == t and (e is None or c["ep"] == e)
                     and name in g]
            shards.append(found[0] if found else None)
        if all(s is None for s in shards):
            continue
        if any(s is None for s in shards):
            missing = [t for t, s in enumerate(shards) if s is None]
            raise MissingShard(f"{rule.hf[0]} ({name} on stage {stage}{'' if e is None else f', EP rank {e}'}): no "
                               f"rank returned its {key.upper()} shard(s) {missing} of {len(shards)}")
        full = mapping.tp_merge(rule, shards)
        out.update(zip(rule.hf, mapping.to_hf(rule, full, spec)))
    return out


def saved_gradients(model) -> dict[str, torch.Tensor]:
    """The gradients of an HF model's trained parameters (``requires_grad``) after its backward, under the names and
    layouts HF's ``save_pretrained`` writes (each expert apart, whatever transformers fuses in memory): HF writes them
    in place of its weights. A trained parameter without a gradient (one the loss did not reach) gives zeros; a
    frozen one is left out (it is written as NaNs, which no gradient is, and dropped). The model's weights are
    restored afterwards."""
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.hf_io import HFReader

    weights = {}
    with torch.no_grad():
        for p in model.parameters():
            weights[p] = p.data
            if not p.requires_grad:
                p.data = torch.full_like(p, float("nan"))
            else:
                p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        with tempfile.TemporaryDirectory(prefix="hf-grads-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            names = HFReader(Path(tmp))
            arch = getattr(model.config, "model_type", None)  # Qwen2.5-VL's names have their own canonical form
            out = {mapping.canonical_hf_name(n, arch): names.get(n).clone() for n in names.names()}
            return {n: g for n, g in out.items() if not (g.is_floating_point() and bool(g.isnan().all()))}
    finally:
        with torch.no_grad():
            for p, w in weights.items():
                p.data = w


def compare(trainer: dict[str, torch.Tensor], hf: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per HF tensor: ``|trainer - hf| / |hf|`` (absolute where HF's gradient is zero, e.g. an expert no token
    reached in either), for every tensor HF trains. ``hf``: HF's gradients of its trained tensors
    (:func:`saved_gradients`). A tensor the trainer returned that HF does not train is an error (KeyError), and so
    is a tensor HF trains that the trainer's side lacks (:class:`MissingGradient`, naming them), unless HF's
    gradient of it is exactly zero (a parameter HF's loss never reaches, which the Megatron model does not hold)."""
    missing = sorted(n for n, g in hf.items() if n not in trainer and bool(g.ne(0).any()))
    if missing:
        raise MissingGradient(
            f"{len(missing)} of the {len(hf)} tensors HF trains have no gradient on the trainer's side (no rank "
            f"returned them, or the trainer froze them): {', '.join(missing[:8])}"
            + (", ..." if len(missing) > 8 else ""))
    out = {}
    for name, g in trainer.items():
        if name not in hf:
            raise KeyError(f"the trainer returned a gradient for {name}, which HF's model does not have or does not "
                           "train")
        ref = hf[name].to(g.dtype)
        diff = float((g - ref).norm())
        scale = float(ref.norm())
        out[name] = diff / scale if scale > 0 else diff
    return out


def relative(a: float, b: float) -> float:
    """``|a - b| / |b|``: a number of the trainer against HF's ``b``."""
    return abs(a - b) / abs(b)


def assert_steps_match(run: dict, ref: dict, rtol: float, norm_rtol: float) -> None:
    """A training job's losses and gradient norms (``run``) against HF's on the same batches (``ref``,
    :func:`tests.support.hf_reference.train`): every loss and the first gradient norm within ``rtol``; the later norms,
    which carry the fp32 rounding of megatron-core's per-tensor norm sums through the clipped AdamW updates, within
    ``norm_rtol``."""
    assert all(relative(a, b) <= rtol for a, b in zip(run["loss"], ref["loss"], strict=True)), (run["loss"],
                                                                                               ref["loss"])
    norms = [relative(a, b) for a, b in zip(run["grad_norm"], ref["grad_norm"], strict=True)]
    assert norms[0] <= rtol and max(norms) <= norm_rtol, (run["grad_norm"], ref["grad_norm"])
