#!/usr/bin/env python
"""Expert parallelism on a mixture-of-experts LLaVA (a benchmark, not a test): tokens/s of the trainer's step at EP1
and at EP2 on the same ranks and batches, measured in one run. Prints the numbers.

The model is a Qwen3-MoE LLaVA (CLIP) of ``--hidden`` with ``--layers`` MoE layers of ``--experts`` experts (top
``--topk``, each of ``--expert-ffn``). Both layouts run ``--ranks`` processes (data parallel) with the trainer's own
``build_training`` and ``train_step`` (megatron-core's MoE layers, dispatcher and DDP; local layers on CPU,
Transformer Engine with grouped GEMM with ``--device cuda``); at EP1 every rank holds every expert, at EP2 each holds
half and the tokens travel to their experts' ranks (``--dispatcher``). Printed per layout: image-expanded tokens/s
over the timed steps (after ``--warmup``), the experts' parameters per rank, and the ratio EP2 / EP1. On a GPU
cluster EP trades the memory of the experts for the dispatcher's traffic; on one CPU it shows that cost.
``--tiny`` runs a seconds-long smoke version.

  python bench/moe.py [--hidden 256 --layers 4 --experts 8 --topk 2 --expert-ffn 256 --ranks 2 --steps 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(a, hf: Path, meg: Path, batches: list) -> dict | None:
    """Per-rank job: each layout's step times (rank 0 returns them)."""
    import torch

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.model.spec import VLMSpec
    from tests.support.train_jobs import encoder_for, job_config, micro_batches
    from megatron_vlm.training import batch_feed
    from megatron_vlm.training.build import build_training
    from megatron_vlm.training.step import train_step
    from megatron_vlm.runtime import distributed

    iter_dir = ckpt.resolve_iteration_dir(meg)
    spec = VLMSpec.load(iter_dir)
    enc = encoder_for(hf, a.seq_length, spec=spec)
    out = {}
    for ep in (1, 2):
        cfg = job_config(dict(ep=ep, micro_batch_size=a.mbs, seq_length=a.seq_length, precision=a.precision,
                              device=a.device, moe_token_dispatcher_type=a.dispatcher, deterministic=False),
                         a.steps + a.warmup, len(batches[0]))
        rt = distributed.setup(1, 1, device=a.device, seed=1234, ep=ep)
        training = build_training(cfg, spec, init_from=iter_dir)
        experts = sum(p.numel() for n, p in training.model.named_parameters() if ".experts." in n)
        times, tokens = [], 0
        for i, gb in enumerate(batches[: a.warmup + a.steps]):
            mine = micro_batches(enc.batch, gb, rt.dp, rt.dp_rank, cfg.micro_batch_size)
            if a.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            r = train_step(training, batch_feed.distribute(mine, rt.device), cfg, rt.device)
            if a.device == "cuda":
                torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t)
                tokens += r.tokens
        out[ep] = dict(seconds=sum(times), tokens=tokens, tokens_per_s=tokens / sum(times), loss=r.loss,
                       expert_params_per_rank=experts, impl=training.impl)
        del training
    return out if torch.distributed.get_rank() == 0 else None


def build(a, work: Path) -> tuple[Path, Path, list]:
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.tiny import make_tiny_llava
    from tests.support.train_jobs import variable_length_batches

    text = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=max(1, a.hidden // 32),
                num_key_value_heads=max(1, a.hidden // 64), head_dim=32, num_experts=a.experts,
                num_experts_per_tok=a.topk, moe_intermediate_size=a.expert_ffn, intermediate_size=2 * a.expert_ffn)
    hf = make_tiny_llava(work / "hf", "qwen3_moe", "clip", text_overrides=text,
                         vision_overrides={"image_size": a.image_size, "patch_size": a.patch_size})
    meg = convert_hf_to_megatron(hf, work / "meg", tp=1)
    batches = variable_length_batches(hf, a.warmup + a.steps, size=a.gbs, seq_length=a.seq_length)
    return hf, meg, batches


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--hidden", type=int, default=256, help="language model hidden size (256)")
    p.add_argument("--layers", type=int, default=4, help="MoE layers (4)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (8)")
    p.add_argument("--topk", type=int, default=2, help="experts per token (2)")
    p.add_argument("--expert-ffn", type=int, default=256, help="each expert's intermediate size (256)")
    p.add_argument("--image-size", type=int, default=64, help="vision input size (64)")
    p.add_argument("--patch-size", type=int, default=8, help="vision patch size (8): 64 image tokens")
    p.add_argument("--seq-length", type=int, default=256, help="--seq-length (256)")
    p.add_argument("--ranks", type=int, default=2, help="processes (data parallel; EP2 splits the experts over 2)")
    p.add_argument("--gbs", type=int, default=8, help="samples per global batch (8)")
    p.add_argument("--mbs", type=int, default=2, help="samples per micro batch (2)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per layout (6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--dispatcher", default="alltoall", choices=["allgather", "alltoall"],
                   help="--moe-token-dispatcher-type (alltoall)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (local layers) or cuda (TE)")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--tiny", action="store_true", help="smoke run: hidden 64, 2 layers, 4 experts, 2 timed steps")
    a = p.parse_args(argv)
    if a.tiny:
        a.hidden, a.layers, a.experts, a.expert_ffn, a.seq_length, a.steps, a.warmup = 64, 2, 4, 32, 96, 2, 1
        a.image_size, a.patch_size = 32, 8
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    from megatron_vlm.runtime.spawn import run_world

    with tempfile.TemporaryDirectory(prefix="mvlm-bench-moe-") as tmp:
        hf, meg, batches = build(a, Path(tmp))
        r = run_world(measure, a.ranks, a, hf, meg, batches)[0]
    r = {f"ep{k}": v for k, v in r.items()}
    r["ratio"] = r["ep2"]["tokens_per_s"] / r["ep1"]["tokens_per_s"]
    print(f"Qwen3-MoE LLaVA: hidden {a.hidden}, {a.layers} MoE layers of {a.experts} experts (top {a.topk}, ffn "
          f"{a.expert_ffn}), {a.ranks} ranks, {a.device} ({r['ep1']['impl']} layers, {a.precision}), "
          f"{a.dispatcher} dispatcher")
    for k in ("ep1", "ep2"):
        s = r[k]
        print(f"  {k.upper()}  {s['tokens_per_s']:9.0f} tokens/s  ({s['tokens']} tokens in {s['seconds']:.2f} s)  "
              f"expert parameters per rank {s['expert_params_per_rank']:,}")
    print(f"  EP2 / EP1 tokens/s: {r['ratio']:.2f}x; expert memory per rank: "
          f"{r['ep2']['expert_params_per_rank'] / r['ep1']['expert_params_per_rank']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
