#!/usr/bin/env python
"""Per-rank training entry point (started by torchrun from train/run.py).

``python train/pretrain_vlm.py --config X.yaml`` reads the resolved config train/run.py wrote; the same flags as
train/run.py are accepted too (after ``--config``, or instead of it: what ``train/run.py --dry-run`` prints).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(argv):
    """The run's TrainConfig from ``--config`` and/or flags (as resolved by train/run.py; not resolved again)."""
    from megatron_vlm.training.config import TrainConfig, build_parser

    parser = build_parser()
    parser.prog = "train/pretrain_vlm.py"
    parser.description = __doc__
    given = vars(parser.parse_args(argv))
    if not given:
        parser.error("give --config (the YAML train/run.py writes) or the run's flags")
    return TrainConfig.from_args(argv, resolve=False)


def main(argv=None):
    cfg = _config(argv)
    from megatron_vlm.cli import setup_logging, stderr_line

    setup_logging(cfg.verbose)
    from megatron_vlm.runtime.distributed import choose_device, teardown
    from megatron_vlm.runtime.lean_imports import skip_unused
    from megatron_vlm.training.trainer import train

    # before megatron-core's import: no Transformer Engine on a CPU rank, no wandb without --wandb
    skip_unused(choose_device(cfg.device), cfg.wandb)

    try:
        train(cfg)
    except Exception as e:
        from megatron_vlm.data.skips import skip_error_line

        line = skip_error_line(e)  # the data stops the run: one line instead of worker tracebacks
        if line is None:
            raise
        stderr_line(f"error: {line}")
        sys.exit(1)
    finally:
        teardown()


def _is_failure(e: BaseException) -> bool:
    """A rank's failure: any Exception, and torch.distributed.checkpoint's CheckpointException, which derives
    from BaseException (a save on a full disk, a load of tensors the model does not match)."""
    return isinstance(e, Exception) or type(e).__name__ == "CheckpointException"


def run(argv=None) -> int:
    """``main`` with this rank's failure recorded for the launcher (``megatron_vlm.launch.failures``): one
    line on stderr and in ``<run_dir>/failures/rank<R>.txt``, the traceback in ``rank<R>.traceback.txt``
    (also on stderr with -v or MVLM_DEBUG=1). Ctrl-C before the trainer's own handler is set exits 130."""
    from megatron_vlm.cli import debug_requested, stderr_line

    rank = int(os.environ.get("RANK", "0"))
    argv_ = sys.argv[1:] if argv is None else list(argv)
    try:
        main(argv_)
        return 0
    except KeyboardInterrupt:
        stderr_line(f"[rank {rank}] interrupted before training started")
        return 130
    except BaseException as e:  # noqa: BLE001 - the rank's boundary
        if not _is_failure(e):
            raise
        from megatron_vlm.launch import failures

        run_dir, verbose = None, debug_requested(argv_)
        try:
            cfg = _config(argv_)
            run_dir, verbose = cfg.run_dir, verbose or cfg.verbose
        except BaseException:  # noqa: BLE001 - the config itself may be what failed
            pass
        reason, tb = failures.record(run_dir, rank, e)
        if verbose:
            import traceback

            traceback.print_exception(e)
        where = f" (traceback: {tb})" if tb is not None and not verbose else ""
        stderr_line(f"[rank {rank}] error: {reason}{where}")
        return 1


if __name__ == "__main__":
    from megatron_vlm.runtime.gc_freeze import exit_process

    exit_process(run())
