#!/usr/bin/env python
"""Launch training: `python train/run.py -g 8 --tp 2 --stage 1 --megatron-load-dir ... --data-path ...`.

A thin command line over ``megatron_vlm.launch.cli`` (run with ``--help`` for every flag). It validates the
request, writes the resolved config to ``<save-dir>/<name>/config.yaml`` and starts
``train/pretrain_vlm.py --config <that file>`` on every rank with torchrun; ``--dry-run`` only prints.
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from megatron_vlm.launch.cli import main  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process  # noqa: E402

if __name__ == "__main__":
    exit_process(main(sys.argv[1:], repo_root=REPO_ROOT))
