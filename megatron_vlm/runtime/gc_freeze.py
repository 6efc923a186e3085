"""Keep Python's cyclic garbage collector off the objects that live as long as the process.

A process that imports torch, megatron-core, Transformer Engine and transformers holds about a million
gc-tracked objects (modules, classes, functions, torch._dynamo's tables). Every full collection walks all of
them, and so does the interpreter's last collection at exit: measured on a 2-core CPU machine, a process that
only imports ``megatron.core`` takes ~1.5-2 s longer to exit than to import (py-spy: ``gc_collect_main``).
``gc.freeze()`` moves what is alive now into the permanent generation, which no later collection visits; what is
created afterwards is collected as usual. So:

- :func:`preload` where a command starts on the libraries it needs anyway (the converters: torch and transformers
  once their inputs are checked, megatron-core where they first use it): the imports run with the collector paused
  (it would otherwise run dozens of times over their growing object graph: ~1.2-1.4 s of the ~6 s of CPU that
  ``import megatron.core, transformers`` takes on this machine), and what they made is frozen;
- :func:`freeze_long_lived` once the long-lived state exists (a training rank after its model, optimizer and
  loader are built);
- :func:`exit_process` instead of ``sys.exit`` at the end of a command's ``__main__``, the spawned ranks of
  :mod:`megatron_vlm.runtime.spawn`, and the per-rank trainer.

Nothing is freed later than it would be: frozen objects are the ones alive until exit anyway.
"""

from __future__ import annotations

import gc
import importlib
import sys
from typing import Iterable, NoReturn


def preload(modules: Iterable[str]) -> None:
    """Import those of ``modules`` (names, e.g. ``"megatron.core"``) not imported yet with the cyclic collector
    paused, then freeze every object alive and turn the collector back on if it was on; nothing when all are
    imported already (a test process, a forked rank). Frozen objects are still freed by reference counting, but a
    cycle among them never is: call it where what is alive lives on (a command's start; a converter before its
    first use of megatron-core, which a fresh process imports there)."""
    missing = [name for name in modules if name not in sys.modules]
    if not missing:
        return
    was_on = gc.isenabled()
    gc.disable()
    try:
        for name in missing:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def freeze_long_lived() -> None:
    """Exclude every object alive now from later garbage collections."""
    gc.freeze()


def exit_process(code: int | None = 0) -> NoReturn:
    """``sys.exit(code)`` without the interpreter's final full collection over every imported object."""
    gc.freeze()
    sys.exit(code)
