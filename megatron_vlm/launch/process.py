"""Running the launched command: signals go to the child, the child's exit status comes back.

``run_forwarding_signals``: a command in a child process (a container's). The child starts in its own session,
so a terminal's Ctrl-C reaches it exactly once: through the launcher, which forwards SIGINT, SIGTERM and SIGHUP
(torchrun passes them to every rank, and the trainer can save a checkpoint). The launcher's exit code is the
child's; a child killed by signal N gives 128+N like a shell.

``run_agent_here``: torchrun's agent in the launcher's own process (a node without a container). The agent
receives the signals itself and passes them to every rank (whose sessions are their own), then ends 128+N.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


#: The signals torch's agent takes over while its ranks run (``TORCHELASTIC_SIGNALS_TO_HANDLE``'s default).
AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def run_agent_here(agent_args: list[str], env_add: Mapping[str, str] | None = None) -> int:
    """``python -m megatron_vlm.launch.elastic AGENT_ARGS`` with ``env_add`` on top of our environment, run in
    this process. The ranks inherit the environment; afterwards this process's environment and signal handlers
    are as they were (torch's agent installs its own and leaves them)."""
    from megatron_vlm.launch import elastic

    saved_env = dict(os.environ)
    saved_handlers = {s: signal.getsignal(s) for s in AGENT_SIGNALS}
    os.environ.update(env_add or {})
    try:
        return elastic.main(agent_args)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for s, handler in saved_handlers.items():
            if handler is not None:  # None: set outside Python, cannot be restored from here
                signal.signal(s, handler)


def run_forwarding_signals(argv: list[str], env_add: Mapping[str, str] | None = None,
                           cwd: str | None = None) -> int:
    """Run ``argv`` (a list; no shell) with ``env_add`` on top of our environment; return its exit code."""
    env = dict(os.environ)
    env.update(env_add or {})
    started: list[subprocess.Popen] = []
    pending: list[int] = []  # signals that arrived before the child existed

    def forward(signum, _frame):
        if not started:
            pending.append(signum)
        elif started[0].poll() is None:
            started[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)
        started.append(proc)
        for signum in pending:
            proc.send_signal(signum)
        return exit_code(proc.wait())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
