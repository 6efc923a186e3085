"""Reading and writing Megatron checkpoints one tensor at a time, for the converters.

**torch_dist.** The keys, global shapes and offsets of every tensor come from megatron-core itself: the converters
build the TP=1/PP=1 model on the meta device (no weight is allocated) and take its ``sharded_state_dict`` with the
factories applied (:func:`dist_pieces`). Each ShardedTensor is then a block of one state-dict tensor (the "full"
tensor of a :class:`~megatron_vlm.convert.mapping.Rule`): a whole tensor, or e.g. the gate or the up half of a
SwiGLU ``linear_fc1``; :class:`Piece` records which block. New kinds of tensors (experts, routers) come with their
rules and megatron-core's own keys, nothing here names them.

- :func:`save_dist` writes through ``dist_checkpointing.save`` with :class:`StreamingSaveStrategy`: megatron-core
  saves its common state and ``metadata.json`` and checks the sharding as in any save, torch.distributed.checkpoint
  writes the ``.distcp`` file and ``.metadata``; the strategy's planner resolves each write item only when the
  writer reaches it, from results a :class:`~megatron_vlm.convert.streaming.Runner` computes ahead in the
  writer's order. At most a few tensors are in memory at any time.
- :class:`DistReader` loads the blocks of one full tensor at a time with torch.distributed.checkpoint (the
  checkpoint's index read once), straight into a tensor of the dtype stored.

**Legacy ``torch``.** :class:`LegacyWriter` first writes each rank file ``mp_rank_XX[_YYY]/model_optim_rng.pt``
with ``torch.save`` under ``torch.serialization.skip_data``, from placeholder (fake) tensors: a complete archive
with every record in place and no data (its CRC-32 0). Each shard's bytes then go to their record's offset as soon
as they are made; once all are in place the records are read back (page cache, bounded chunks) and their CRC-32s
written into the zip central directory and data descriptors, so every file ends as the archive ``torch.save`` would
have written: ``zipfile``'s ``testzip`` and ``unzip -t`` pass. :class:`LegacyReader` reads rank files
memory-mapped.
"""

from __future__ import annotations

import io
import logging
import math
import os
import threading
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.convert import mapping
from megatron_vlm.convert.file_tensors import Located, Target, itemsize, tensor_bytes, write_all

log = logging.getLogger(__name__)


