"""Skipped samples: counting them by reason, and stopping when the data yields nothing but skips.

The task encoder skips a sample it cannot train on (images that do not fit ``seq_length``, a chat template
that drops the image token, ...) by raising energon's ``SkipSample``. Energon then moves on to the next
sample without calling its error handler and without counting the skip against its ``failure_tolerance``
(which counts exceptions only), and its training datasets repeat forever: a dataset or chat template that
makes *every* sample skip spins without end.

:class:`SkipCounter` bounds that. After ``limit`` consecutive skips it raises :class:`TooManySkippedSamples`
with the skip reasons counted. That error is a subclass of energon's ``FatalSampleError``, the one kind of
exception energon never hands to its error handler: it leaves the data worker process (torch re-raises it in
the training process as a ``FatalSampleError`` whose message carries the worker's traceback) and ends the
run. :func:`skip_error_line` recovers the one-line message from any of those forms, for the entry point to
print instead of the tracebacks.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Mapping, NoReturn

from megatron.energon import SkipSample
from megatron.energon.errors import FatalSampleError

log = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_SKIPS = 1000
_PREFIX = "stopped after "
# How the message appears in a traceback formatted in a data worker ("module.TooManySkippedSamples: ...").
_IN_TRACEBACK = re.compile(r"TooManySkippedSamples: (" + _PREFIX + r"[^\n]*)")
# A sample the model cannot take at all (megatron_vlm.data.task_encoder.VideoNotSupportedError) stops the run too.
_FATAL_IN_TRACEBACK = re.compile(r"VideoNotSupportedError: ([^\n]*)")


class TooManySkippedSamples(FatalSampleError):
    """``limit`` samples in a row were skipped; the message counts the reasons and says what to fix."""


class SkipCounter:
    """Counts skipped samples per reason; raises ``SkipSample``, or ``TooManySkippedSamples`` at the bound.

    ``hints`` maps a reason kind (the encoder's names, e.g. ``"image_tokens"``) to what the user should check;
    the stopping message carries the hints of the kinds seen in the run of skips.
    """

    def __init__(self, limit: int = DEFAULT_MAX_CONSECUTIVE_SKIPS, hints: Mapping[str, str] | None = None):
        if int(limit) < 1:
            raise ValueError(f"the bound on consecutive skipped samples must be >= 1, got {limit}")
        self.limit = int(limit)
        self.hints = dict(hints or {})
        #: reason -> samples skipped for it (over this worker's life)
        self.total: Counter = Counter()
        self._run: Counter = Counter()  # reason -> skips since the last kept sample
        self._kinds: dict[str, str] = {}

    @property
    def consecutive(self) -> int:
        return sum(self._run.values())

    def kept(self) -> None:
        """A sample was kept: the run of consecutive skips ends."""
        self._run.clear()
        self._kinds.clear()

    def skip(self, key: str, kind: str, reason: str) -> NoReturn:
        self.total[reason] += 1
        self._run[reason] += 1
        self._kinds.setdefault(reason, kind)
        n = self.total[reason]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ... : warn without flooding the log
            log.warning("skipping sample %s: %s (%d such samples so far in this worker)", key, reason, n)
        if self.consecutive >= self.limit:
            raise TooManySkippedSamples(self.summary())
        raise SkipSample()

    def summary(self) -> str:
        """One line: the run of skips, its reasons counted (most frequent first) and what to check."""
        top = self._run.most_common(3)
        text = ", ".join(f"{n} x {reason!r}" for reason, n in top)
        rest = self._run.most_common()[3:]
        if rest:
            text += f", and {sum(n for _, n in rest)} more for {len(rest)} other reasons"
        hints = []
        for reason, _ in self._run.most_common():
            hint = self.hints.get(self._kinds[reason])
            if hint and hint not in hints:
                hints.append(hint)
        line = f"{_PREFIX}{self.consecutive} consecutive skipped samples: {text}"
        return line + "".join(f"; {h}" for h in hints)


def skip_error_line(exc: BaseException) -> str | None:
    """The :class:`TooManySkippedSamples` message behind ``exc``, or None when ``exc`` is something else.

    Finds it raised directly, chained under energon's ``FatalSampleError`` (a loader without workers), or
    as text in the traceback that torch's DataLoader carries over from a worker process.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TooManySkippedSamples) or type(e).__name__ == "VideoNotSupportedError":
            return str(e)
        m = _IN_TRACEBACK.search(str(e)) or _FATAL_IN_TRACEBACK.search(str(e))
        if m:
            return m.group(1)
        e = e.__cause__ or e.__context__
    return None
