#!/usr/bin/env python
"""Per-rank training entry point (started by torchrun from train/run.py): python train/pretrain_vlm.py --config X.yaml"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True, help="resolved TrainConfig YAML written by train/run.py")
    p.add_argument("-v", "--verbose", action="store_true", help="show library warnings")
    a = p.parse_args(argv)
    from megatron_vlm.cli import setup_logging, stderr_line

    setup_logging(a.verbose)
    from megatron_vlm.runtime.distributed import teardown
    from megatron_vlm.training.config import TrainConfig
    from megatron_vlm.training.trainer import train

    cfg = TrainConfig.from_yaml(a.config)
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


def run(argv=None) -> int:
    """``main`` with this rank's failure recorded for the launcher (``megatron_vlm.launch.failures``): one
    line on stderr and in ``<run_dir>/failures/rank<R>.txt``, the traceback in ``rank<R>.traceback.txt``
    (also on stderr with -v or MVLM_DEBUG=1). Ctrl-C before the trainer's own handler is set exits 130."""
    from megatron_vlm.cli import debug_requested, stderr_line

    rank = int(os.environ.get("RANK", "0"))
    try:
        main(argv)
        return 0
    except KeyboardInterrupt:
        stderr_line(f"[rank {rank}] interrupted before training started")
        return 130
    except Exception as e:  # noqa: BLE001 - the rank's boundary
        from megatron_vlm.launch import failures

        run_dir = None
        try:
            argv_ = sys.argv[1:] if argv is None else argv
            from megatron_vlm.training.config import TrainConfig

            run_dir = TrainConfig.from_yaml(argv_[argv_.index("--config") + 1]).run_dir
        except Exception:  # noqa: BLE001 - the config itself may be what failed
            pass
        if run_dir is not None:
            reason, tb = failures.record(run_dir, rank, e)
        else:
            reason, tb = failures.reason_of(e), None
        if debug_requested(argv):
            import traceback

            traceback.print_exc()
        where = f" (traceback: {tb})" if tb is not None and not debug_requested(argv) else ""
        stderr_line(f"[rank {rank}] error: {reason}{where}")
        return 1


if __name__ == "__main__":
    sys.exit(run())
