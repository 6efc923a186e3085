"""Why a rank failed, in one line, from the rank to the launcher: ``<run_dir>/failures/rank<R>.txt``.

A failing rank (``train/pretrain_vlm.py``) writes its one-line reason there and its full traceback next to
it (``rank<R>.traceback.txt``); the launcher clears the folder before starting the ranks and, when training
exits non-zero, prints the first rank's reason as its LAST line, so the cause is not buried in the output
of the other ranks and torchrun. Ranks of other nodes write to their own node's run directory.

When the run directory cannot take the report (a full or read-only disk may be the very failure), the rank
writes it to the local directory the launcher names in ``MVLM_FAILURES_DIR`` (a temporary directory it
creates for the launch), so the last line still names the rank and its reason.
"""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path

FAILURES_DIR = "failures"
#: environment variable naming the launcher's fallback directory for the reports
FALLBACK_ENV = "MVLM_FAILURES_DIR"


def reason_of(exc: BaseException) -> str:
    """The one-line reason of ``exc``: the shared CLI wording for known faults, else type and first line."""
    from megatron_vlm.cli import describe_error

    line = describe_error(exc)
    if line is None:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return " ".join(line.split())


def _write(d: Path, rank: int, reason: str, exc: BaseException) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    tb = d / f"rank{rank}.traceback.txt"
    tb.write_text("".join(traceback.format_exception(exc)))
    tmp = d / f".rank{rank}.txt.tmp"
    tmp.write_text(reason + "\n")
    os.replace(tmp, d / f"rank{rank}.txt")
    return tb


def record(run_dir: str | os.PathLike | None, rank: int, exc: BaseException) -> tuple[str, Path | None]:
    """Write rank ``rank``'s reason and traceback into ``<run_dir>/failures`` (else the launcher's fallback
    directory); return (reason, traceback file or None if neither could be written)."""
    reason = reason_of(exc)
    dirs = ([Path(run_dir) / FAILURES_DIR] if run_dir is not None else []) + \
        ([Path(os.environ[FALLBACK_ENV])] if os.environ.get(FALLBACK_ENV) else [])
    for d in dirs:
        try:
            return reason, _write(d, rank, reason, exc)
        except OSError:  # a full or read-only disk may be the failure itself: try the next place
            continue
    return reason, None


def clear(run_dir: str | os.PathLike) -> None:
    shutil.rmtree(Path(run_dir) / FAILURES_DIR, ignore_errors=True)


def first(run_dir: str | os.PathLike, *more: str | os.PathLike) -> tuple[int, str, Path] | None:
    """(rank, reason, traceback file) of the rank that failed first (oldest report) in ``<run_dir>/failures``
    and the directories ``more`` (the fallback), or None when no rank recorded one."""
    found = []
    for d in [Path(run_dir) / FAILURES_DIR, *map(Path, more)]:
        for f in d.glob("rank*.txt"):
            name = f.name[len("rank"):-len(".txt")]
            if name.isdigit():
                try:
                    found.append((f.stat().st_mtime_ns, int(name), f.read_text().strip(),
                                  d / f"rank{name}.traceback.txt"))
                except OSError:
                    continue
    if not found:
        return None
    _, rank, reason, tb = min(found)
    return rank, reason, tb
