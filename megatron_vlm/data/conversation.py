"""The one conversation format megatron-vlm stores and trains on, and its conversions.

A conversation is a list of messages ``{"role": "system"|"user"|"assistant", "content": [part, ...]}``
whose parts are ``{"type": "text", "text": str}``, ``{"type": "image"}`` or ``{"type": "video"}`` -- the HF
multimodal chat format that :mod:`megatron_vlm.data.chat_template`'s templates (and HF processors) render.
Images and videos are kept apart, each in the order their parts appear. As in LLaVA-NeXT, the ``<image>``
placeholder of a record with a video stands for the video; ``<video>`` is refused in text (the tokenizer would
read it as the video token).

Converters from the three input formats (VQA rows, LLaVA ``conversations``, OpenAI ``messages``) live here
so that the writer, the task encoder and ``stats.py`` agree on what a sample means. They raise
:class:`Reject` with a human-readable reason when a record cannot be used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
}


class Reject(ValueError):
    """A record that cannot become a sample; the message is the reason written to rejected.jsonl."""


@dataclass
class Conversation:
    """Messages in the stored format plus the image (video) references in the order their image (video) parts
    appear.

    ``images`` and ``videos`` hold whatever the reader found (a path relative to the image root, or a ``data:``
    URL); the writer replaces them by validated bytes.
    """

    messages: list[dict]
    images: list = field(default_factory=list)
    fields: dict = field(default_factory=dict)  # format-specific fields to store (VQA: question, answer)
    videos: list = field(default_factory=list)


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


IMAGE_PART = {"type": "image"}
VIDEO_PART = {"type": "video"}


def split_placeholders(text: str, kind: str = "image") -> list[dict]:
    """``"<image>\\nWhat is it?"`` -> [image, text "What is it?"] (``kind='video'``: a video part).

    The chat template writes a newline after every image part, so the one newline that follows a
    placeholder in LLaVA data is dropped to render the original text back exactly.
    """
    parts: list[dict] = []
    pieces = text.split(PLACEHOLDER)
    for i, piece in enumerate(pieces):
        if i > 0:
            parts.append({"type": kind})
            if piece.startswith("\n"):
                piece = piece[1:]
        if piece:
            parts.append(text_part(piece))
    return parts


def count_images(messages: list[dict], kind: str = "image") -> int:
    return sum(1 for m in messages for p in m["content"] if p["type"] == kind)


def message_text(message: dict) -> str:
    return "".join(p["text"] for p in message["content"] if p["type"] == "text")


def has_lone_surrogate(obj) -> bool:
    """True if any string in ``obj`` holds a lone surrogate (bytes that were not valid UTF-8)."""
    if isinstance(obj, str):
        return any("\ud800" <= c <= "\udfff" for c in obj)
    if isinstance(obj, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(has_lone_surrogate(v) for v in obj)
    return False


def check_conversation(messages: list[dict], n_images: int, n_videos: int = 0) -> None:
    """Shared rules: a non-empty conversation with an answer, images and videos only in user turns, no
    ``<video>`` in text, counts matching."""
    if not messages:
        raise Reject("empty conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise Reject("conversation has no assistant turn")
    for i, m in enumerate(messages):
        media = count_images([m]) + count_images([m], "video")
        if not m["content"] or (not message_text(m).strip() and media == 0):
            raise Reject(f"empty {'answer' if m['role'] == 'assistant' else 'turn'} (turn {i}, {m['role']})")
        if m["role"] == "assistant" and not message_text(m).strip():
            raise Reject(f"empty answer (turn {i})")
        if m["role"] != "user" and media:
            kind = "image" if count_images([m]) else "video"
            raise Reject(f"{kind} in a {m['role']} turn (turn {i}); {kind}s are supported in user turns only")
        if VIDEO_PLACEHOLDER in message_text(m):
            raise Reject(f"<video> in the text of turn {i}; a video is a 'video' field (its placeholder is "
                         "<image>, as in LLaVA-NeXT) or a video_url part")
    found = count_images(messages)
    if found != n_images:
        raise Reject(f"{found} <image> placeholder(s) but {n_images} image(s)")
    found = count_images(messages, "video")
    if found != n_videos:
        raise Reject(f"{found} <image> placeholder(s) but {n_videos} video(s)")


def _text_field(row: dict, names: tuple[str, ...], what: str) -> str:
    for name in names:
        if name in row and row[name] is not None:
            value = row[name]
            if isinstance(value, list):
                value = value[0] if value else ""
            if not isinstance(value, str):
                value = str(value)
            return value
    raise Reject(f"missing {what} (expected a field {' or '.join(repr(n) for n in names)})")


IMAGE_FIELDS = ("image", "image_path", "file_name")


def from_vqa(row: dict) -> Conversation:
    """A VQA row ``{image, question, answer}`` -> [user: image + question, assistant: answer].

    ``answers`` (a list; the first is used) is accepted for ``answer``. The question may hold one
    ``<image>`` to place the image; without one the image comes first. A row with a ``video`` field instead
    of an image gives the same conversation with a video (its placeholder is ``<image>`` too).
    """
    has_image = any(row.get(n) not in (None, "") for n in IMAGE_FIELDS)
    kind = "video" if row.get("video") not in (None, "") and not has_image else "image"
    if kind == "image" and row.get("video") not in (None, ""):
        raise Reject("both an image and a video; a VQA row holds one of them")
    ref = _text_field(row, ("video",) if kind == "video" else IMAGE_FIELDS, kind)
    question = _text_field(row, ("question", "query", "prompt"), "question")
    answer = _text_field(row, ("answer", "answers"), "answer")
    if not answer.strip():
        raise Reject("empty answer")
    for mark in (PLACEHOLDER, VIDEO_PLACEHOLDER):
        if mark in answer:
            raise Reject(f"{mark} in the answer")
    if VIDEO_PLACEHOLDER in question:
        raise Reject("<video> in the question; the placeholder of a video is <image>, as in LLaVA-NeXT")
    n = question.count(PLACEHOLDER)
    if n > 1:
        raise Reject(f"{n} <image> placeholders in the question but 1 {kind}")
    fields = {"question": question, "answer": answer}
    messages = vqa_messages(question, answer, kind)
    return Conversation(messages, [ref], fields) if kind == "image" else Conversation(messages, [], fields, [ref])


def vqa_messages(question: str, answer: str, kind: str = "image") -> list[dict]:
    """The conversation of a VQA sample (also used for energon ``VQASample``s at training time); ``kind``
    'video' for a VQA video sample."""
    user = split_placeholders(question, kind) if PLACEHOLDER in question else [{"type": kind}] + (
        [text_part(question)] if question else []
    )
    return [{"role": "user", "content": user}, {"role": "assistant", "content": [text_part(answer)]}]


def _paths(item: dict, key: str) -> list[str]:
    value = item.get(key)
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        raise Reject(f"'{key}' must be a path or a list of paths")
    return list(value)


def from_llava(item: dict) -> Conversation:
    """A LLaVA record ``{id, image? | video?, conversations: [{from, value}]}`` -> conversation (all turns kept).

    As in LLaVA-NeXT, a record's ``video`` (a path) takes the place of its image: its ``<image>`` placeholder
    stands for the video."""
    turns = item.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise Reject("empty conversation")
    images, videos = _paths(item, "image"), _paths(item, "video")
    if images and videos:
        raise Reject("both 'image' and 'video'; a LLaVA-NeXT record holds one of them")
    kind = "video" if videos else "image"
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Reject(f"turn {i} is not an object")
        role = ROLE_ALIASES.get(str(turn.get("from", turn.get("role", ""))).lower())
        if role is None:
            raise Reject(f"turn {i} has unknown role {turn.get('from', turn.get('role'))!r}")
        value = turn.get("value", turn.get("content"))
        if not isinstance(value, str):
            raise Reject(f"turn {i} has no text 'value'")
        messages.append({"role": role, "content": split_placeholders(value, kind)})
    check_conversation(messages, len(images), len(videos))
    return Conversation(messages, images, videos=videos)


#: OpenAI-style media parts (and HF's plain ``image``/``video`` parts with a url): kind -> (media, stored part)
_MEDIA_PARTS = {"image_url": ("image", IMAGE_PART), "image": ("image", IMAGE_PART),
                "video_url": ("video", VIDEO_PART), "video": ("video", VIDEO_PART)}


def from_chat(item: dict) -> Conversation:
    """An OpenAI chat-completion record ``{messages: [{role, content}]}`` -> conversation.

    ``content`` is a string or a list of parts of type ``text``, ``image_url`` and ``video_url``
    (``{"url": ...}`` or a plain string; a base64 data URL such as ``data:video/mp4;base64,...`` or a path
    relative to the image root). ``<image>`` must not appear in text: images are ``image_url`` parts.
    """
    raw = item.get("messages")
    if not isinstance(raw, list) or not raw:
        raise Reject("empty conversation")
    messages, images, videos = [], [], []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise Reject(f"message {i} is not an object")
        role = ROLE_ALIASES.get(str(msg.get("role", "")).lower())
        if role is None:
            raise Reject(f"message {i} has unsupported role {msg.get('role')!r}")
        content = msg.get("content")
        parts: list[dict] = []
        if isinstance(content, str):
            parts = [text_part(content)] if content else []
        elif isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise Reject(f"message {i}: text part without a string 'text'")
                    parts.append(text_part(part["text"]))
                elif kind in _MEDIA_PARTS:
                    what, part_type = _MEDIA_PARTS[kind]
                    url = part.get(f"{what}_url", part.get(what))
                    if isinstance(url, dict):
                        url = url.get("url")
                    if not isinstance(url, str) or not url:
                        raise Reject(f"message {i}: {what} part without a url")
                    parts.append(dict(part_type))
                    (images if what == "image" else videos).append(url)
                else:
                    raise Reject(f"message {i}: unsupported content part type {kind!r}")
        elif content is not None:
            raise Reject(f"message {i}: content must be a string or a list of parts")
        for p in parts:
            if p["type"] == "text" and PLACEHOLDER in p["text"]:
                n = p["text"].count(PLACEHOLDER)
                raise Reject(f"{n} <image> placeholder(s) in text; chat images must be image_url parts")
        messages.append({"role": role, "content": parts})
    check_conversation(messages, len(images), len(videos))
    return Conversation(messages, images, videos=videos)


FORMATS = {"vqa": from_vqa, "llava": from_llava, "chat": from_chat}

# What marks a record of each format: (description, keys it has -- one of each group)
FORMAT_SIGNS = {
    "vqa": ("a VQA row", (("question", "query", "prompt"), ("answer", "answers"))),
    "llava": ("a LLaVA record", (("conversations",),)),
    "chat": ("an OpenAI chat record", (("messages",),)),
}


def guess_format(record) -> str | None:
    """The one input format whose keys ``record`` has (None: no format's, or several formats')."""
    if not isinstance(record, dict):
        return None
    found = [f for f, (_, groups) in FORMAT_SIGNS.items() if all(any(k in record for k in g) for g in groups)]
    return found[0] if len(found) == 1 else None


def check_format(fmt: str, record, where: str) -> None:
    """Refuse ``--format fmt`` when a record (the input's first) is clearly of another format."""
    guess = guess_format(record)
    if guess is not None and guess != fmt:
        what, groups = FORMAT_SIGNS[guess]
        keys = " and ".join(repr(next(k for k in g if k in record)) for g in groups)
        raise ValueError(f"--format {fmt}: {where} is {what} (it has {keys}), not {FORMAT_SIGNS[fmt][0]}; "
                         f"use --format {guess}")
