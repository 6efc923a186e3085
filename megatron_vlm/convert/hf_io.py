"""Reading and writing HF safetensors checkpoints one tensor at a time, never the whole model.

``HFReader`` indexes a model directory (``model.safetensors`` or a sharded ``model.safetensors.index.json``),
exposes tensors under canonical names (:func:`mapping.canonical_hf_name`) and checks that every file is present
and complete. It reads each file's header (the safetensors format: an 8-byte length, a JSON table of names,
dtypes, shapes and byte ranges, then the data) and memory-maps the file: :meth:`HFReader.view` is a tensor on the
mapped bytes (no copy, and the pages belong to the page cache, not to the process's anonymous memory),
:meth:`HFReader.release` drops a tensor's pages from the mapping once it is converted, so the mapping never keeps
the model resident.

``SafetensorsWriter`` writes a planned list of tensors (names, dtypes, shapes known up front) into
``max_shard_bytes`` shards plus the index, as ``save_pretrained`` lays them out: the headers are written first and
each tensor's bytes go straight to their place in their shard as soon as they are made, in any order and from
several threads. Nothing is buffered; a shard is complete when every tensor planned for it has been written.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_vlm.convert.file_tensors import Located, Target, write_all, write_tensor
from megatron_vlm.convert.mapping import canonical_hf_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

#: safetensors dtype names <-> torch dtypes
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    file: str
    key: str  # the name in the file (before canonical_hf_name)
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte range in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> tuple[dict, int]:
    """(header table, offset of the data) of a safetensors file; :class:`CheckpointError` when it is not one
    or is cut short."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{path} is truncated or not a safetensors file; re-download the model")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path} has a corrupt header ({e}); re-download the model") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt header; re-download the model")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size < 8 + n + end:
        raise CheckpointError(f"{path} is truncated ({size} bytes); re-download the model")
    return header, 8 + n