# ---- megatron-core's view of the model ------------------------------------------------------------------------
class _MetaOnly(torch.overrides.TorchFunctionMode):
    """Keeps a model build on the meta device on a machine with CUDA too: megatron-core's layers name their device
    (``torch.cuda.current_device()`` unless ``use_cpu_initialization``, which is off where CUDA is) and its CLIP ViT
    moves a buffer with ``.cuda()``, which a meta tensor refuses ("Cannot copy out of meta tensor"). Every device
    a factory function or ``Tensor.to`` names becomes ``meta``, and ``.cuda()`` of a meta tensor is the tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda and args and args[0].is_meta:
            return args[0]
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = "meta"
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, int, torch.device)):
            args = (args[0], "meta", *args[2:])
        return func(*args, **kwargs)


def meta_model(spec, dtype: torch.dtype):
    """The TP=1/PP=1 LLaVAModel on the meta device (a one-process world must be up): shapes and megatron-core's
    checkpoint keys, no weights. Every parameter gets ``dtype`` (megatron-core makes local norms and the ViT's
    conv1 fp32 whatever ``params_dtype`` says; a converted checkpoint keeps one dtype)."""
    from megatron_vlm.model.build import ModelOptions, build_model

    with torch.device("meta"), _MetaOnly():
        model = build_model(spec, ModelOptions(params_dtype=dtype, perform_initialization=False, seq_length=64))
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = torch.empty(p.shape, dtype=dtype, device="meta")
    return model


@dataclass
class Piece:
    """A ShardedTensor of megatron-core's (``sh``) and the block of the full tensor ``name`` it holds."""

    sh: object  # megatron.core.dist_checkpointing.ShardedTensor
    name: str  # the state-dict name, a Rule's ``mcore``
    start: tuple[int, ...]
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]  # the full tensor's shape

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.sh.key, tuple(self.sh.global_offset)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The block of the full tensor ``t`` (dimensions the block spans whole are left alone, so a row proxy of
        :mod:`megatron_vlm.convert.copyplan` passes through)."""
        for d, (s, n) in enumerate(zip(self.start, self.shape)):
            if d == 0 and (s or n != t.shape[0]) or d > 0 and (s or n != self.full_shape[d]):
                t = t.narrow(d, s, n)
        return t


def dist_pieces(model, names, layout: ckpt.DistKeyLayout = ckpt.DistKeyLayout()):
    """``(sharded_state_dict, pieces)``: megatron-core's sharded state dict of ``model`` (keys of ``layout``,
    factories applied) and, for each state-dict name in ``names``, the :class:`Piece` s it is stored as. Raises
    when megatron-core's model and the names disagree, or when the pieces do not tile a tensor exactly."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = ckpt.model_sharded_state_dict(model, layout)
    params = dict(model.state_dict(keep_vars=True))
    apply_factories(sharded)
    pieces: dict[str, list[Piece]] = {}
    for key, value in sharded.items():
        name = key[len(layout.prefix):]
        shs = [v for v in (nested_values(value) if isinstance(value, (dict, list)) else [value])
               if isinstance(v, ShardedTensor)]
        if not shs:
            continue  # _extra_state objects: megatron-core saves them, nothing converts them
        if name not in names:
            raise ValueError(f"megatron-core's model has {name}, which no conversion rule makes")
        full = tuple(params[name].shape)
        for sh in shs:
            if getattr(sh, "flattened_range", None) is not None:
                raise ValueError(f"{sh.key}: a flattened ShardedTensor in a model state dict")
            p = sh.prepend_axis_num
            start, shape = tuple(sh.global_offset[p:]), tuple(sh.local_shape)
            if len(start) != len(full) or any(s + n > f for s, n, f in zip(start, shape, full)):
                raise ValueError(f"{sh.key} at {tuple(sh.global_offset)} is not a block of {name} {full}")
            pieces.setdefault(name, []).append(Piece(sh, name, start, shape, full))
        if sum(math.prod(pc.shape) for pc in pieces[name]) != math.prod(full):
            raise ValueError(f"megatron-core stores {name} {full} in blocks that do not tile it")
    absent = sorted(set(names) - set(pieces))
    if absent:
        raise ValueError(f"megatron-core's model has no {absent[0]} ({len(absent)} rule tensors absent)")
    return sharded, pieces


def exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` on a storage of exactly its bytes (torch.distributed.checkpoint's writer copies any tensor whose storage
    is larger); a contiguous view is re-wrapped without a copy."""
    if not t.is_contiguous():
        return t.contiguous()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    return torch.frombuffer(tensor_bytes(t), dtype=torch.uint8).view(t.dtype).view(t.shape)


# ---- torch_dist: writing --------------------------------------------------------------------------------------
class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open binary file, as a seekable file (one item of a ``.distcp``
    file is one ``torch.save`` archive)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: pos, io.SEEK_CUR: self.pos + pos, io.SEEK_END: self.length + pos}[whence]
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def archive_tensor(f, offset: int, length: int) -> tuple[torch.Tensor, int]:
    """The tensor that the ``torch.save`` archive at ``[offset, offset + length)`` of ``f`` holds, its data not
    read (its shape, dtype and layout, from torch's own reader), and the file offset of its storage's bytes."""
    view = _Slice(f, offset, length)
    with torch.serialization.skip_data():
        t = torch.load(view, map_location="cpu", weights_only=True)
    records = [r for r in torch._C.PyTorchFileReader(_Slice(f, offset, length)).get_all_records()
               if r.startswith("data/")]
    if not isinstance(t, torch.Tensor) or len(records) != 1:
        raise ValueError("not a one-tensor archive")
    return t, offset + torch._C.PyTorchFileReader(_Slice(f, offset, length)).get_record_offset(records[0])


def _make_strategy(write_data):
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class _Writer(dcp.FileSystemWriter):
        """torch.distributed.checkpoint's file system writer, one file, in two passes: :meth:`write_data` writes
        every item's archive with ``torch.save`` under ``skip_data`` (the records in place, no tensor data);
        :meth:`commit` has ``write_data`` write the data at the offsets those archives give, flushes, and writes
        ``.metadata``."""

        @property
        def checkpoint_id(self):  # a str, as megatron-core's own writer records it in .metadata
            return str(self.path)

        def write_data(self, plan, planner):
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            path = Path(self.path) / name
            results, self._tensors = [], []
            with open(path, "wb") as f:
                for item in plan.items:
                    offset = f.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        f.write(planner.resolve_data(item).getbuffer())
                    else:
                        sizes, dtype = tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype
                        with torch.serialization.skip_data(materialize_fake_tensors=True):
                            torch.save(_placeholder(sizes, dtype), f)
                        self._tensors.append((item.index, str(path), offset, f.tell() - offset))
                    results.append(WriteResult(item.index, f.tell() - offset,
                                               _StorageInfo(name, offset, f.tell() - offset)))
            fut = Future()
            fut.set_result(results)
            return fut

        def finish(self, metadata, results):
            self.finished = (metadata, results)  # written by commit(), after the data

        def commit(self) -> None:
            """Fill the tensors' bytes where the archives say (outside torch's save, which would turn Ctrl-C
            into a CheckpointException), flush them, then write ``.metadata``."""
            offsets = {}
            for index, path, offset, length in self._tensors:
                with open(path, "rb") as f:
                    offsets[(index.fqn, tuple(index.offset))] = (path, archive_tensor(f, offset, length)[1])
            write_data(offsets)
            for path in {p for _, p, _, _ in self._tensors}:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            dcp.FileSystemWriter.finish(self, *self.finished)

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        """megatron-core's torch_dist save whose tensor data ``write_data`` writes in place (:class:`_Writer`)."""

        def __init__(self):
            super().__init__("torch_dist", 1)

        def save(self, sharded_state_dict, checkpoint_dir):
            flat = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)[0]
            pyt = mcore_to_pyt_state_dict(flat, False)
            writer = _Writer(str(checkpoint_dir), single_file_per_rank=True, sync_files=False, thread_count=1)
            planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                                       flatten_sharded_tensors=False)
            dcp.save(pyt, storage_writer=writer, planner=planner, no_dist=True)
            writer.commit()

    return StreamingSaveStrategy()


def _placeholder(shape, dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` with no memory behind it (for ``torch.save`` under ``skip_data``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype)


def save_dist(sharded_state_dict: dict, iter_dir, write_data) -> None:
    """Save ``sharded_state_dict`` (from :func:`dist_pieces`, on the meta device) to ``iter_dir`` with
    ``dist_checkpointing.save``; ``write_data(offsets)`` then writes the data: ``offsets[(key, global offset)]`` is
    the ``(file, byte offset)`` of each ShardedTensor's bytes."""
    from megatron.core import dist_checkpointing

    Path(iter_dir).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded_state_dict, str(iter_dir), sharded_strategy=_make_strategy(write_data))


