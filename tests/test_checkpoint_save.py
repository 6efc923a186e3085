"""Every torch_dist save goes through ``checkpoint.save_sharded``: without CUDA, megatron-core's write-results
queue is served by a process forked from the saving one, not by a fresh interpreter that imports torch again."""

import multiprocessing

import pytest
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_vlm import checkpoint as ckpt
from tests.conftest import not_here

pytestmark = pytest.mark.slow  # each test starts the queue's server process


@pytest.fixture
def no_queue_yet(monkeypatch):
    if torch.cuda.is_available():
        not_here("with CUDA megatron-core starts its queue itself")
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    yield
    queue = filesystem_async._results_queue
    if queue is not None:
        queue._manager.shutdown()


def test_the_write_results_queue_is_served_by_a_forked_process(no_queue_yet):
    ckpt._fork_write_results_queue()
    queue = filesystem_async._results_queue
    assert isinstance(queue._manager._process, multiprocessing.get_context("fork").Process)
    queue.put({"rank": 0})  # megatron-core's writer puts its results there and reads them back
    assert queue.get(timeout=30) == {"rank": 0}
    ckpt._fork_write_results_queue()  # started once per process
    assert filesystem_async._results_queue is queue


def test_megatron_core_would_spawn_it(no_queue_yet):
    """The negative control: left to itself, megatron-core starts the queue's server by spawn."""
    getter = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
    queue = getter()
    assert isinstance(queue._manager._process, multiprocessing.get_context("spawn").Process)
