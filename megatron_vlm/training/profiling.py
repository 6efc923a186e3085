"""``--profile``: torch.profiler over a range of training iterations, written small enough to bring back from a
GPU machine.

Megatron-LM's flags and counting: ``--profile-step-start A --profile-step-end B`` records the iterations after
A and up to B (its steps A..B-1 counted from 0; in this project's 1-based log, iterations A+1 to B), with one
warm-up iteration before them when A > 0, on the global ranks ``--profile-ranks`` (default 0). A resumed run
records what is left of the range. The profiler starts at the warm-up iteration, so the iterations before it run
without it.

What it writes, under ``<run dir>/profile/``, per profiled rank (``rankR_iterA-B``: the iterations recorded):

- ``....trace.json.gz``: the Chrome trace (chrome://tracing or https://ui.perfetto.dev), CPU ops and, on a GPU,
  the CUDA kernels and memory copies, with the step's phases as named ranges (:mod:`.timers`). No stacks and no
  shapes: they multiply its size. Capped at :data:`CAP_BYTES` (16 MiB) compressed; a larger trace loses its
  shortest events until it fits, and the table file says how many and below which duration.
- ``....top.txt``: the top :data:`TABLE_ROWS` ops by self time (``key_averages``), on a GPU once by device time
  (the kernels) and once by host time (the host ops), with the calls and totals of each; then what was cut.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger("megatron_vlm.train")

CAP_BYTES = 16 * 1024 * 1024
TABLE_ROWS = 40


def profile_range(cfg, start_iter: int) -> tuple[int, int] | None:
    """The 1-based iterations (first, last) this job records, or None when the range lies before ``start_iter``
    (a resumed run past it)."""
    first, last = max(cfg.profile_step_start + 1, start_iter + 1), cfg.profile_step_end
    return (first, last) if first <= last else None


class StepProfiler:
    """Drives torch.profiler from the loop: :meth:`before` at the start of each iteration, :meth:`after` at its
    end; ``timers`` (a :class:`~megatron_vlm.training.timers.StepTimers`) names the phases while it records."""

    def __init__(self, cfg, rank: int, start_iter: int, timers=None, cap_bytes: int = CAP_BYTES):
        self.timers, self.cap = timers, cap_bytes
        self.prof = None
        self.range = profile_range(cfg, start_iter) if cfg.profile and rank in cfg.profile_ranks else None
        if cfg.profile and rank in cfg.profile_ranks and self.range is None:
            log.warning("--profile-step-end %d: this run resumes at iteration %d, after the profiled range; nothing "
                        "is profiled", cfg.profile_step_end, start_iter)
        self.rank, self.out = rank, Path(cfg.run_dir) / "profile"
        self.warmup = 1 if self.range is not None and self.range[0] > start_iter + 1 else 0

    def before(self, iteration: int) -> None:
        """Iteration ``iteration`` (1-based) starts."""
        if self.range is None or self.prof is not None or iteration != self.range[0] - self.warmup:
            return
        first, last = self.range
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=self.warmup,
                                                                    active=last - first + 1, repeat=1),
            on_trace_ready=lambda p: write_profile(p, self.out, f"rank{self.rank}_iter{first}-{last}", self.cap,
                                                   cuda=torch.profiler.ProfilerActivity.CUDA in activities))
        self.prof.start()
        if self.timers is not None:
            self.timers.labels = True

    def after(self, iteration: int) -> None:
        """Iteration ``iteration`` ended."""
        if self.prof is None:
            return
        self.prof.step()
        if iteration >= self.range[1]:
            self.close()

    def close(self) -> None:
        """Stop (and write, when the active range ended); the loop calls it at its end too (a stop by signal)."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            self.range = None
            if self.timers is not None:
                self.timers.labels = False


def write_profile(prof, out: Path, stem: str, cap_bytes: int = CAP_BYTES, cuda: bool = False) -> tuple[Path, Path]:
    """The trace (gzipped, within ``cap_bytes``) and the table of ``prof``'s top ops; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    trace, table = out / f"{stem}.trace.json.gz", out / f"{stem}.top.txt"
    raw = out / f".{stem}.trace.json"
    prof.export_chrome_trace(str(raw))
    try:
        cut = gzip_within(raw, trace, cap_bytes)
    finally:
        raw.unlink(missing_ok=True)
    events = prof.key_averages()
    parts = []
    if cuda:
        parts.append("Top ops by device (CUDA) self time: the kernels\n"
                     + events.table(sort_by="self_cuda_time_total", row_limit=TABLE_ROWS))
    parts.append("Top ops by host (CPU) self time\n" + events.table(sort_by="self_cpu_time_total",
                                                                    row_limit=TABLE_ROWS))
    parts.append(f"Rows: the top {TABLE_ROWS} of {len(events)} op names. Trace: {trace.name}, "
                 f"{trace.stat().st_size / 2**20:.2f} MiB compressed. " + (cut or "Nothing was cut from it."))
    table.write_text("\n\n".join(parts) + "\n")
    log.info("profile written: %s and %s", trace, table)
    return trace, table


def gzip_within(raw: Path, trace: Path, cap_bytes: int) -> str | None:
    """gzip ``raw`` into ``trace``; if it does not fit ``cap_bytes``, drop its shortest duration events (a binary
    search on the threshold) until it does. Returns what was cut, or None."""
    data = raw.read_bytes()
    packed = gzip.compress(data, compresslevel=6)
    if len(packed) <= cap_bytes:
        trace.write_bytes(packed)
        return None
    doc = json.loads(data)
    events = doc.get("traceEvents", [])
    durations = sorted({e["dur"] for e in events if e.get("ph") == "X" and "dur" in e})

    def keep_above(threshold):
        kept = [e for e in events if not (e.get("ph") == "X" and e.get("dur", 0) < threshold)]
        return gzip.compress(json.dumps(dict(doc, traceEvents=kept)).encode(), compresslevel=6), len(events) - len(kept)

    lo, hi, best = 0, len(durations), None
    while lo < hi:  # the smallest threshold index whose trace fits
        mid = (lo + hi) // 2
        packed, dropped = keep_above(durations[mid])
        if len(packed) <= cap_bytes:
            best, hi = (packed, dropped, durations[mid]), mid
        else:
            lo = mid + 1
    if best is None:  # even the longest events alone do not fit: keep only the metadata
        packed, dropped = keep_above(float("inf"))
        best = (packed, dropped, float("inf"))
    packed, dropped, threshold = best
    trace.write_bytes(packed)
    return (f"Cut to fit {cap_bytes / 2**20:g} MiB: {dropped} of {len(events)} events shorter than {threshold:g} us "
            "were dropped from the trace (the table above counts every event).")

