"""torchrun (``torch.distributed.run``) with short endings: ``python -m megatron_vlm.launch.elastic ARGS``.

torchrun itself ends a signalled run with a ``SignalException`` traceback and exit code 1, and a failed
rank with a ``ChildFailedError`` report of dozens of lines. Here the same launcher runs (same arguments,
same agent, same shutdown: the signal is passed to every rank, which saves a checkpoint and stops), and
then: a signal N exits ``128 + N`` (Ctrl-C: 130) with one line; a failed rank exits 1 with one line naming
the rank and its exit code (the rank's own reason is printed last by ``train/run.py``, see
``megatron_vlm.launch.failures``). Imports only torch, so it runs wherever torchrun does.

Forked ranks (``MVLM_RANK_START=fork``, CPU only; the test suite sets it): torchrun's agent starts each rank as a
process forked from the agent's own instead of a new interpreter running the script -- torchrun's function
entry point with its ``fork`` start method: the same agent, rendezvous, per-rank environment, signal forwarding
and failure handling; the rank runs the script as ``__main__`` with its arguments. Where the agent runs in a
process that already imported torch, megatron-core and transformers (a test's command forked from the fork server
of :mod:`megatron_vlm.runtime.spawn`), each rank skips those imports: ~6.6 CPU-s per rank in the 3.11 lane, most of
a short test run's start. Anywhere else it gains nothing, so nothing else sets it; a GPU always starts new
interpreters (CUDA cannot be used in a forked child of a process that initialised it), and so does a rank whose
start must run the interpreter's own hooks (``sitecustomize``: tests/test_fault_drill.py sets ``exec``).
"""

from __future__ import annotations

import os
import signal
import sys

#: the environment variable that picks how torchrun's agent starts the ranks: ``exec`` (the default: a new
#: interpreter per rank, as torchrun does) or ``fork`` (see the module docstring)
RANK_START = "MVLM_RANK_START"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def forks_ranks() -> bool:
    """Whether this agent forks its ranks (``MVLM_RANK_START=fork`` on a CPU-only node: CUDA_VISIBLE_DEVICES='',
    which ``launch.torchrun.rank_env`` sets for ``--device cpu``)."""
    return os.environ.get(RANK_START, "exec") == "fork" and os.environ.get("CUDA_VISIBLE_DEVICES") == ""


def _forked_rank(script: str, *argv: str) -> None:
    """A forked rank: ``script`` run as ``__main__`` with ``argv``, as ``python -u script argv...`` would."""
    import runpy

    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # -u: every line reaches the log as it is written
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        # a new interpreter's torch reads OMP_NUM_THREADS as it starts; one imported before the fork does not
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    signalled = _note_stop_signals()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if not signalled:
            raise
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    else:
        if not signalled:
            return
        code = 0
    # The agent stopped the run (it passed SIGTERM/SIGINT on and now waits for the rank to end): torchrun's function
    # entry point would otherwise hand back a result and wait for the agent to read it, which a stopping agent never
    # does, until its shutdown timeout kills the rank. End as the rank's interpreter would.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _note_stop_signals() -> list:
    """Handlers the script installs for SIGTERM/SIGINT also note that one arrived (the returned list gets an entry)."""
    import signal as _signal

    noted: list = []
    install = _signal.signal

    def noting(signum, handler):
        if signum in (_signal.SIGTERM, _signal.SIGINT) and callable(handler):
            def wrapped(sig, frame, _handler=handler):
                noted.append(sig)
                return _handler(sig, frame)

            return install(signum, wrapped)
        return install(signum, handler)

    _signal.signal = noting
    return noted


def _launch(args) -> None:
    """torch.distributed.run.run(args), with forked ranks where :func:`forks_ranks`."""
    from torch.distributed.run import run

    if not forks_ranks():
        run(args)
        return
    import warnings

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    config, cmd, cmd_args = config_from_args(args)
    if not (isinstance(cmd, str) and cmd_args[:1] == ["-u"] and len(cmd_args) >= 2):
        run(args)  # not ``python -u SCRIPT ...`` (--no-python, -m): torchrun's own start
        return
    config.start_method = "fork"
    _one_line_failures()
    # the agent holds threads (its rendezvous store); the rank forked from it runs none of theirs
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks.*")
    elastic_launch(config=config, entrypoint=_forked_rank)(*cmd_args[1:])


def _one_line_failures() -> None:
    """A failed forked rank is reported as torchrun reports a failed rank it started as a binary: its line without
    the traceback of torch's own ``ProcessExitedException`` (the rank's reason is printed by train/run.py)."""
    import logging

    class _NoTraceback(logging.Filter):
        def filter(self, record):
            if record.exc_info and str(record.msg).startswith("failed (exitcode"):
                record.exc_info, record.exc_text = None, None
            return True

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoTraceback())


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args

    try:
        _launch(parse_args(argv))
        return 0
    except SignalException as e:
        sig = int(e.sigval)
        print(f"torchrun: stopped by {_signal_name(sig)}; the ranks were passed the signal to save a checkpoint "
              "and stop", file=sys.stderr, flush=True)
        return 128 + sig
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        print(f"torchrun: rank {rank} {how} (first of {len(e.failures)} failed rank(s))", file=sys.stderr,
              flush=True)
        return 1


if __name__ == "__main__":
    from megatron_vlm.runtime.gc_freeze import exit_process

    exit_process(main())
