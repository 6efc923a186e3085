"""The grad norm, clip and copy of megatron-core's optimizer on torch's multi-tensor (foreach) kernels, where
megatron-core has no fused kernels to bind: neither Transformer Engine nor Apex imported (a plain PyPI install, ROCm,
a GPU image without TE), and every CPU process (TE's CUDA kernels fail on CPU tensors).

megatron-core's own fallbacks (``megatron.core.utils.local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``)
take one ``torch.norm`` per tensor and gather the norms into a host list (``torch.tensor`` of device scalars: one
host sync per parameter tensor, ~140 per iteration for the kit's model), then read the total back with ``float``;
the scale runs one multiply and one copy per tensor. Registry entry ``foreach-optimizer-kernels`` binds, in their
place, :func:`l2_norm` (``torch._foreach_norm`` and one norm of the stacked norms: the total stays on the device, no
sync) and :func:`scale` (``torch._foreach_mul_`` in place for the clip, ``torch._foreach_copy_`` for the main
parameter copies, whose scale is 1). megatron-core's ``get_grad_norm_fp32`` still reads the total once per step
(``total_norm.item()``), as it does with TE's and Apex's kernels.

Equal to megatron-core's fallbacks: the norm to fp32 rounding (the per-tensor norms are summed in another order:
relative 1e-6), the clip and the copies bit for bit (the same elementwise multiply and cast);
tests/test_mcore_patches.py::test_foreach_optimizer_kernels_equal_megatron_cores_fallbacks.
"""

from __future__ import annotations

import torch

from megatron_vlm.runtime import mcore_patches

NAME = "foreach-optimizer-kernels"


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` (and megatron's local fallback): the l2 norm of every tensor of
    ``tensor_lists`` as a one-element fp32 tensor on their device (and, with ``per_tensor``, each tensor's norm)."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    if len({n.dtype for n in norms}) > 1 or norms[0].dtype != torch.float:
        norms = [n.float() for n in norms]
    stacked = torch.stack(norms)
    return torch.linalg.vector_norm(stacked).reshape(1), (stacked if per_tensor else None)


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * factor`` for each pair of ``tensor_lists[0]``,
    ``tensor_lists[1]`` (in place when they are the same tensors: the clip; a plain copy, cast to the destination's
    dtype, when the factor is 1: the main parameters' copies)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    elif factor == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def falls_back() -> bool:
    """Whether megatron-core's optimizer modules bound its own local fallbacks (no TE, no Apex at their import)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    return clip_grads.l2_norm_impl is local_multi_tensor_l2_norm


def use_foreach_kernels(always: bool = False) -> None:
    """Apply the entry for the process when megatron-core fell back to its local kernels (``always``: the CPU
    layer, whatever megatron-core bound)."""
    if always or falls_back():
        mcore_patches.apply(NAME)


@mcore_patches.implements(NAME)
def _foreach_kernels(originals: dict) -> dict:
    return {"megatron.core.optimizer.clip_grads:l2_norm_impl": l2_norm,
            "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl": scale,
            "megatron.core.optimizer.optimizer:multi_tensor_scale_impl": scale}
