"""Input file -> validated, deterministic webdataset shards -> energon-prepared dataset.

Data flows forward: :mod:`readers` (records) -> :mod:`conversation` (meaning, rules) -> :mod:`images`
(bytes, checks) -> :mod:`shards` (tars) -> :mod:`prepare` (energon metadata). This module owns the
orchestration: worker processes, the progress bar, ``rejected.jsonl``, the bad-fraction limit and the
atomic output directory. ``data_prep/make_wds.py`` is its command line.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_vlm.atomic import atomic_dir, atomic_write_text
from megatron_vlm.data.conversation import FORMATS, Reject
from megatron_vlm.data.images import process_image, read_ref
from megatron_vlm.data.readers import RawRecord, read_records

log = logging.getLogger(__name__)

REJECTED_FILE = "rejected.jsonl"
SUMMARY_FILE = "make_wds.json"
KEY_FORMAT = "{:09d}"


class TooManyRejectsError(RuntimeError):
    pass


@dataclass
class MakeWdsResult:
    output: Path
    total: int
    written: int
    rejected: int
    reasons: dict[str, int]
    shards: list[tuple[str, int]]
    splits: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "output": str(self.output),
            "records": self.total,
            "written": self.written,
            "rejected": self.rejected,
            "rejected_by_reason": self.reasons,
            "shards": {name: n for name, n in self.shards},
            "splits": self.splits,
            "warnings": self.warnings,
        }


def _reason_class(reason: str) -> str:
    """Group reasons for the summary ("missing image 'a.jpg'" -> "missing image", counts -> N)."""
    for sep in (" '", ' "', ":", " (", ";"):
        reason = reason.split(sep)[0]
    return re.sub(r"\b\d+\b", "N", reason.strip())


def convert_record(fmt: str, rec: RawRecord, image_root: Path) -> tuple[dict | None, str | None]:
    """One record -> ``({extension: bytes}, None)`` for the tar, or ``(None, reason)``."""
    if rec.error:
        return None, rec.error
    try:
        conv = FORMATS[fmt](rec.obj)
        jpeg_only = fmt == "vqa"
        images = []
        for i, ref in enumerate(conv.images):
            what = f"image {i}" if len(conv.images) > 1 else "image"
            images.append(process_image(read_ref(ref, image_root), jpeg_only=jpeg_only, what=what))
    except Reject as e:
        return None, str(e)
    src_id = rec.obj.get("id", rec.obj.get("question_id"))
    meta = {"id": src_id, "source": rec.source}
    if fmt == "vqa":
        question = rec.obj.get("question", rec.obj.get("query", rec.obj.get("prompt", "")))
        answer = conv.messages[-1]["content"][0]["text"]
        ext, data = images[0]
        members = {
            "jpg": data,
            "txt": answer.encode("utf-8"),
            "json": _json_bytes({"question": str(question), **meta}),
        }
    else:
        members = {"json": _json_bytes({"messages": conv.messages, **meta})}
        for i, (ext, data) in enumerate(images):
            members[f"img{i}.{ext}"] = data
    return members, None


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True).encode("utf-8")


# Worker-process state (set once per worker by the pool initializer).
_WORKER: dict = {}


def _init_worker(fmt: str, image_root: str) -> None:
    _WORKER.update(fmt=fmt, image_root=Path(image_root))


def _work(rec: RawRecord):
    members, reason = convert_record(_WORKER["fmt"], rec, _WORKER["image_root"])
    return rec, members, reason


def make_wds(
    fmt: str,
    input_path: str | os.PathLike,
    output: str | os.PathLike,
    image_root: str | os.PathLike | None = None,
    shard_size: int = 1000,
    split="9,1,0",
    workers: int = 1,
    prepare: bool = True,
    max_bad_fraction: float = 0.01,
    overwrite: bool = False,
    progress: bool = True,
) -> MakeWdsResult:
    """Convert ``input_path`` (format ``fmt``: vqa | llava | chat) into an energon dataset at ``output``.

    Images are paths relative to ``image_root`` (default: the input file's directory). Rejected records
    go to ``output/rejected.jsonl``; above ``max_bad_fraction`` nothing is written except
    ``<output>.rejected.jsonl`` next to it, and :class:`TooManyRejectsError` names the reasons.
    """
    from megatron_vlm.data import prepare as prep
    from megatron_vlm.data.shards import ShardWriter

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not 0 <= max_bad_fraction <= 1:
        raise ValueError(f"--max-bad-fraction must be within [0, 1], got {max_bad_fraction}")
    prep.parse_split(split)
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"--input {input_path} does not exist")
    image_root = Path(image_root) if image_root is not None else input_path.parent
    if not image_root.is_dir():
        raise FileNotFoundError(f"--image-root {image_root} is not a directory")
    output = Path(output)
    workers = max(1, int(workers))

    with atomic_dir(output, overwrite=overwrite, what="--output") as tmp:
        writer = ShardWriter(tmp, shard_size)
        reasons: Counter = Counter()
        total = written = 0
        records = read_records(input_path)
        pool = None
        if workers > 1:
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(fmt, str(image_root)))
            results = pool.imap(_work, records, chunksize=8)
        else:
            _init_worker(fmt, str(image_root))
            results = map(_work, records)
        bar = _progress(progress, fmt)
        try:
            with open(tmp / REJECTED_FILE, "w", encoding="utf-8") as rejected:
                for rec, members, reason in results:
                    total += 1
                    if reason is not None:
                        reasons[_reason_class(reason)] += 1
                        rejected.write(json.dumps(
                            {"source": rec.source, "index": rec.index,
                             "id": (rec.obj or {}).get("id"), "reason": reason, "record": rec.text},
                            ensure_ascii=True) + "\n")
                    else:
                        writer.write(KEY_FORMAT.format(written), members)
                        written += 1
                    if bar is not None:
                        bar.update(1)
                        if reason is not None:
                            bar.set_postfix(rejected=sum(reasons.values()), refresh=False)
        finally:
            if bar is not None:
                bar.close()
            if pool is not None:
                pool.terminate()
                pool.join()
            shards = writer.close()
        n_rejected = sum(reasons.values())
        result = MakeWdsResult(output, total, written, n_rejected, dict(sorted(reasons.items())), shards)
        if total == 0:
            raise ValueError(f"--input {input_path} holds no records")
        if n_rejected > max_bad_fraction * total or written == 0:
            kept = output.with_name(output.name + ".rejected.jsonl")
            os.replace(tmp / REJECTED_FILE, kept)
            raise TooManyRejectsError(
                f"{n_rejected} of {total} records rejected ({n_rejected / total:.1%} > --max-bad-fraction "
                f"{max_bad_fraction:g}); nothing was written to {output}. Reasons: "
                + ", ".join(f"{k}: {v}" for k, v in result.reasons.items())
                + f". Each rejected record and its reason: {kept}"
            )
        if prepare:
            prep.run_energon_prepare(tmp, fmt, split, workers=min(workers, len(shards)))
            result.splits = prep.split_shards(tmp)
            result.warnings = prep.check_split(tmp, split)
            for w in result.warnings:
                log.warning(w)
        atomic_write_text(tmp / SUMMARY_FILE, json.dumps(result.summary(), indent=2) + "\n")
        _apply_umask(tmp)
    return result


def _apply_umask(root: Path) -> None:
    """Temporary directories and files are created private (0700/0600); give the result normal modes."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


def _progress(enabled: bool, fmt: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc=f"make_wds {fmt}", unit=" samples", dynamic_ncols=True)
