"""Streaming reading and writing of HF safetensors checkpoints (one tensor at a time, never the whole model).

``HFReader`` indexes a model directory (``model.safetensors`` or a sharded ``model.safetensors.index.json``),
exposes tensors under canonical names (:func:`mapping.canonical_hf_name`) and checks that every file is
present and complete. It opens a file for each tensor it reads and closes it again: safetensors memory-maps
the file, and a handle kept open would keep every page read so far resident (the whole model by the end). ``HFShardWriter`` writes tensors into size-bounded shards plus the index, like
``save_pretrained``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_vlm.convert.mapping import canonical_hf_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    pass


class HFReader:
    def __init__(self, hf_dir):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
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
        self._files: list[str] = []
        self._where: dict[str, tuple[str, str]] = {}
        for fname in files:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"{path} is listed in {INDEX} but missing; re-download the model")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{path} is truncated or corrupt ({e}); re-download the model") from e
            _check_complete(path, handle)
            self._files.append(fname)
            for name in handle.keys():
                self._where[canonical_hf_name(name)] = (fname, name)
            del handle
        if weight_map:
            missing = [n for n, f in weight_map.items() if canonical_hf_name(n) not in self._where]
            if missing:
                raise CheckpointError(f"{len(missing)} tensors of {INDEX} are not in their files, e.g. {missing[0]}")

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        try:
            fname, key = self._where[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing from {self.dir}; is this the right model?") from None
        return self._open(fname).get_tensor(key)  # a copy; the mapping goes with the handle

    def _open(self, fname: str):
        from safetensors import safe_open

        return safe_open(str(self.dir / fname), framework="pt")

    def dtype(self) -> torch.dtype:
        counts: dict[torch.dtype, int] = {}
        handles = {f: self._open(f) for f in self._files}
        for fname, key in self._where.values():
            t = handles[fname].get_slice(key)
            dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(t.get_dtype())
            if dt is not None:
                counts[dt] = counts.get(dt, 0) + 1
        return max(counts, key=counts.get) if counts else torch.float32

    def nbytes(self) -> int:
        return sum(os.path.getsize(self.dir / f) for f in self._files)


def _check_complete(path: Path, handle) -> None:
    """A file cut short after its header still opens; compare the header's data size with the file size."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if os.path.getsize(path) < 8 + header_len + end:
        raise CheckpointError(f"{path} is truncated ({os.path.getsize(path)} bytes); re-download the model")


class HFShardWriter:
    """Writes tensors to ``model-0000X-of-0000N.safetensors`` shards of at most ``max_shard_bytes``."""

    def __init__(self, out_dir, max_shard_bytes: int = 5 * 2**30):
        self.dir = Path(out_dir)
        self.max = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + n > self.max:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += n
        self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        fname = f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(self.dir / fname), metadata={"format": "pt"})
        self._shards.append((fname, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(self.dir / self._shards[0][0], self.dir / SINGLE)
            return
        weight_map = {}
        for i, (tmp, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / tmp, self.dir / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2))
