"""Why a rank failed, in one line, from the rank to the launcher: ``<run_dir>/failures/rank<R>.txt``.

A failing rank (``train/pretrain_vlm.py``) writes its one-line reason there and its full traceback next to
it (``rank<R>.traceback.txt``); the launcher clears the folder before starting the ranks and, when training
exits non-zero, prints the first rank's reason as its LAST line, so the cause is not buried in the output
of the other ranks and torchrun. Ranks of other nodes write to their own node's run directory.
"""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path

FAILURES_DIR = "failures"


def reason_of(exc: BaseException) -> str:
    """The one-line reason of ``exc``: the shared CLI wording for known faults, else type and first line."""
    from megatron_vlm.cli import describe_error

    line = describe_error(exc)
    if line is None:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return " ".join(line.split())


def record(run_dir: str | os.PathLike, rank: int, exc: BaseException) -> tuple[str, Path | None]:
    """Write rank ``rank``'s reason and traceback; return (reason, traceback file or None if unwritable)."""
    reason = reason_of(exc)
    d = Path(run_dir) / FAILURES_DIR
    try:
        d.mkdir(parents=True, exist_ok=True)
        tb = d / f"rank{rank}.traceback.txt"
        tb.write_text("".join(traceback.format_exception(exc)))
        tmp = d / f".rank{rank}.txt.tmp"
        tmp.write_text(reason + "\n")
        os.replace(tmp, d / f"rank{rank}.txt")
        return reason, tb
    except OSError:  # a full or read-only disk may be the failure itself: the console line still says it
        return reason, None


def clear(run_dir: str | os.PathLike) -> None:
    shutil.rmtree(Path(run_dir) / FAILURES_DIR, ignore_errors=True)


def first(run_dir: str | os.PathLike) -> tuple[int, str] | None:
    """(rank, reason) of the rank that failed first (oldest file), or None when no rank recorded one."""
    d = Path(run_dir) / FAILURES_DIR
    found = []
    for f in d.glob("rank*.txt"):
        name = f.name[len("rank"):-len(".txt")]
        if name.isdigit():
            try:
                found.append((f.stat().st_mtime_ns, int(name), f.read_text().strip()))
            except OSError:
                continue
    if not found:
        return None
    _, rank, reason = min(found)
    return rank, reason
