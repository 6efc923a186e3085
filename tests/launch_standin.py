"""Stand-in for train/pretrain_vlm.py in launcher tests (set through MEGATRON_VLM_ENTRYPOINT).

Reads the resolved config with ``TrainConfig.from_yaml`` like the trainer, joins the gloo process group that
torchrun set up, all-reduces ``rank + 1`` and writes what it saw to ``$STANDIN_OUT/rank<RANK>.json``.
``STANDIN_MODE=fail``: the last rank exits with code 3. ``STANDIN_MODE=signal``: waits for SIGTERM/SIGINT, records it
in ``$STANDIN_OUT/signal<RANK>.txt`` (as a trainer saving a checkpoint would) and exits 0.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_vlm.training.config import TrainConfig  # noqa: E402


def main() -> int:
    cfg = TrainConfig.from_yaml(sys.argv[sys.argv.index("--config") + 1])
    out = Path(os.environ["STANDIN_OUT"])
    rank = int(os.environ["RANK"])
    mode = os.environ.get("STANDIN_MODE", "")
    if mode == "signal":
        def record(signum, _frame):
            (out / f"signal{rank}.txt").write_text(signal.Signals(signum).name)
            sys.exit(0)

        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGINT, record)
        (out / f"ready{rank}.txt").write_text("ready")
        while True:
            time.sleep(0.05)
    if mode == "fail" and rank == int(os.environ["WORLD_SIZE"]) - 1:
        return 3

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    keys = ("LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
            "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    record = dict(rank=rank, allreduce=t.item(), env={k: os.environ.get(k) for k in keys},
                  cfg=dict(stage=cfg.stage, tp=cfg.tp, gpus=cfg.gpus, nodes=cfg.nodes, node_rank=cfg.node_rank,
                           image_token_id=cfg.image_token_id, pad_token_id=cfg.pad_token_id,
                           micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
                           grad_accum=cfg.grad_accum, device=cfg.device, precision=cfg.precision))
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
