"""Refuse an output that is, contains or lies inside one of the command's inputs, before anything is written.

Every output is written under a temporary name and then renamed over the final path (``atomic.py``); with
``--overwrite`` the old path is deleted. So ``--megatron-dir`` equal to ``--hf-dir``, or ``megatron_to_hf
--hf-dir`` equal to (or a parent of) the training run it exports, would delete the input. Commands call
:func:`check_output_apart` with their output and inputs right after parsing the arguments, so such a command
stops with one line naming both paths and nothing is touched.

Local paths are compared after resolving ``~``, relative paths and symlinks (and, for paths that exist, by
file identity, which also catches bind mounts); ``msc://`` URLs compare by string prefix at ``/``
boundaries. A local path never overlaps a URL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from megatron_vlm.cli import InputError

#: relations, as the message words them (output first)
SAME, CONTAINS, INSIDE = "is the same as", "contains", "lies inside"


def _remote(p) -> bool:
    return "://" in str(p)


def _resolve(p) -> str | Path:
    if _remote(p):
        return str(p).rstrip("/")
    return Path(os.path.realpath(os.path.abspath(os.path.expanduser(str(p)))))


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _below(a, b) -> bool:
    """``a`` lies strictly inside ``b`` (both resolved)."""
    if isinstance(a, str) != isinstance(b, str):
        return False
    if isinstance(a, str):
        return a.startswith(b + "/")
    return any(_same(parent, b) for parent in a.parents)


def relation(output, input_) -> str | None:
    """How ``output`` relates to ``input_``: :data:`SAME`, :data:`CONTAINS`, :data:`INSIDE` or None (apart)."""
    out, inp = _resolve(output), _resolve(input_)
    if _same(out, inp):
        return SAME
    if _below(inp, out):
        return CONTAINS
    if _below(out, inp):
        return INSIDE
    return None


def _shown(p) -> str:
    resolved = _resolve(p)
    return f"{p}" if str(resolved) == str(p) else f"{p} (= {resolved})"


def check_output_apart(out_flag: str, output, inputs: Iterable[tuple[str, object]],
                       inside_ok: Iterable[str] = ()) -> None:
    """Raise ``InputError`` when ``output`` (given as ``out_flag``) is, contains or lies inside an input.

    ``inputs``: ``(flag, path)`` pairs; ``None`` paths are skipped. ``inside_ok``: flags of inputs that the
    output may lie inside (e.g. a dataset directory that gets a ``stats.json``); it must still not be or
    contain them.
    """
    if output is None:
        return
    inside_ok = set(inside_ok)
    for flag, path in inputs:
        if path is None:
            continue
        rel = relation(output, path)
        if rel is None or (rel == INSIDE and flag in inside_ok):
            continue
        harm = {SAME: "writing it would replace the input",
                CONTAINS: "writing it (with --overwrite) would delete the input",
                INSIDE: "the output would be written into the input (and --overwrite would delete part of it)"}[rel]
        raise InputError(f"{out_flag} {_shown(output)} {rel} {flag} {_shown(path)}; {harm}: choose another "
                         f"{out_flag}, apart from {flag}")
