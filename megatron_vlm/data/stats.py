"""Sample and token counts of prepared datasets, and an energon metadataset blending them by weight.

Counts are per split (energon's ``.nv-meta/split.yaml``): samples, images, text tokens (the model's chat
template, image tokens not counted), image tokens (images x tokens per image; for anyres models each image's
own count from its size, read from its header; InternVL: its tiles from its size, times the tokens of a tile),
videos, their chosen frames and video tokens (OneVision: the
frame count and rate read from each video's container, the frames chosen by the task encoder's
``video_fps``/``video_frames`` rule, ``frames * ceil(side/2)**2 + 1`` tokens; InternVL: a tile's tokens per frame,
the ``FrameN:`` lines counted as text; Qwen-VL: the frames its video processor takes at ``video_fps``, their
merged patches per pair of frames, and Qwen3-VL's timestamps), and how many samples
exceed ``seq_length`` once images and videos are expanded (the task encoder truncates those). The tars are read
directly (images and videos are not decoded), with the same conversation rules the task encoder uses.

Time and memory stay linear in the data and bounded per sample: a sample whose text parts exceed
``max_text_bytes`` is not read nor tokenized (tokenizing one huge string can take minutes and gigabytes);
it is counted in ``samples``, ``over_seq_length`` and ``too_long_to_count``, not in the token counts.
``data_prep/stats.py`` is the command line.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path
from typing import Iterator

import yaml

from megatron_vlm.data.conversation import vqa_messages
from megatron_vlm.data.prepare import split_metas
from megatron_vlm.data.sample import IMAGE_PART_RE, VIDEO_PART_RE, VQA_PARTS, image_parts, video_parts, vqa_video_part

_NAME_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
SPLITS = ("train", "val", "test")
from megatron_vlm.data.limits import DEFAULT_MAX_TEXT_BYTES  # noqa: E402 - the command line quotes it
OVERSIZED = "__oversized__"  # key set in a sample whose text parts were too large to read
IMAGE_SIZES = "__image_sizes__"  # image part -> (width, height), for anyres models
VIDEOS = "__videos__"  # video part -> megatron_vlm.data.videos.VideoInfo (frames, fps, size)
_HEADER_BYTES = 1 << 16


def _image_size(tar, member) -> tuple[int, int]:
    """(width, height) of an image member from its header (its first 64 KiB; all of it if that is not enough)."""
    import io

    from PIL import Image

    f = tar.extractfile(member)
    head = f.read(_HEADER_BYTES)
    try:
        return Image.open(io.BytesIO(head)).size
    except Exception:  # noqa: BLE001 - a header beyond the first bytes (e.g. large EXIF): read the whole image
        return Image.open(io.BytesIO(head + f.read())).size


def _is_video(part: str) -> bool:
    return VIDEO_PART_RE.match(part) is not None or part in VQA_PARTS[3:]


def iter_tar_samples(tar_path: Path, parts: tuple[str, ...] = ("json", "txt"),
                     max_bytes: int | None = None, image_sizes: bool = False) -> Iterator[tuple[str, dict]]:
    """``(key, {part: bytes or None})`` per sample; only ``parts`` (and image parts' names) are read.

    With ``max_bytes``, a sample whose ``parts`` add up to more is yielded with ``OVERSIZED`` set to their
    total size and none of them read (None), so memory stays bounded whatever the tar holds. With
    ``image_sizes``, ``IMAGE_SIZES`` maps each image part to its (width, height), read from its header, and
    ``VIDEOS`` each video part to its :class:`~megatron_vlm.data.videos.VideoInfo` (read from its container)."""

    def finish(key, sample, members):
        size = sum(m.size for m in members)
        if max_bytes is not None and size > max_bytes:
            sample[OVERSIZED] = size
        else:
            for m in members:
                sample[_NAME_RE.match(m.name).group(2)] = tar.extractfile(m).read()
        if image_sizes:
            from megatron_vlm.data.videos import probe

            sample[IMAGE_SIZES] = {_NAME_RE.match(m.name).group(2): _image_size(tar, m) for m in image_members}
            sample[VIDEOS] = {_NAME_RE.match(m.name).group(2): probe(tar.extractfile(m)) for m in video_members}
        return key, sample

    key, sample, members, image_members, video_members = None, {}, [], [], []
    with tarfile.open(tar_path, "r") as tar:
        for member in tar:
            if not member.isfile():
                continue
            m = _NAME_RE.match(member.name)
            if not m:
                continue
            k, part = m.groups()
            if k != key:
                if key is not None:
                    yield finish(key, sample, members)
                key, sample, members, image_members, video_members = k, {}, [], [], []
            sample[part] = None
            if part in parts:
                members.append(member)
            elif image_sizes and (part in ("jpg", "png") or IMAGE_PART_RE.match(part)):
                image_members.append(member)
            elif image_sizes and _is_video(part):
                video_members.append(member)
        if key is not None:
            yield finish(key, sample, members)


def _checked_samples(tar_path: Path, max_bytes: int, image_sizes: bool = False) -> Iterator[tuple[str, dict]]:
    """``iter_tar_samples`` with a damaged tar reported as a ``ValueError`` naming it."""
    try:
        yield from iter_tar_samples(tar_path, max_bytes=max_bytes, image_sizes=image_sizes)
    except (tarfile.TarError, EOFError) as e:
        raise ValueError(f"{tar_path}: unreadable tar ({e}); the dataset is damaged: copy it again or rebuild it "
                         "with data_prep/make_wds.py") from None


def conversation_of_raw(sample: dict) -> tuple[list[dict], int]:
    """``(messages, number of images)`` of a raw tar sample in either layout (its videos: :func:`raw_videos`)."""
    meta = json.loads(sample["json"]) if sample.get("json") else {}
    if "messages" in meta:
        return meta["messages"], len(image_parts(sample))
    answer = sample["txt"].decode("utf-8") if sample.get("txt") is not None else ""
    if vqa_video_part(sample) is not None:
        return vqa_messages(meta.get("question", ""), answer, "video"), 0
    return vqa_messages(meta.get("question", ""), answer), 1


def raw_videos(sample: dict) -> list[str]:
    """The video part names of a raw tar sample in either layout, in video order."""
    video = vqa_video_part(sample)
    return video_parts(sample) or ([video] if video is not None else [])


def _video_tokens(task_encoder, info, key: str) -> tuple[int, int]:
    """(chosen frames, video tokens) of one video for ``task_encoder``'s model and frame choice."""
    from megatron_vlm.data.task_encoder import refuse_videos
    from megatron_vlm.data.videos import frame_indices

    if task_encoder.spec.is_qwen_vl:  # the frames its video processor takes, the ids that stand for them
        plan = task_encoder.plan_of(info)
        return len(plan["indices"]), len(plan["ids"])
    refuse_videos(task_encoder.spec, key, getattr(task_encoder, "video_token_id", None) is not None)
    frames = len(frame_indices(info.frames, info.fps, task_encoder.video_fps, task_encoder.video_frames))
    return frames, task_encoder.spec.anyres.video_tokens(frames)


def dataset_stats(path: str | Path, task_encoder, seq_length: int | None = None, progress: bool = False,
                  max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES) -> dict:
    """Per-split counts for one prepared dataset, tokenized like ``task_encoder`` (a VLMTaskEncoder)."""
    path = Path(path)
    seq_length = seq_length or task_encoder.seq_length
    k = task_encoder.tokens_per_image
    geo = getattr(getattr(task_encoder, "spec", None), "anyres", None)  # anyres: tokens depend on image size
    ivl = hasattr(task_encoder, "image_tiles")  # InternVL: tiles depend on image size, frames are images
    qvl = hasattr(task_encoder, "tokens_of_size")  # Qwen2.5-VL: tokens depend on image size
    result = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"stats {path.name}", unit=" samples", disable=None)  # no bar in a log file
    for split, meta in split_metas(path).items():
        s = dict(samples=0, images=0, text_tokens=0, image_tokens=0, videos=0, video_frames=0, video_tokens=0,
                 tokens=0, max_tokens=0, over_seq_length=0, too_long_to_count=0)
        for shard in meta.shards:
            sized = geo is not None or ivl or qvl
            for key, raw in _checked_samples(path / shard.name, max_text_bytes, image_sizes=sized):
                if f"{shard.name}/{key}" in meta.sample_excludes:
                    continue
                if OVERSIZED in raw:
                    s["samples"] += 1
                    s["images"] += len(image_parts(raw)) or ("jpg" in raw)  # messages layout, else VQA's one
                    s["videos"] += len(raw_videos(raw))
                    s["over_seq_length"] += 1
                    s["too_long_to_count"] += 1
                    continue
                messages, n_img = conversation_of_raw(raw)
                names = raw_videos(raw)
                if names and geo is None and not qvl and not (ivl and task_encoder.chat.video):  # nothing probed
                    _video_tokens(task_encoder, None, f"{shard.name}/{key}")
                videos = [raw[VIDEOS][n] for n in names]
                if ivl:  # each video's frames are lines of the text, each frame an image of one tile
                    task_encoder.chat.frames = [task_encoder.frame_count(info) for info in videos]
                ids = task_encoder.chat(messages).ids
                text = len(ids) - n_img - (sum(task_encoder.chat.frames) if ivl else len(videos))
                image_tokens = n_img * k
                frames = video_tokens = 0
                for info in videos:
                    f, t = (task_encoder.frame_count(info), None) if ivl else \
                        _video_tokens(task_encoder, info, f"{shard.name}/{key}")
                    frames, video_tokens = frames + f, video_tokens + (f * k if ivl else t)
                if ivl:
                    sizes = raw[IMAGE_SIZES]
                    names = image_parts(raw) or [n for n in ("jpg", "png") if n in sizes]
                    image_tokens = sum(task_encoder.image_tiles(sizes[n][1], sizes[n][0]) * k for n in names[:n_img])
                if qvl:
                    sizes = raw[IMAGE_SIZES]
                    names = image_parts(raw) or [n for n in ("jpg", "png") if n in sizes]
                    image_tokens = sum(task_encoder.tokens_of_size(sizes[n][1], sizes[n][0]) for n in names[:n_img])
                if geo is not None:
                    sizes = raw[IMAGE_SIZES]
                    names = image_parts(raw) or [n for n in ("jpg", "png") if n in sizes]
                    tiled = task_encoder.tiled(n_img)
                    image_tokens = sum(geo.num_tokens(sizes[n][1], sizes[n][0], tiled) for n in names[:n_img])
                total = text + image_tokens + video_tokens
                s["samples"] += 1
                s["images"] += n_img
                s["text_tokens"] += text
                s["image_tokens"] += image_tokens
                s["videos"] += len(videos)
                s["video_frames"] += frames
                s["video_tokens"] += video_tokens
                s["tokens"] += total
                s["max_tokens"] = max(s["max_tokens"], total)
                s["over_seq_length"] += total > seq_length
                if bar is not None:
                    bar.update(1)
        s["mean_tokens"] = round(s["tokens"] / s["samples"], 2) if s["samples"] else 0.0
        result[split] = s
    if bar is not None:
        bar.close()
    return result


