#!/usr/bin/env python
"""Answer a prompt about images or a video with a trained model (see megatron_vlm.eval.generate)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.cli import run_cli  # noqa: E402
from megatron_vlm.eval.generate import main  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process  # noqa: E402

if __name__ == "__main__":
    exit_process(run_cli(main))
