"""Tokenizer conventions of megatron-vlm: which token is the image token, the pad token, the embedding rows.

This module is the one place that knows how a LLaVA directory's tokens are set up:

- the IMAGE TOKEN. The model's config is the truth for its id (``image_token_index`` / ``image_token_id`` of
  ``config.json``, for LLaVA, LLaVA-NeXT and OneVision alike): it is what the model replaces by image features.
  The processor's ``image_token`` (``processor_config.json``, or the tokenizer's named ``image_token`` that
  transformers reads from ``tokenizer_config.json``) names the string the chat template writes. Both must meet
  in the tokenizer: the tokenizer maps that string to the config's id, or :func:`resolve_image_token` stops
  with one line naming both files and both ids. Without a named token, the string is the tokenizer's token at
  the config's id (which must be an added token). Nothing is guessed from the order of a tokenizer's special
  tokens: real LM tokenizers carry their own (``<|im_start|>``, ``[INST]``, ``[control_8]``, ...).
- :func:`add_vlm_tokens` adds the image token (a OneVision model also ``<video>``, whose id the config's
  ``video_token_index`` records; a pad token where the tokenizer has none);
- :func:`special_token_ids` / :func:`read_special_token_ids` read the image / pad / eos ids back;
- :func:`embedding_rows` is the vocabulary padding rule of ``convert/build_llava.py``.

The chat templates live in :mod:`megatron_vlm.data.chat_template`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DEFAULT_IMAGE_TOKEN = "<image>"
DEFAULT_VIDEO_TOKEN = "<video>"  # LLaVA-OneVision's (HF's video_token_index)
DEFAULT_PAD_TOKEN = "<pad>"
#: the multiple ``build_llava`` pads the embedding rows to when the tokenizer outgrows them (llava-1.5: 32064)
DEFAULT_VOCAB_PADDING = 64
#: config fields holding the image token id (transformers 5 names it image_token_id, older configs
#: and the original LLaVA-NeXT checkpoints image_token_index)
CONFIG_ID_FIELDS = ("image_token_id", "image_token_index")


class ImageTokenError(ValueError):
    """The model config, the processor and the tokenizer do not agree on the image token."""


@dataclass(frozen=True)
class ImageToken:
    token: str
    id: int


@dataclass(frozen=True)
class SpecialTokenIds:
    image: int
    pad: int
    eos: int | None
    bos: int | None
    image_token: str = DEFAULT_IMAGE_TOKEN
    video: int | None = None  # OneVision's video token (None: the tokenizer has none)


def config_image_token_id(config) -> int | None:
    """The image token id of an HF LLaVA / LLaVA-NeXT / OneVision config (object or dict), or None."""
    for name in CONFIG_ID_FIELDS:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def named_image_token(tokenizer, processor_image_token: str | None = None) -> str | None:
    """The image token string the processor names: its ``image_token``, else the tokenizer's named one."""
    if processor_image_token:
        return str(processor_image_token)
    named = getattr(tokenizer, "image_token", None)  # transformers 5: tokenizer_config.json "image_token"
    return str(named) if named else None


