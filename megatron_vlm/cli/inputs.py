"""Cheap checks of the Hugging Face directories a command is about to read, before transformers sees them.

transformers fails on a corrupt JSON file with a message that does not name it ("Invalid control character at:
line 1 column 30"). These checks read only the JSON files, so they take milliseconds, and raise ``InputError`` with
the file, what is wrong and what to do. The same checks of a Megatron checkpoint are
:mod:`megatron_vlm.checkpoint.checks`.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_vlm.cli import InputError

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def read_json(path: str | Path, fix: str = "restore or regenerate it") -> dict:
    """The JSON object in ``path``; ``InputError`` naming the file when it is missing or not valid JSON."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; {fix}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text, so not a JSON file; {fix}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON ({e.msg}: line {e.lineno} column {e.colno}); {fix}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, found {type(data).__name__}; {fix}")
    return data


def check_hf_dir(d: str | Path, flag: str) -> None:
    """An HF model directory: exists, with a valid ``config.json``."""
    d = Path(d)
    if not d.is_dir():
        raise InputError(f"{flag} {d}: no such directory; give a local Hugging Face model directory")
    if not (d / "config.json").is_file():
        raise InputError(f"{flag} {d} has no config.json: not a Hugging Face model directory")
    read_json(d / "config.json", "re-download the model or restore config.json")


def check_tokenizer_dir(d: str | Path, flag: str) -> None:
    """A directory holding a tokenizer (``tokenizer_config.json`` or ``tokenizer.json``), its JSON valid."""
    d = Path(d)
    if not d.is_dir():
        raise InputError(f"{flag} {d}: no such directory; give the HF LLaVA directory written by "
                         "convert/build_llava.py (it holds the tokenizer)")
    present = [f for f in TOKENIZER_FILES if (d / f).is_file()]
    if not present:
        raise InputError(f"{flag} {d} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); give the HF LLaVA "
                         "directory written by convert/build_llava.py")
    for f in present + [f for f in ("preprocessor_config.json", "processor_config.json") if (d / f).is_file()]:
        read_json(d / f, "copy the tokenizer files again from the HF model directory")
