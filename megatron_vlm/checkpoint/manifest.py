"""The checksum manifests of a checkpoint: what a save records of every file, and what a resume checks.

A shard cut short or lost is found by its size alone (:mod:`megatron_vlm.checkpoint.checks` compares the torch_dist
shards with their index). A file whose size is right but whose bytes are not -- a bad disk block, a copy that wrote
garbage, a file overwritten in place -- is found only by reading it. So a training save records checksums of every
file of the iteration directory before ``ckpt_meta.json`` (the file that marks it complete), and a resume checks
them before it loads anything:

- where megatron-core has its own integrity manifest (0.19: ``dist_checkpointing.save/load(verify_integrity=True)``,
  :func:`megatron_vlm.runtime.mcore_version.has_integrity_manifest`), the files it writes are in its ``integrity.json``
  (SHA-256, hashed and checked by megatron-core on rank 0; :func:`mcore_listed` reads which);
- ``checksums.json``, megatron-vlm's own, has the rest (all files with megatron-core 0.16; the side files and
  ``integrity.json`` itself with 0.19): ``{"algorithm": "crc32", "files": {"__0_0.distcp": {"bytes": N, "crc32":
  "89abcdef"}, ...}}``. Each rank checksums a share of the files (:func:`share`) and rank 0 writes the manifest, so
  a save reads its bytes back once, spread over the ranks, and a resume the same way (zlib's crc32: ~0.6 GB/s per
  process on a busy 2-core machine).

Both re-reads cost time in proportion to the checkpoint (megatron-core's on one rank): ``--no-verify-integrity``
skips them, for multi-TB checkpoints, and the sizes are still checked. Checkpoints without a manifest (written
before it existed, by Megatron-LM, by the converters, or with ``--no-verify-integrity``) load as before;
object-store saves (``msc://``) write none, as the store checks what it receives. Pure Python (no torch), so the
launcher reads it before any rank starts (sizes only: :func:`size_problems`).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

MANIFEST = "checksums.json"
ALGORITHM = "crc32"
#: megatron-core's integrity manifest (``megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME``)
MCORE_MANIFEST = "integrity.json"
_CHUNK = 8 << 20
#: written after the manifest (it marks the directory complete), so not in it
NOT_LISTED = {MANIFEST, "ckpt_meta.json"}


def crc32(path) -> str:
    """The crc32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def mcore_listed(it_dir) -> set[str]:
    """The files megatron-core's integrity manifest of ``it_dir`` lists (empty without one). ValueError naming it
    when it does not parse (megatron-core would fail on it on rank 0 alone)."""
    path = Path(it_dir) / MCORE_MANIFEST
    if not path.is_file():
        return set()
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
        return {str(k) for k in files}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable integrity manifest ({type(e).__name__}: {e})") from None


def files_of(it_dir) -> list[str]:
    """The files of an iteration directory a manifest lists (relative paths, sorted)."""
    root = Path(it_dir)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name not in NOT_LISTED)


def share(names: list[str], sizes: dict[str, int], world: int, rank: int) -> list[str]:
    """Rank ``rank``'s part of ``names`` when ``world`` ranks checksum them: largest first to the least loaded rank,
    so every rank reads about as many bytes (the same answer on every rank)."""
    load = [0] * world
    mine = []
    for name in sorted(names, key=lambda n: (-sizes.get(n, 0), n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes.get(name, 0)
        if r == rank:
            mine.append(name)
    return mine


def entries(it_dir, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes": size, "crc32": hex}}`` of the files ``names`` of ``it_dir``."""
    root = Path(it_dir)
    return {n: {"bytes": (root / n).stat().st_size, ALGORITHM: crc32(root / n)} for n in names}


def write(it_dir, files: dict[str, dict]) -> None:
    from megatron_vlm.files.atomic import atomic_write_text

    atomic_write_text(Path(it_dir) / MANIFEST, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1,
                                                          sort_keys=True))


def read(it_dir) -> dict[str, dict] | None:
    """The manifest's files (None: the checkpoint has none). A manifest that does not parse is itself damaged:
    ValueError naming it."""
    path = Path(it_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {data.get('algorithm')!r}")
        return {str(k): {"bytes": int(v["bytes"]), ALGORITHM: str(v[ALGORITHM])} for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: unreadable checksum manifest ({type(e).__name__}: {e})") from None


def size_problems(it_dir, files: dict[str, dict]) -> list[str]:
    """Files of the manifest that are missing or of another size (reads no file's bytes)."""
    root = Path(it_dir)
    out = []
    for name, e in sorted(files.items()):
        f = root / name
        if not f.is_file():
            out.append(f"{f}: missing (the checkpoint's {MANIFEST} lists it)")
        elif f.stat().st_size != e["bytes"]:
            out.append(f"{f}: {f.stat().st_size} bytes, its {MANIFEST} says {e['bytes']}")
    return out


def checksum_problems(it_dir, files: dict[str, dict], names: list[str]) -> list[str]:
    """Files among ``names`` whose size or crc32 differs from the manifest's."""
    root = Path(it_dir)
    out = size_problems(it_dir, {n: files[n] for n in names})
    if out:
        return out
    for n in names:
        got = crc32(root / n)
        if got != files[n][ALGORITHM]:
            out.append(f"{root / n}: its bytes changed after the save (crc32 {got}, its {MANIFEST} says "
                       f"{files[n][ALGORITHM]})")
    return out
