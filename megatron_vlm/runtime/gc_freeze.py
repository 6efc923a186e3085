"""Keep Python's cyclic garbage collector off the objects that live as long as the process.

A process that imports torch, megatron-core, Transformer Engine and transformers holds about a million
gc-tracked objects (modules, classes, functions, torch._dynamo's tables). Every full collection walks all of
them, and so does the interpreter's last collection at exit: measured on a 2-core CPU machine, a process that
only imports ``megatron.core`` takes ~1.5-2 s longer to exit than to import (py-spy: ``gc_collect_main``).
``gc.freeze()`` moves what is alive now into the permanent generation, which no later collection visits; what is
created afterwards is collected as usual. So:

- :func:`freeze_long_lived` once the long-lived state exists (a training rank after its model, optimizer and
  loader are built);
- :func:`exit_process` instead of ``sys.exit`` at the end of a command's ``__main__``, the spawned ranks of
  :mod:`megatron_vlm.runtime.spawn`, and the per-rank trainer.

Nothing is freed later than it would be: frozen objects are the ones alive until exit anyway.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def freeze_long_lived() -> None:
    """Exclude every object alive now from later garbage collections."""
    gc.freeze()


def exit_process(code: int | None = 0) -> NoReturn:
    """``sys.exit(code)`` without the interpreter's final full collection over every imported object."""
    gc.freeze()
    sys.exit(code)
