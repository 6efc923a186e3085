"""One training step and one evaluation pass on megatron-core's forward/backward schedules.

The loss is a sum over loss tokens per micro batch, returned to the schedule with its token count
(``calculate_per_token_loss``): megatron's ``finalize_model_grads`` divides the gradients by the token count
of the whole global batch (all micro batches, all data-parallel ranks), so the loss and gradients of a
global batch are the same at any TP/PP/DP and any gradient accumulation.

Inputs are passed to the model positionally, as Megatron-LM's ``pretrain_vlm.py`` does: megatron's
``Float16Module`` casts positional floating-point inputs (pixel values, loss mask) to the compute dtype on the
first pipeline stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch

from megatron_vlm.runtime.cpu_compat import step_scope

_NO_INPUTS = SimpleNamespace(images=None, tokens=None, labels=None, loss_mask=None, num_image_tiles=None,
                             position_ids=None)


@dataclass
class StepResult:
    """What a training step gives the loop, left on the device: the loop's metrics read every iteration's numbers at
    once at a log interval or a checkpoint (:mod:`.metrics`), so the step itself reads nothing back. The properties
    read them one by one (a host sync each: for tools and tests)."""

    values: torch.Tensor  # float64 [loss sum, loss tokens, samples, tokens, images, squares] of the global batch
    # (all DP ranks; squares: the sum of the samples' squared lengths, for the FLOPs of attention)
    grad_norm: float | torch.Tensor | None  # before clipping, as megatron's optimizer returns it; None when skipped
    loss_scale: float = 1.0  # the loss scale the step ran at (fp16; 1 otherwise)
    moe: dict | None = None  # a mixture-of-experts model's routing numbers (megatron_vlm.training.moe.stats)

    def _host(self, i: int) -> float:
        return self.values[i].item()

    @property
    def loss_sum(self) -> float:  # summed token losses of the global batch
        return self._host(0)

    @property
    def loss_tokens(self) -> float:  # loss tokens of the global batch
        return self._host(1)

    @property
    def samples(self) -> int:
        return int(self._host(2))

    @property
    def tokens(self) -> int:
        return int(self._host(3))

    @property
    def images(self) -> int:
        return int(self._host(4))

    @property
    def loss(self) -> float:
        loss_sum, loss_tokens = self.values[:2].tolist()
        return loss_sum / max(loss_tokens, 1.0)


def loss_func(loss_mask, output):
    losses = output.float()
    mask = loss_mask.float()
    total = (losses * mask).sum()
    n = mask.sum()
    return total, n.int(), {"lm loss": torch.stack([total.detach(), n.detach()])}


def _on(device, t):
    """``t`` on ``device``: a non-blocking copy, so the host queues it and goes on (energon's loader pins the host
    batches on a GPU machine; from pageable memory the copy is a synchronous one, as before)."""
    return None if t is None else t.to(device, non_blocking=True)


def _host_layout(model, b, device):
    """The micro batch's image/text layout, computed on the host from its host tensors
    (:mod:`megatron_vlm.model.host_layout`), on ``device``; None for a model without one or a batch held on the
    device (a tensor-parallel rank's received batch: megatron-core computes the layout there)."""
    from megatron.core.utils import get_attr_wrapped_model

    if b.tokens is None or b.tokens.device.type != "cpu":
        return None
    try:
        make = get_attr_wrapped_model(model, "host_layout")
    except RuntimeError:  # not a megatron-vlm model
        return None
    layout = make(b)
    return None if layout is None else layout.to(device)


def forward_step(device, data_iterator, model, moe=None):
    """``None`` micro batches (middle pipeline stages) pass no inputs; a packed one (``cu_seqlens``) passes
    megatron's PackedSeqParams (see :mod:`megatron_vlm.data.packing` and :mod:`.batch_feed`). ``moe``: a
    mixture-of-experts model's :class:`~megatron_vlm.training.moe.orchestration.MoETraining` in training, told where
    each micro batch's forward starts and ends on this rank."""
    b = next(data_iterator)
    micro = moe.begin(b, model) if moe is not None else None
    kwargs = {}
    if b is None:
        b = _NO_INPUTS
    else:
        if getattr(b, "cu_seqlens", None) is not None:
            from megatron.core import parallel_state as ps

            from megatron_vlm.data.packing import packed_seq_params

            kwargs["packed_seq_params"] = packed_seq_params(_on(device, b.cu_seqlens), b.max_seqlen,
                                                            ps.get_context_parallel_world_size() > 1)
        if getattr(b, "model_kwargs", None) is not None:  # anyres: image sizes and tokens; Qwen-VL: image grids
            kwargs.update(b.model_kwargs(device))
        layout = _host_layout(model, b, device)
        if layout is not None:
            kwargs["host_layout"] = layout
    # M-RoPE models (Qwen2.5-VL, Qwen3-VL) take the batch's [3, b, s] positions on every stage; the others compute them
    positions = _on(device, getattr(b, "position_ids", None))
    out, loss_mask = model(_on(device, b.images), _on(device, b.tokens), positions, None, _on(device, b.labels),
                           _on(device, b.loss_mask), None, _on(device, b.num_image_tiles), **kwargs)
    if micro is not None:
        moe.forward_done(micro, out)
    return out, partial(loss_func, loss_mask)


def chunk_batches(batches: list, num_chunks: int) -> list:
    """What each of this rank's model chunks takes from the micro batches ``batches``: all of them for one chunk;
    with virtual pipeline stages, the first chunk of the first rank (inputs) and the last chunk of the last rank
    (labels, loss mask) take the batches, the other chunks run the middle of the model and take what a middle
    pipeline stage takes (:func:`_middle`). One iterator per chunk, as
    megatron-core's interleaved schedule wants them."""
    from megatron.core import parallel_state as ps

    if num_chunks == 1:
        return [iter(batches)]
    first, last = ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True)
    middle = [_middle(b) for b in batches]
    return [iter(batches if (first and c == 0) or (last and c == num_chunks - 1) else middle)
            for c in range(num_chunks)]


