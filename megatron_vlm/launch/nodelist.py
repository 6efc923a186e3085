"""SLURM host lists: ``expand_nodelist("gpu[01-04,07],login1")`` -> the host names, in order.

Handles comma-separated items, bracket ranges with zero padding (``n[08-10]`` -> n08 n09 n10), lists inside
brackets and several bracket groups in one name (``r[1-2]n[1-2]``). Pure Python: never calls scontrol, so it
works in containers and tests.
"""

from __future__ import annotations

import itertools
import re


class NodelistError(ValueError):
    pass


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise NodelistError(f"nodelist {text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NodelistError(f"nodelist {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise NodelistError(f"nodelist {text!r}: '[' without ']'")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_bracket(body: str, whole: str) -> list[str]:
    out = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise NodelistError(f"nodelist {whole!r}: {part!r} is not a number or a range like 01-04")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise NodelistError(f"nodelist {whole!r}: range {part} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(a, b + 1))  # padding: the width of the lower bound
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """All host names of a SLURM nodelist, in the order SLURM gives them."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", item)
        options = [
            _expand_bracket(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces if p != ""
        ]
        hosts.extend("".join(combo) for combo in itertools.product(*options))
    if not hosts:
        raise NodelistError(f"nodelist {nodelist!r} names no hosts")
    return hosts
