"""The converters' engine: per-tensor work in bounded memory, overlapped, with progress.

A conversion is a list of :class:`Task` s, one per tensor it makes: read the sources (memory-mapped), reshard,
write the bytes. This module owns how those tasks run:

- **the memory cap.** :func:`memory_budget` measures what the process already holds (its anonymous memory,
  ``Pss_Anon``), takes ``--max-memory`` (or, by default, what the machine has available), refuses at the start,
  naming the tensor, when the largest task cannot fit beside it, and returns the bytes the tasks may hold at once:
  never more than a few tasks' worth, so the peak is set by the largest tensor, not by the model;
- :class:`Budget` admits a task only when its bytes fit under that limit;
- :class:`Runner`: worker threads (torch's kernels, kernel copies, reads and writes release the GIL) that run the
  tasks in any order, each writing its own bytes in place. A failure or Ctrl-C stops every worker after its
  current task, before the caller removes its half-written output;
- :class:`Readahead`: the tasks' source bytes asked of the disk ahead of the workers, in the tasks' order
  (:attr:`Task.reads`), so that a conversion of files not in memory reads them as fast as ``cat`` would;
- :class:`Progress`: bytes done, throughput and time left: tqdm on a terminal, a log line every 10 s otherwise;
- :func:`anon_bytes`: a process's proportional anonymous memory (what ``bench/convert.py`` samples).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

#: what the process may grow by beyond the tasks' estimates (allocator slack, metadata, Python objects)
SLACK = 96 << 20
#: the share of the machine's available memory a conversion takes when no --max-memory is given
AUTO_SHARE = 0.8


class MemoryCapError(ValueError):
    """The largest piece of work does not fit under the memory cap."""


# ---- sizes and memory measures -------------------------------------------------------------------------------
_UNITS = {"": 2**30, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``--max-memory`` values: ``24GB``, ``24GiB``, ``800MB``, ``1.5TB``; a bare number is GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 24GB, 24GiB or 800MB (a bare number is GiB)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{text!r} must be more than zero")
    return n


def memory_size(text: str) -> int:
    """argparse type of ``--max-memory`` (:func:`parse_size`)."""
    import argparse

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


memory_size.__name__ = "size"


def format_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def anon_bytes(pid: int | str = "self") -> int | None:
    """Anonymous memory of process ``pid``, pages shared with other processes counted in proportion
    (``Pss_Anon`` of ``/proc/PID/smaps_rollup``; ``RssAnon`` where the kernel lacks it). Memory mapped from files
    (the memory-mapped inputs, the page cache) is not counted. None where /proc is unreadable."""
    for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss_Anon:"), (f"/proc/{pid}/status", "RssAnon:")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1]) * 1024
        except OSError:
            continue
    return None


def available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_workers() -> int:
    """Worker threads: one per core beyond the writer's, at least 2, at most 4 (more only contend for the
    memory bus and the disk)."""
    return max(2, min(4, (os.cpu_count() or 2)))


# ---- tasks, budget, runner ------------------------------------------------------------------------------------
@dataclass
class Task:
    """One tensor's work. ``cost``: the bytes it holds at its peak; ``nbytes``: the bytes it writes (progress);
    ``after``: called once it is done (e.g. to drop its sources' pages from the process); ``reads``: the
    ``(path, offset, length)`` spans of files it reads, for :class:`Readahead`."""

    name: str
    cost: int
    nbytes: int
    run: Callable[[], object] | None
    after: Callable[[], None] | None = None
    reads: tuple = ()


class Budget:
    """Bytes that running tasks may hold at once. A task waits until its bytes fit (or nothing else is held, so
    a task larger than the limit, which :func:`memory_budget` refuses up front, could never deadlock)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, cancelled: threading.Event) -> bool:
        with self._cond:
            while self.used and self.used + n > self.limit:
                if cancelled.is_set():
                    return False
                self._cond.wait(0.1)
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


#: how far (bytes of sources) :class:`Readahead` may run ahead of the finished copies: what it adds to the page
#: cache at most, beyond what the workers are copying
READ_AHEAD_BYTES = 256 << 20