def _middle(batch):
    """A micro batch as a middle stage sees it: None, or only the packed boundaries, each row's positions of
    samples (a mixture-of-experts model's routers leave the padding out) and an M-RoPE model's 3-D positions."""
    cu, rows = getattr(batch, "cu_seqlens", None), getattr(batch, "row_tokens", None)
    positions = getattr(batch, "position_ids", None)  # M-RoPE: every layer's rotary reads them
    if batch is None or (cu is None and rows is None and positions is None):
        return None
    from megatron_vlm.training.batch_feed import MicroBatch

    return MicroBatch(None, None, None, None, None, row_tokens=rows, cu_seqlens=cu,
                      max_seqlen=batch.max_seqlen if cu is not None else None, position_ids=positions)


def _reduce_losses(losses, device) -> torch.Tensor:
    """[loss sum, token count] of the global batch on the last pipeline stage (zeros elsewhere); a context-parallel
    rank holds the loss of its part of each sequence, so the sum runs over data- and context-parallel ranks."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(2, device=device, dtype=torch.float64)
    for d in losses:
        total += d["lm loss"].to(device).double()
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return total


def _iterators(batches: list, ddps: list):
    """The schedule's data iterator: one, or one per model chunk (:func:`chunk_batches`)."""
    its = chunk_batches(batches, len(ddps))
    return its[0] if len(its) == 1 else its


