"""torchrun (``torch.distributed.run``) with short endings: ``python -m megatron_vlm.launch.elastic ARGS``.

torchrun itself ends a signalled run with a ``SignalException`` traceback and exit code 1, and a failed
rank with a ``ChildFailedError`` report of dozens of lines. Here the same launcher runs (same arguments,
same agent, same shutdown: the signal is passed to every rank, which saves a checkpoint and stops), and
then: a signal N exits ``128 + N`` (Ctrl-C: 130) with one line; a failed rank exits 1 with one line naming
the rank and its exit code (the rank's own reason is printed last by ``train/run.py``, see
``megatron_vlm.launch.failures``). Imports only torch, so it runs wherever torchrun does.
"""

from __future__ import annotations

import signal
import sys


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
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