# ---- torch_dist: reading --------------------------------------------------------------------------------------
class DistReader:
    """Full tensors of a torch_dist checkpoint: read through torch.distributed.checkpoint one at a time
    (:meth:`read`), or located in the ``.distcp`` files for a kernel copy (:meth:`located`). Thread-safe."""

    def __init__(self, iter_dir, pieces: dict[str, list[Piece]]):
        from torch.distributed.checkpoint import FileSystemReader

        self.dir, self.pieces = str(iter_dir), pieces
        reader = FileSystemReader(self.dir)
        self.metadata = reader.read_metadata()
        self._archives: dict = {}
        self._lock = threading.Lock()
        _check_transforms(self.dir, self.metadata, reader)

    def dtype(self, name: str) -> torch.dtype:
        sh = self.pieces[name][0].sh
        md = self.metadata.state_dict_metadata.get(sh.key)
        if md is None:
            raise ckpt.CheckpointLayoutError(f"{self.dir} has no tensor {sh.key}; it is not a checkpoint of this "
                                             "model")
        return md.properties.dtype

    def shape(self, name: str) -> tuple[int, ...]:
        ps = self.pieces[name]
        return tuple(max(pc.start[d] + pc.shape[d] for pc in ps) for d in range(len(ps[0].shape)))

    def read(self, rule) -> torch.Tensor:
        """The full tensor of ``rule`` (in the dtype stored), loaded with torch.distributed.checkpoint."""
        from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner, mcore_to_pyt_state_dict
        from torch.distributed import checkpoint as dcp

        metadata, name = self.metadata, rule.mcore

        class _Reader(dcp.FileSystemReader):
            def read_metadata(self, *args, **kwargs):
                return metadata

        full = torch.empty(self.shape(name), dtype=self.dtype(name))
        grouped: dict[str, list] = {}
        copies = []
        for pc in self.pieces[name]:
            target = pc.of(full)
            buf = target if target.is_contiguous() else torch.empty(pc.shape, dtype=full.dtype)
            if buf is not target:
                copies.append((target, buf))
            # megatron-core's stacked-layer axes become ordinary axes of extent 1: a subset of a key's blocks then
            # loads on its own (torch's ShardedTensor, which megatron-core uses for prepended axes, wants every
            # block of the key a one-process world holds)
            p = pc.sh.prepend_axis_num
            grouped.setdefault(pc.sh.key, []).append(replace(
                pc.sh, data=buf.view((1,) * p + pc.shape), local_shape=(1,) * p + pc.shape, prepend_axis_num=0))
        shs = [sh for v in grouped.values() for sh in v]
        pyt = mcore_to_pyt_state_dict(grouped, True)
        dcp.load(pyt, storage_reader=_Reader(self.dir),
                 planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=shs, flatten_state_dict=False,
                                          flatten_sharded_tensors=False), no_dist=True)
        for target, buf in copies:
            target.copy_(buf)
        return full

    def located(self, rule):
        """``(sources, assemble, layout)`` for a kernel copy of ``rule``'s full tensor: the stored chunks that make it
        (each a :class:`~megatron_vlm.convert.file_tensors.Located`), the function that places them (rows only) and
        a key of that placement (tensors of one shape stored alike share their copy plan), or None when a chunk is
        not a block of whole rows stored plainly."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        name = rule.mcore
        full_shape = self.shape(name)
        sources, places = [], []
        for pc in self.pieces[name]:
            p = pc.sh.prepend_axis_num
            lo = tuple(pc.sh.global_offset)
            hi = tuple(o + n for o, n in zip(lo, (1,) * p + pc.shape))
            md = self.metadata.state_dict_metadata[pc.sh.key]
            for chunk in md.chunks:
                c_lo, c_n = tuple(chunk.offsets), tuple(chunk.sizes)
                if any(a + n <= b or a >= c for a, n, b, c in zip(c_lo, c_n, lo, hi)):
                    continue  # not in this piece
                inside = all(b <= a and a + n <= c for a, n, b, c in zip(c_lo, c_n, lo, hi))
                if not inside or any(n != 1 for n in c_n[:p]) or c_n[p + 1:] != tuple(full_shape[1:]):
                    return None  # a chunk across pieces, layers or a split of the rows: computed instead
                info = self.metadata.storage_data.get(MetadataIndex(pc.sh.key, chunk.offsets))
                if info is None or getattr(info, "transform_descriptors", None):
                    return None  # stored through a transform (e.g. compressed): read through it instead
                path = str(Path(self.dir) / info.relative_path)
                t, data = self._archive(path, info.offset, info.length)
                if (not t.is_contiguous() or t.storage_offset() or tuple(t.shape) != c_n
                        or t.untyped_storage().nbytes() != t.nbytes or t.dtype != self.dtype(name)):
                    return None
                row0 = c_lo[p] - lo[p] + pc.start[0]
                sources.append(Located(path, data, t.dtype, c_n[p:], lambda: None))
                places.append((row0, c_n[p]))

        def assemble(xs: list[torch.Tensor]) -> torch.Tensor:
            out = xs[0].new_zeros((full_shape[0],) + tuple(xs[0].shape[1:]))
            for x, (row0, n) in zip(xs, places):
                out[row0:row0 + n] = x
            return out

        return sources, assemble, ("rows", tuple(full_shape), tuple(places))

    def _archive(self, path: str, offset: int, length: int):
        key = (path, offset)
        with self._lock:
            if key not in self._archives:
                with open(path, "rb") as f:
                    self._archives[key] = archive_tensor(f, offset, length)
            return self._archives[key]


def _check_transforms(where: str, metadata, reader) -> None:
    """torch.distributed.checkpoint may store an item through stream transforms (its ``transform_descriptors``, e.g.
    ZStandard compression): :meth:`DistReader.read` loads such items through them, :meth:`DistReader.located` never
    copies their bytes. Raises :class:`CheckpointLayoutError` in one line when this torch has no extension for a
    transform, before anything is read."""
    registry = getattr(getattr(reader, "transforms", None), "extension_registry", None)
    seen = set()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
        if not descriptors or descriptors in seen:
            continue
        seen.add(descriptors)
        try:
            if registry is None:
                raise ValueError("this torch reads no transforms")
            registry.from_descriptor_list(descriptors)
        except Exception as e:  # noqa: BLE001 (torch's registry raises ValueError, an extension anything)
            raise ckpt.CheckpointLayoutError(
                f"{where}: {index.fqn} is stored through torch.distributed.checkpoint transform(s) "
                f"{', '.join(descriptors)}, which this environment cannot undo ({e}); read the checkpoint where the "
                "extension is installed (torch's ZStandard needs the zstandard package), or save it without "
                "transforms") from None


# ---- legacy rank files ----------------------------------------------------------------------------------------
class LegacyWriter:
    """The rank files of a legacy checkpoint, written in place. ``layout[(tp_rank, pp_rank, ep_rank)]``: the
    rank's ``(local name, dtype, shape)`` or ``(local name, dtype, shape, entry)`` (``ep`` expert-parallel ranks:
    Megatron-LM's ``mp_rank_TT[_PPP]_EEE`` files when above 1); ``entry`` is the file's model entry the tensor goes
    to, ``model`` (the default) or, with virtual pipeline stages, ``model0``, ``model1``, ... (one per model chunk,
    as Megatron-LM writes them). Each file is first written whole by ``torch.save`` under ``skip_data`` (every
    record in place, no data, its CRC-32 0); :meth:`target` gives where a tensor's bytes go, and :meth:`close` puts
    each record's CRC-32 into its zip headers once every byte is in place."""

    def __init__(self, iter_dir, pp: int, layout: dict, iteration, ep: int = 1):
        self._files: dict[tuple[int, int, int], dict] = {}
        for (t, p, e), entries in layout.items():
            path = ckpt.legacy_rank_file(iter_dir, t, p, pp, e, ep)
            path.parent.mkdir(parents=True, exist_ok=True)
            chunks: dict[str, list] = {}
            for name, dtype, shape, *entry in entries:
                chunks.setdefault(entry[0] if entry else "model", []).append((name, dtype, tuple(shape)))
            keys = sorted(chunks, key=lambda k: (len(k), k))  # model0, model1, ..., model10
            ordered = [(key, name, dtype, shape) for key in keys for name, dtype, shape in chunks[key]]
            state = {key: {name: _placeholder(shape, dtype) for name, dtype, shape in chunks[key]} for key in keys}
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save({**state, "checkpoint_version": 3.0, "iteration": iteration}, path)
            records = _records(path, [((key, name), math.prod(shape) * itemsize(dtype))
                                      for key, name, dtype, shape in ordered])
            self._files[(t, p, e)] = {"fd": os.open(path, os.O_RDWR), "records": records,
                                      "entries": {(key, name): (dtype, shape) for key, name, dtype, shape in ordered}}

    def target(self, tp_rank: int, pp_rank: int, name: str, ep_rank: int = 0, entry: str = "model"):
        f = self._files[(tp_rank, pp_rank, ep_rank)]
        dtype, shape = f["entries"][(entry, name)]
        return Target(f["fd"], f["records"][(entry, name)].offset, dtype, shape,
                      f"{name} ({entry} of rank file TP {tp_rank}, PP {pp_rank}, EP {ep_rank})")

    def close(self, workers: int = 2) -> None:
        """Write every record's CRC-32 (read back from the page cache in bounded chunks, ``workers`` records at
        a time) into its zip headers, then flush the files to disk."""
        from concurrent.futures import ThreadPoolExecutor

        jobs = [(f["fd"], r) for f in self._files.values() for r in f["records"].values()]
        with ThreadPoolExecutor(max(1, workers)) as pool:
            crcs = list(pool.map(lambda job: _crc32(job[0], job[1].offset, job[1].nbytes), jobs))
        for (fd, record), crc in zip(jobs, crcs):
            for at in record.crc_at:
                write_all(fd, crc.to_bytes(4, "little"), at)
        for f in self._files.values():
            os.fsync(f["fd"])
        self.abort()

    def abort(self) -> None:
        for f in self._files.values():
            if f["fd"] >= 0:
                os.close(f["fd"])
                f["fd"] = -1


