"""Per-tensor gradients of one training step, the trainer's against HF's own, in HF's on-disk tensor names.

- :func:`capture` snapshots, at the trainer's optimizer step, this rank's gradient of every trained parameter
  (megatron-core's ``main_grad``: reduced over data-parallel ranks and divided by the global batch's loss tokens by
  ``finalize_model_grads``, before clipping) under the rank's local names, with the rank's parallel coordinates.
- :func:`assemble` puts the ranks' shards together into full tensors with the conversion's own mapping rules
  (pipeline stage, expert-parallel rank, tensor-parallel merge) and turns them into HF tensors with
  :func:`megatron_vlm.convert.mapping.to_hf`, as an export turns weights.
- :func:`hf_gradients` runs HF's model on the same global batch (the per-token objective of
  :mod:`megatron_vlm.testing.hf_reference`) and has HF's own ``save_pretrained`` write its gradients in place of
  its weights, so the names and layouts are HF's on-disk ones (experts one by one) without this module knowing how
  transformers holds them in memory. With ``aux_coeff``, a mixture-of-experts model's objective also holds the
  load-balancing term the trainer optimises (:mod:`megatron_vlm.training.moe`): megatron-core's switch loss,
  computed from the router logits of HF's own routers (captured by forward hooks) per micro batch and MoE layer,
  times the coefficient, averaged over micro batches and summed over layers.

:func:`compare` gives each tensor's difference relative to the norm of HF's gradient.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from megatron_vlm.spec import VLMSpec

IGNORE = -100


def capture(training) -> list:
    """Install the snapshot on ``training``'s optimizer: the returned list gets one entry per optimizer step,
    ``{local parameter name: gradient}`` of this rank's trained parameters."""
    steps: list = []
    step = training.optimizer.step

    def snapshot_then_step(*args, **kwargs):
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


def assemble(ranks: list[tuple[dict, dict]], spec: VLMSpec, tp: int, pp: int, layers: list[int], ep: int = 1,
             etp: int | None = None) -> dict[str, torch.Tensor]:
    """HF-named full gradients from ``ranks``: (coordinates, {local name: gradient}) of every rank of a world at
    ``tp``/``pp``/``ep``/``etp`` with ``layers`` language layers per stage. Tensors no rank trained are left out."""
    from megatron_vlm.convert import mapping

    etp = tp if etp is None else etp
    per_rank = spec.num_moe_experts // ep if spec.is_moe else None
    out = {}
    for rule in mapping.rules(spec):
        stage = mapping.stages_of(rule, spec, layers)[0]
        e = mapping.ep_rank_of(rule, spec, ep)
        name = mapping.local_name(rule, stage, layers, per_rank)
        shards = []
        for t in range(mapping.split_size(rule, tp, etp)):
            key = "etp" if rule.expert is not None else "tp"
            found = [g[name] for c, g in ranks if c["pp"] == stage and c[key] == t and (e is None or c["ep"] == e)
                     and name in g]
            shards.append(found[0] if found else None)
        if any(s is None for s in shards):
            continue
        full = mapping.tp_merge(rule, shards)
        out.update(zip(rule.hf, mapping.to_hf(rule, full, spec)))
    return out


def switch_loss(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """megatron-core's load-balancing (switch) loss of one micro batch at one MoE layer, from router ``logits``
    [tokens, experts]: ``E / (k T^2) * sum_i (sum_x p_xi) * count_i``, with ``p`` the softmax over all experts
    and ``count_i`` how many of the tokens' top-k choices are expert ``i``; no coefficient."""
    probs = torch.softmax(logits.float(), dim=-1)
    tokens, experts = logits.shape
    counts = torch.zeros(experts).index_add_(0, torch.topk(probs, topk, dim=-1).indices.reshape(-1),
                                             torch.ones(tokens * topk))
    return (probs.sum(0) * counts).sum() * experts / (topk * tokens * tokens)


def hf_gradients(hf_dir, global_batch: list, cfg, aux_coeff: float = 0.0,
                 micro_batch_size: int | None = None) -> dict:
    """HF's model on ``global_batch`` (encoded trainer samples) with the trainer's trained parts
    (``cfg.trained_parts``), fp32: ``{"loss": the per-token cross entropy of
    :func:`megatron_vlm.testing.hf_reference.train`, "aux": the load-balancing term (0 without ``aux_coeff``),
    "grads": {HF on-disk name: gradient of loss + aux}}``.

    With ``aux_coeff`` the samples run in micro batches of ``micro_batch_size`` (consecutive samples, as the
    trainer's jobs split a global batch), each as one HF batch: every sample of a micro batch must have the same
    length, so that the tokens HF routes are the trainer's (no padding)."""
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.hf_io import HFReader
    from megatron_vlm.convert.verify import load_hf_model
    from megatron_vlm.testing.hf_reference import hf_inputs, trained

    spec = VLMSpec.from_hf_dir(hf_dir)
    model = load_hf_model(hf_dir).train()
    for name, p in model.named_parameters():
        p.requires_grad_(trained(name, cfg.trained_parts))
    inputs = [hf_inputs(s, spec) for s in global_batch]
    n_total = sum(int((i["labels"] != IGNORE).sum()) for i in inputs)
    total = aux_total = 0.0
    if aux_coeff:
        routed: list = []
        hooks = [m.register_forward_hook(lambda mod, args, out: routed.append(out[0]))
                 for n, m in model.named_modules() if n.endswith((".mlp.gate", ".block_sparse_moe.gate"))]
        step = micro_batch_size or 1
        groups = [inputs[i:i + step] for i in range(0, len(inputs), step)]
        for group in groups:
            batch = {k: torch.cat([i[k] for i in group]) for k in group[0]}
            routed.clear()
            out = model(**batch)
            n = int((batch["labels"] != IGNORE).sum())
            # HF's input holds each sample's last token too (its labels are read from the inputs); the trainer's
            # rows stop before it (the token is only a label there): the router sees every position but that one
            rows = [r.reshape(len(group), -1, r.shape[-1])[:, :-1].reshape(-1, r.shape[-1]) for r in routed]
            aux = aux_coeff * sum(switch_loss(r, spec.moe_router_topk) for r in rows) / len(groups)
            (out.loss * (n / n_total) + aux).backward()
            total += out.loss.item() * n / n_total
            aux_total += float(aux.detach())
        for h in hooks:
            h.remove()
    else:
        for i in inputs:
            loss = model(**i).loss * (int((i["labels"] != IGNORE).sum()) / n_total)
            loss.backward()
            total += loss.item()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    with tempfile.TemporaryDirectory(prefix="hf-grads-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        names = HFReader(Path(tmp))
        grads = {mapping.canonical_hf_name(n): names.get(n).clone() for n in names.names()}
    return {"loss": total, "aux": aux_total, "grads": grads}


def compare(trainer: dict[str, torch.Tensor], hf: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per HF tensor the trainer computed: ``|trainer - hf| / |hf|`` (absolute where HF's gradient is zero, e.g. an
    expert no token reached in either)."""
    out = {}
    for name, g in trainer.items():
        ref = hf[name].to(g.dtype)
        diff = float((g - ref).norm())
        scale = float(ref.norm())
        out[name] = diff / scale if scale > 0 else diff
    return out
