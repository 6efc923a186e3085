"""Which bytes of a converted tensor are unchanged bytes of its sources, so that they go file to file in the kernel.

Most conversion steps (``mapping.to_mcore``, ``tp_shard``, ``tp_merge``, ``to_hf``, the block of a ShardedTensor)
move whole rows: they concatenate, interleave (the fused QKV), split and pad along the first dimension. Such a step
is run once on *proxy* tensors (:func:`row_runs`): each source row is replaced by a row of two int64 labels
``(2k, 2k + 1)`` that name the source and the row, all other dimensions of extent 1. When the result has the
proxy layout of the real output and every row still holds its two labels in order, its rows name their sources,
and consecutive source rows become byte ranges that :func:`fill` copies file to file (:func:`copy_range`: with
``os.copy_file_range``, the kernel copy ``cp`` uses, where source and output share their place in a page; else
through a small buffer, which is faster there). Rows of zeros (vocabulary padding) are left as holes of
the preallocated output, which read as zeros. Anything else (a split along another dimension, a dtype cast, a
one-dimensional tensor) is computed from memory-mapped views and written with ``pwrite``.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from typing import Callable

import torch

from megatron_vlm.convert.file_tensors import (WRITE_PIECE, Located, Target, itemsize, start_writeback, write_all,
                                               write_tensor)

_SRC_SHIFT = 40  # label = (source + 1) << 40 | (row * blocks + block)
#: outputs smaller than this are computed: a copy plan saves nothing there
MIN_COPY_BYTES = 1 << 16
#: a two-dimensional tensor's rows are labelled in (at most) this many blocks, so that splits along the second
#: dimension (row-parallel TP shards, up to TP=8) are followed too
MAX_BLOCKS = 16


def _blocks(shape) -> int:
    """Labels per row: the largest power of two up to :data:`MAX_BLOCKS` dividing a 2-D tensor's row (the blocks
    tile the row in order); 1 (the whole row) for more dimensions."""
    if len(shape) != 2:
        return 1
    k = 1
    while k < MAX_BLOCKS and shape[1] % (2 * k) == 0:
        k *= 2
    return k


def row_runs(fn: Callable[[list[torch.Tensor]], torch.Tensor], sources: list[Located], out_shape, out_dtype,
             ) -> list[tuple[int, int, int, int]] | None:
    """The byte runs ``(source index, source byte offset, output byte offset, length)`` that make
    ``fn(sources)`` (the padding rows left out), or None when the output is not made of whole blocks of source
    rows of its own dtype (:class:`RowPlan` with ``fn`` as the whole step)."""
    return RowPlan(sources, fn).runs(lambda t: t, out_shape, out_dtype)


class RowPlan:
    """Copy plans of the outputs of one ``step(sources)`` that makes a full tensor (each output, e.g. a TP shard,
    is ``part(full)``): the step is taken on the proxies once per granularity, and each output's part from it.

    The rows are labelled in blocks (:func:`_blocks`), and a plan that moves parts of rows is made twice, at that
    granularity and at half of it: a step that moves whole blocks gives the same bytes both times, one that
    reorders elements inside a block (a flip, an element interleave) does not, and is computed instead. A row
    that cannot be split into two or more equal blocks is labelled by its two ends, which the step must keep
    together and in order."""

    def __init__(self, sources: list[Located], step: Callable[[list[torch.Tensor]], torch.Tensor]):
        self.sources, self.step = sources, step
        self.ok = bool(sources) and all(len(s.shape) >= 2 and s.dtype == sources[0].dtype
                                        and tuple(s.shape[1:]) == tuple(sources[0].shape[1:]) for s in sources)
        self.k = _blocks(sources[0].shape) if self.ok else 1
        self._made: dict[int, torch.Tensor | None] = {}

    def _proxy_output(self, k: int):
        if k not in self._made:
            per_row = max(k, 2)
            try:
                proxies = []
                for i, s in enumerate(self.sources):
                    labels = ((i + 1) << _SRC_SHIFT) + torch.arange(s.shape[0] * per_row, dtype=torch.int64)
                    proxies.append(labels.view((s.shape[0],) + (1,) * (len(s.shape) - 2) + (per_row,)))
                self._made[k] = self.step(proxies)
            except Exception:  # noqa: BLE001 (a step the proxy cannot take: computed instead)
                self._made[k] = None
        return self._made[k]

    def runs(self, part: Callable[[torch.Tensor], torch.Tensor], out_shape, out_dtype) -> list | None:
        """The byte runs of output ``part(full)`` (shape ``out_shape``, ``out_dtype``), or None."""
        out_shape = tuple(out_shape)
        if not self.ok or len(out_shape) != len(self.sources[0].shape) or self.sources[0].dtype != out_dtype:
            return None
        # the label arithmetic is many small ops: torch function modes (the CPU compatibility layer's, where
        # megatron-core runs on a CPU) are kept out of them, which made planning most of an export's time
        with torch._C.DisableTorchFunction():
            runs = self._runs(part, out_shape, out_dtype, self.k)
            if runs is None or self.k == 1:
                return runs
            src_row = math.prod(self.sources[0].shape[1:]) * itemsize(out_dtype)
            out_row = math.prod(out_shape[1:]) * itemsize(out_dtype)
            if src_row == out_row and all(a % src_row == 0 and b % out_row == 0 and n % out_row == 0
                                          for _, a, b, n in runs):
                return runs  # whole rows moved: nothing inside a row to check
            return runs if self._runs(part, out_shape, out_dtype, self.k // 2) == runs else None

    def _runs(self, part, out_shape, out_dtype, k: int):
        row = math.prod(self.sources[0].shape[1:])  # elements
        out_row = math.prod(out_shape[1:])
        block = row // k
        if not out_row or out_row % block or k == 1 and out_row != row:
            return None
        k_out = out_row // block * (2 if k == 1 else 1)
        full = self._proxy_output(k)
        if full is None:
            return None
        try:
            out = part(full)
        except Exception:  # noqa: BLE001
            return None
        if tuple(out.shape) != (out_shape[0],) + (1,) * (len(out_shape) - 2) + (k_out,) or out.dtype != torch.int64:
            return None
        labels = out.reshape(-1)
        pad = labels == 0
        src = torch.where(pad, -1, (labels >> _SRC_SHIFT) - 1)
        pos = labels & ((1 << _SRC_SHIFT) - 1)
        if bool(torch.any((src >= len(self.sources)) | (~pad & (src < 0)))):
            return None
        if k == 1:  # whole rows: each output row is one source row's two ends, in order
            ends = labels.view(-1, 2)
            if not bool(torch.all((ends[:, 0] == 0) & (ends[:, 1] == 0) | (ends[:, 1] == ends[:, 0] + 1)
                                  & (pos.view(-1, 2)[:, 0] % 2 == 0))):
                return None
            src, pos, pad = src.view(-1, 2)[:, 0], pos.view(-1, 2)[:, 0] // 2, pad.view(-1, 2)[:, 0]
        bb = block * itemsize(out_dtype)
        n = src.numel()
        if not n:
            return []
        cut = torch.ones(n, dtype=torch.bool)  # where a run starts: another source, a jump, padding
        cut[1:] = (src[1:] != src[:-1]) | (pos[1:] != pos[:-1] + 1) | pad[1:] | pad[:-1]
        starts = cut.nonzero().flatten()
        lengths = torch.diff(starts, append=torch.tensor([n]))
        keep = ~pad[starts]
        starts, lengths = starts[keep], lengths[keep]
        return list(zip(src[starts].tolist(), (pos[starts] * bb).tolist(), (starts * bb).tolist(),
                        (lengths * bb).tolist()))


class Files:
    """The source files, opened once: read-only descriptors, and read-only mappings for gathered writes
    (thread-safe)."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def mapped(self, path: str) -> memoryview:
        fd = self.fd(path)
        with self._lock:
            m = self._maps.get(path)
            if m is None:
                m = self._maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            return memoryview(m)

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                try:
                    m.close()
                except BufferError:  # a view is still alive; the mapping goes with it
                    pass
            for fd in self._fds.values():
                os.close(fd)
            self._maps.clear()
            self._fds.clear()


