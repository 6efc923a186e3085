"""Tensors at byte offsets of files: what the converters' readers hand out and their writers take.

A reader names where a source tensor's bytes are (:class:`Located`: a file and a byte offset, plus a memory-mapped
view for when the tensor must be computed from); a writer names where an output tensor's bytes go (:class:`Target`:
an open file, preallocated, and a byte offset). :mod:`megatron_vlm.convert.copyplan` moves bytes from the one to the
other; :func:`write_all` writes a computed tensor's bytes (:func:`tensor_bytes`) to a target. Nothing here knows a
file format: :mod:`~megatron_vlm.convert.hf_io` (safetensors) and :mod:`~megatron_vlm.convert.mcore_io` (Megatron
checkpoints) build on it, and it imports neither.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Located:
    """A C-contiguous source tensor at byte ``offset`` of the file ``path``; ``view()`` gives the tensor itself
    (memory-mapped) for outputs that must be computed."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    view: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Target:
    """Where an output tensor's bytes go: ``offset`` of the open file ``fd``, preallocated (holes read as zeros)."""

    fd: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def write_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` (a buffer) is at ``offset`` of ``fd``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"short write at offset {offset}")
        view, offset = view[n:], offset + n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