def device_readahead(path: str) -> int:
    """Bytes the kernel reads ahead for ``path``'s device (its backing device's ``read_ahead_kb``; 128 KiB, the
    kernel's default, where sysfs does not say): one ``POSIX_FADV_WILLNEED`` reads at most this much."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    for f in (f"/sys/class/bdi/{major}:{minor}/read_ahead_kb",  # disks, network file systems
              f"/sys/dev/block/{major}:{minor}/../queue/read_ahead_kb"):  # a partition: its disk's
        try:
            with open(f) as fh:
                return max(128, int(fh.read())) << 10
        except (OSError, ValueError):
            continue
    return 128 << 10


class Readahead:
    """Asks the kernel to read the tasks' source bytes into the page cache ahead of the workers, in the order
    the tasks run, from its own thread, at most ``ahead`` bytes beyond the tasks that have finished.

    The workers read their sources in large pieces at two places of a file at once, which the kernel's own
    readahead serves a few pages at a time when the file is not in memory: the export of a 3.2 GB
    torch_dist checkpoint from the disk ran its tasks for 5.4-7.5 s, 3.6-4.2 s with its sources read ahead
    (``cat`` of the file: 1.9 s). ``POSIX_FADV_WILLNEED`` starts reads without waiting and without copying (one
    call reads at most :func:`device_readahead` bytes, so it is asked that much at a time); where the pages are in
    memory already it finds them there. A hint only: a failure leaves the tasks to read for themselves.

    ``spans``: per task, in the tasks' order, the ``(path, offset, length)`` it reads (:attr:`Task.reads`).
    :class:`Runner` uses it as a context manager around a run, and calls :meth:`finished` with a task's index when
    it is done."""

    def __init__(self, spans: list[list[tuple[str, int, int]]], ahead: int = READ_AHEAD_BYTES):
        self._spans, self._ahead = spans, ahead
        self._finished = 0  # source bytes of the finished tasks
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def __enter__(self):
        if hasattr(os, "posix_fadvise") and any(self._spans):
            self._thread = threading.Thread(target=self._run, name="readahead", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        return False

    def finished(self, task: int) -> None:
        with self._cond:
            self._finished += sum(n for _, _, n in self._spans[task])
            self._cond.notify_all()

    def _run(self) -> None:
        fds: dict[str, tuple[int, int]] = {}
        asked = 0
        try:
            for spans in self._spans:
                for path, offset, n in spans:
                    if path not in fds:
                        fds[path] = (os.open(path, os.O_RDONLY), device_readahead(path))
                    fd, step = fds[path]
                    end = offset + n
                    while offset < end:
                        with self._cond:
                            while not self._stop and asked - self._finished > self._ahead:
                                self._cond.wait()
                            if self._stop:
                                return
                        k = min(step, end - offset)
                        os.posix_fadvise(fd, offset, k, os.POSIX_FADV_WILLNEED)
                        offset, asked = offset + k, asked + k
        except OSError:
            return  # a hint: the tasks read what is not in memory themselves
        finally:
            for fd, _ in fds.values():
                os.close(fd)


class Runner:
    """Runs tasks on worker threads under a :class:`Budget`, in any order (each writes its own bytes in place).
    Use it as a context manager: an error or Ctrl-C in the calling thread stops and joins the workers (each after
    its current task) before the caller removes its half-written output."""

    def __init__(self, workers: int, budget: Budget, progress: "Progress | None" = None):
        self.workers, self.budget, self.progress = max(1, workers), budget, progress
        self._cancel = threading.Event()
        self._claim = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._tasks: list[Task] = []
        self._next = 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._cancel.set()
        self._stop()
        return False

    def _join(self) -> None:
        for t in self._threads:
            while t.is_alive():
                t.join(0.2)  # a timed join: Ctrl-C reaches the calling thread
        self._threads = []

    def _stop(self) -> None:
        """Wait for the workers to end their current task (a second Ctrl-C does not cut this short: they may be
        writing into files the caller is about to close and remove)."""
        self._cancel.set()
        while self._threads:
            try:
                self._join()
            except KeyboardInterrupt:
                continue

    def _work(self, readahead: Readahead) -> None:
        while not self._cancel.is_set():
            with self._claim:
                if self._next >= len(self._tasks):
                    return
                index, task = self._next, self._tasks[self._next]
                self._next += 1
                if not self.budget.acquire(task.cost, self._cancel):
                    return
            try:
                if not self._cancel.is_set():
                    task.run()
                    if task.after is not None:
                        task.after()
                    readahead.finished(index)
                    if self.progress is not None:
                        self.progress.update(task.nbytes)
            except BaseException as e:  # noqa: BLE001 (handed to the calling thread)
                if self._error is None:
                    self._error = e
                self._cancel.set()
            finally:
                self.budget.release(task.cost)

    def run(self, tasks: list[Task]) -> None:
        """Run every task; raise the first failure (the other workers stop after their current task)."""
        if self._error is not None:
            raise self._error
        self._tasks, self._next = list(tasks), 0
        with Readahead([list(t.reads) for t in self._tasks]) as readahead:
            for i in range(min(self.workers, len(self._tasks))):
                t = threading.Thread(target=self._work, args=(readahead,), name=f"convert-{i}", daemon=True)
                t.start()
                self._threads.append(t)
            try:
                self._join()
            except BaseException:
                self._stop()
                raise
        if self._error is not None:
            raise self._error


# ---- memory plan ----------------------------------------------------------------------------------------------
def memory_budget(tasks: list[Task], max_memory: int | None, workers: int) -> int:
    """The bytes ``tasks`` may hold at once (at most ``workers`` of the largest), checked against the cap.

    The cap is ``max_memory`` (``--max-memory``) or, when None, what the process holds now plus
    :data:`AUTO_SHARE` of the machine's available memory. It covers the process's whole anonymous memory: what it
    already holds (the interpreter, torch, megatron-core) plus the tasks plus :data:`SLACK`. Raises
    :class:`MemoryCapError` naming the largest task when it alone does not fit."""
    if not tasks:
        return SLACK
    biggest = max(tasks, key=lambda t: t.cost)
    held = anon_bytes() or 0
    if max_memory is None:
        avail = available_bytes()
        cap, source = (None, "") if avail is None else (held + int(AUTO_SHARE * avail),
                                                        f"{AUTO_SHARE:.0%} of the {format_bytes(avail)} available")
    else:
        cap, source = max_memory, f"--max-memory {format_bytes(max_memory)}"
    want = workers * biggest.cost
    if cap is None:
        return want
    room = cap - held - SLACK
    if biggest.cost > room:
        need = held + SLACK + biggest.cost
        fix = "raise --max-memory" if max_memory is not None else "free memory or use a machine with more"
        raise MemoryCapError(
            f"--max-memory: {biggest.name} needs about {format_bytes(biggest.cost)} to convert, beside the "
            f"{format_bytes(held)} this process holds, which is more than {source} allows; {fix} (at least "
            f"{format_bytes(need)})")
    budget = min(room, want)
    log.debug("memory: %s held, tasks may hold %s (largest: %s, %s)", format_bytes(held), format_bytes(budget),
              biggest.name, format_bytes(biggest.cost))
    return budget


# ---- progress -------------------------------------------------------------------------------------------------
class Progress:
    """Bytes done of ``total``: a tqdm bar on a terminal, else a log line every ``interval`` seconds and one at
    the end. Thread-safe."""

    def __init__(self, total: int, desc: str, interval: float = 10.0):
        from tqdm import tqdm

        self.total, self.desc, self.interval = max(1, int(total)), desc, interval
        self.done = 0
        self._lock = threading.Lock()
        self._start = self._last = time.monotonic()
        self._bar = tqdm(total=self.total, desc=desc, unit="B", unit_scale=True, disable=None, file=sys.stderr,
                         smoothing=0.1)
        if self._bar.disable:
            self._bar = None
            log.info("%s: %s to write", desc, format_bytes(self.total))

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.monotonic()
            if now - self._last >= self.interval and self.done < self.total:
                self._last = now
                rate = self.done / max(now - self._start, 1e-9)
                left = (self.total - self.done) / rate if rate else float("inf")
                log.info("%s: %s of %s (%.0f%%), %s/s, about %.0f s left", self.desc, format_bytes(self.done),
                         format_bytes(self.total), 100 * self.done / self.total, format_bytes(rate), left)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            return
        secs = time.monotonic() - self._start
        log.info("%s: %s in %.1f s (%s/s)", self.desc, format_bytes(self.done), secs,
                 format_bytes(self.done / max(secs, 1e-9)))
