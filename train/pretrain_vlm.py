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
    from megatron_vlm.cli import setup_logging

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
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        teardown()


if __name__ == "__main__":
    main()
