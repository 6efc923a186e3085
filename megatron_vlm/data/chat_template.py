"""The chat template a LLaVA directory carries: the LM's own, taught to render images, or LLaVA-1.5's.

``convert/build_llava.py --chat-template`` chooses (:func:`choose_chat_template`):

- ``keep`` (default): the text model's own template (ChatML for Qwen2-Instruct, ``[INST]`` for Mistral, ...).
  Training data and HF processors give message contents as lists of parts
  (``[{"type": "image"}, {"type": "text", "text": ...}]``). A template that already renders such a list with
  one image token per image part is kept as it is. One that does not (most LM templates only concatenate
  string contents) gets :data:`IMAGE_PARTS_PREFIX` put in front of it: a Jinja preamble that rewrites each
  list content into a string, an image part becoming the image token and a newline (LLaVA's
  ``<image>\\n``), text parts their text, before the LM's template runs unchanged. An LM without a
  template (a base model such as vicuna-7b-v1.5) gets LLaVA-1.5's.
- ``llava``: LLaVA-1.5's ``USER: ... ASSISTANT:`` template (:func:`llava_chat_template`), whatever the LM had.
- a path to a ``.jinja`` file: that template (adapted to image parts like the LM's).

A OneVision model (``video_token``) also renders each ``{"type": "video"}`` part as ``<video>`` and a newline.

What is chosen is logged. How assistant turns are closed for training (the eos rule) is
:mod:`megatron_vlm.data.chat_tokens`' business.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_vlm.model.tokenizer import DEFAULT_IMAGE_TOKEN

CHAT_TEMPLATE_CHOICES = ("keep", "llava")

# LLaVA-1.5 style. The generation prompt ends in ``ASSISTANT:`` without a trailing space, so the answer's first
# token at inference is the same space-prefixed token the model was trained on (``ASSISTANT: red`` -> ``Ġred``).
# It accepts plain-string contents and HF multimodal content lists; each image part becomes one image token.
_LLAVA_TEMPLATE = (
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

# Rewrites list contents into strings (image part -> image token + newline) before a string-only template.
# One line, no whitespace between tags and no whitespace control, so it renders nothing itself.
IMAGE_PARTS_PREFIX = (
    "{#- megatron-vlm: image content parts -> @@IMAGE@@ (convert/build_llava.py --chat-template keep) -#}"
    "{%- set mvlm_ns = namespace(messages=[]) %}"
    "{%- for mvlm_m in messages %}"
    "{%- if mvlm_m['content'] is string or mvlm_m['content'] is none %}"
    "{%- set mvlm_ns.messages = mvlm_ns.messages + [mvlm_m] %}"
    "{%- else %}{%- set mvlm_t = namespace(s='') %}"
    "{%- for mvlm_p in mvlm_m['content'] %}"
    "{%- if mvlm_p['type'] == 'image' %}{%- set mvlm_t.s = mvlm_t.s + '@@IMAGE@@\\n' %}@@VIDEO_PART@@"
    "{%- elif mvlm_p['type'] == 'text' %}{%- set mvlm_t.s = mvlm_t.s + mvlm_p['text'] %}{%- endif %}"
    "{%- endfor %}"
    "{%- set mvlm_ns.messages = mvlm_ns.messages + [dict(mvlm_m, content=mvlm_t.s)] %}"
    "{%- endif %}{%- endfor %}"
    "{%- set messages = mvlm_ns.messages %}"
)
_MARK = "{#- megatron-vlm: image content parts"

# The conversation every candidate template must render: one image part, text parts, an answer.
_PROBE_TEXT, _PROBE_ANSWER = "mvlm probe question", "mvlm probe answer"


class ChatTemplateError(ValueError):
    pass


def llava_chat_template(image_token: str = DEFAULT_IMAGE_TOKEN, video_token: str | None = None) -> str:
    """LLaVA-1.5's chat template with ``image_token`` for image content parts (eos closes each answer); with
    ``video_token`` (OneVision) a video part renders as that token and a newline, like an image."""
    video = f"{{% elif part['type'] == 'video' %}}{video_token}\n" if video_token else ""
    return _LLAVA_TEMPLATE.replace("@@IMAGE@@", image_token).replace("@@VIDEO@@", video)


def with_image_parts(template: str, image_token: str = DEFAULT_IMAGE_TOKEN, video_token: str | None = None) -> str:
    """``template`` with :data:`IMAGE_PARTS_PREFIX` in front (once); with ``video_token`` video parts too."""
    if template.startswith(_MARK):
        return template
    video = ("{%- elif mvlm_p['type'] == 'video' %}{%- set mvlm_t.s = mvlm_t.s + '" + video_token + "\\n' %}"
             if video_token else "")
    return IMAGE_PARTS_PREFIX.replace("@@IMAGE@@", image_token).replace("@@VIDEO_PART@@", video) + template


def renders_images(tokenizer, template: str, image_token: str, video_token: str | None = None) -> tuple[bool, str]:
    """Whether ``template`` renders a multimodal message with one ``image_token`` per image part (and, with
    ``video_token``, one per video part; and its text and answer); the reason when not."""
    parts = [{"type": "image"}] + ([{"type": "video"}] if video_token else [])
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": _PROBE_TEXT}]},
                {"role": "assistant", "content": [{"type": "text", "text": _PROBE_ANSWER}]}]
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception as e:  # jinja raises anything (TypeError on str + list, the template's own exceptions)
        return False, f"it fails on content lists ({type(e).__name__}: {e})"
    n = text.count(image_token)
    if n != 1 or _PROBE_TEXT not in text or _PROBE_ANSWER not in text:
        return False, f"it renders an image part as {n} {image_token!r} tokens"
    if video_token and text.count(video_token) != 1:
        return False, f"it renders a video part as {text.count(video_token)} {video_token!r} tokens"
    return True, ""


@dataclass(frozen=True)
class ChosenTemplate:
    template: str
    note: str  # what was done, for the log


def choose_chat_template(tokenizer, choice: str = "keep", image_token: str = DEFAULT_IMAGE_TOKEN,
                         what: str = "the text model", video_token: str | None = None) -> ChosenTemplate:
    """The chat template of a built LLaVA directory (see the module docstring). ``tokenizer`` is the LM's
    (its ``chat_template`` is read); ``choice`` is ``keep``, ``llava`` or a path to a Jinja file."""
    if choice == "llava":
        return ChosenTemplate(llava_chat_template(image_token, video_token), "LLaVA-1.5's (USER: ... ASSISTANT:), as asked")
    if choice == "keep":
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # several named templates: the default one
            own = own.get("default")
        if not own:
            return ChosenTemplate(llava_chat_template(image_token, video_token),
                                  f"LLaVA-1.5's (USER: ... ASSISTANT:): {what} has no chat template")
        source = f"{what}'s own"
    else:
        path = Path(choice)
        if not path.is_file():
            raise ChatTemplateError(f"--chat-template {choice}: not 'keep', 'llava' or a Jinja template file")
        own, source = path.read_text(), str(path)
    ok, why = renders_images(tokenizer, own, image_token, video_token)
    if ok:
        return ChosenTemplate(own, f"{source}, unchanged (it renders image parts as {image_token!r})")
    adapted = with_image_parts(own, image_token, video_token)
    ok2, why2 = renders_images(tokenizer, adapted, image_token, video_token)
    if not ok2:
        raise ChatTemplateError(
            f"the chat template of {source} cannot render image parts: {why}, and with string contents {why2}; "
            "pass --chat-template llava (LLaVA-1.5's) or a Jinja file that renders {'type': 'image'} parts")
    return ChosenTemplate(adapted, f"{source}, with image parts rendered as {image_token!r} + newline "
                                   f"(the template alone: {why})")
