"""Every torch_dist save goes through ``checkpoint.save_sharded``, which starts megatron-core's write-results queue
itself: without CUDA its server is forked from the saving process, not a fresh interpreter that imports torch again;
on every device path (spawned, as megatron-core does, with CUDA) the server ends with the rank that started it, even
when the rank is killed with SIGKILL."""

import multiprocessing
import os
import signal
import time

import psutil
import pytest
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_vlm.checkpoint import layout as ckpt
from tests.conftest import not_here

pytestmark = pytest.mark.slow  # each test starts the queue's server process


@pytest.fixture
def no_queue_yet(monkeypatch):
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    yield
    queue = filesystem_async._results_queue
    if queue is not None:
        queue._manager.shutdown()


def test_the_write_results_queue_is_served_by_a_forked_process(no_queue_yet):
    if torch.cuda.is_available():
        not_here("with CUDA the queue's server is spawned")
    ckpt._start_write_results_queue()
    queue = filesystem_async._results_queue
    assert isinstance(queue._manager._process, multiprocessing.get_context("fork").Process)
    queue.put({"rank": 0})  # megatron-core's writer puts its results there and reads them back
    assert queue.get(timeout=30) == {"rank": 0}
    ckpt._start_write_results_queue()  # started once per process
    assert filesystem_async._results_queue is queue


def _rank(report, ours: bool, cuda: bool) -> None:
    """A stand-in rank (a forked child): start the queue (ours, or megatron-core's own getter) as a rank with or
    without CUDA would, report its server's pid, and wait to be killed."""
    torch.cuda.is_available = lambda: cuda
    filesystem_async._results_queue = None
    if ours:
        ckpt._start_write_results_queue()
        queue = filesystem_async._results_queue
    else:
        getter = getattr(filesystem_async, "get_write_results_queue", None) or \
            filesystem_async._get_write_results_queue
        queue = getter()
    process = queue._manager._process
    report.send((process.pid, type(process).__name__))
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_the_rank(ours: bool, cuda: bool, wait_s: float = 10.0) -> tuple[int, str, bool]:
    """(server pid, its process kind, whether it outlived its rank by ``wait_s``) after a SIGKILL of the rank."""
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    rank = ctx.Process(target=_rank, args=(theirs, ours, cuda))  # (a daemonic process may not start one)
    rank.start()
    assert mine.poll(120), "the stand-in rank did not start its queue"
    server, kind = mine.recv()
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(30)
    deadline = time.time() + wait_s
    while _alive(server) and time.time() < deadline:
        time.sleep(0.1)
    return server, kind, _alive(server)


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda-spawn", "cpu-fork"])
def test_the_queue_server_ends_with_a_killed_rank_on_every_device_path(cuda):
    server, kind, outlived = _kill_the_rank(ours=True, cuda=cuda)
    assert kind == ("SpawnProcess" if cuda else "ForkProcess")
    assert not outlived, f"write-results queue server {server} outlived its rank"


def test_megatron_core_would_spawn_it_and_orphan_it():
    """The negative control: left to itself, megatron-core spawns the queue's server, which outlives a rank killed
    with SIGKILL (this test then ends it)."""
    server, kind, outlived = _kill_the_rank(ours=False, cuda=True, wait_s=2.0)
    try:
        assert kind == "SpawnProcess" and outlived
    finally:
        if _alive(server):
            os.kill(server, signal.SIGKILL)