def token_id(tokenizer, token: str) -> int | None:
    """The id of ``token`` in ``tokenizer``, or None when it has no such token: looked up by the token and checked
    by the way back (an unknown token maps to the unk id, or to None), so the whole vocabulary (``get_vocab``, ~0.3 s
    for Qwen's 151k tokens) is never built."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid < 0 or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token) or \
            tokenizer.convert_ids_to_tokens(int(tid)) != token:
        return None
    return int(tid)


def resolve_image_token(tokenizer, config_id: int | None = None, named: str | None = None, *,
                        config_src: str = "the model config", named_src: str = "the processor",
                        tokenizer_src: str = "the tokenizer") -> ImageToken:
    """The image token of a model: ``config_id`` (the config's ``image_token_index``) is the truth for the id,
    ``named`` (the processor's ``image_token``) for the string; the tokenizer must map one to the other.
    ``*_src`` name the files in error messages."""
    if config_id is not None:
        if named is not None:
            tid = token_id(tokenizer, named)
            if tid is None:
                raise ImageTokenError(
                    f"{named_src} names the image token {named!r}, which {tokenizer_src} does not have; "
                    f"{config_src} has image_token_index {config_id}: rebuild the directory with "
                    "convert/build_llava.py")
            if tid != config_id:
                at = _token_at(tokenizer, config_id)
                raise ImageTokenError(
                    f"image token mismatch: {config_src} has image_token_index {config_id} ({at}), but "
                    f"{named_src} names {named!r}, which {tokenizer_src} maps to id {tid}; make them agree "
                    f"(set image_token_index to {tid}, or image_token to the token at {config_id})")
            return ImageToken(named, config_id)
        if not 0 <= config_id < len(tokenizer) or config_id not in _added_ids(tokenizer):
            raise ImageTokenError(
                f"{config_src} has image_token_index {config_id}, but in {tokenizer_src} ({len(tokenizer)} tokens) "
                f"that id is {_token_at(tokenizer, config_id)}, not an added image token; give the tokenizer the "
                f"model was built with (convert/build_llava.py adds {DEFAULT_IMAGE_TOKEN!r})")
        return ImageToken(str(tokenizer.convert_ids_to_tokens(config_id)), config_id)
    token = named or DEFAULT_IMAGE_TOKEN
    tid = token_id(tokenizer, token)
    if tid is None:
        raise ImageTokenError(
            f"{tokenizer_src} has no image token {token!r} and no model config names one; build the model "
            "directory with convert/build_llava.py (it adds the token) or pass --image-token-id")
    return ImageToken(token, tid)


def _added_ids(tokenizer) -> set[int]:
    return set(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})


def _token_at(tokenizer, tid: int) -> str:
    if not 0 <= tid < len(tokenizer):
        return f"beyond the tokenizer's {len(tokenizer)} tokens"
    return f"the tokenizer's {tokenizer.convert_ids_to_tokens(tid)!r}"


def add_vlm_tokens(tokenizer, image_token: str = DEFAULT_IMAGE_TOKEN, video_token: str | None = None) -> list[str]:
    """Add the image token (then ``video_token``, then a pad token if missing, as llava-hf: ``<image>`` 32000,
    ``<pad>`` 32001) as special tokens; return what was added. The LM's own extra special tokens are kept."""
    added = []
    for token in [image_token] + ([video_token] if video_token else []):
        if token not in tokenizer.get_vocab() or token not in tokenizer.all_special_tokens:
            if token not in tokenizer.get_vocab():
                added.append(token)
            tokenizer.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": DEFAULT_PAD_TOKEN})
        added.append(DEFAULT_PAD_TOKEN)
    return added


def special_token_ids(tokenizer, image_token: str | None = None, image_token_id: int | None = None,
                      **sources) -> SpecialTokenIds:
    """Image / pad / eos / bos ids of a LLaVA tokenizer. ``image_token_id`` is the model config's id and
    ``image_token`` the processor's string (see :func:`resolve_image_token`; ``sources`` name the files)."""
    img = resolve_image_token(tokenizer, image_token_id, named_image_token(tokenizer, image_token), **sources)
    if tokenizer.pad_token_id is None:
        raise ValueError(f"{sources.get('tokenizer_src', 'the tokenizer')} has no pad token; build the model "
                         "directory with convert/build_llava.py")
    return SpecialTokenIds(image=img.id, pad=int(tokenizer.pad_token_id), eos=tokenizer.eos_token_id,
                           bos=tokenizer.bos_token_id, image_token=img.token, video=video_token_id(tokenizer))


def video_token_id(tokenizer, video_token: str = DEFAULT_VIDEO_TOKEN) -> int | None:
    """The id of the tokenizer's video token, or None when it has none (a model without video support)."""
    return token_id(tokenizer, video_token)


def directory_sources(hf_dir) -> dict:
    """The model config's image token id, the processor's image token and the file names of an HF directory,
    as keyword arguments of :func:`special_token_ids` (the tokenizer itself is loaded by the caller)."""
    d = Path(hf_dir)
    config = _read_json(d / "config.json")
    processor = _read_json(d / "processor_config.json")
    named_file = "processor_config.json" if processor.get("image_token") else "tokenizer_config.json"
    return dict(image_token_id=config_image_token_id(config) if config else None,
                image_token=processor.get("image_token") or None,
                config_src=str(d / "config.json"), named_src=f"{d / named_file}'s image_token",
                tokenizer_src=f"the tokenizer in {d}")


def read_special_token_ids(hf_dir, tokenizer=None) -> SpecialTokenIds:
    """:func:`special_token_ids` of an HF LLaVA directory (its config, processor config and tokenizer)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return special_token_ids(tokenizer, **directory_sources(hf_dir))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it from the model's original files") from None
    return data if isinstance(data, dict) else {}


def embedding_rows(lm_rows: int, tokenizer_len: int, padding: int | None = None) -> int:
    """Rows of the LLaVA's embedding and output layer built from an LM with ``lm_rows`` rows whose tokenizer
    (image and pad token added) holds ``tokenizer_len`` tokens.

    The LM's own size is kept when it already covers the tokenizer (Qwen2: 152064 rows for 151647 tokens).
    When the added tokens outgrow it, the rows grow to the next multiple of ``padding`` (default 64, as
    llava-hf/llava-1.5-7b-hf: vicuna's 32000 rows + ``<image>``, ``<pad>`` -> 32064). An explicit ``padding``
    also rounds a covering size up to its multiple (``padding=1``: exactly the tokenizer's length when growing).
    Megatron pads further at run time (to a multiple of ``make_vocab_size_divisible_by``, 128, whatever the TP) and
    trims that on export.
    """
    rows = max(lm_rows, tokenizer_len)
    if rows > lm_rows or padding:
        p = padding or DEFAULT_VOCAB_PADDING
        rows = int(math.ceil(rows / p) * p)
    return rows