#: runs shorter than this are gathered into ``pwritev`` calls of at most
#: :data:`~megatron_vlm.convert.file_tensors.WRITE_PIECE` bytes (a row-parallel shard is one run per row) rather
#: than copied one ``copy_file_range`` each
SMALL_RUN = 1 << 16
_IOV_MAX = 1024


_KERNEL_COPY = [True]  # cleared after the first file system that refuses copy_file_range
_buffers = threading.local()  # each worker thread's bounce buffer


def copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    """``n`` bytes from ``src_off`` of ``src_fd`` to ``dst_off`` of ``dst_fd``. Where the two offsets sit at the
    same place of a page (``cp``'s case), in the kernel (``copy_file_range``); elsewhere, or where the file system
    refuses it, through a buffer of :data:`~megatron_vlm.convert.file_tensors.WRITE_PIECE` bytes. The kernel's copy
    moves page-cache pages through a pipe, and between offsets at different places of a page it writes each page in
    two parts: on this project's 2-core VM, 1 GiB from a file in memory to a new file, with its fsync, took
    0.79-0.90 s aligned and 1.04-1.21 s misaligned by 64 bytes; through the buffer, misaligned, 0.70-0.75 s."""
    if (src_off - dst_off) % mmap.PAGESIZE == 0:
        while n and _KERNEL_COPY[0]:
            try:
                k = os.copy_file_range(src_fd, dst_fd, n, src_off, dst_off)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                _KERNEL_COPY[0] = False
                break
            if k <= 0:
                raise OSError(errno.EIO, f"copy_file_range copied nothing at offset {src_off}")
            src_off, dst_off, n = src_off + k, dst_off + k, n - k
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = memoryview(bytearray(WRITE_PIECE))
    while n:
        k = os.preadv(src_fd, [buf[:min(n, len(buf))]], src_off)
        if not k:
            raise OSError(errno.EIO, f"unexpected end of file at offset {src_off}")
        write_all(dst_fd, buf[:k], dst_off)
        src_off, dst_off, n = src_off + k, dst_off + k, n - k


