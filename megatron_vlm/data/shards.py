"""Deterministic webdataset shard writing: ``000000.tar, 000001.tar, ...``.

The same samples give byte-identical tars: members in a fixed order (sorted by extension within a
sample, samples in input order), fixed mtime, uid/gid 0, empty user/group names, mode 0644, USTAR format.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

MTIME = 0
SHARD_NAME = "{:06d}.tar"


class ShardWriter:
    """Write samples ``key -> {extension: bytes}`` into tars of ``shard_size`` samples under ``out_dir``."""

    def __init__(self, out_dir: str | Path, shard_size: int = 1000):
        if shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.shard_size = shard_size
        self.shards: list[tuple[str, int]] = []  # (file name, samples)
        self._tar: tarfile.TarFile | None = None
        self._count = 0

    def _open_next(self) -> None:
        self.close_shard()
        name = SHARD_NAME.format(len(self.shards))
        self._tar = tarfile.open(self.out_dir / name, "w", format=tarfile.USTAR_FORMAT)
        self.shards.append((name, 0))
        self._count = 0

    def write(self, key: str, members: dict[str, bytes]) -> None:
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        if self._tar is None or self._count >= self.shard_size:
            self._open_next()
        for ext in sorted(members):
            data = members[ext]
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mtime = MTIME
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            self._tar.addfile(info, io.BytesIO(data))
        self._count += 1
        name, _ = self.shards[-1]
        self.shards[-1] = (name, self._count)

    def close_shard(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def close(self) -> list[tuple[str, int]]:
        self.close_shard()
        return self.shards

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
