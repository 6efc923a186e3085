#!/usr/bin/env python
"""Score a model on a split of an energon dataset: accuracy by exact and VQA-normalised match (see megatron_vlm.eval.evaluate)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.cli import run_cli  # noqa: E402
from megatron_vlm.eval.evaluate import main  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process  # noqa: E402

if __name__ == "__main__":
    exit_process(run_cli(main))
