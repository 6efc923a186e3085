"""Start a small local distributed world (one process per rank, gloo on CPU / NCCL on GPUs) and collect
each rank's return value. Used by verification (``--verify``), tests and benchmarks; training itself is
started by torchrun through ``train/run.py``.
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


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args, kwargs) -> None:
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


def run_world(fn, world_size: int, *args, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes; return the per-rank results.

    ``fn`` must be importable (module level) and is expected to call ``distributed.setup`` itself.
    A failure on any rank raises ``WorldError`` with that rank's traceback.
    """
    from megatron_vlm.runtime.distributed import _free_port

    with tempfile.TemporaryDirectory(prefix="mvlm-world-") as out:
        port = _free_port()
        ctx = mp.start_processes(
            _entry, args=(world_size, port, out, fn, args, kwargs), nprocs=world_size, join=False,
            start_method="spawn",
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
