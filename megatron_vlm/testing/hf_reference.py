"""The outside reference for the trainer: HF's own model, loss and an AdamW loop on the trainer's batches.

The trainer's samples (``VLMSample`` / ``AnyresSample``: Megatron tokens with one token per image or video,
labels shifted by one, a loss mask) are turned into what HF ``LlavaForConditionalGeneration`` /
``LlavaOnevisionForConditionalGeneration`` take: every image/video token expanded to its count, and ``labels``
that are -100 except at the positions whose token the trainer's loss predicts. HF's forward with ``labels``
computes its own (shifted, mean) cross entropy over the true vocabulary; a global batch's loss is the sum of
each sample's HF loss times its label count, over the global batch's label count - the per-token objective the
trainer normalises over the whole global batch (:mod:`megatron_vlm.training.step`).

:func:`train` runs ``steps`` global batches through HF with ``torch.optim.AdamW`` and gradient-norm clipping set as
the trainer's optimizer is (:func:`megatron_vlm.training.build.optimizer_config`: learning rate, betas, eps, weight
decay; weight decay only on the tensors megatron-core decays, not on biases and norms), and returns the loss and the
gradient norm (before clipping, over the trained parameters) of every step, to be compared with the trainer's
logged numbers; with ``grads=True`` also the first step's gradient of every trained tensor in Megatron's layout
(:func:`mcore_grads`), to be compared tensor by tensor.
"""

from __future__ import annotations

import math

import torch

from megatron_vlm.spec import VLMSpec

IGNORE = -100


def hf_inputs(sample, spec: VLMSpec) -> dict:
    """HF forward inputs (with ``labels``) of one encoded trainer sample."""
    x = torch.cat([sample.tokens, sample.labels[-1:]]).tolist()  # the full sequence the sample was cut from
    media = {spec.image_token_id, *([spec.video_token_id] if spec.video_token_id is not None else [])}
    anyres = hasattr(sample, "num_image_tokens")
    counts = sample.num_image_tokens.tolist() if anyres else [spec.num_image_tokens] * x.count(spec.image_token_id)
    if hasattr(sample, "num_image_tiles") and not anyres:  # InternVL: a tile's tokens x the image's (frame's) tiles
        counts = [spec.num_image_tokens * int(n) for n in sample.num_image_tiles]
    ids, start, k = [], [], 0  # start[i]: HF position of x[i]
    for t in x:
        start.append(len(ids))
        if t in media:
            ids += [t] * counts[k]
            k += 1
        else:
            ids.append(t)
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(sample.loss_mask.tolist()):
        if m:  # position i predicts x[i + 1]; HF's loss reads it from labels at x[i + 1]'s position
            labels[start[i + 1]] = x[i + 1]
    out = dict(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
    if not anyres:
        if len(sample.images):
            out["pixel_values"] = sample.images
        return out
    tiles = [0] + sample.num_image_tiles.cumsum(0).tolist()
    items = [t for t in x if t in media]
    for j, t in enumerate(items):
        rows = sample.images[tiles[j]:tiles[j + 1]][None]
        if t == spec.video_token_id:
            out["pixel_values_videos"] = rows
        else:
            out.update(pixel_values=rows, image_sizes=sample.image_sizes[j:j + 1])
    if sum(1 for t in items if t != spec.video_token_id) > 1 or sum(1 for t in items if t == spec.video_token_id) > 1:
        raise ValueError("the HF reference takes at most one image and one video per sample")
    return out


def decays(name: str, param: torch.Tensor, spec: VLMSpec) -> bool:
    """Whether megatron-core's optimizer applies weight decay to HF tensor ``name``: not to biases and
    one-dimensional tensors (norms, ``image_newline``; its default without ``apply_wd_to_qk_layernorm``), judged on
    the Megatron tensor it becomes (HF's 1-D CLIP class embedding is Megatron's 3-D ``class_token``)."""
    from megatron_vlm.convert import mapping

    rule = next((r for r in mapping.rules(spec) if name in r.hf), None)
    if rule is None:  # a tensor Megatron does not hold: it trains nowhere
        return param.dim() > 1 and not name.endswith(".bias")
    if rule.kind == "class_token":
        return True
    return param.dim() > 1 and not rule.mcore.endswith(".bias")


def mcore_grads(hf_grads: dict[str, torch.Tensor], spec: VLMSpec) -> dict[str, torch.Tensor]:
    """Gradients by HF name -> full Megatron tensors by their global name (every rule whose HF tensors all have
    one; the TP/PP shards of a rank come from :func:`megatron_vlm.convert.mapping.tp_shard` and ``local_name``)."""
    from megatron_vlm.convert import mapping

    return {rule.mcore: mapping.to_mcore(rule, [hf_grads[h] for h in rule.hf], spec)
            for rule in mapping.rules(spec) if all(h in hf_grads for h in rule.hf)}


def trained(name: str, parts: dict) -> bool:
    """Whether HF parameter ``name`` trains, given the trainer's ``cfg.trained_parts``."""
    if "vision_tower" in name:
        return parts["vision"]
    if "multi_modal_projector" in name or "image_newline" in name:
        return parts["projector"]
    return parts["language"]


def train(hf_dir, global_batches: list[list], cfg, steps: int | None = None, grads: bool = False,
          decay_everything: bool = False) -> dict:
    """HF losses and gradient norms of ``steps`` global batches (all of them by default), with AdamW updates
    between them as ``cfg`` (a TrainConfig: trained parts and the optimizer settings) sets; fp32. ``grads``: also
    the first step's gradients (before clipping) in Megatron's layout (``"grads"``: global name -> full tensor).
    ``decay_everything``: weight decay on every tensor, as the reference did before (the negative control)."""
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.verify import load_hf_model
    from megatron_vlm.training.build import optimizer_config

    spec = VLMSpec.from_hf_dir(hf_dir)
    oc = optimizer_config(cfg)
    if oc.optimizer != "adam" or not oc.decoupled_weight_decay:
        raise ValueError(f"the HF reference runs AdamW; the trainer's optimizer is {oc.optimizer} "
                         f"(decoupled weight decay {oc.decoupled_weight_decay})")
    model = load_hf_model(hf_dir).train()
    groups: dict[bool, list] = {True: [], False: []}
    names = {}
    for name, p in model.named_parameters():
        p.requires_grad_(trained(name, cfg.trained_parts))
        if p.requires_grad:
            canonical = mapping.canonical_hf_name(name)
            groups[decay_everything or decays(canonical, p, spec)].append(p)
            names[p] = canonical
    params = groups[True] + groups[False]
    opt = torch.optim.AdamW([{"params": groups[True], "weight_decay": oc.weight_decay},
                             {"params": groups[False], "weight_decay": 0.0}],
                            lr=oc.lr, betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps)
    losses, norms, first_grads = [], [], None
    for gb in global_batches[:steps]:
        opt.zero_grad(set_to_none=True)
        inputs = [hf_inputs(s, spec) for s in gb]
        n_total = sum(int((i["labels"] != IGNORE).sum()) for i in inputs)
        total = 0.0
        for i in inputs:
            n = int((i["labels"] != IGNORE).sum())
            loss = model(**i).loss * (n / n_total)
            loss.backward()
            total += loss.item()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
        if grads and first_grads is None:
            first_grads = mcore_grads({names[p]: p.grad.detach().clone() for p in params if p.grad is not None}, spec)
        if oc.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, oc.clip_grad)
        opt.step()
        losses.append(total)
        norms.append(norm)
    out = {"loss": losses, "grad_norm": norms}
    if grads:
        out["grads"] = first_grads
    return out
