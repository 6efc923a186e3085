"""The outside reference for the trainer: HF's own model, loss and an AdamW loop on the trainer's batches.

The trainer's samples (``VLMSample`` / ``AnyresSample``: Megatron tokens with one token per image or video,
labels shifted by one, a loss mask) are turned into what HF ``LlavaForConditionalGeneration`` /
``LlavaOnevisionForConditionalGeneration`` take: the whole sequence the sample was cut from (the trainer's tokens
and, in Megatron's framing, the last label after them; a mixture-of-experts model's samples hold the whole sequence
as their tokens already, :func:`megatron_vlm.data.task_encoder.whole_sequence`), every image/video token expanded
to its count, and ``labels`` that are -100 except at the positions whose token the trainer's loss predicts. HF's
forward with ``labels``
computes its own (shifted, mean) cross entropy over the true vocabulary; a global batch's loss is the sum of
each sample's HF loss times its label count, over the global batch's label count - the per-token objective the
trainer normalises over the whole global batch (:mod:`megatron_vlm.training.step`).

A mixture-of-experts language model's objective is its HF model's (``Qwen3MoeForCausalLM``,
``MixtralForCausalLM``): the cross entropy plus ``router_aux_loss_coef`` times transformers' own
``load_balancing_loss_func`` (of the text model's module), computed per micro batch as HF's forward computes it
per batch: the router logits of every MoE layer over every position of HF's input, taken from HF's own routers by
forward hooks (no position masked: HF's own framing, the last position routed too). The micro batches are the
trainer's (consecutive
``cfg.micro_batch_size`` samples of a global batch: each data-parallel rank's slice is contiguous), and the term
is averaged over them, as gradient accumulation averages it. The samples still run through HF one at a time,
so nothing is padded on HF's side.

:func:`train` runs ``steps`` global batches through HF with ``torch.optim.AdamW`` and gradient-norm clipping set as
the trainer's optimizer is (:func:`megatron_vlm.training.build.optimizer_config`: learning rate, betas, eps, weight
decay; weight decay only on the tensors megatron-core decays, not on biases and norms), and returns the loss and the
gradient norm (before clipping, over the trained parameters) of every step, to be compared with the trainer's
logged numbers; with ``grads=True`` also the first step's gradient of every trained tensor under HF's on-disk
names (:func:`tests.support.grad_reference.saved_gradients`), to be compared tensor by tensor with the
trainer's (:mod:`tests.support.grad_reference`).
"""

from __future__ import annotations

import math

import torch

from megatron_vlm.model.spec import VLMSpec

IGNORE = -100


#: (directory, its files' sizes and times) -> the spec read from it: VLMSpec.from_hf_dir loads the tokenizer to check
#: the special tokens (~1 s for Qwen's), and a test's references read the same few models again and again
_SPECS: dict = {}


def spec_of(hf_dir) -> VLMSpec:
    """``VLMSpec.from_hf_dir(hf_dir)``, read once per process while the directory's files stay as they are (a copy:
    a caller may change its own)."""
    import copy
    import os

    state = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(hf_dir) if e.is_file()))
    key = (os.path.realpath(hf_dir), state)
    if key not in _SPECS:
        _SPECS[key] = VLMSpec.from_hf_dir(hf_dir)
    return copy.deepcopy(_SPECS[key])


def qwen_vl_inputs(sample, spec: VLMSpec) -> dict:
    """HF ``Qwen2_5_VLForConditionalGeneration``'s inputs (with ``labels``) of one encoded Qwen2.5-VL sample: its
    tokens (images and videos already expanded, as the processor expands them) and the last label after them, the
    processor's ``pixel_values`` / ``image_grid_thw`` of its images and ``pixel_values_videos`` / ``video_grid_thw`` /
    (Qwen2.5-VL) ``second_per_grid_ts`` of its videos (the sample holds them all in token order), and ``mm_token_type_ids`` over
    the whole sequence (1 at image tokens, 2 at video tokens), from which HF's forward computes its own M-RoPE
    positions (``get_rope_index``): the trainer's positions are not given to it."""
    ids = torch.cat([sample.tokens, sample.labels[-1:]])
    labels = torch.full_like(ids, IGNORE)
    at = sample.loss_mask.nonzero()[:, 0] + 1  # position i predicts ids[i + 1]: HF reads it at i + 1
    labels[at] = ids[at]
    video_id = spec.hf_config["video_token_id"]
    types = (ids == spec.image_token_id).int() + 2 * (ids == video_id).int()
    out = dict(input_ids=ids[None], labels=labels[None], mm_token_type_ids=types[None])
    grid = sample.image_grid_thw
    if not len(grid):
        return out
    video = sample.second_per_grid_ts > 0  # the items that are videos
    rows = torch.repeat_interleave(video, grid.prod(-1))  # each patch's item
    if bool((~video).any()):
        out.update(pixel_values=sample.images[~rows], image_grid_thw=grid[~video])
    if bool(video.any()):
        out.update(pixel_values_videos=sample.images[rows], video_grid_thw=grid[video])
        if spec.arch != "qwen3_vl":  # Qwen3-VL's time is in the text (timestamps)
            out["second_per_grid_ts"] = sample.second_per_grid_ts[video]
    return out


def hf_inputs(sample, spec: VLMSpec) -> dict:
    """HF forward inputs (with ``labels``) of one encoded trainer sample."""
    from megatron_vlm.data.task_encoder import whole_sequence

    if spec.is_qwen_vl:
        return qwen_vl_inputs(sample, spec)

    # the full sequence the sample was cut from: its tokens, and in Megatron's framing the last label after them
    x = sample.tokens.tolist() if whole_sequence(spec) else torch.cat([sample.tokens, sample.labels[-1:]]).tolist()
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


