"""Tokenizer conventions of megatron-vlm: the image token, the pad token and the chat template.

This module is the one place that knows how a LLaVA directory's tokenizer is set up:
- ``add_vlm_tokens`` adds the image token (a OneVision model also ``<video>``; a pad token where the tokenizer
  has none);
- ``special_token_ids`` reads the image / pad / eos ids back from a saved tokenizer (never hard-coded);
- ``default_chat_template`` is the LLaVA-1.5 style template installed by ``convert/build_llava.py``.
  The generation prompt ends in ``ASSISTANT:`` without a trailing space, so the answer's first token at
  inference is the same space-prefixed token the model was trained on (``ASSISTANT: red`` -> ``Ġred``).
  It accepts both plain-string contents and HF multimodal content lists
  (``[{"type": "image"}, {"type": "text", "text": ...}]``); each image part becomes one image token, and with
  a video token each video part one video token.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IMAGE_TOKEN = "<image>"
DEFAULT_VIDEO_TOKEN = "<video>"  # LLaVA-OneVision's (HF's video_token_index)
DEFAULT_PAD_TOKEN = "<pad>"

# Role prefixes of the default template. The task encoder masks everything but assistant contents.
_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}SYSTEM: "
    "{% elif message['role'] == 'user' %}USER: "
    "{% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}@@IMAGE@@\n@@VIDEO@@"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def default_chat_template(image_token: str = DEFAULT_IMAGE_TOKEN, video_token: str | None = None) -> str:
    """The LLaVA-1.5 style chat template with ``image_token`` for image content parts (and ``video_token`` for
    video parts, followed by a newline like an image; without it video parts render as nothing)."""
    video = f"{{% elif part['type'] == 'video' %}}{video_token}\n" if video_token else ""
    return _TEMPLATE.replace("@@IMAGE@@", image_token).replace("@@VIDEO@@", video)


@dataclass(frozen=True)
class SpecialTokenIds:
    image: int
    pad: int
    eos: int | None
    bos: int | None
    video: int | None = None  # OneVision's video token (None: the tokenizer has none)


def add_vlm_tokens(tokenizer, image_token: str = DEFAULT_IMAGE_TOKEN, video_token: str | None = None) -> list[str]:
    """Add the image token (then ``video_token``, and a pad token if missing) as special tokens; return what
    was added."""
    added = []
    extra: dict = {}
    for token in [image_token] + ([video_token] if video_token else []):
        if token not in tokenizer.get_vocab() or token not in tokenizer.all_special_tokens:
            extra.setdefault("additional_special_tokens", []).append(token)
            if token not in tokenizer.get_vocab():
                added.append(token)
    if tokenizer.pad_token is None:
        extra["pad_token"] = DEFAULT_PAD_TOKEN
        added.append(DEFAULT_PAD_TOKEN)
    if extra:
        tokenizer.add_special_tokens(extra, replace_extra_special_tokens=False)
    return added


def image_token_of(tokenizer) -> str:
    """The image token a LLaVA tokenizer carries (the first additional special token)."""
    extra = list(getattr(tokenizer, "extra_special_tokens", None) or []) or list(
        getattr(tokenizer, "additional_special_tokens", None) or []
    )
    return str(extra[0]) if extra else DEFAULT_IMAGE_TOKEN


def special_token_ids(tokenizer, image_token: str | None = None) -> SpecialTokenIds:
    """Image / pad / eos / bos ids of a tokenizer prepared by ``add_vlm_tokens``."""
    image_token = image_token or image_token_of(tokenizer)
    ids = tokenizer.convert_tokens_to_ids([image_token])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise ValueError(
            f"tokenizer has no image token {image_token!r}; build the model directory with "
            "convert/build_llava.py (it adds the token) or pass --image-token"
        )
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer has no pad token; build the model directory with convert/build_llava.py")
    return SpecialTokenIds(
        image=int(ids[0]), pad=int(tokenizer.pad_token_id), eos=tokenizer.eos_token_id, bos=tokenizer.bos_token_id,
        video=video_token_id(tokenizer),
    )


def video_token_id(tokenizer, video_token: str = DEFAULT_VIDEO_TOKEN) -> int | None:
    """The id of the tokenizer's video token, or None when it has none (a model without video support)."""
    vocab = tokenizer.get_vocab()
    return int(vocab[video_token]) if video_token in vocab else None
