"""Helper processes that end with the process that started them, even when it is killed with SIGKILL.

A process started by a rank (megatron-core's checkpoint write-results queue server is one) outlives the rank when the
rank dies without running its exit handlers: kill -9, the out-of-memory killer, a node agent's SIGKILL. On Linux
:func:`end_with_parent`, run first thing in the helper, asks the kernel for SIGKILL when its parent ends
(``PR_SET_PDEATHSIG``). This module imports nothing else of the package, so a spawned interpreter that runs it stays
light.
"""

from __future__ import annotations

import os
import signal


def end_with_parent(parent: int) -> None:
    """In a helper process: end when ``parent`` (the process that started it) ends, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing changes)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the helper ends as it always did
        return
    if os.getppid() != parent:  # the parent ended before the line above ran
        os._exit(0)