def fill(target: Target, fn: Callable[[list[torch.Tensor]], torch.Tensor], sources: list[Located], files: Files,
         runs: list | None = None) -> None:
    """Write ``fn(sources)`` to ``target``: the byte runs of :func:`row_runs` (``runs``, computed when None) in
    the kernel (long runs by ``copy_file_range``, short ones gathered from the mapped sources into ``pwritev``
    calls), or the tensor computed from the sources' views and written."""
    if runs is None:
        runs = plan(fn, sources, target)
    if runs is None:
        write_tensor(target, fn([s.view() for s in sources]))  # it checks the tensor against the target's slot
        return
    gather: list = []
    gathered = 0  # bytes in gather
    for s, src_off, out_off, n in runs:
        if n >= SMALL_RUN:
            copy_range(files.fd(sources[s].path), sources[s].offset + src_off, target.fd, target.offset + out_off, n)
            continue
        if gather and (gather[-1][0] + gather[-1][1] != out_off or len(gather) == _IOV_MAX
                       or gathered + n > WRITE_PIECE):
            _gathered(target, gather, files, sources)
            gather, gathered = [], 0
        gather.append((out_off, n, s, src_off))
        gathered += n
    if gather:
        _gathered(target, gather, files, sources)
    start_writeback(target.fd, target.offset, target.nbytes)


def _gathered(target: Target, pieces: list, files: Files, sources: list[Located]) -> None:
    """One ``pwritev`` of consecutive output pieces ``(output offset, length, source, source offset)``, each a
    slice of its mapped source file (no copy in the process)."""
    views = [files.mapped(sources[s].path)[sources[s].offset + a:sources[s].offset + a + n]
             for _, n, s, a in pieces]
    pos = target.offset + pieces[0][0]
    done = os.pwritev(target.fd, views, pos)
    for v in views:  # after a short write (rare), the rest piece by piece
        skip = min(done, v.nbytes)
        done -= skip
        if skip < v.nbytes:
            write_all(target.fd, v[skip:], pos + skip)
        pos += v.nbytes
    for v in views:
        v.release()


def plan(fn, sources: list[Located], target: Target) -> list | None:
    """:func:`row_runs` for ``target``, or None when it is small (computing it is as cheap)."""
    if target.nbytes < MIN_COPY_BYTES:
        return None
    return row_runs(fn, sources, target.shape, target.dtype)