def metadataset_yaml(yaml_path: str | Path, datasets: list[tuple[str | Path, float]], splits=("train", "val")) -> str:
    """Energon MetadatasetV2 text blending ``datasets`` [(path, weight)] for each split.

    Paths are written relative to the YAML file (energon resolves them from its location).
    """
    base = Path(yaml_path).absolute().parent
    body = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {}}
    for split in splits:
        blend = []
        for path, weight in datasets:
            rel = os.path.relpath(Path(path).absolute(), base)
            blend.append({"weight": float(weight), "path": rel, "split_part": split})
        body["splits"][split] = {"blend": blend}
    return yaml.safe_dump(body, sort_keys=False)


def summarize(paths: list[str | Path], task_encoder, seq_length: int | None = None, progress: bool = False,
              max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES) -> dict:
    seq_length = seq_length or task_encoder.seq_length
    out = {
        "tokenizer": task_encoder.hf_dir,
        "seq_length": seq_length,
        "tokens_per_image": task_encoder.tokens_per_image,
        **({"video_fps": task_encoder.video_fps, "video_frames": task_encoder.video_frames}
           if hasattr(task_encoder, "video_fps") else {}),
        "datasets": {},
        "total": {},
    }
    for p in paths:
        out["datasets"][str(p)] = dataset_stats(p, task_encoder, seq_length, progress, max_text_bytes)
    for split in SPLITS:
        agg: dict = {}
        for per in out["datasets"].values():
            for name, v in per.get(split, {}).items():
                if name == "max_tokens":
                    agg[name] = max(agg.get(name, 0), v)
                elif name != "mean_tokens":
                    agg[name] = agg.get(name, 0) + v
        if agg:
            agg["mean_tokens"] = round(agg["tokens"] / agg["samples"], 2) if agg["samples"] else 0.0
            out["total"][split] = agg
    return out
