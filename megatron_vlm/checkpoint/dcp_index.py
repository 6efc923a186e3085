"""The ``.metadata`` index of a torch_dist checkpoint, read without importing torch and without running code.

torch.distributed.checkpoint writes the index as a pickle of its ``Metadata`` dataclasses. The cheap input
checks of the converters and the training launcher (:mod:`megatron_vlm.checkpoint.checks`,
:mod:`megatron_vlm.launch.preflight`) need two facts from it: the bytes each ``.distcp`` shard must hold, and
the global shapes of the tensors. torch's ``FileSystemReader.read_metadata`` would give them, but it imports
torch.distributed.checkpoint (~3.5 s of CPU on a 2-core machine: most of what a CPU launch's launcher spent),
and it unpickles with ``pickle.load``, which runs whatever callable the file names.

:func:`read_index` unpickles with an allowlist instead: the dataclasses of torch's index become plain records
of their fields, ``torch.Size`` a tuple, a dtype or layout its name; any other global is refused
(:class:`UnreadableIndex`), so a damaged or hostile index is an error, never code. The allowlist is what the
indexes torch 2.13 writes hold (megatron-core 0.16 and 0.19 checkpoints: converted at any TP/PP, training
iterations with optimizer state, bf16, Transformer Engine ``_extra_state``); ``tests/test_dcp_index.py``
compares this reader with torch's on such checkpoints. The ranks still load checkpoints with megatron-core.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = ".metadata"

#: the classes of torch's index, by module (each read as a record of its pickled fields)
_RECORDS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
}
_DTYPES = {
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
}


class UnreadableIndex(ValueError):
    """The index is not a torch_dist index this reader knows (damaged, truncated, or naming other code)."""


class _Record:
    """A field record standing in for one of torch's index dataclasses (or enums, built from their value)."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and all(p is None or isinstance(p, dict) for p in state):
            for part in state:  # (__dict__ or None, __slots__ values)
                self.__dict__.update(part or {})
        else:  # a class's own __getstate__ (TensorProperties: a tuple of its fields)
            self.state = state


_TYPES: dict[tuple[str, str], type] = {}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _RECORDS.get(module, ()):
            return _TYPES.setdefault((module, name), type(name, (_Record,), {}))
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and name in _DTYPES:
            return f"torch.{name}"
        if module == "torch.serialization" and name == "_get_layout":
            return str
        raise UnreadableIndex(f"it names {module}.{name}, which a torch_dist index does not hold")


@dataclass
class Index:
    shard_bytes: dict[str, int]  # shard file (relative to the iteration directory) -> bytes it must hold
    shapes: dict[str, tuple[int, ...]]  # tensor key -> global shape


def read_index(it_dir) -> Index:
    """The shards and tensor shapes that ``it_dir/.metadata`` records; :class:`UnreadableIndex` if it cannot
    be read (any failure, with the reason)."""
    path = Path(it_dir) / INDEX_FILE
    try:
        with open(path, "rb") as f:
            meta = _Unpickler(f).load()
        shard_bytes: dict[str, int] = {}
        for info in (getattr(meta, "storage_data", None) or {}).values():
            rel = getattr(info, "relative_path", None)
            if rel is not None:
                shard_bytes[rel] = max(shard_bytes.get(rel, 0), int(info.offset) + int(info.length))
        shapes = {key: tuple(int(n) for n in md.size) for key, md in meta.state_dict_metadata.items()
                  if hasattr(md, "size")}
    except UnreadableIndex:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling or shape failure means an index this cannot read
        raise UnreadableIndex(f"{type(e).__name__}: {e}") from None
    return Index(shard_bytes, shapes)
