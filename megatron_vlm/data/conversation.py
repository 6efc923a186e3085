"""The one conversation format megatron-vlm stores and trains on, and its conversions.

A conversation is a list of messages ``{"role": "system"|"user"|"assistant", "content": [part, ...]}``
whose parts are ``{"type": "text", "text": str}`` or ``{"type": "image"}`` -- the HF multimodal chat format
that :func:`megatron_vlm.chat_template.llava_chat_template` (and HF processors) render. Images are kept
apart, in the order their image parts appear.

Converters from the three input formats (VQA rows, LLaVA ``conversations``, OpenAI ``messages``) live here
so that the writer, the task encoder and ``stats.py`` agree on what a sample means. They raise
:class:`Reject` with a human-readable reason when a record cannot be used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEHOLDER = "<image>"

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
    """Messages in the stored format plus the image references in the order their image parts appear.

    ``images`` hold whatever the reader found (a path relative to the image root, or ``bytes`` of an
    embedded image); the writer replaces them by validated image bytes.
    """

    messages: list[dict]
    images: list = field(default_factory=list)
    fields: dict = field(default_factory=dict)  # format-specific fields to store (VQA: question, answer)


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


IMAGE_PART = {"type": "image"}


def split_placeholders(text: str) -> list[dict]:
    """``"<image>\\nWhat is it?"`` -> [image, text "What is it?"].

    The chat template writes a newline after every image part, so the one newline that follows a
    placeholder in LLaVA data is dropped to render the original text back exactly.
    """
    parts: list[dict] = []
    pieces = text.split(PLACEHOLDER)
    for i, piece in enumerate(pieces):
        if i > 0:
            parts.append(dict(IMAGE_PART))
            if piece.startswith("\n"):
                piece = piece[1:]
        if piece:
            parts.append(text_part(piece))
    return parts


def count_images(messages: list[dict]) -> int:
    return sum(1 for m in messages for p in m["content"] if p["type"] == "image")


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


def check_conversation(messages: list[dict], n_images: int) -> None:
    """Shared rules: a non-empty conversation with an answer, images only in user turns, counts matching."""
    if not messages:
        raise Reject("empty conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise Reject("conversation has no assistant turn")
    for i, m in enumerate(messages):
        if not m["content"] or (not message_text(m).strip() and count_images([m]) == 0):
            raise Reject(f"empty {'answer' if m['role'] == 'assistant' else 'turn'} (turn {i}, {m['role']})")
        if m["role"] == "assistant" and not message_text(m).strip():
            raise Reject(f"empty answer (turn {i})")
        if m["role"] != "user" and count_images([m]):
            raise Reject(f"image in a {m['role']} turn (turn {i}); images are supported in user turns only")
    found = count_images(messages)
    if found != n_images:
        raise Reject(f"{found} <image> placeholder(s) but {n_images} image(s)")


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


def from_vqa(row: dict) -> Conversation:
    """A VQA row ``{image, question, answer}`` -> [user: image + question, assistant: answer].

    ``answers`` (a list; the first is used) is accepted for ``answer``. The question may hold one
    ``<image>`` to place the image; without one the image comes first.
    """
    image = _text_field(row, ("image", "image_path", "file_name"), "image")
    question = _text_field(row, ("question", "query", "prompt"), "question")
    answer = _text_field(row, ("answer", "answers"), "answer")
    if not answer.strip():
        raise Reject("empty answer")
    if PLACEHOLDER in answer:
        raise Reject("<image> in the answer")
    n = question.count(PLACEHOLDER)
    if n > 1:
        raise Reject(f"{n} <image> placeholders in the question but 1 image")
    return Conversation(vqa_messages(question, answer), [image], {"question": question, "answer": answer})


def vqa_messages(question: str, answer: str) -> list[dict]:
    """The conversation of a VQA sample (also used for energon ``VQASample``s at training time)."""
    user = split_placeholders(question) if PLACEHOLDER in question else [dict(IMAGE_PART)] + (
        [text_part(question)] if question else []
    )
    return [{"role": "user", "content": user}, {"role": "assistant", "content": [text_part(answer)]}]


def from_llava(item: dict) -> Conversation:
    """A LLaVA record ``{id, image?, conversations: [{from, value}]}`` -> conversation (all turns kept)."""
    turns = item.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise Reject("empty conversation")
    images = item.get("image")
    if images is None or images == "":
        images = []
    elif isinstance(images, str):
        images = [images]
    elif not (isinstance(images, list) and all(isinstance(x, str) for x in images)):
        raise Reject("'image' must be a path or a list of paths")
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
        messages.append({"role": role, "content": split_placeholders(value)})
    check_conversation(messages, len(images))
    return Conversation(messages, list(images))


def from_chat(item: dict) -> Conversation:
    """An OpenAI chat-completion record ``{messages: [{role, content}]}`` -> conversation.

    ``content`` is a string or a list of parts of type ``text`` and ``image_url`` (``{"url": ...}`` or a
    plain string; a base64 data URL or a path relative to the image root). ``<image>`` must not appear in
    text: images are ``image_url`` parts.
    """
    raw = item.get("messages")
    if not isinstance(raw, list) or not raw:
        raise Reject("empty conversation")
    messages, images = [], []
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
                elif kind in ("image_url", "image"):
                    url = part.get("image_url", part.get("image"))
                    if isinstance(url, dict):
                        url = url.get("url")
                    if not isinstance(url, str) or not url:
                        raise Reject(f"message {i}: image part without a url")
                    parts.append(dict(IMAGE_PART))
                    images.append(url)
                else:
                    raise Reject(f"message {i}: unsupported content part type {kind!r}")
        elif content is not None:
            raise Reject(f"message {i}: content must be a string or a list of parts")
        for p in parts:
            if p["type"] == "text" and PLACEHOLDER in p["text"]:
                n = p["text"].count(PLACEHOLDER)
                raise Reject(f"{n} <image> placeholder(s) in text; chat images must be image_url parts")
        messages.append({"role": role, "content": parts})
    check_conversation(messages, len(images))
    return Conversation(messages, images)


FORMATS = {"vqa": from_vqa, "llava": from_llava, "chat": from_chat}
