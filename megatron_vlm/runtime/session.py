"""A one-process distributed world for tools that need megatron-core but run as a single process
(converters, verification of a TP=1/PP=1 model, notebooks)."""

from __future__ import annotations

import contextlib

import torch

from megatron_vlm.runtime import distributed


@contextlib.contextmanager
def single_process_world(device: str | None = None):
    """Initialise a world of size 1 (TP=PP=1) unless one exists already; tear down what it started."""
    if torch.distributed.is_initialized():
        yield distributed.current()
        return
    import os

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    os.environ["MASTER_PORT"] = str(distributed._free_port())
    rt = distributed.setup(1, 1, device=device)
    try:
        yield rt
    finally:
        distributed.teardown()
