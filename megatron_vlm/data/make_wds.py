"""Input file -> validated, deterministic webdataset shards -> energon-prepared dataset.

Data flows forward: :mod:`readers` (records) -> :mod:`conversation` (meaning, rules) -> :mod:`images` and
:mod:`videos` (bytes, checks) -> :mod:`shards` (tars) -> :mod:`prepare` (energon metadata). This module owns the
orchestration: worker processes, the progress bar, ``rejected.jsonl``, the bad-fraction limit and the
atomic output directory. ``data_prep/make_wds.py`` is its command line.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_vlm.files import storage
from megatron_vlm.files.atomic import OutputExistsError, atomic_dir, atomic_write_text
from megatron_vlm.data.conversation import FORMATS, Reject, check_format
from megatron_vlm.data.images import process_image, read_ref
from megatron_vlm.data.readers import RawRecord, parse, read_records, record_text
from megatron_vlm.data.shards import SHARD_NAME, ShardWriter, sample_tar_bytes
from megatron_vlm.data.videos import VIDEO_EXTENSIONS, check_video

log = logging.getLogger(__name__)

REJECTED_FILE = "rejected.jsonl"
SUMMARY_FILE = "make_wds.json"
KEY_FORMAT = "{:09d}"
DEFAULT_MAX_TEXT_CHARS = 1_000_000  # per message: ~250k tokens, beyond any training sequence


class TooManyRejectsError(RuntimeError):
    pass


@dataclass
class MakeWdsResult:
    output: Path | str  # str: an msc:// URL
    total: int
    written: int
    rejected: int
    reasons: dict[str, int]
    shards: list[tuple[str, int]]
    splits: dict[str, list[str]] = field(default_factory=dict)  # split -> shard names (with prepare)
    videos: int = 0  # videos written

    def summary(self) -> dict:
        return {
            "output": str(self.output),
            "records": self.total,
            "written": self.written,
            "videos": self.videos,
            "rejected": self.rejected,
            "rejected_by_reason": self.reasons,
            "shards": {name: n for name, n in self.shards},
            "splits": {
                name: {"shards": names, "samples": sum(dict(self.shards)[n] for n in names)}
                for name, names in self.splits.items()
            },
        }


def _reason_class(reason: str) -> str:
    """Group reasons for the summary ("missing image 'a.jpg'" -> "missing image", counts -> N)."""
    for sep in (" '", ' "', ":", " (", ";"):
        reason = reason.split(sep)[0]
    return re.sub(r"(?<![\w-])\d+(?![\w-])", "N", reason.strip())


def check_text_length(messages: list[dict], max_chars: int) -> None:
    """Reject a record with a message longer than ``max_chars`` characters (a runaway or garbage field)."""
    for i, m in enumerate(messages):
        n = sum(len(p["text"]) for p in m["content"] if p["type"] == "text")
        if n > max_chars:
            raise Reject(f"text too long: message {i} ({m['role']}) has {n} characters, more than "
                         f"--max-text-chars {max_chars}; shorten or drop the record, or raise --max-text-chars")


def convert_record(fmt: str, rec: RawRecord, image_root: Path, max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
                   allow_outside_symlinks: bool = False) -> tuple[dict | None, str | None]:
    """One record -> ``({extension: bytes}, None)`` for the tar, or ``(None, reason)``."""
    parse(rec)
    if rec.error:
        return None, rec.error
    try:
        conv = FORMATS[fmt](rec.obj)
        check_text_length(conv.messages, max_text_chars)
        jpeg_only = fmt == "vqa"
        images = []
        for i, ref in enumerate(conv.images):
            what = f"image {i}" if len(conv.images) > 1 else "image"
            data = read_ref(ref, image_root, allow_outside_symlinks)
            images.append(process_image(data, jpeg_only=jpeg_only, what=what))
        videos = []  # stored byte for byte once PyAV has checked them
        for i, ref in enumerate(conv.videos):
            what = f"video {i}" if len(conv.videos) > 1 else "video"
            videos.append(check_video(read_ref(ref, image_root, allow_outside_symlinks, kind="video"), what))
    except Reject as e:
        return None, str(e)
    meta = {"id": rec.obj.get("id", rec.obj.get("question_id")), "source": rec.source}
    if fmt == "vqa":
        members = {
            "txt": conv.fields["answer"].encode("utf-8"),
            "json": _json_bytes({"question": conv.fields["question"], **meta}),
        }
        ext, data = (images or videos)[0]
        members["jpg" if images else ext] = data
    else:
        members = {"json": _json_bytes({"messages": conv.messages, **meta})}
        for i, (ext, data) in enumerate(images):
            members[f"img{i}.{ext}"] = data
        for i, (ext, data) in enumerate(videos):
            members[f"vid{i}.{ext}"] = data
    return members, None


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True).encode("utf-8")


class SplitAssigner:
    """Deterministic sample-level split: each sample goes to the split furthest below its share.

    With weights 9,1,0 every prefix of the output holds train:val within one sample of 9:1, so the
    validation set is spread over the whole input, and small datasets split exactly too.
    """

    def __init__(self, weights):
        total = float(sum(weights))
        self.shares = [w / total for w in weights]
        self.counts = [0] * len(weights)
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        deficits = [share * self.n - c for share, c in zip(self.shares, self.counts)]
        best = max(range(len(deficits)), key=lambda i: (deficits[i], -i))
        self.counts[best] += 1
        return best


# Worker-process state (set once per worker by the pool initializer).
_WORKER: dict = {}


def _init_worker(fmt: str, image_root: str, max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
                 allow_outside_symlinks: bool = False) -> None:
    _WORKER.update(fmt=fmt, image_root=Path(image_root), max_text_chars=max_text_chars,
                   allow_outside_symlinks=allow_outside_symlinks)


def _work(rec: RawRecord):
    """Runs in the workers: everything per sample, down to its tar bytes (the key is the record index)."""
    members, reason = convert_record(_WORKER["fmt"], rec, _WORKER["image_root"], _WORKER["max_text_chars"],
                                     _WORKER["allow_outside_symlinks"])
    blob = None if members is None else sample_tar_bytes(KEY_FORMAT.format(rec.index), members)
    obj_id = (rec.obj or {}).get("id")
    text = (rec.text or record_text(rec.obj)) if reason is not None else ""
    videos = sum(1 for ext in members or () if ext.split(".")[-1] in VIDEO_EXTENSIONS)
    return rec.index, rec.source, text, obj_id, blob, reason, videos


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
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    allow_outside_symlinks: bool = False,
) -> MakeWdsResult:
    """Convert ``input_path`` (format ``fmt``: vqa | llava | chat) into an energon dataset at ``output``.

    Images are paths relative to ``image_root`` (default: the input file's directory). Sample keys are
    the record's position in the input (``000000017`` = the 18th record). With ``prepare``, samples are
    split by ``split`` weights sample by sample (:class:`SplitAssigner`): train shards come first, then
    val, then test, and energon prepare gets those shard lists. Without it, all samples go into one shard
    sequence for an interactive ``energon prepare``. Rejected records go to ``output/rejected.jsonl``;
    above ``max_bad_fraction`` nothing is written except ``<output>.rejected.jsonl`` next to it, and
    :class:`TooManyRejectsError` names the reasons.

    ``output`` may be an object-store URL (``msc://PROFILE/PATH``): the tars are built in a local temporary
    directory (shards are numbered only once every split is known), uploaded, and then ``energon prepare``
    runs on the remote copy, reading the tar headers there and writing ``.nv-meta`` there; ``make_wds.json``
    is uploaded last. A dataset whose upload or prepare was interrupted has no ``.nv-meta/dataset.yaml``, and
    training refuses it. The rejected-records file of a failed remote conversion stays in the current directory.

    A record with a message longer than ``max_text_chars`` characters is rejected ("text too long"); an image
    path that is a symlink leading outside ``image_root`` is rejected unless ``allow_outside_symlinks``.
    """
    from megatron_vlm.data import prepare as prep

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not 0 <= max_bad_fraction <= 1:
        raise ValueError(f"--max-bad-fraction must be within [0, 1], got {max_bad_fraction}")
    weights = prep.parse_split(split)
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"--input {input_path} " + ("is not a file" if input_path.exists() else "does not exist"))
    image_root = Path(image_root) if image_root is not None else input_path.parent
    if not image_root.is_dir():
        raise FileNotFoundError(f"--image-root {image_root} is not a directory")
    records = _checked_records(fmt, input_path)
    remote = storage.is_remote(output)
    if remote:
        output = storage.check_url(output, "--output")
        if not overwrite and not storage.is_empty(output):
            raise OutputExistsError(f"--output {output} already holds objects; remove them or pass --overwrite")
        staging = tempfile.TemporaryDirectory(prefix="make_wds-")
        local_out = Path(staging.name) / "data"
    else:
        output = local_out = Path(output)
    workers = max(1, int(workers))
    if max_text_chars < 1:
        raise ValueError(f"--max-text-chars must be at least 1, got {max_text_chars}")
    opts = (fmt, str(image_root), max_text_chars, allow_outside_symlinks)

    with atomic_dir(local_out, overwrite=overwrite, what="--output") as tmp:
        if prepare:
            writers = [ShardWriter(tmp, shard_size, f".{name}-{{:06d}}.tar") for name in prep.SPLITS]
            assign = SplitAssigner(weights)
        else:
            writers, assign = [ShardWriter(tmp, shard_size)], (lambda: 0)
        reasons: Counter = Counter()
        total = written = videos = 0
        pool = None
        if workers > 1:
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=opts)
            results = pool.imap(_work, records, chunksize=16)
        else:
            _init_worker(*opts)
            results = map(_work, records)
        bar = _progress(progress, fmt)
        try:
            with open(tmp / REJECTED_FILE, "w", encoding="utf-8") as rejected:
                for index, source, text, obj_id, blob, reason, n_videos in results:
                    total += 1
                    if reason is not None:
                        reasons[_reason_class(reason)] += 1
                        rejected.write(json.dumps(
                            {"source": source, "index": index, "id": obj_id, "reason": reason, "record": text},
                            ensure_ascii=True) + "\n")
                    else:
                        writers[assign()].write_sample_bytes(blob)
                        written += 1
                        videos += n_videos
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
            for w in writers:
                w.close()
        n_rejected = sum(reasons.values())
        if total == 0:
            raise ValueError(f"--input {input_path} holds no records")
        if n_rejected > max_bad_fraction * total or written == 0:
            name = output.rsplit("/", 1)[-1] if remote else output.name
            kept = Path(name + ".rejected.jsonl").absolute() if remote else output.with_name(name + ".rejected.jsonl")
            os.replace(tmp / REJECTED_FILE, kept)
            raise TooManyRejectsError(
                f"{n_rejected} of {total} records rejected ({n_rejected / total:.1%} > --max-bad-fraction "
                f"{max_bad_fraction:g}); nothing was written to {output}. Reasons: "
                + ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items()))
                + f". Each rejected record and its reason: {kept}"
            )
        shards, splits = _number_shards(tmp, writers, prep.SPLITS if prepare else None)
        result = MakeWdsResult(output, total, written, n_rejected, dict(sorted(reasons.items())), shards, splits,
                               videos)
        summary = json.dumps(result.summary(), indent=2) + "\n"
        layout = prep.dataset_layout(fmt, videos)
        if not remote:
            if prepare:
                prep.run_energon_prepare(tmp, layout, splits, workers=min(workers, len(shards)))
            atomic_write_text(tmp / SUMMARY_FILE, summary)
            _apply_umask(tmp)
    if remote:
        with staging:
            _publish(local_out, output, summary, layout if prepare else None, splits, min(workers, len(shards)))
    return result


def _checked_records(fmt: str, input_path: Path):
    """The input's records, after checking that the first one is of format ``fmt`` (a LLaVA json given as
    ``--format vqa`` is refused with the right ``--format``, instead of rejecting every record)."""
    records = read_records(input_path)
    first = next(records, None)
    if first is None:
        return iter(())
    parse(first)
    if first.obj is not None:
        check_format(fmt, first.obj, f"the first record of --input {input_path} ({first.source})")
    return itertools.chain([first], records)


def _publish(local: Path, url: str, summary: str, fmt: str | None, splits, workers: int) -> None:
    """Upload a staged dataset to ``url``, run energon prepare there (``fmt`` None: not), summary last."""
    from megatron_vlm.data import prepare as prep

    storage.remove_tree(url)  # what an --overwrite replaces
    for f in sorted(local.iterdir()):
        storage.upload_file(f, storage.join(url, f.name))
    if fmt is not None:
        prep.run_energon_prepare(url, fmt, splits, workers=workers)
    storage.write_text(storage.join(url, SUMMARY_FILE), summary)


def _number_shards(tmp: Path, writers, split_names) -> tuple[list[tuple[str, int]], dict[str, list[str]]]:
    """Rename per-split shards to one sequence 000000.tar, ... (train, then val, then test)."""
    if split_names is None:
        return writers[0].shards, {}
    shards, splits = [], {}
    for name, w in zip(split_names, writers):
        splits[name] = []
        for tmp_name, count in w.shards:
            final = SHARD_NAME.format(len(shards))
            os.replace(tmp / tmp_name, tmp / final)
            shards.append((final, count))
            splits[name].append(final)
    return shards, splits


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

    return tqdm(desc=f"make_wds {fmt}", unit=" samples", dynamic_ncols=True, disable=None)  # no bar in a log file
