"""Start a small local distributed world (one process per rank, gloo on CPU / NCCL on GPUs) and collect
each rank's return value. Used by verification (``--verify``), tests and benchmarks; training itself is
started by torchrun through ``train/run.py``.

Where no CUDA GPU is visible, the ranks are forked from multiprocessing's fork server, which imports torch,
megatron-core and transformers once (``_PRELOAD``, ~6-8 s of CPU per process on a 2-core machine) for all the
worlds a process starts, instead of once per rank. The server never runs a kernel (no thread pool to inherit);
each rank takes the caller's current environment and working directory, as a spawned process would. With CUDA,
ranks are spawned: a fork server that imported CUDA libraries could hand its children a used driver.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


class WorldError(RuntimeError):
    pass


def thread_names() -> dict[str, int]:
    """This process's threads by name (Linux ``/proc/self/task/*/comm``; elsewhere Python's own threads): a
    world's jobs must not accumulate them (gloo starts three per process group, see
    :func:`megatron_vlm.runtime.distributed.destroy_parallel_groups`)."""
    import collections
    import threading

    names: collections.Counter = collections.Counter()
    task = Path("/proc/self/task")
    if not task.is_dir():
        return dict(collections.Counter(t.name for t in threading.enumerate()))
    for t in task.iterdir():
        try:
            names[(t / "comm").read_text().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return dict(names)


#: What the fork server imports once for every process it forks (see the module docstring): ranks, and the
#: tests' commands (tests.support.forked_cli: train/run.py reads a tokenizer, make_wds writes energon sets).
_PRELOAD = ["torch", "megatron.core", "megatron.core.dist_checkpointing", "transformers",
            "transformers.models.auto.tokenization_auto", "megatron.energon", "megatron_vlm.model.build",
            "megatron_vlm.runtime.distributed"]


def _start_method() -> str:
    if torch.cuda.is_available():
        return "spawn"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once this process's server runs: it already holds them
    return "forkserver"


def _entry(rank: int, world: int, port: int, out_dir: str, env: dict, cwd: str, fn, args, kwargs) -> None:
    if os.environ != env:  # a forked rank starts from the fork server's environment; take the caller's
        os.environ.clear()
        os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not os.environ.get("MVLM_VERBOSE"):
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron_vlm.runtime.gc_freeze import freeze_long_lived

    # what the fork server imported (torch, megatron-core, transformers: ~1M objects) lives as long as the rank:
    # no collection of the jobs' garbage (distributed.destroy_parallel_groups collects after every job) walks it
    freeze_long_lived()
    try:
        result = fn(*args, **kwargs)
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException as e:
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()},
                   Path(out_dir) / f"rank{rank}.pt")
        raise
    finally:
        from megatron_vlm.runtime.distributed import teardown

        try:
            teardown()
        except Exception:
            pass
        freeze_long_lived()  # the process ends here: skip the interpreter's last full collection (gc_freeze)


def run_world(fn, world_size: int, *args, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes; return the per-rank results.

    ``fn`` must be importable (module level) and is expected to call ``distributed.setup`` itself.
    A failure on any rank raises ``WorldError`` with that rank's traceback.
    """
    from megatron_vlm.runtime.distributed import _free_port

    with tempfile.TemporaryDirectory(prefix="mvlm-world-") as out:
        port = _free_port()
        ctx = mp.start_processes(
            _entry, args=(world_size, port, out, dict(os.environ), os.getcwd(), fn, args, kwargs),
            nprocs=world_size, join=False, start_method=_start_method(),
        )
        try:
            while not ctx.join():
                pass
        except Exception as e:
            msgs = []
            for r in range(world_size):
                p = Path(out) / f"rank{r}.pt"
                if p.is_file():
                    rec = torch.load(p, weights_only=False)
                    if not rec["ok"]:
                        msgs.append(f"rank {r}: {rec['tb']}")
            raise WorldError("\n".join(msgs) or str(e)) from None
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False)["result"] for r in range(world_size)]
