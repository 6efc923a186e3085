"""The vision encoder's work shared out over the context-parallel group (issue 65, ``--vision-cp-split``).

Under context parallelism every rank of a CP group holds the same micro batch and keeps 2 of the 2 x CP chunks of
its sequence. megatron-core's ``LLaVAModel`` runs the whole vision encoder on every CP rank before that split, so
at CP4 three quarters of the vision work (and, with an unfrozen encoder, of its activations) is repeated.

:func:`share` makes the CP ranks split it instead. The encoder's input is the micro batch's tiles ``[N, 3, H, W]``
(images, anyres or InternVL tiles, video frames: every family's encoder takes them along its first dimension, one
tile size per model, so a share balanced by tile count is balanced by patch count). Rank ``r`` of the CP group
encodes the contiguous tiles :func:`shares` gives it; the outputs are all-gathered over the group, in rank order,
with megatron-core's ``gather_from_sequence_parallel_region``, whose backward reduce-scatters: each rank receives
the summed gradient of its own tiles from every rank's sequence chunks. megatron-core's DDP then sums the encoder's
gradients over the data x context-parallel group, which gives CP1's gradients (tests/test_train_reference.py holds
them against HF's with the encoder unfrozen).

A rank whose share is empty (fewer tiles than CP ranks) encodes one tile and keeps none of its output: it still
takes part in the gather and in its backward, and its encoder's parameters get (zero) gradients, so no collective
and no DDP bucket waits on it. A micro batch without images skips the encoder on every rank alike (megatron-core's
forward does). The share is two forward hooks on the encoder module (its parameters and state dict unchanged).
The share's arithmetic (:func:`shares`, :func:`tiles_per_rank`) imports no torch: the
launcher's memory estimate reads it.
"""

from __future__ import annotations

_HOOKS = "_vision_cp_share_hooks"
_PLAN = "_vision_cp_share_plan"


def shares(n: int, size: int) -> list[int]:
    """Tiles per CP rank of a micro batch's ``n`` tiles: contiguous, in rank order, as equal as they can be."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def gather_rows(counts: list[int], width: int) -> list[tuple[int, int]]:
    """The gathered rows that hold tiles, as ``(start, stop)`` slices in tile order: rank ``r``'s ``counts[r]``
    tiles start at ``r * width`` of the gather (every rank's share padded to ``width`` rows). Slices, not an index
    tensor: nothing is copied to the device."""
    return [(r * width, r * width + n) for r, n in enumerate(counts) if n]


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def _before(module, args):
    images = args[0]
    group = _group()
    size, rank = group.size(), group.rank()
    counts = shares(images.shape[0], size)
    start = sum(counts[:rank])
    mine = counts[rank]
    setattr(module, _PLAN, (counts, mine == 0))
    local = images[start:start + mine] if mine else images[:1]  # an empty share encodes one tile, keeps none
    return (local, *args[1:])


def _after(module, args, output):
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    counts, empty = getattr(module, _PLAN)
    setattr(module, _PLAN, None)
    local = output[:0] if empty else output
    width = max(counts)
    if local.shape[0] < width:  # every rank sends the same rows: its share padded
        local = torch.cat([local, local.new_zeros(width - local.shape[0], *local.shape[1:])])
    gathered = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=_group())
    rows = gather_rows(counts, width)
    if rows == [(r * width, (r + 1) * width) for r in range(len(counts))]:  # equal shares, in order: all of it
        return gathered
    return torch.cat([gathered[a:b] for a, b in rows])


def share(vision_model) -> None:
    """Share ``vision_model``'s tiles out over the CP group of each forward (the group is read at the forward, as
    megatron-core's parallel state holds it)."""
    if getattr(vision_model, _HOOKS, None):
        return
    setattr(vision_model, _HOOKS, (vision_model.register_forward_pre_hook(_before),
                                   vision_model.register_forward_hook(_after)))


def tiles_per_rank(n: int, cp: int, split: bool = True) -> int:
    """The most tiles one CP rank encodes of ``n`` (the memory estimate's share)."""
    return max(shares(n, cp)) if split and cp > 1 else n
