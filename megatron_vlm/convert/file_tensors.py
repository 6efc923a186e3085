"""Tensors at byte offsets of files: what the converters' readers hand out and their writers take.

A reader names where a source tensor's bytes are (:class:`Located`: a file and a byte offset, plus a memory-mapped
view for when the tensor must be computed from); a writer names where an output tensor's bytes go (:class:`Target`:
an open file, preallocated, and a byte offset). :mod:`megatron_vlm.convert.copyplan` moves bytes from the one to the
other; :func:`write_tensor` writes a computed tensor's bytes to a target, and :func:`start_writeback` hands a
finished target's bytes to the disk (both ways of filling a target end with it). Nothing here knows a file format:
:mod:`~megatron_vlm.convert.hf_io` (safetensors) and :mod:`~megatron_vlm.convert.mcore_io` (Megatron checkpoints)
build on it, and it imports neither.
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

    @property
    def span(self) -> tuple[str, int, int]:
        """``(path, offset, length)``: the bytes of the file it is (what a task declares it reads)."""
        return self.path, self.offset, math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Target:
    """Where an output tensor's bytes go: ``offset`` of the open file ``fd``, preallocated (holes read as zeros); a
    slot of ``shape`` x ``dtype`` bytes, which the next tensor of the file follows. ``name`` says which tensor it is
    (in errors)."""

    fd: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    name: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


#: the most bytes one write hands the kernel. On this project's 2-core VM (one that hands free memory back to its
#: host: free page reporting), 1 GiB written to a new file in 2 MiB or 8 MiB pieces took 11.8-13.1 s with its fsync,
#: in 64 KiB or 1 MiB pieces 0.64-0.77 s (``cp``'s kernel copy 0.79-0.90 s; ``bench/write_pieces.py``), most likely
#: because Linux (6.x) caches a file written in large pieces in 2 MiB folios, taken from the blocks the host must
#: back again. Elsewhere a piece this size costs one system call per MiB.
WRITE_PIECE = 1 << 20


def write_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` (a buffer) is at ``offset`` of ``fd``, at most
    :data:`WRITE_PIECE` bytes a call."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view[:WRITE_PIECE], offset)
        if n <= 0:
            raise OSError(f"short write at offset {offset}")
        view, offset = view[n:], offset + n


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-out of the range's dirty pages, do not wait
_sync_file_range: list = []  # [the C function, or None where the C library has none]


def start_writeback(fd: int, offset: int, n: int) -> None:
    """Start writing ``n`` bytes at ``offset`` of ``fd`` to the disk, without waiting (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing elsewhere). A writer calls it on each finished part, so the
    disk writes while the next parts are copied, and the final ``fsync`` finds little left to do (on this machine:
    a 1 GiB misaligned kernel copy with its fsync took 0.55-0.76 s with it, 0.86-1.08 s without)."""
    if not _sync_file_range:
        import ctypes

        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (AttributeError, OSError):
            fn = None
        _sync_file_range.append(fn)
    fn = _sync_file_range[0]
    if fn is not None and n > 0:
        fn(fd, offset, n, _SYNC_FILE_RANGE_WRITE)  # a hint: a failure shows at the fsync that follows


def write_tensor(target: Target, t: torch.Tensor) -> None:
    """``t``'s bytes (a CPU tensor of the target's dtype and shape) written to ``target``, handed to the disk. A
    tensor of another dtype or shape than the target's slot is refused before a byte is written (its bytes would
    overwrite the next tensor of the file, or leave part of the slot unwritten), naming the tensor."""
    data = tensor_bytes(t)
    if t.dtype != target.dtype or tuple(t.shape) != tuple(target.shape) or data.nbytes != target.nbytes:
        raise ValueError(f"{target.name or 'a tensor'}: made {t.dtype} {tuple(t.shape)} ({data.nbytes} bytes), but "
                         f"its slot in the output file holds {target.dtype} {tuple(target.shape)} ({target.nbytes} "
                         "bytes); nothing was written")
    write_all(target.fd, data, target.offset)
    start_writeback(target.fd, target.offset, target.nbytes)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