@dataclass(frozen=True)
class _Record:
    """A storage record of a rank file: its data's byte range and the offsets of the zip fields holding its CRC-32
    (the central directory's, and the data descriptor's or the local header's)."""

    offset: int
    nbytes: int
    crc_at: tuple[int, ...]


_CRC_CHUNK = 8 << 20


def _crc32(fd: int, offset: int, nbytes: int) -> int:
    """The CRC-32 of bytes ``[offset, offset + nbytes)`` of ``fd``, read :data:`_CRC_CHUNK` at a time."""
    buf = bytearray(min(nbytes, _CRC_CHUNK))
    crc, done = 0, 0
    while done < nbytes:
        n = os.preadv(fd, [memoryview(buf)[:min(len(buf), nbytes - done)]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at offset {offset + done}")
        crc = zlib.crc32(memoryview(buf)[:n], crc)
        done += n
    return crc


def _records(path: Path, tensors: list[tuple[object, int]]) -> dict:
    """``name -> _Record`` of the storage records ``torch.save`` wrote for ``tensors`` (one storage each,
    numbered in pickling order, which is the state dicts' order), checked against the archive's sizes."""
    import struct
    import zipfile

    reader = torch._C.PyTorchFileReader(str(path))
    with zipfile.ZipFile(path) as zf:
        infos = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
        central, count, start = {}, len(zf.infolist()), zf.start_dir
    with open(path, "rb") as f:
        f.seek(start)  # the central directory: a CRC-32 at byte 16 of each entry
        for _ in range(count):
            head = f.read(46)
            if head[:4] != b"PK\x01\x02":
                raise RuntimeError(f"{path}: unexpected zip central directory")
            name_len, extra_len, comment_len = struct.unpack("<3H", head[28:34])
            name = f.read(name_len).decode()
            central[name.split("/", 1)[-1]] = f.tell() - name_len - 46 + 16
            f.seek(extra_len + comment_len, os.SEEK_CUR)
        out = {}
        for i, (name, nbytes) in enumerate(tensors):
            record = f"data/{i}"
            info = infos.get(record)
            if info is None or info.file_size != nbytes or record not in central:
                raise RuntimeError(f"{path}: record {record} holds {info and info.file_size} bytes, {name} has "
                                   f"{nbytes}")
            offset = reader.get_record_offset(record)
            if info.flag_bits & 0x08:  # a data descriptor follows the data (its signature is optional)
                f.seek(offset + nbytes)
                own = offset + nbytes + (4 if f.read(4) == b"PK\x07\x08" else 0)
            else:
                own = info.header_offset + 14
            out[name] = _Record(offset, nbytes, (central[record], own))
    return out


class LegacyReader:
    """Full tensors of a legacy checkpoint, merged over TP from memory-mapped rank files (thread-safe). With expert
    parallelism (``meta.ep`` > 1) an expert's tensors come from its EP rank's files (``mp_rank_TT[_PPP]_EEE``), under
    their local indices, merged over the expert TP size; with virtual pipeline stages (``meta.vpp`` > 1) from the
    ``model<c>`` entry of the chunk that holds them, under the chunk's own layer numbers. Each shard is read from a
    file that holds it (:class:`megatron_vlm.checkpoint.legacy_ranks.Sources`: Megatron-LM writes only some (TP, EP)
    files at ETP < TP)."""

    def __init__(self, iter_dir, spec, meta: ckpt.CheckpointMeta):
        from megatron_vlm.checkpoint import legacy_ranks

        self.dir, self.spec, self.meta = iter_dir, spec, meta
        self.ep, self.etp = meta.ep, meta.etp or meta.tp
        self.per_rank = spec.num_moe_experts // self.ep if spec.is_moe else None
        self.sources = legacy_ranks.Sources(iter_dir, legacy_ranks.present(iter_dir, self.ep > 1), meta.tp, meta.pp,
                                            self.ep, self.etp, spec.is_moe)
        self.stage_layers = meta.stage_layers  # per virtual stage (per PP stage without VPP)
        self._files: dict[tuple[int, int, int], tuple[dict, str, int | None]] = {}
        self._lock = threading.Lock()

    def _rank(self, t: int, p: int, e: int = 0, entry: str = "model") -> tuple[dict, str, int | None]:
        """(state under local names, file, base) of a rank file's model ``entry``: a storage's bytes are at
        ``data_ptr - base`` of the file (None when they cannot be placed)."""
        with self._lock:
            if (t, p, e) not in self._files:
                f = ckpt.load_legacy_rank(self.dir, t, p, self.meta.pp, ep_rank=e, ep=self.ep)
                states = {k: ckpt.normalize_legacy_names(v) for k, v in f.items()
                          if k == "model" or (k.startswith("model") and k[5:].isdigit())}  # TE names, _extra_state
                path = str(ckpt.legacy_rank_file(self.dir, t, p, self.meta.pp, e, self.ep))
                self._files[(t, p, e)] = (states, path, _storage_base(path, [
                    v for state in states.values() for v in state.values() if isinstance(v, torch.Tensor)]))
            states, path, base = self._files[(t, p, e)]
            if entry not in states:
                raise ckpt.CheckpointLayoutError(
                    f"{path} has no '{entry}' entry (it has {sorted(states)}); the checkpoint's virtual pipeline "
                    f"stages (vpp={self.meta.vpp} in its {ckpt.META}) are not those of its rank files")
            return states[entry], path, base

    def _stored_as(self, rule) -> tuple[list[tuple[int, int, int]], str, str]:
        """The rank files ``(tp, pp, ep)`` that hold ``rule``'s TP shards, in TP order, its local name there and
        the files' model entry (``model<c>`` for chunk c with virtual pipeline stages)."""
        from megatron_vlm.model.pipeline_layout import rank_and_chunk

        stage = mapping.stages_of(rule, self.spec, self.stage_layers)[0]
        name = mapping.local_name(rule, stage, self.stage_layers, self.per_rank)
        p, c = rank_and_chunk(stage, self.meta.pp)
        entry = "model" if self.meta.vpp == 1 else f"model{c}"
        split = mapping.split_size(rule, self.meta.tp, self.etp)
        e = mapping.ep_rank_of(rule, self.spec, self.ep)
        if rule.expert is None:
            files = [(t, p, self.sources.dense(t, p)) for t in range(split)]
        else:
            files = [(self.sources.experts(x, p, e), p, e) for x in range(split)]
        return files, name, entry

    def shards(self, rule) -> list[torch.Tensor]:
        files, name, entry = self._stored_as(rule)
        out = []
        for t, p, e in files:
            state = self._rank(t, p, e, entry)[0]
            if name not in state:
                raise ckpt.CheckpointLayoutError(f"{name} is missing from rank file tp={t} pp={p}"
                                                 f"{f' ep={e}' if self.ep > 1 else ''}"
                                                 f"{f' ({entry})' if entry != 'model' else ''} of {self.dir}")
            out.append(state[name])
        return out

    def read(self, rule) -> torch.Tensor:
        return mapping.tp_merge(rule, self.shards(rule))

    def located(self, rule):
        """``(sources, merge, layout)`` for a kernel copy: the TP shards in their files, ``tp_merge`` and a key of
        it; None when a shard's bytes cannot be placed."""
        files, _, entry = self._stored_as(rule)
        sources = []
        for (t, p, e), shard in zip(files, self.shards(rule)):
            _, path, base = self._rank(t, p, e, entry)
            if base is None or not shard.is_contiguous():
                return None
            offset = shard.untyped_storage().data_ptr() - base + shard.storage_offset() * shard.element_size()
            sources.append(Located(path, offset, shard.dtype, tuple(shard.shape), lambda: None))
        return sources, lambda xs: mapping.tp_merge(rule, xs), ("tp_merge", rule.split)


def _storage_base(path: str, tensors: list[torch.Tensor]) -> int | None:
    """The address the memory-mapped file ``path`` starts at, from its tensors' storages and torch's record
    offsets (each storage is one record); None when they do not line up."""
    reader = torch._C.PyTorchFileReader(path)
    offsets = {reader.get_record_offset(r) for r in reader.get_all_records() if r.startswith("data/")}
    ptrs = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    if not ptrs or not offsets:
        return None
    first = min(ptrs)
    for o in sorted(offsets):  # the file may hold other records (an optimizer's state) before the model's
        base = first - o
        if all(p - base in offsets for p in ptrs):
            return base
    return None
