#!/usr/bin/env python
"""GPU correctness and speed on one GPU (issue: TE layers by default, bf16 and FP8 verified). Prints a table.

What it measures, in one run (each part can be picked with ``--only``):

``logits``  HF ``LlavaForConditionalGeneration`` vs the Megatron model loaded from the converted checkpoint
            (torch_dist, TP=1), with local layers and with Transformer Engine layers:
            - fp32 with TF32 off: max |logit difference| must be <= 1e-4 (the converter's tolerance);
            - bf16: the Megatron model in bf16 against HF in fp32 must differ by at most
              ``BF16_FACTOR`` (2) x what HF's own bf16 model differs from HF fp32 on the same batch (plus 1e-3):
              bf16 keeps 8 mantissa bits, so any bf16 implementation differs from fp32 by a model-dependent amount,
              and a correct one is no further off than the reference implementation in the same precision.
``train``   bf16 training (stage 2: LM + projector) through the real launcher ``train/run.py`` and energon loader
            on synthetic VQA data, from the same converted checkpoint (random weights), ``--iters`` iterations:
            local layers, Transformer Engine layers, and ``--fp8`` with each recipe of ``--recipes`` (those the
            GPU cannot run are reported as refused, with the trainer's message). Loss curves: TE vs local and each
            FP8 recipe vs TE bf16 must agree within ``--loss-tolerance`` (2%, largest relative per-iteration
            difference). Speed: tokens/s, model TFLOP/s and MFU (H100/H200 peak) after ``--warmup`` iterations,
            and speed-ups.
``fusions`` (with ``train``) the Transformer Engine bf16 run again with every fusion off (Megatron-LM's ``--no-*``
            flags): the same loss curve within ``--loss-tolerance``, and the speed-up the fusions give.
``packing`` packed vs unpacked forward of the same samples with TE layers in bf16 (``thd`` with image-expanded
            ``cu_seqlens``; tests.support.packing_check): logits within the bf16 yardstick, per-sample losses
            within 1%; with ``train`` also a packed training row (``--packing-buffer-size 64 --packed-seq-length``
            ``--pack-factor`` x ``--seq-length``): tokens/s, MFU and speed-up vs the unpacked TE run.

``moe``     (bench/gpu_quick.sh) a Qwen3-MoE LLaVA (``--moe-layers`` x ``--experts`` experts, top ``--topk``) trained at
            EP1 through train/run.py: tokens/s, TFLOP/s of the active parameters and MFU, with Transformer Engine's
            grouped GEMM (``--moe-grouped-gemm``, TEGroupedMLP) when ``--impls`` has transformer_engine, else with
            local layers (SequentialMLP). EP2 needs a second GPU.
``cp``      (bench/gpu_quick.sh) context parallelism: one step of ONE long sample (``--cp-images`` images of the set-up's
            LLaVA and a question: ~4k positions at the default size) at CP1 and at CP2 with Transformer Engine's p2p
            attention (``--impls transformer_engine``; local layers' reference attention otherwise, the CPU
            rehearsal), from the same weights, each in its own local world: equal losses (``--loss-tolerance``) and
            the peak memory per rank of the step (``max_memory_allocated``; on CPU the peak resident set). CP2 needs
            two GPUs: NCCL runs one rank per GPU (it refuses two ranks on one device, "Duplicate GPU detected"), so
            on a one-GPU machine the CP2 row says so and only CP1 is measured.
``vpp``     (bench/gpu_quick.sh) virtual pipeline parallelism: the set-up's LLaVA trained through train/run.py at PP2 and
            at PP2 x VPP2 (megatron-core's interleaved 1F1B schedule), from the same weights on the same batches, with
            the language layers split evenly in chunks (``--pp-layers`` with an even count per rank, e.g. 12,10 of 22
            layers: chunks of 6 and 5): equal loss curves (``--loss-tolerance``), tokens/s of both and the speed-up
            of the smaller pipeline bubble. PP2 needs two GPUs (NCCL runs one rank per GPU); on a one-GPU machine the
            rows say so. On CPU (``--tiny``) both run as two gloo ranks.
``internvl`` (bench/gpu_quick.sh) the InternVL family's logits against HF's ``InternVLForConditionalGeneration``: a
            model built by ``build_llava.py --arch internvl`` (a Qwen2-style LM at ``--hidden``, InternViT-300M-shaped
            layers at ``--vision-hidden`` with its layer scales, 448-px tiles: 256 tokens each after the pixel shuffle)
            on the reference batch of multi-tile images, with each of ``--impls``: fp32 with TF32 off within 1e-4,
            bf16 within the yardstick above.
``perf_*``  ``perf_profile``, ``perf_shapes``, ``perf_te`` (bench/gpu_quick.sh --perf; bench/gpu_steps/perf.py): where
            a step's time goes: two profiled iterations of ours and of the HF loop (traces and top-ops tables into
            $OUT), micro batch --mbs against --gbs (the host's share), SDPA against local attention, packed against
            padded, and with Transformer Engine: TE bf16, FP8 tensorwise and delayed at the fast shape (micro batch
            --gbs).
``hf``      (bench/gpu_quick.sh) the reference loop: HF ``LlavaForConditionalGeneration`` with SDPA attention trained by
            a plain PyTorch loop (bf16 autocast over fp32 weights, as HF's Trainer runs bf16; AdamW, the trainer's
            schedule and clipping) on the same batches (energon loader + ``VLMTaskEncoder``, same seed) and the same
            parts (stage 2: LM + projector); tokens/s, model TFLOP/s (the trainer's FLOP count) and MFU, and the
            ratio of each Megatron training row to it.

bench/gpu_quick.sh runs these as separate steps, each with its own time limit, over one set-up
(``--setup-only`` builds it into ``--inputs DIR``; later steps reuse it with ``--inputs DIR``), merging every
step's rows into one JSON file as they come (``--out``), and prints the table at the end (``--report FILE``).

Sizes: the default model is a ~1B Llama-like LM (hidden 2048, 22 layers, FFN 5632, 32 heads, 16 KV heads) with a
CLIP-L/14-336-shaped ViT (hidden 1024, 24 layers, 16 heads, 336 px, 576 image tokens), random weights.
``--tiny`` shrinks everything to run on CPU in seconds (local layers only, fp32/bf16): the CPU test suite runs
it to prove the plumbing.

  python bench/gpu.py [--only logits,packing,train,fusions] [--iters 50] [--recipes delayed,tensorwise,blockwise,mxfp8]
  python bench/gpu.py --tiny            # CPU, local layers
  python bench/gpu.py --inputs /tmp/q --setup-only; python bench/gpu.py --inputs /tmp/q --only hf --iters 30
  python bench/gpu.py --report $OUT/gpu_bench.json [--steps $OUT/steps.jsonl]
The machine needs megatron-core, energon and Transformer Engine: see bench/GPU.md (bench/gpu_prepare.py).
Results are also written as JSON to ``--out`` (default: $OUT/gpu_bench.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# This file is the command: its flags (parse) and the order of the steps (main). Each step's code is a module of
# bench/gpu_steps/ (its __init__ lists them). What the steps define is imported here, so that bench/gpu.py's names
# stay what code importing this script uses (tests/test_bench_gpu.py, tests/test_transformer_impl.py).
from bench.gpu_steps.common import (FULL, TINY, build_inputs, curve_diff, mfu, use_run_command,  # noqa: E402,F401
                                    versions)
from bench.gpu_steps.logits import (BF16_FACTOR, BF16_FLOOR, FP32_TOLERANCE, check_logits,  # noqa: E402,F401
                                    hf_reference, megatron_logits)
from bench.gpu_steps.logits import no_tf32 as _no_tf32  # noqa: E402,F401
from bench.gpu_steps.training import (NO_FUSIONS, RECIPES, TRAIN_LOG, check_training, on_sigterm,  # noqa: E402,F401
                                      runnable_recipes, train_run)
from bench.gpu_steps.packing import check_packing, packing_flags  # noqa: E402,F401
from bench.gpu_steps.hf_loop import HF_ROW, check_hf_loop, hf_loop  # noqa: E402,F401
from bench.gpu_steps.moe import MOE_FAMILY, build_moe_inputs, check_moe  # noqa: E402,F401
from bench.gpu_steps.cp import check_cp, cp_sample  # noqa: E402,F401
from bench.gpu_steps.vpp import check_vpp, vpp_split  # noqa: E402,F401
from bench.gpu_steps.internvl import (INTERNVL_TILE, build_internvl_inputs, check_internvl,  # noqa: E402,F401
                                      internvl_hf_logits)
from bench.gpu_steps import perf  # noqa: E402,F401
from bench.gpu_steps.perf import PARTS as PERF_PARTS, check_perf_profile, check_perf_shapes, check_perf_te  # noqa: E402
from bench.gpu_steps.results import (  # noqa: E402,F401
    STEP_LABELS, not_measured, print_table, report, verdict, with_ratios, write_results)


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU, local layers only (plumbing check)")
    p.add_argument("--only", default="logits,packing,train,fusions", help="comma-separated parts: logits (HF vs "
                   "Megatron), packing (packed vs unpacked forward, and a packed training row), train (bf16 local/TE, "
                   "FP8 recipes), fusions (a TE training row with every fusion off), hf (the HF + SDPA reference "
                   "loop on the same batches), moe (an MoE LLaVA at EP1: TE grouped GEMM, or local layers), cp (one "
                   "long sample at CP1 and at CP2 with TE's p2p attention: losses and peak memory per rank), vpp (PP2 "
                   "x VPP2 against PP2 through train/run.py: equal losses, tokens/s; needs two GPUs), internvl (the "
                   "InternVL family's logits against HF), perf_profile, perf_shapes, perf_te (bench/gpu_quick.sh "
                   "--perf: profiles, micro batch and attention comparisons, TE and FP8 at the fast shape)")
    p.add_argument("--inputs", type=Path, default=None, help="set-up folder (HF model, data, converted checkpoint): "
                   "reused when it holds one, else built there and kept")
    p.add_argument("--setup-only", action="store_true", help="build the set-up into --inputs and stop")
    p.add_argument("--report", type=Path, default=None, metavar="JSON", help="print the table of a results file "
                   "and exit (1 if a check or a step failed)")
    p.add_argument("--steps", type=Path, default=None, help="with --report: bench/gpu_quick.sh's steps.jsonl")
    p.add_argument("--pack-factor", type=int, default=4, help="packed sequence length = this x --seq-length")
    p.add_argument("--cp-images", type=int, default=None, help="images of the context-parallel row's one long sample "
                   "(default 7: ~4k positions; 3 with --tiny)")
    p.add_argument("--impls", default=None, help="layer implementations (default: transformer_engine,local on "
                   "CUDA; local with --tiny)")
    p.add_argument("--recipes", default=None, help=f"FP8 recipes to train with (default on CUDA: {','.join(RECIPES)};"
                   " none with --tiny)")
    for k, v in FULL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None,
                       help=f"default {v} ({TINY[k]} with --tiny)")
    p.add_argument("--loss-tolerance", type=float, default=0.02, help="largest relative loss difference (default 2%%)")
    p.add_argument("--num-workers", type=int, default=None, help="data-loader workers (default 2; 0 with --tiny)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: $OUT/gpu_bench.json if $OUT is set)")
    a = p.parse_args(argv)
    sizes = TINY if a.tiny else FULL
    for k, v in sizes.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.num_workers is None:
        a.num_workers = 0 if a.tiny else 2
    if a.cp_images is None:
        a.cp_images = 3 if a.tiny else 7
    a.device = "cpu" if a.tiny else "cuda"
    a.precision = "fp32" if a.tiny else "bf16"
    a.impls = (a.impls or ("local" if a.tiny else "transformer_engine,local")).split(",")
    a.recipes = [r for r in (a.recipes if a.recipes is not None else ("" if a.tiny else ",".join(RECIPES))).split(",")
                 if r]
    a.only = set(a.only.split(","))
    if a.out is None and os.environ.get("OUT"):
        a.out = Path(os.environ["OUT"]) / "gpu_bench.json"
    a.out_dir = a.out.parent if a.out else None
    if a.gbs % a.mbs:
        p.error(f"--gbs {a.gbs} must be a multiple of --mbs {a.mbs}")
    if a.setup_only and a.inputs is None:
        p.error("--setup-only needs --inputs DIR (where the set-up is kept for the later steps)")
    unknown = a.only - {"logits", "packing", "train", "fusions", "hf", "moe", "cp", "vpp", "internvl", *PERF_PARTS}
    if unknown:
        p.error(f"--only {','.join(sorted(unknown))}: unknown part(s); pick from logits,packing,train,fusions,hf,moe,"
                "cp,vpp,internvl," + ",".join(PERF_PARTS))
    return a


def main(argv=None, run_command=subprocess.run) -> int:
    use_run_command(run_command)
    a = parse(argv)
    if a.report:
        return report(a.report, a.steps)
    if not a.tiny:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU is visible; run with --tiny for the CPU plumbing check")
    import signal

    # bench/gpu_quick.sh's time limit sends SIGTERM: leave through the ``finally`` below, which writes the rows so far
    signal.signal(signal.SIGTERM, on_sigterm)
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_", dir=a.work_dir))
    if a.out_dir:
        a.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    info: dict = {}
    try:
        info.update(versions())
        t = time.perf_counter()
        if a.inputs and (a.inputs / "megatron").is_dir():
            hf, data, meg = a.inputs / "hf", a.inputs / "data", a.inputs / "megatron"
        else:
            hf, data, meg = build_inputs(a, a.inputs or work)
            info["set-up s"] = round(time.perf_counter() - t, 1)
        if a.setup_only:
            print(f"set-up in {a.inputs}: {info.get('set-up s', 'reused')} s", flush=True)
        if "logits" in a.only and not a.setup_only:
            rows += check_logits(hf, meg, a.impls, a.device)
        if "packing" in a.only and "transformer_engine" in a.impls and not a.setup_only:
            rows += check_packing(hf, meg, a)
        if "train" in a.only and not a.setup_only:
            rows += check_training(a, work, hf, data, meg, a.impls, a.recipes)
        if "hf" in a.only and not a.setup_only:
            rows += check_hf_loop(a, hf, data)
        if "moe" in a.only and not a.setup_only:
            rows += check_moe(a, work, a.inputs or work, data)
        if "cp" in a.only and not a.setup_only:
            rows += check_cp(a, hf, meg)
        if "vpp" in a.only and not a.setup_only:
            rows += check_vpp(a, work, hf, data, meg)
        if "internvl" in a.only and not a.setup_only:
            rows += check_internvl(a, a.inputs or work)
        for part, check in zip(PERF_PARTS, (check_perf_profile, check_perf_shapes, check_perf_te)):
            if part in a.only and not a.setup_only:
                rows += check(a, work, hf, data, meg)
    finally:
        if a.out:
            write_results(a.out, info, rows, {k: str(v) for k, v in vars(a).items()})
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = with_ratios(rows)
    print_table(rows, info)
    failed = [r for r in rows if r.get("ok") is False]
    print("\n" + verdict(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    sys.exit(main())
