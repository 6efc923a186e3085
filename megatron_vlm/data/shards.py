"""Deterministic webdataset shard writing: ``000000.tar, 000001.tar, ...``.

The same samples give byte-identical tars: members in a fixed order (sorted by extension within a
sample, samples in input order), fixed mtime, uid/gid 0, empty user/group names, mode 0644, USTAR headers,
and the end-of-archive padding ``tarfile`` writes. A sample's tar bytes are built by
:func:`sample_tar_bytes` (a pure function, so worker processes can build them), and the writer only
appends them: the writing process does no per-member work.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

MTIME = 0
SHARD_NAME = "{:06d}.tar"
_BLOCK = tarfile.BLOCKSIZE  # 512
_RECORD = tarfile.RECORDSIZE  # 10240


def sample_tar_bytes(key: str, members: dict[str, bytes]) -> bytes:
    """The tar members ``<key>.<ext>`` of one sample (headers, data, padding), extensions sorted."""
    if not key or "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must be non-empty without '.' or '/'")
    out = []
    for ext in sorted(members):
        data = members[ext]
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size = len(data)
        info.mtime = MTIME
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.type = tarfile.REGTYPE
        out.append(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
        out.append(data)
        rem = len(data) % _BLOCK
        if rem:
            out.append(b"\0" * (_BLOCK - rem))
    return b"".join(out)


class ShardWriter:
    """Append samples to tars of ``shard_size`` samples, named from ``first_index`` on, under ``out_dir``."""

    def __init__(self, out_dir: str | Path, shard_size: int = 1000, name_format: str = SHARD_NAME):
        if shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.shard_size = shard_size
        self.name_format = name_format
        self.shards: list[tuple[str, int]] = []  # (file name, samples)
        self._file = None
        self._count = 0
        self._size = 0

    def write(self, key: str, members: dict[str, bytes]) -> None:
        self.write_sample_bytes(sample_tar_bytes(key, members))

    def write_sample_bytes(self, blob: bytes) -> None:
        if self._file is None or self._count >= self.shard_size:
            self.close_shard()
            name = self.name_format.format(len(self.shards))
            self._file = open(self.out_dir / name, "wb")
            self.shards.append((name, 0))
            self._count = self._size = 0
        self._file.write(blob)
        self._size += len(blob)
        self._count += 1
        self.shards[-1] = (self.shards[-1][0], self._count)

    def close_shard(self) -> None:
        if self._file is not None:
            end = self._size + 2 * _BLOCK  # two zero blocks end the archive, padded to a full record
            self._file.write(b"\0" * (2 * _BLOCK + (-end) % _RECORD))
            self._file.close()
            self._file = None

    def close(self) -> list[tuple[str, int]]:
        self.close_shard()
        return self.shards

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