@step_scope()  # on CPU: the step runs without the CPU layer's per-op device mode (runtime/cpu_compat.py)
def train_step(training, batches: list, cfg, device, timers=None) -> StepResult:
    """Forward/backward over this rank's micro batches of one global batch, then the optimizer step. ``timers``: the
    loop's :class:`~megatron_vlm.training.timers.StepTimers`, marked at the end of each phase."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddps, optimizer = training.ddps, training.optimizer
    for ddp in ddps:
        ddp.zero_grad_buffer()
    optimizer.zero_grad()
    # fp16's dynamic loss scale (read before the step changes it); other precisions have none, and reading the
    # scale tensor would be one more host-device sync per step
    scale = float(optimizer.get_loss_scale()) if cfg.precision == "fp16" else 1.0
    moe = getattr(training, "moe", None)
    with contextlib.ExitStack() as stack:
        if moe is not None:  # the MoE load-balancing term's weight in this step (training/moe/)
            from megatron_vlm.training.moe.orchestration import global_loss_tokens

            micro_batches = len(batches) * ps.get_data_parallel_world_size()
            stack.enter_context(moe.step(global_loss_tokens(batches, device), micro_batches))
        losses = get_forward_backward_func()(
            forward_step_func=partial(forward_step, device, moe=moe), data_iterator=_iterators(batches, ddps),
            model=ddps,
            num_microbatches=len(batches), seq_length=cfg.lm_seq_length, micro_batch_size=cfg.micro_batch_size,
            forward_only=False)
    routing = moe.collect(len(batches), device) if moe is not None else None
    if timers is not None:
        timers.mark("forward-backward")
    ok, grad_norm, _ = optimizer.step()
    training.scheduler.step(increment=1)
    if timers is not None:
        timers.mark("optimizer")
    total = _reduce_losses(losses, device)
    # the logged loss comes from the last stage: share it with the whole pipeline so every rank reports it
    torch.distributed.broadcast(total, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    counts = _counts([b for b in batches if b is not None and b.tokens is not None], device)  # middle stages: none
    torch.distributed.all_reduce(counts, group=ps.get_data_parallel_group())
    if timers is not None:
        timers.mark("loss-reduce")
    return StepResult(torch.cat([total, counts]), grad_norm if ok else None, scale, routing)


def _counts(fed: list, device) -> torch.Tensor:
    """[samples, tokens, images, squares] of this rank's micro batches ``fed``, a float64 tensor on ``device``
    (``squares``: the sum of the samples' squared lengths, attention's work in :mod:`.flops`), made without reading a
    device tensor back: the host's numbers go over in one (pinned, non-blocking) copy, those of batches already on
    the device (received over the TP group) are summed there."""
    samples = sum(getattr(b, "num_samples", None) or b.tokens.shape[0] for b in fed)  # packs hold several
    parts = [(b.num_image_tiles.to(torch.float64).sum(), _squares(b)) for b in fed]
    on_host = [torch.stack(p) for p in parts if p[0].device.type == "cpu"]
    host = torch.cat([torch.tensor([samples, sum(b.num_tokens for b in fed)], dtype=torch.float64),
                      torch.stack(on_host).sum(0) if on_host else torch.zeros(2, dtype=torch.float64)])
    if getattr(device, "type", str(device)) == "cuda":
        host = host.pin_memory()
    counts = host.to(device, non_blocking=True)
    on_device = [torch.stack([a.to(device), b.to(device)]) for a, b in parts if a.device.type != "cpu"]
    if on_device:
        counts[2:] += torch.stack(on_device).sum(0)
    return counts


def _squares(batch) -> torch.Tensor:
    """The sum of the squared lengths of ``batch``'s samples: each row's real positions (``row_tokens``), or a
    pack's sample segments (the first ``num_samples`` of its ``cu_seqlens``; the rest is the pack's padding, and a
    pack received over the TP group, which has no sample count, counts every segment)."""
    cu = getattr(batch, "cu_seqlens", None)
    if cu is not None:
        n = getattr(batch, "num_samples", None) or cu.numel() - 1
        lengths = cu[1:n + 1] - cu[:n]
    else:
        lengths = batch.row_tokens
    return lengths.to(torch.float64).square().sum()


def pad_micro_batch(batch, micro_batch_size: int, image_token_id):
    """A partial last batch filled up to ``micro_batch_size`` rows with copies of its last row whose loss mask
    is zero (and with no position of a sample, for an MoE model's routing counts): pipeline stages exchange
    activations of a fixed [seq, micro batch, hidden] shape, so every micro batch must have the same number of rows
    (a short one would leave the next stage waiting). A Qwen-VL batch (its image tokens expanded in the tokens) is
    filled with rows of text instead, token 0 at counting positions, which need no pixels.
    ``image_token_id``: the image token's id, or the ids of every image/video token (``spec.media_token_ids``)."""
    if batch is None or batch.tokens is None:  # a middle pipeline stage
        return batch
    n = batch.tokens.shape[0]
    if n >= micro_batch_size:
        return batch
    extra = micro_batch_size - n

    def rows(t):
        return torch.cat([t, t[-1:].expand(extra, *t.shape[1:])], dim=0)

    if getattr(batch, "image_grid_thw", None) is not None:  # Qwen-VL: rows of text (token 0), no images
        _, s = batch.tokens.shape
        text = batch.tokens.new_zeros(extra, s)
        positions = torch.arange(s, dtype=batch.position_ids.dtype)[None, None].expand(3, extra, s)
        return type(batch).derive_from(
            batch, images=batch.images, image_grid_thw=batch.image_grid_thw, num_image_tiles=batch.num_image_tiles,
            tokens=torch.cat([batch.tokens, text]), labels=torch.cat([batch.labels, text]),
            loss_mask=torch.cat([batch.loss_mask, batch.loss_mask.new_zeros(extra, s)]), num_tokens=batch.num_tokens,
            row_tokens=torch.cat([batch.row_tokens, batch.row_tokens.new_zeros(extra)]),
            position_ids=torch.cat([batch.position_ids, positions], dim=1))
    media = torch.tensor(image_token_id if isinstance(image_token_id, (tuple, list)) else [image_token_id])
    k = int(torch.isin(batch.tokens[-1], media.to(batch.tokens.device)).sum())  # images/videos in token order
    n_images = batch.num_image_tiles.shape[0]
    tiles = int(batch.num_image_tiles[n_images - k:].sum())  # anyres: several tiles per image
    last_images, last_tiles = batch.images[batch.images.shape[0] - tiles:], batch.num_image_tiles[n_images - k:]
    per_image = {name: torch.cat([getattr(batch, name)] + [getattr(batch, name)[n_images - k:]] * extra)
                 for name in ("image_sizes", "num_image_tokens") if hasattr(batch, name)}  # anyres batches
    return type(batch).derive_from(
        batch, images=torch.cat([batch.images] + [last_images] * extra),
        num_image_tiles=torch.cat([batch.num_image_tiles] + [last_tiles] * extra), tokens=rows(batch.tokens),
        labels=rows(batch.labels), loss_mask=torch.cat([batch.loss_mask, batch.loss_mask.new_zeros(
            extra, batch.loss_mask.shape[1])]), num_tokens=batch.num_tokens,
        row_tokens=torch.cat([batch.row_tokens, batch.row_tokens.new_zeros(extra)]), **per_image)


def loss_free(batch):
    """``batch`` with no position in the loss (its loss mask zero) and none of a sample's (``row_tokens`` zero, for an
    MoE model's routing counts): a micro batch that runs through the schedule and adds nothing to the result."""
    if batch is None:
        return None
    fields = {name: torch.zeros_like(getattr(batch, name)) for name in ("loss_mask", "row_tokens")
              if getattr(batch, name, None) is not None}
    return dataclasses.replace(batch, **fields)  # an energon batch or a batch_feed.MicroBatch: both dataclasses


def evaluate(training, batches: list, cfg, device) -> float | None:
    """Mean loss per loss token over ``batches`` (this rank's share of the validation set); None if empty. With
    virtual pipeline stages megatron-core's interleaved schedule runs micro batches in groups of PP only, so a count
    that is not a multiple of PP is filled up with loss-free copies of the last one (:func:`loss_free`): every micro
    batch is evaluated, and the filling adds nothing to the loss or its token count."""
    n = torch.tensor([len(batches)], device=device)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
    n = int(n.item())
    batches = [pad_micro_batch(b, cfg.micro_batch_size, training.spec.media_token_ids) for b in batches[:n]]
    if not batches:
        return None
    if len(training.models) > 1:
        from megatron.core import parallel_state as ps

        batches += [loss_free(batches[-1])] * (-len(batches) % ps.get_pipeline_model_parallel_world_size())
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddps = training.ddps
    overlap = training.overlapping_param_gather()
    if overlap:  # parameters must be current before a forward outside the training step
        training.disable_forward_pre_hook()
    for ddp in ddps:
        ddp.eval()
    with torch.no_grad():
        losses = get_forward_backward_func()(
            forward_step_func=partial(forward_step, device), data_iterator=_iterators(batches, ddps), model=ddps,
            num_microbatches=len(batches), seq_length=cfg.lm_seq_length, micro_batch_size=cfg.micro_batch_size,
            forward_only=True)
    for ddp in ddps:
        ddp.train()
    if overlap:
        training.enable_forward_pre_hook()
    from megatron.core import parallel_state as ps

    total = _reduce_losses(losses, device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        return (total[0] / total[1].clamp(min=1)).item()
    return None
