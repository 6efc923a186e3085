"""What a prepared sample looks like inside the tars, and how energon turns it into a Python object.

Tar layout per sample key ``K`` (written by :mod:`megatron_vlm.data.make_wds`):
- ``vqa``: ``K.jpg`` (image), ``K.txt`` (answer), ``K.json`` (``{"question", "id", "source"}``) -- the
  energon VQA layout; energon's own ``VQASample`` with field map image=jpg, context=json[question],
  answers=txt reads it.
- ``llava`` / ``chat``: ``K.json`` (``{"messages", "id", "source"}``, messages in the format of
  :mod:`megatron_vlm.data.conversation`) and ``K.img0.jpg``, ``K.img1.png``, ... in image-part order.
  :class:`ConversationSample` is their energon sample type; ``.nv-meta/sample_loader.py`` maps the raw
  parts onto it with :func:`sample_loader` / :func:`part_filter`.

:func:`cook` does the same for a dataset prepared interactively as "Crude sample" (energon's
CrudeWebdataset), so :class:`~megatron_vlm.data.task_encoder.VLMTaskEncoder` reads both.
:func:`conversation_of` gives ``(messages, images)`` for any of these sample types.
"""

from __future__ import annotations

import re
from typing import Any

from megatron.energon import Sample, VQASample
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless
from megatron.energon.task_encoder.cooking import basic_sample_keys

from megatron_vlm.data.conversation import vqa_messages

IMAGE_PART_RE = re.compile(r"^img(\d+)\.(jpg|jpeg|png)$")


@edataclass
class ConversationSample(Sample):
    """A multi-turn conversation with zero or more images (decoded by energon's decoder)."""

    #: Images in the order of the image parts of ``messages``.
    images: list
    #: ``[{"role": ..., "content": [{"type": "text", "text": ...} | {"type": "image"}]}]``
    messages: list


def image_parts(raw: dict) -> list[str]:
    """The image part names of a raw sample, in image order."""
    found = []
    for name in raw:
        m = IMAGE_PART_RE.match(name)
        if m:
            found.append((int(m.group(1)), name))
    return [name for _, name in sorted(found)]


def part_filter(part: str) -> bool:
    return part == "json" or IMAGE_PART_RE.match(part) is not None


def sample_loader(raw: dict) -> dict:
    """Energon sample loader: raw parts -> the fields of :class:`ConversationSample`."""
    meta = raw["json"]
    return dict(images=[raw[name] for name in image_parts(raw)], messages=meta["messages"])


@stateless
def cook(raw: dict) -> Sample:
    """Energon cooker for crude samples of either layout (conversation or VQA)."""
    base = basic_sample_keys(raw)
    meta = raw.get("json") or {}
    if "messages" in meta:
        return ConversationSample(**base, **sample_loader(raw))
    image = raw.get("jpg", raw.get("png"))
    return VQASample(**base, image=image, context=meta.get("question", ""), answers=raw.get("txt"))


def conversation_of(sample: Any) -> tuple[list[dict], list]:
    """``(messages, images)`` of a ConversationSample or an energon VQASample (answers str or list)."""
    if isinstance(sample, ConversationSample):
        return sample.messages, list(sample.images)
    if isinstance(sample, VQASample):
        answers = sample.answers
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


SAMPLE_LOADER_PY = '''\
# Written by megatron-vlm (data_prep/make_wds.py): maps the tar parts of a conversation sample
# (K.json with "messages", K.img0.jpg, K.img1.png, ...) onto megatron_vlm.data.sample.ConversationSample.
from megatron_vlm.data.sample import part_filter, sample_loader  # noqa: F401
'''
