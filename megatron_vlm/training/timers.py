"""The training step's timers: where each iteration's time goes, measured without adding a sync or a barrier.

Each iteration is cut at marks into consecutive phases (Megatron-LM's ``--timing-log-level`` decides which are
shown, :data:`LEVELS`):

- ``batch-load``: the loader's ``next()`` for this rank's micro batches (the wait for decoded samples);
- ``batch-distribute``: :func:`megatron_vlm.training.batch_feed.distribute` (the broadcasts to the other TP ranks
  and the middle pipeline stages); with ``batch-load`` it is ``data-wait``;
- ``forward-backward``: megatron-core's schedule over the micro batches (gradient reduction included);
- ``optimizer``: the optimizer step and the learning-rate schedule;
- ``loss-reduce``: the loss and count reductions over the data-parallel (and pipeline) ranks;
- ``step``: all of them, the iteration from the first ``next()`` to the end of the step (logging, evaluation and
  checkpoints are not in it).

On CPU the marks are ``time.perf_counter`` readings. On CUDA each mark also records a CUDA event on the current
stream; the console, TensorBoard and ``metrics.jsonl`` then give the device's timeline (how long the GPU spent
between two marks, which for ``data-wait`` is the time it waited for the batch), and at level 2 the host's too.
The events are read only at a log interval, after an event wait the log interval pays once (where it also reads
the losses, :mod:`.metrics`); the step itself never waits for them. megatron-core's own ``Timers`` are not used
here: their ``start``/``stop`` call ``torch.cuda.synchronize()``, which would put a device sync into every phase
of every step.

``--timing-log-option`` (max, minmax, all) reports each phase over the ranks: one all-gather of a few numbers per
log interval, on every rank (no barrier; the ranks meet there anyway at the next collective of the step).
"""

from __future__ import annotations

import time

import torch

# the phases in their order in an iteration; each ends at its mark
PHASES = ("batch-load", "batch-distribute", "forward-backward", "optimizer", "loss-reduce")
# what each --timing-log-level shows (Megatron-LM: 0 only the iteration, 1 the parts run once per iteration,
# 2 finer parts); derived: data-wait = batch-load + batch-distribute, step = all phases
LEVELS = {0: ("step",),
          1: ("step", "data-wait", "forward-backward", "optimizer", "loss-reduce"),
          2: ("step", "data-wait", "batch-load", "batch-distribute", "forward-backward", "optimizer",
              "loss-reduce")}
OPTIONS = ("max", "minmax", "all")


class StepTimers:
    """Marks of the current iteration and the finished iterations not yet read (:meth:`read`).

    ``device``: the rank's torch device (CUDA events on a GPU). ``level``: ``--timing-log-level``. The loop calls
    :meth:`begin` at the start of an iteration, :meth:`mark` at the end of each phase and :meth:`end` after the
    last; ``labels`` (set by the profiler for the iterations it records) also opens a ``record_function`` range per
    phase, so a profile's trace names them."""

    def __init__(self, device, level: int = 1):
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.level = level
        self.labels = False
        self._marks: list = []  # (phase, host seconds, event or None); the first is the iteration's start
        self._done: list = []  # finished iterations' marks, until read
        self._range = None

    def _stamp(self, name: str | None):
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((name, time.perf_counter(), event))

    def begin(self) -> None:
        self._marks = []
        self._stamp(None)
        self._label(PHASES[0])

    def mark(self, phase: str) -> None:
        """The end of ``phase`` (one of :data:`PHASES`), which starts the next one."""
        self._stamp(phase)
        i = PHASES.index(phase)
        self._label(PHASES[i + 1] if i + 1 < len(PHASES) else None)

    def end(self) -> None:
        """The iteration is over: its marks wait for :meth:`read`."""
        self._label(None)
        if len(self._marks) > 1:
            self._done.append(self._marks)
        self._marks = []

    def discard(self) -> None:
        """The iteration trained nothing (``--skip-train-iteration-range``): :meth:`read` gives None for it."""
        self._label(None)
        self._done.append(None)
        self._marks = []

    def _label(self, name: str | None) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.labels and name is not None:
            self._range = torch.profiler.record_function(name)
            self._range.__enter__()

    def read(self) -> list[dict[str, float]]:
        """Seconds per shown phase of each finished iteration since the last read, oldest first (the device's
        timeline on CUDA, plus ``host/<phase>`` at level 2; None for a discarded one). On CUDA this waits for the
        last event: call it where the log interval syncs anyway."""
        done, self._done = self._done, []
        timed = [m for m in done if m is not None]
        if self.cuda and timed:
            timed[-1][-1][2].synchronize()
        return [None if marks is None else self._phases(marks) for marks in done]

    def _phases(self, marks) -> dict[str, float]:
        host, dev = {}, {}
        for (_, t0, e0), (name, t1, e1) in zip(marks, marks[1:]):
            host[name] = t1 - t0
            if e0 is not None:
                dev[name] = e0.elapsed_time(e1) / 1e3
        out = {}
        for prefix, parts in (("", dev if self.cuda else host), ("host/", host if self.cuda and self.level >= 2
                                                                 else {})):
            if not parts:
                continue
            derived = dict(parts, step=sum(parts.values()))
            if "batch-load" in parts or "batch-distribute" in parts:
                derived["data-wait"] = parts.get("batch-load", 0.0) + parts.get("batch-distribute", 0.0)
            out.update({prefix + k: derived[k] for k in LEVELS[self.level] if k in derived})
        return out


def over_ranks(window: dict[str, float], option: str, device) -> dict:
    """``window`` (phase -> mean seconds on this rank) over every rank, as ``--timing-log-option`` asks: {phase:
    max}, {phase: [min, max]} or {phase: [rank 0, rank 1, ...]}. Collective over the world (all ranks hold the
    same phases, in the same order); a single process returns its own numbers in the same form."""
    names = sorted(window)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        mine = torch.tensor([window[k] for k in names], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine)
        table = torch.stack(gathered).tolist()  # [rank][phase]
    else:
        table = [[window[k] for k in names]]
    out = {}
    for j, name in enumerate(names):
        col = [row[j] for row in table]
        out[name] = max(col) if option == "max" else [min(col), max(col)] if option == "minmax" else col
    return out


def describe(stats: dict, option: str) -> str:
    """The console's part for ``stats`` (:func:`over_ranks`): milliseconds per phase, ``min-max`` over ranks."""
    def ms(v):
        if isinstance(v, list):
            return "/".join(f"{1e3 * x:.1f}" for x in v) if option == "all" else \
                f"{1e3 * v[0]:.1f}-{1e3 * v[1]:.1f}"
        return f"{1e3 * v:.1f}"

    order = [k for k in LEVELS[2] if k in stats] + sorted(k for k in stats if k not in LEVELS[2])
    return "time ms (" + option + " over ranks): " + ", ".join(f"{k} {ms(stats[k])}" for k in order)