class _MappedTensors:
    """Tensors of safetensors files, memory-mapped (the base of :class:`HFReader` and :class:`SafetensorsFile`)."""

    def __init__(self, root: Path):
        self.dir = root
        self._files: list[str] = []
        self._info: dict[str, TensorInfo] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _add_file(self, fname: str, rename=lambda key: key) -> None:
        path = self.dir / fname
        header, base = read_header(path)
        self._files.append(fname)
        for key, v in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype = ST_DTYPES[v["dtype"]]
                s, e = v["data_offsets"]
                shape = tuple(int(d) for d in v["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {key} has a corrupt header entry; re-download the "
                                      "model") from None
            self._info[rename(key)] = TensorInfo(fname, key, dtype, shape, base + s, base + e)

    def names(self) -> list[str]:
        return sorted(self._info)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def info(self, name: str) -> TensorInfo:
        try:
            return self._info[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing from {self.dir}; is this the right model?") from None

    def _map(self, fname: str) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(fname)
            if m is None:
                with open(self.dir / fname, "rb") as f:
                    # a private mapping: the tensors are writable views (torch wants that), and a write would
                    # never reach the file
                    m = self._maps[fname] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            return m

    def located(self, name: str):
        """``name`` as a :class:`~megatron_vlm.convert.file_tensors.Located` source (its file and byte offset)."""
        info = self.info(name)
        return Located(str(self.dir / info.file), info.start, info.dtype, info.shape, lambda: self.view(name))

    def view(self, name: str) -> torch.Tensor:
        """``name`` as a tensor on the memory-mapped file (no copy). Valid until :meth:`close`."""
        info = self.info(name)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        raw = torch.frombuffer(self._map(info.file), dtype=torch.uint8, count=info.nbytes, offset=info.start)
        return raw.view(info.dtype).view(info.shape)

    def get(self, name: str) -> torch.Tensor:
        """``name`` as a tensor of its own (a copy of the mapped bytes)."""
        return self.view(name).clone()

    def release(self, name: str) -> None:
        """Drop ``name``'s pages from this process's mapping (they stay in the page cache): after a tensor is
        converted, its bytes need not stay resident in the converter."""
        info = self._info.get(name)
        m = info and self._maps.get(info.file)
        if m is None:
            return
        page = mmap.PAGESIZE
        start = -(-info.start // page) * page  # whole pages inside the tensor only: a neighbour may be in use
        stop = info.end // page * page
        if stop > start and hasattr(m, "madvise"):
            m.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                try:
                    m.close()
                except BufferError:  # a tensor still views it; the mapping goes when that tensor does
                    pass
            self._maps.clear()

    def dtype(self) -> torch.dtype:
        """The floating dtype most of the tensors have (float32 when none is floating)."""
        counts: dict[torch.dtype, int] = {}
        for info in self._info.values():
            if info.dtype in (torch.float32, torch.bfloat16, torch.float16):
                counts[info.dtype] = counts.get(info.dtype, 0) + 1
        return max(counts, key=counts.get) if counts else torch.float32

    def nbytes(self) -> int:
        return sum(os.path.getsize(self.dir / f) for f in self._files)


class HFReader(_MappedTensors):
    """The weights of an HF model directory, under canonical names."""

    def __init__(self, hf_dir):
        super().__init__(Path(hf_dir))
        if not (self.dir / "config.json").is_file():
            raise CheckpointError(f"--hf-dir {self.dir} is not a Hugging Face model directory (no config.json)")
        if (self.dir / INDEX).is_file():
            weight_map = json.loads((self.dir / INDEX).read_text())["weight_map"]
        elif (self.dir / SINGLE).is_file():
            weight_map = None
        else:
            raise CheckpointError(
                f"--hf-dir {self.dir} has no {SINGLE} or {INDEX}; save the model with safe_serialization=True"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        arch = _model_type(self.dir / "config.json")

        def rename(key: str) -> str:
            return canonical_hf_name(key, arch)

        for fname in files:
            if not (self.dir / fname).is_file():
                raise CheckpointError(f"{self.dir / fname} is listed in {INDEX} but missing; re-download the model")
            self._add_file(fname, rename)
        if weight_map:
            missing = [n for n in weight_map if rename(n) not in self._info]
            if missing:
                raise CheckpointError(f"{len(missing)} tensors of {INDEX} are not in their files, e.g. {missing[0]}")


def _model_type(config_json: Path) -> str | None:
    """The ``model_type`` of an HF config.json (which of mapping's name layouts its tensors use), or None."""
    try:
        data = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


class SafetensorsFile(_MappedTensors):
    """The tensors of one safetensors file (e.g. a checkpoint's ``hf_extra.safetensors``), under their own names."""

    def __init__(self, path):
        path = Path(path)
        super().__init__(path.parent)
        self._add_file(path.name)


# ---- writing --------------------------------------------------------------------------------------------------
class SafetensorsWriter:
    """Writes the planned tensors ``entries`` (``(name, dtype, shape)``) into shards of at most
    ``max_shard_bytes`` in ``out_dir``: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` (``single_name``: always one file of that name, e.g. ``hf_extra.safetensors``).
    :meth:`write` may be called from several threads, in any order; :meth:`close` checks that every tensor was
    written, flushes the files to disk and writes the index."""

    def __init__(self, out_dir, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_bytes: int = 5 * 2**30, single_name: str | None = None):
        self.dir = Path(out_dir)
        shards: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = [[]]
        size = 0
        for name, dtype, shape in entries:
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if single_name is None and shards[-1] and size + n > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, dtype, tuple(shape), n))
            size += n
        if single_name is not None:
            names = [single_name]
        elif len(shards) == 1:
            names = [SINGLE]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self._slots: dict[str, tuple[int, int, int, torch.dtype, tuple[int, ...]]] = {}
        self._files: list[tuple[str, int]] = []
        self.total = 0
        self.index = len(shards) > 1 and single_name is None
        for k, (fname, items) in enumerate(zip(names, shards)):
            # as safetensors orders them: the widest dtypes first, so every tensor stays aligned, then by name (so a
            # file HF wrote comes back byte for byte)
            items = sorted(items, key=lambda it: (-torch.empty((), dtype=it[1]).element_size(), it[0]))
            table, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, dtype, shape, n in items:
                table[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
                offset += n
            header = json.dumps(table, separators=(",", ":")).encode()
            header += b" " * (-len(header) % 8)
            base = 8 + len(header)
            fd = os.open(self.dir / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._files.append((fname, fd))
            write_all(fd, len(header).to_bytes(8, "little") + header, 0)
            os.ftruncate(fd, base + offset)
            for name, dtype, shape, n in items:
                self._slots[name] = (k, base + table[name]["data_offsets"][0], n, dtype, shape)
            self.total += offset
        self._left = set(self._slots)
        self._lock = threading.Lock()

    def target(self, name: str):
        """Where ``name``'s bytes go (a :class:`~megatron_vlm.convert.file_tensors.Target`); the caller fills it."""
        k, offset, n, dtype, shape = self._slots[name]
        with self._lock:
            self._left.discard(name)
        return Target(self._files[k][1], offset, dtype, shape, name)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        write_tensor(self.target(name), tensor)  # it checks the tensor against the planned slot

    def close(self) -> None:
        if self._left:
            raise RuntimeError(f"{len(self._left)} planned tensors were not written, e.g. {sorted(self._left)[0]}")
        for _, fd in self._files:
            os.fsync(fd)
        self.abort()
        if self.index:
            weight_map = {name: self._files[k][0] for name, (k, *_) in self._slots.items()}
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / INDEX).write_text(json.dumps(index, indent=2))

    def abort(self) -> None:
        """Close the files (a failed conversion's directory is removed by its caller)."""
        for _, fd in self._files:
            try:
                os.close(fd)
            except OSError:
                pass
        self._files = [(f, -1) for f, _ in self._files]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