def trained(name: str, parts: dict) -> bool:
    """Whether HF parameter ``name`` trains, given the trainer's ``cfg.trained_parts`` (Qwen2.5-VL: the patch
    merger ``visual.merger`` is the projector, the rest of ``visual`` the vision encoder)."""
    if "visual.merger" in name or "visual.deepstack_merger_list" in name:
        return parts["projector"]
    if "vision_tower" in name or "visual." in name:
        return parts["vision"]
    if "multi_modal_projector" in name or "image_newline" in name:
        return parts["projector"]
    return parts["language"]


def load_balancing(model):
    """HF's load-balancing term of ``model`` (a LLaVA around a mixture-of-experts text model), or None for a dense
    one: ``(loss_func(per-layer router logits, attention_mask), routers' outputs list, coefficient, hooks)``.
    ``loss_func`` is transformers' ``load_balancing_loss_func`` of the text model's own module (Qwen3-MoE, Mixtral),
    with the text config's ``num_experts`` / ``num_local_experts`` and ``num_experts_per_tok``; the list fills with
    each routed layer's router logits (forward hooks on HF's routers, in layer order)."""
    import functools
    import sys

    text = model.config.text_config
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if not experts:
        return None
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    lm = next(m for m in model.modules() if type(m).__name__.endswith(("MoeModel", "MixtralModel")))
    func = sys.modules[type(lm).__module__].load_balancing_loss_func
    routed: list = []
    hooks = [r.register_forward_hook(lambda mod, args, out: routed.append(out[0])) for r in routers]
    return (functools.partial(func, num_experts=experts, top_k=text.num_experts_per_tok), routed,
            text.router_aux_loss_coef, hooks)


def train(hf_dir, global_batches: list[list], cfg, steps: int | None = None, grads: bool = False,
          decay_everything: bool = False, aux_coeff: float | None = None) -> dict:
    """HF losses and gradient norms of ``steps`` global batches (all of them by default), with AdamW updates
    between them as ``cfg`` (a TrainConfig: trained parts, micro batch size and the optimizer settings) sets; fp32.

    Returns ``{"loss": [cross entropy per step], "aux": [the load-balancing term per step: coefficient x the mean
    over micro batches of load_balancing_loss_func; 0 for a dense model], "lb": [that mean without the
    coefficient], "grad_norm": [of cross entropy + term, per step]}``; ``grads``: also the first step's gradients
    (before clipping) as ``"grads"`` (HF on-disk name -> tensor). ``aux_coeff``: the load-balancing coefficient
    (default: ``cfg.moe_aux_loss_coeff``, else the HF config's ``router_aux_loss_coef``; 0: HF LLaVA's plain cross
    entropy). ``decay_everything``: weight decay on every tensor, as the reference did before (the negative
    control)."""
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.verify import load_hf_model
    from tests.support.grad_reference import saved_gradients
    from megatron_vlm.training.build import optimizer_config

    spec = spec_of(hf_dir)
    oc = optimizer_config(cfg)
    if oc.optimizer != "adam" or not oc.decoupled_weight_decay:
        raise ValueError(f"the HF reference runs AdamW; the trainer's optimizer is {oc.optimizer} "
                         f"(decoupled weight decay {oc.decoupled_weight_decay})")
    model = load_hf_model(hf_dir).train()
    groups: dict[bool, list] = {True: [], False: []}
    for name, p in model.named_parameters():
        p.requires_grad_(trained(name, cfg.trained_parts))
        if p.requires_grad:
            groups[decay_everything or decays(mapping.canonical_hf_name(name, spec.arch), p, spec)].append(p)
    params = groups[True] + groups[False]
    opt = torch.optim.AdamW([{"params": groups[True], "weight_decay": oc.weight_decay},
                             {"params": groups[False], "weight_decay": 0.0}],
                            lr=oc.lr, betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps)
    balance = load_balancing(model)
    if balance is not None:
        coeff = aux_coeff if aux_coeff is not None else (
            cfg.moe_aux_loss_coeff if cfg.moe_aux_loss_coeff is not None else balance[2])
        if not coeff:
            for h in balance[3]:
                h.remove()
            balance = None
    mbs = cfg.micro_batch_size or 1
    out: dict = {"loss": [], "aux": [], "lb": [], "grad_norm": []}
    for gb in global_batches[:steps]:
        opt.zero_grad(set_to_none=True)
        inputs = [hf_inputs(s, spec) for s in gb]
        n_total = sum(int((i["labels"] != IGNORE).sum()) for i in inputs)
        micro = [inputs[k:k + mbs] for k in range(0, len(inputs), mbs)]
        total = lb_total = 0.0
        for group in micro:
            ce = 0.0
            if balance is not None:
                balance[1].clear()
            for i in group:
                loss = model(**i).loss * (int((i["labels"] != IGNORE).sum()) / n_total)
                total += loss.item()
                ce = ce + loss
            if balance is not None:
                routed = balance[1]
                per_sample = len(routed) // len(group)  # each sample's forward routed every MoE layer in order
                layers = tuple(torch.cat([routed[k * per_sample + layer] for k in range(len(group))])
                               for layer in range(per_sample))
                lb = balance[0](layers)  # every position of HF's input, as HF's forward of unpadded rows routes them
                lb_total += float(lb.detach()) / len(micro)
                ce = ce + coeff * lb / len(micro)
            ce.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
        if grads and "grads" not in out:
            out["grads"] = saved_gradients(model)
        if oc.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, oc.clip_grad)
        opt.step()
        out["loss"].append(total)
        out["lb"].append(lb_total)
        out["aux"].append(coeff * lb_total if balance is not None else 0.0)
        out["grad_norm"].append(norm)
    if balance is not None:
        for h in balance[3]:
            h.remove()
    return out
