"""What a prepared sample looks like inside the tars, and how energon turns it into a Python object.

Tar layout per sample key ``K`` (written by :mod:`megatron_vlm.data.make_wds`):
- ``vqa``: ``K.jpg`` (image), ``K.txt`` (answer), ``K.json`` (``{"question", "id", "source"}``) -- the
  energon VQA layout; energon's own ``VQASample`` with field map image=jpg, context=json[question],
  answers=txt reads it.
- ``llava`` / ``chat``: ``K.json`` (``{"messages", "id", "source"}``, messages in the format of
  :mod:`megatron_vlm.data.conversation`) and ``K.img0.jpg``, ``K.img1.png``, ... in image-part order,
  ``K.vid0.mp4``, ... in video-part order (videos as given, byte for byte).
  :class:`ConversationSample` is their energon sample type; ``.nv-meta/sample_loader.py`` maps the raw
  parts onto it with :func:`sample_loader` / :func:`part_filter`.
- ``vqa`` with videos: a video row is ``K.mp4`` (or ``.mkv``, ``.avi``), ``K.txt``, ``K.json`` -- the VQA layout
  with the video in place of the image. Energon's ``VQASample`` has no video, so such a dataset is prepared as
  ``ConversationSample``s: the sample loader reads both VQA layouts too.

:func:`cook` does the same for a dataset prepared interactively as "Crude sample" (energon's
CrudeWebdataset), so :class:`~megatron_vlm.data.task_encoder.VLMTaskEncoder` reads both.
:func:`conversation_of` gives ``(messages, images)`` for any of these sample types.
"""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any

from megatron.energon import Sample, VQASample
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless
from megatron.energon.task_encoder.cooking import basic_sample_keys

from megatron_vlm.data.conversation import vqa_messages

IMAGE_PART_RE = re.compile(r"^img(\d+)\.(jpg|jpeg|png)$")
VIDEO_PART_RE = re.compile(r"^vid(\d+)\.(mp4|mkv|webm|mov|avi)$")
VQA_PARTS = ("json", "txt", "jpg", "png", "mp4", "mkv", "webm", "mov", "avi")  # the VQA layouts' parts


@edataclass
class ConversationSample(Sample):
    """A multi-turn conversation with zero or more images (decoded by energon's decoder)."""

    #: Images in the order of the image parts of ``messages``.
    images: list
    #: ``[{"role": ..., "content": [{"type": "text", "text": ...} | {"type": "image"} | {"type": "video"}]}]``
    messages: list
    #: Videos (energon ``AVDecoder``s) in the order of the video parts of ``messages``.
    videos: list = field(default_factory=list)


def image_parts(raw: dict, pattern=IMAGE_PART_RE) -> list[str]:
    """The image part names of a raw sample, in image order (``pattern=VIDEO_PART_RE``: video parts)."""
    found = []
    for name in raw:
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), name))
    return [name for _, name in sorted(found)]


def video_parts(raw: dict) -> list[str]:
    """The video part names of a raw sample, in video order."""
    return image_parts(raw, VIDEO_PART_RE)


def vqa_video_part(raw: dict) -> str | None:
    """The video part of a VQA-layout video sample (``K.mp4``), or None."""
    return next((ext for ext in VQA_PARTS[3:] if ext in raw), None)


def part_filter(part: str) -> bool:
    return part in VQA_PARTS or IMAGE_PART_RE.match(part) is not None or VIDEO_PART_RE.match(part) is not None


def sample_loader(raw: dict) -> dict:
    """Energon sample loader: raw parts -> the fields of :class:`ConversationSample` (either layout)."""
    meta = raw["json"]
    if "messages" in meta:
        return dict(images=[raw[name] for name in image_parts(raw)], messages=meta["messages"],
                    videos=[raw[name] for name in video_parts(raw)])
    answer = raw.get("txt")
    answer = answer.decode("utf-8") if isinstance(answer, bytes) else str(answer or "")
    video = vqa_video_part(raw)
    if video is not None:
        return dict(images=[], videos=[raw[video]], messages=vqa_messages(meta.get("question", ""), answer, "video"))
    return dict(images=[raw.get("jpg", raw.get("png"))], messages=vqa_messages(meta.get("question", ""), answer))


@stateless
def cook(raw: dict) -> Sample:
    """Energon cooker for crude samples of either layout (conversation or VQA)."""
    base = basic_sample_keys(raw)
    meta = raw.get("json") or {}
    if "messages" in meta or vqa_video_part(raw) is not None:
        return ConversationSample(**base, **sample_loader(raw))
    image = raw.get("jpg", raw.get("png"))
    return VQASample(**base, image=image, context=meta.get("question", ""), answers=raw.get("txt"))


def conversation_of(sample: Any) -> tuple[list[dict], list]:
    """``(messages, images)`` of a ConversationSample or an energon VQASample (answers str or list)."""
    if isinstance(sample, ConversationSample):
        return sample.messages, list(sample.images)
    if isinstance(sample, VQASample):
        answers = sample.answers
        if answers is None:
            raise ValueError(f"VQA sample {sample.__key__} has no answer")
        if isinstance(answers, (list, tuple)):
            if not answers:
                raise ValueError(f"VQA sample {sample.__key__} has no answer")
            if sample.answer_weights is not None and len(sample.answer_weights) == len(answers):
                weights = [float(w) for w in sample.answer_weights]
                answers = [answers[weights.index(max(weights))]]
            answer = answers[0]
        else:
            answer = answers
        return vqa_messages(sample.context or "", str(answer)), [sample.image]
    raise TypeError(f"unsupported sample type {type(sample).__name__}; expected ConversationSample or VQASample")


def videos_of(sample: Any) -> list:
    """The videos of a sample (energon ``AVDecoder``s, in video-part order; none for a ``VQASample``)."""
    return list(getattr(sample, "videos", None) or [])


SAMPLE_LOADER_PY = '''\
# Written by megatron-vlm (data_prep/make_wds.py): maps the tar parts of a conversation sample
# (K.json with "messages", K.img0.jpg, ..., K.vid0.mp4, ...; or a VQA row K.json, K.txt, K.jpg / K.mp4) onto
# megatron_vlm.data.sample.ConversationSample.
from megatron_vlm.data.sample import part_filter, sample_loader  # noqa: F401
'''
