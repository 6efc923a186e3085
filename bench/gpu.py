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
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: How the set-up's conversion and each training run are started: ``subprocess.run``; the test passes
#: tests.support.forked_cli.run (main's ``run_command``): the same commands, without importing torch again.
_run_command = subprocess.run
sys.path.insert(0, str(ROOT))

FP32_TOLERANCE = 1e-4
BF16_FACTOR = 2.0
BF16_FLOOR = 1e-3
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")

FULL = dict(hidden=2048, layers=22, vision_hidden=1024, vision_layers=24, image_size=336, samples=512,
            mbs=4, gbs=16, seq_length=1024, iters=50, warmup=10, lr=1e-4,
            moe_layers=8, experts=8, topk=2, expert_ffn=1408)
TINY = dict(hidden=128, layers=4, vision_hidden=128, vision_layers=2, image_size=56, samples=8,
            mbs=2, gbs=4, seq_length=128, iters=3, warmup=1, lr=1e-4,
            moe_layers=2, experts=4, topk=2, expert_ffn=64)


def _train_bench():
    """bench/train.py as a module: its model/data set-up and throughput summary are reused here."""
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- set-up ----------------------------------------------------------------------------------------------
def build_inputs(a, work: Path) -> tuple[Path, Path, Path]:
    """(HF LLaVA dir, energon dataset, converted Megatron checkpoint at TP=1) with random weights: bench/train.py's
    set-up (Llama-like LM, CLIP ViT with patch 14, one image and a one-word answer per sample)."""
    return _train_bench().build_inputs(a, work, run_command=_run_command)


def versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"}
    for dist in ("megatron-core", "megatron-energon", "transformers", "transformer_engine", "transformer_engine_cu13",
                 "transformer_engine_torch"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


# ---- logits ----------------------------------------------------------------------------------------------
def _no_tf32():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def hf_reference(hf_dir, batch, dtype, device):
    """HF logits [B, S, vocab] (fp32 on CPU) of ``batch`` with the model in ``dtype`` on ``device``."""
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    with torch.no_grad():
        out = model(input_ids=batch.hf_input_ids.to(device), pixel_values=batch.images.to(device, dtype)).logits
    del model
    return out.float().cpu()


def megatron_logits(meg_dir, batch, impl: str, dtype, device: str):
    """Logits of the checkpoint loaded into a TP=1 model with ``impl`` layers in ``dtype`` (in this process)."""
    import dataclasses

    import torch

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.verify import megatron_forward_logits
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.model.spec import VLMSpec

    iter_dir = ckpt.resolve_iteration_dir(meg_dir)
    with single_process_world(device):
        spec = VLMSpec.load(iter_dir)
        opts = ModelOptions(seq_length=batch.combined_length, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            use_te=impl == "transformer_engine", perform_initialization=False)
        model = build_model(spec, opts)
        if device == "cuda":
            model.cuda()
        ckpt.load_model_weights(model, iter_dir)
        model = model.to(dtype).eval()  # as megatron's Float16Module casts it (the ViT's conv1 included)
        logits = megatron_forward_logits(model, dataclasses.replace(batch, images=batch.images.to(dtype)))
        del model
    return logits.float()[:, : batch.combined_length, : spec.vocab_size]


def check_logits(hf, meg, impls, device: str) -> list[dict]:
    """Rows of the logits table: (impl, dtype, max |diff| vs HF fp32, tolerance, pass)."""
    import torch

    from megatron_vlm.convert.verify import reference_batch
    from megatron_vlm.model.spec import VLMSpec

    _no_tf32()
    spec = VLMSpec.from_hf_dir(hf)
    batch = reference_batch(spec)
    ref = hf_reference(hf, batch, torch.float32, device)[..., : spec.vocab_size]
    hf_bf16 = hf_reference(hf, batch, torch.bfloat16, device)[..., : spec.vocab_size]
    hf_bf16_err = (hf_bf16 - ref).abs().max().item()
    rows = [dict(part="logits", impl="HF transformers", dtype="bf16", diff=hf_bf16_err, tolerance=None, ok=None,
                 note="HF bf16 vs HF fp32: the yardstick")]
    for impl in impls:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                got = megatron_logits(meg, batch, impl, dtype, device)
            except Exception as e:  # report and go on: one broken implementation must not hide the others
                rows.append(dict(part="logits", impl=impl, dtype=name, diff=None, tolerance=None, ok=False,
                                 note=f"{type(e).__name__}: {e}"[:300]))
                continue
            diff = (got - ref).abs().max().item()
            tol = FP32_TOLERANCE if dtype == torch.float32 else BF16_FACTOR * hf_bf16_err + BF16_FLOOR
            rows.append(dict(part="logits", impl=impl, dtype=name, diff=diff, tolerance=tol, ok=diff <= tol,
                             note="TF32 off" if dtype == torch.float32 else f"<= {BF16_FACTOR:g} x HF bf16 + "
                             f"{BF16_FLOOR:g}"))
    return rows


# ---- training ----------------------------------------------------------------------------------------------
def train_run(a, work: Path, hf: Path, data: Path, meg: Path, name: str, impl: str, precision: str,
              recipe: str | None = None, extra: tuple = ()) -> dict:
    """One training run through train/run.py; returns the summary (losses, tokens/s, ...) or an error note."""
    cmd = [sys.executable, "train/run.py", "--device", a.device, "-g", "1", "--stage", "2",
           "--megatron-load-dir", str(meg), "--tokenizer-load-dir", str(hf), "--data-path", str(data),
           "--save-dir", str(work / "runs"), "--name", name, "--no-save", "--train-iters", str(a.iters),
           "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.gbs), "--lr", str(a.lr),
           "--seq-length", str(a.seq_length), "--num-workers", str(a.num_workers), "--seed", str(a.seed),
           "--log-interval", str(max(1, a.iters // 5)), "--precision", precision, "--transformer-impl", impl]
    if recipe:
        cmd += ["--fp8", "--fp8-recipe", recipe]
    cmd += list(extra)  # later flags override (argparse keeps the last)
    t0 = time.time()
    # every run appends to one file in $OUT: a killed run's log comes back, and the GPU machine returns at most 8 files
    log_path = (Path(a.out_dir) if a.out_dir else work) / TRAIN_LOG
    with open(log_path, "ab") as logf, _child_running():
        logf.write(f"==== {name}: {' '.join(cmd)}\n".encode())
        logf.flush()
        start = logf.tell()
        res = _run_command(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                           env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    text = log_path.read_bytes()[start:].decode(errors="replace")
    if res.returncode:
        lines = [ln for ln in text.splitlines() if "rror" in ln or "needs" in ln] or text.splitlines()[-3:]
        return {"name": name, "error": (lines[-1] if lines else f"exit {res.returncode}")[:300]}
    rows = [json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    tb = _train_bench()
    a2 = argparse.Namespace(stage=2)
    out = tb.summarize(rows, t0, a.warmup, tb.step_flops(a2, hf))
    out["name"] = name
    out["layers_line"] = next((ln.split("transformer layers: ", 1)[1] for ln in text.splitlines()
                               if "transformer layers: " in ln), "")
    out["fusions_line"] = next((ln.split("fusions: ", 1)[1] for ln in text.splitlines() if "fusions: " in ln), "")
    out["fp8"] = bool(recipe)
    return out


_CHILD = {"running": False, "terminated": False}
#: the training runs' own output, one file for all runs (headed ``==== <run name>: <command>``)
TRAIN_LOG = "train_runs.log"


class _child_running:
    """Marks a training child as running: a SIGTERM then (bench/gpu_quick.sh's time limit, sent to the whole process
    group, the child included) lets the child shut its own workers down first (train/run.py forwards it to its
    launcher), and this process leaves once the child has returned, not in the middle of waiting for it (which
    would SIGKILL the child and orphan its workers)."""

    def __enter__(self):
        _CHILD["running"] = True

    def __exit__(self, *exc):
        _CHILD["running"] = False
        if _CHILD["terminated"]:
            sys.exit(143)


def _on_sigterm(*_):
    if _CHILD["running"]:
        _CHILD["terminated"] = True
    else:
        sys.exit(143)


#: every fusion switched off, with Megatron-LM's flag names (the "fusions off" training row)
NO_FUSIONS = ("--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
              "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
              "--no-cross-entropy-loss-fusion")


def packing_flags(a) -> tuple:
    """The packed training row: packs of ``--pack-factor`` x --seq-length positions from a buffer of 64 samples;
    a micro batch is one pack, and a global batch holds as many packs as the unpacked run has micro batches."""
    return ("--packing-buffer-size", "64", "--packed-seq-length", str(a.pack_factor * a.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(max(1, a.gbs // a.mbs)))


def mfu(row: dict) -> float | None:
    """Model FLOPs utilisation of a training row on this GPU (None where its peak is not known)."""
    import torch

    from megatron_vlm.training.flops import peak_flops

    peak = peak_flops(torch.device("cuda"), row.get("fp8", False)) if torch.cuda.is_available() else None
    return row["tflops"] * 1e12 / peak if peak and "tflops" in row else None


def check_packing(hf, meg, a) -> list[dict]:
    """Packed ('thd') vs unpacked forward, TE layers in bf16 (tests.support.packing_check)."""
    from tests.support.packing_check import packed_vs_unpacked

    try:
        r = packed_vs_unpacked(meg, hf, seq_length=a.seq_length)
    except Exception as e:  # report it as a failed check
        return [dict(part="packing", impl="transformer_engine", dtype="bf16", ok=False,
                     note=f"{type(e).__name__}: {e}"[:300])]
    return [dict(part="packing", impl="transformer_engine", dtype="bf16", diff=r["logit_diff"],
                 tolerance=r["logit_tolerance"], ok=r["ok"],
                 note=f"logits packed vs unpacked fp32 (unpacked bf16: {r['unpacked_bf16_error']:.3g}); per-sample "
                      f"loss rel. diff {r['loss_rel_diff']:.2g} (<= {r['loss_rtol']:g}); cu_seqlens {r['cu_seqlens']}")]


def curve_diff(x: list[float], ref: list[float]) -> float:
    """Largest relative per-iteration difference of two loss curves."""
    return max(abs(p - q) / abs(q) for p, q in zip(x, ref))


def runnable_recipes() -> list[str]:
    """FP8 recipes this machine's GPU can run (none without one)."""
    import torch

    from megatron_vlm.model import fp8

    if not torch.cuda.is_available():
        return []
    return fp8.runnable(torch.cuda.get_device_capability(), torch.version.cuda)


def check_training(a, work, hf, data, meg, impls, recipes) -> list[dict]:
    runs = {}
    for impl in impls:
        runs[impl] = train_run(a, work, hf, data, meg, f"bf16_{impl}", impl, a.precision)
    base = runs.get("transformer_engine") or runs["local"]
    for r in recipes:
        runs[f"fp8_{r}"] = train_run(a, work, hf, data, meg, f"fp8_{r}", "transformer_engine", "bf16", r)
    te = "transformer_engine" in impls
    if te and "fusions" in a.only:  # the same run with every fusion off: same losses, slower
        runs["te_no_fusions"] = train_run(a, work, hf, data, meg, "bf16_te_no_fusions", "transformer_engine",
                                          a.precision, extra=NO_FUSIONS)
    if te and "packing" in a.only:  # other batches (packs), so no loss comparison: throughput and MFU
        runs["te_packed"] = train_run(a, work, hf, data, meg, "bf16_te_packed", "transformer_engine", a.precision,
                                      extra=packing_flags(a))
    rows = []
    local = runs.get("local")
    expected = set(runnable_recipes())
    for key, r in runs.items():
        row = dict(part="train", impl=key, dtype=a.precision if not key.startswith("fp8") else "fp8+bf16")
        if "error" in r:  # a failure is a failed check, except a recipe this GPU cannot run being refused
            refused = key.startswith("fp8_") and key[4:] not in expected
            row.update(ok=None if refused else False, note=("refused as expected: " if refused else "") + r["error"])
            rows.append(row)
            continue
        ref = local if key == "transformer_engine" else base if key.startswith("fp8") or key == "te_no_fusions" \
            else None
        diff = curve_diff(r["losses"], ref["losses"]) if ref and "error" not in ref and ref is not r else None
        speed = r["tokens_per_s"] / ref["tokens_per_s"] if diff is not None else None
        if key == "te_packed" and "error" not in base:
            speed = r["tokens_per_s"] / base["tokens_per_s"]
        row.update(loss_first=r["losses"][0], loss_last=r["losses"][-1], diff=diff, tolerance=a.loss_tolerance
                   if diff is not None else None, ok=None if diff is None else diff <= a.loss_tolerance,
                   tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], speedup=speed, s_per_iter=r["s_per_iter"],
                   losses=r["losses"], mfu=mfu(r), note=r.get("layers_line", ""), fusions=r.get("fusions_line", ""))
        if key == "te_packed":
            row["note"] = "packed: " + " ".join(packing_flags(a)) + "; speed-up vs TE bf16 unpacked"
        rows.append(row)
    return rows


# ---- mixture of experts: an MoE LLaVA at EP1 ----------------------------------------------------------------------
MOE_FAMILY = "qwen3_moe"


def build_moe_inputs(a, inputs: Path) -> tuple[Path, Path]:
    """(HF dir, converted TP1/EP1 checkpoint) of a Qwen3-MoE LLaVA: ``--moe-layers`` MoE layers of ``--experts``
    experts (top ``--topk``, each of ``--expert-ffn``) at ``--hidden``, the set-up's CLIP ViT (its saved parts)
    and tokenizer style; random weights. Built once in ``inputs/moe``."""
    from megatron_vlm.convert.build import build_llava
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.data.synthetic import COLOURS
    from tests.support.tiny import make_text_model

    work = inputs / "moe"
    hf, meg = work / "hf", work / "megatron"
    if (meg / "latest_checkpointed_iteration.txt").is_file():
        return hf, meg
    texts = ["what colour is the square ? " + " ".join(COLOURS)] * 4
    text = make_text_model(work / "text", MOE_FAMILY, texts=texts, hidden_size=a.hidden,
                           num_hidden_layers=a.moe_layers, num_attention_heads=a.hidden // 64,
                           num_key_value_heads=max(1, a.hidden // 128), head_dim=64, num_experts=a.experts,
                           num_experts_per_tok=a.topk, moe_intermediate_size=a.expert_ffn,
                           intermediate_size=2 * a.expert_ffn)
    build_llava(text, inputs / "parts" / "vision", hf, vocab_size_padding=128)
    convert_hf_to_megatron(hf, meg, tp=1)  # in this process: one interpreter start less than the CLI
    return hf, meg


def check_moe(a, work: Path, inputs: Path, data: Path) -> list[dict]:
    """The MoE row: tokens/s, model TFLOP/s (active parameters: the trainer's count) and MFU of the MoE LLaVA
    trained through train/run.py at EP1 on this GPU, with Transformer Engine's grouped GEMM (TEGroupedMLP,
    ``--moe-grouped-gemm``) when ``--impls`` has transformer_engine, else megatron-core's SequentialMLP (local
    layers: the CPU rehearsal). EP2 needs two GPUs; this is the one-GPU number."""
    te = "transformer_engine" in a.impls
    impl = "transformer_engine" if te else "local"
    label = "TE grouped GEMM, EP1" if te else "local SequentialMLP, EP1"
    row = dict(part="moe", impl=label, dtype=a.precision)
    try:
        hf, meg = build_moe_inputs(a, inputs)
    except Exception as e:  # report and go on
        return [dict(row, ok=False, note=f"set-up: {type(e).__name__}: {e}"[:300])]
    extra = ("--ep", "1") + (("--moe-grouped-gemm",) if te else ())
    r = train_run(a, work, hf, data, meg, f"moe_ep1_{impl}", impl, a.precision, extra=extra)
    if "error" in r:
        return [dict(row, ok=False, note=r["error"])]
    import math

    return [dict(row, loss_first=r["losses"][0], loss_last=r["losses"][-1], losses=r["losses"],
                 tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], s_per_iter=r["s_per_iter"], mfu=mfu(r),
                 ok=all(math.isfinite(x) for x in r["losses"]),
                 note=f"{a.moe_layers} MoE layers x {a.experts} experts (top {a.topk}, FFN {a.expert_ffn}), "
                      f"hidden {a.hidden}; TFLOP/s of the active parameters; " + r.get("layers_line", ""))]


# ---- context parallelism: CP2 (TE p2p) against CP1 on one long sample -------------------------------------------------
def cp_sample(a, hf: Path):
    """One long sample of the set-up's LLaVA: ``--cp-images`` images (576 positions each at the default 336 px), a
    question between them and a one-word answer; its positions, rounded up to a multiple of 64, are the run's
    ``--seq-length``."""
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array
    from megatron_vlm.data.task_encoder import VLMSample
    from tests.support.train_jobs import encoder_for

    enc = encoder_for(hf, 1 << 20)
    images = [Image.fromarray(image_array(a.image_size, i)) for i in range(a.cp_images)]
    content = [p for _ in images for p in ({"type": "image"}, {"type": "text", "text": "what colour is the square ?"})]
    fields = enc.encode_conversation([{"role": "user", "content": content},
                                      {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], images,
                                     "cp")
    sample = VLMSample(__key__="cp", __restore_key__=(), __subflavors__=None, __sources__=None, **fields)
    return sample, -(-int(sample.num_tokens) // 64) * 64


def check_cp(a, hf: Path, meg: Path) -> list[dict]:
    """The context-parallel rows: CP1 and CP2 (``cp_comm_type`` p2p with Transformer Engine) on one long sample."""
    import torch

    from megatron_vlm.runtime.spawn import run_world
    from tests.support.memory_jobs import step_peak_jobs

    te = "transformer_engine" in a.impls
    impl = "transformer_engine" if te else "local"
    try:
        sample, seq = cp_sample(a, hf)
    except Exception as e:  # report and go on
        return [dict(part="cp", impl=f"{impl}, CP1", dtype=a.precision, ok=False, note=f"{type(e).__name__}: {e}"[:300])]
    gpus = torch.cuda.device_count() if a.device == "cuda" else 2
    base = dict(seq_length=seq, micro_batch_size=1, stage=2, device=a.device, precision=a.precision,
                transformer_impl=impl, seed=a.seed)
    runs = {}
    for cp in (1, 2):
        label = f"{'TE p2p' if te and cp > 1 else impl}, CP{cp}"
        if cp > gpus:
            runs[cp] = dict(part="cp", impl=label, dtype=a.precision, ok=None,
                            note=f"not measured: CP{cp} needs {cp} GPUs, this machine has {gpus} (NCCL runs one rank per "
                                 "GPU and refuses two ranks on one device: 'Duplicate GPU detected')")
            continue
        job = dict(base, name=f"cp{cp}", cp=cp, **(dict(cp_comm_type="p2p") if te and cp > 1 else {}))
        try:
            r = run_world(step_peak_jobs, cp, str(meg), str(hf), [sample], [job])[0][0]
        except Exception as e:  # report and go on
            runs[cp] = dict(part="cp", impl=label, dtype=a.precision, ok=False, note=f"{type(e).__name__}: {e}"[:300])
            continue
        peak = max(m["peak"] for m in r["ranks"])
        runs[cp] = dict(part="cp", impl=label, dtype=a.precision, loss_first=r["loss"], loss_last=r["loss"],
                        peak_gib=peak / 2 ** 30, peak_extra_gib=max(m["peak"] - m["before"] for m in r["ranks"]) / 2 ** 30,
                        s_per_iter=max(m["seconds"] for m in r["ranks"]), positions=int(sample.num_tokens), ok=None,
                        note=f"one sample of {int(sample.num_tokens)} positions ({a.cp_images} images); peak per rank "
                             f"{peak / 2 ** 30:.2f} GiB" + (" (allocated)" if a.device == "cuda" else " (resident)"))
    one, two = runs[1], runs[2]
    if "loss_first" in one and "loss_first" in two:
        diff = abs(two["loss_first"] - one["loss_first"]) / abs(one["loss_first"])
        two.update(diff=diff, tolerance=a.loss_tolerance, ok=diff <= a.loss_tolerance,
                   memory_ratio=two["peak_extra_gib"] / one["peak_extra_gib"])
        two["note"] += f"; the step's peak above its start x{two['memory_ratio']:.2f} of CP1's"
        one["ok"] = True
    return [one, two]


# ---- virtual pipeline parallelism: PP2 x VPP2 against PP2 --------------------------------------------------------
def vpp_split(layers: int) -> list[int] | None:
    """Language layers per rank of PP2 that split into two chunks each (even counts, as equal as they come: 12,10 of
    22); None when the model has too few layers (under 4)."""
    first = (layers + 2) // 4 * 2
    rest = layers - first
    return [first, rest] if first >= 2 and rest >= 2 and rest % 2 == 0 else None


def check_vpp(a, work: Path, hf: Path, data: Path, meg: Path) -> list[dict]:
    """The virtual-pipeline rows: the set-up's LLaVA trained at PP2 and at PP2 x VPP2 through train/run.py (two
    ranks), same weights, batches and steps: equal losses and both throughputs."""
    import torch

    impl = "transformer_engine" if "transformer_engine" in a.impls else "local"
    split = vpp_split(a.layers)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 2
    rows = {}
    for vpp in (1, 2):
        label = f"{impl}, PP2" + (" x VPP2" if vpp > 1 else "")
        row = dict(part="vpp", impl=label, dtype=a.precision)
        if gpus < 2 or split is None:
            rows[vpp] = dict(row, ok=None, note="not measured: " + (
                f"PP2 needs 2 GPUs, this machine has {gpus} (NCCL runs one rank per GPU and refuses two ranks on one "
                "device: 'Duplicate GPU detected')" if gpus < 2 else
                f"the set-up's {a.layers} language layers do not make two chunks on each of two ranks"))
            continue
        extra = ("-g", "2", "--pp", "2", "--pp-layers", ",".join(map(str, split)))
        if vpp > 1:
            extra += ("--num-virtual-stages-per-pipeline-rank", str(vpp))
        r = train_run(a, work, hf, data, meg, f"vpp{vpp}_{impl}", impl, a.precision, extra=extra)
        if "error" in r:
            rows[vpp] = dict(row, ok=False, note=r["error"])
            continue
        chunks = ", ".join(f"{n // vpp}" for n in split)
        rows[vpp] = dict(row, loss_first=r["losses"][0], loss_last=r["losses"][-1], losses=r["losses"],
                         tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], s_per_iter=r["s_per_iter"], ok=None,
                         note=f"--pp-layers {','.join(map(str, split))}" + (
                             f", {vpp} chunks per rank of {chunks} layers (interleaved 1F1B)" if vpp > 1 else
                             " (1F1B)") + f"; {a.gbs // a.mbs} micro batches per step")
    plain, inter = rows[1], rows[2]
    if "losses" in plain and "losses" in inter:
        diff = curve_diff(inter["losses"], plain["losses"])
        inter.update(diff=diff, tolerance=a.loss_tolerance, ok=diff <= a.loss_tolerance,
                     speedup=inter["tokens_per_s"] / plain["tokens_per_s"], mfu=mfu(inter))
        plain.update(ok=True, mfu=mfu(plain))
    return [plain, inter]


# ---- the InternVL family: logits against HF ----------------------------------------------------------------------
INTERNVL_TILE = 448  # InternViT's tile: 32 x 32 patches of 14, 256 tokens after the pixel shuffle


def build_internvl_inputs(a, inputs: Path) -> tuple[Path, Path]:
    """(HF InternVL dir, converted TP1 checkpoint), built once in ``inputs/internvl``: ``build_llava --arch internvl``
    from a Qwen2-style LM (``--hidden``, 4 layers) and a vision-only InternViT (``--vision-hidden``, 4 layers with
    layer scales, InternViT-300M's norms and biases; ``--image-size`` with --tiny, else 448 px)."""
    import torch
    from transformers import InternVLVisionConfig, InternVLVisionModel

    from megatron_vlm.convert.build import build_llava
    from megatron_vlm.convert.build_internvl import default_image_processor
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.data.synthetic import COLOURS
    from tests.support.tiny import make_text_model

    work = inputs / "internvl"
    hf, meg = work / "hf", work / "megatron"
    if (meg / "latest_checkpointed_iteration.txt").is_file():
        return hf, meg
    tile = a.image_size if a.tiny else INTERNVL_TILE
    texts = ["what colour is the square ? " + " ".join(COLOURS)] * 4
    text = make_text_model(work / "text", "qwen2", texts=texts, hidden_size=a.hidden, num_hidden_layers=4,
                           num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
                           tokenizer="chatml")
    vh = a.vision_hidden
    vcfg = InternVLVisionConfig(hidden_size=vh, intermediate_size=4 * vh, num_hidden_layers=4,
                                num_attention_heads=max(1, vh // 64), image_size=[tile, tile], patch_size=[14, 14],
                                attention_bias=True, norm_type="layer_norm", layer_norm_eps=1e-6)
    torch.manual_seed(a.seed)
    vit = InternVLVisionModel(vcfg)
    with torch.no_grad():  # HF initialises the layer scales to 0.1, position embeddings and the class token to 0
        for name, p in vit.named_parameters():
            if name.endswith(("lambda_1", "lambda_2")) or "position_embeddings" in name or "cls_token" in name:
                p.add_(0.5 * torch.randn_like(p))
    vit.save_pretrained(str(work / "vit"))
    default_image_processor(tile).save_pretrained(str(work / "vit"))
    build_llava(text, work / "vit", hf, arch="internvl", vocab_size_padding=128)
    convert_hf_to_megatron(hf, meg, tp=1)  # in this process: one interpreter start less than the CLI
    return hf, meg


def internvl_hf_logits(hf_dir, batch, dtype, device):
    """HF InternVL's logits of each sample of ``batch`` alone (fp32 on CPU; zero beyond a sample's length)."""
    import torch
    from transformers import InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    out = torch.zeros(*batch.hf_input_ids.shape, model.config.text_config.vocab_size)
    with torch.no_grad():
        for b in range(batch.num_samples):
            inputs = batch.hf_sample(b)
            logits = model(input_ids=inputs["input_ids"].to(device),
                           pixel_values=inputs["pixel_values"].to(device, dtype)).logits[0]
            out[b, :logits.shape[0]] = logits.float().cpu()
    del model
    return out


def check_internvl(a, inputs: Path) -> list[dict]:
    """The InternVL rows: HF bf16 vs fp32 (the yardstick), then each of ``--impls`` in fp32 (TF32 off, 1e-4) and bf16
    (the yardstick's bound) on the reference batch of multi-tile images."""
    import torch

    from megatron_vlm.convert.verify import max_logit_diff, reference_batch
    from megatron_vlm.model.spec import VLMSpec

    row = dict(part="internvl")
    try:
        hf, meg = build_internvl_inputs(a, inputs)
    except Exception as e:  # report and go on
        return [dict(row, impl="set-up", dtype="-", ok=False, note=f"{type(e).__name__}: {e}"[:300])]
    _no_tf32()
    spec = VLMSpec.from_hf_dir(hf)
    batch = reference_batch(spec)
    ref = internvl_hf_logits(hf, batch, torch.float32, a.device)
    yard = max_logit_diff(ref, internvl_hf_logits(hf, batch, torch.bfloat16, a.device), spec.vocab_size, batch)
    tiles = batch.num_image_tiles.tolist()
    rows = [dict(row, impl="HF transformers", dtype="bf16", diff=yard, tolerance=None, ok=None,
                 note=f"HF bf16 vs HF fp32: the yardstick; tiles per image {tiles}, {spec.num_image_tokens} tokens "
                      "each")]
    for impl in a.impls:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                got = megatron_logits(meg, batch, impl, dtype, a.device)
            except Exception as e:  # report and go on
                rows.append(dict(row, impl=impl, dtype=name, ok=False, note=f"{type(e).__name__}: {e}"[:300]))
                continue
            diff = max_logit_diff(ref, got, spec.vocab_size, batch)
            tol = FP32_TOLERANCE if dtype == torch.float32 else BF16_FACTOR * yard + BF16_FLOOR
            rows.append(dict(row, impl=impl, dtype=name, diff=diff, tolerance=tol, ok=diff <= tol,
                             note="TF32 off" if dtype == torch.float32 else
                             f"<= {BF16_FACTOR:g} x HF bf16 + {BF16_FLOOR:g}"))
    return rows


# ---- the reference: HF + SDPA in a plain PyTorch loop ------------------------------------------------------------
HF_ROW = "HF + SDPA loop"


def hf_loop(a, hf: Path, data: Path) -> dict:
    """Train HF's LLaVA (SDPA attention) in a plain PyTorch loop on our batches; bench/train.py's summary of it.

    Same data (energon loader, ``VLMTaskEncoder``, seed; each image token expanded as the HF processor writes it),
    same trained parts (stage 2: LM + projector; the ViT frozen), AdamW with the trainer's defaults (3% linear
    warm-up, cosine decay, gradient clipping 1.0), gradient accumulation to ``--gbs``. bf16 as HF's Trainer runs
    it: fp32 weights and optimizer, matmuls under bf16 autocast. Each iteration ends with a device sync, so its
    time stamp is the step's end."""
    import math

    import torch
    import torch.nn.functional as F
    from transformers import LlavaForConditionalGeneration

    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.data.task_encoder import VLMTaskEncoder

    tb = _train_bench()
    dev = torch.device(a.device)
    t0 = time.time()
    torch.manual_seed(a.seed)
    model = LlavaForConditionalGeneration.from_pretrained(str(hf), dtype=torch.float32,
                                                          attn_implementation="sdpa").to(dev).train()
    model.model.vision_tower.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    warm = int(0.03 * a.iters)

    def lr_factor(step):
        if step < warm:
            return step / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, a.iters - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    enc = VLMTaskEncoder(hf, a.seq_length)
    data_iter = iter(build_train_loader(data, enc, a.mbs, 0, 1, a.num_workers, a.seed))
    rows = []
    for it in range(1, a.iters + 1):
        batches = [tb.hf_batch(next(data_iter), enc.image_token_id, enc.tokens_per_image, enc.pad_token_id)
                   for _ in range(a.gbs // a.mbs)]
        n_loss = sum(int((b["labels"] != -100).sum()) for b in batches)
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=dev)
        for b in batches:
            with autocast:
                logits = model(input_ids=b["input_ids"].to(dev, non_blocking=True),
                               pixel_values=b["pixel_values"].to(dev, non_blocking=True)).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].to(dev).flatten(), ignore_index=-100,
                                   reduction="sum")
            (loss / n_loss).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_value = loss_sum.item() / n_loss  # synchronises: the time stamp is the step's end
        rows.append({"iteration": it, "loss": loss_value, "samples": a.gbs, "time": time.time(),
                     "tokens": sum(b["num_tokens"] for b in batches),
                     "images": sum(b["pixel_values"].shape[0] for b in batches)})
        if it % max(1, a.iters // 5) == 0:
            print(f"HF + SDPA iteration {it}/{a.iters}: loss {loss_value:.4f}", flush=True)
    out = tb.summarize(rows, t0, a.warmup, tb.step_flops(argparse.Namespace(stage=2), hf))
    out["name"] = HF_ROW
    return out


def check_hf_loop(a, hf: Path, data: Path) -> list[dict]:
    """The reference loop's row (part ``train``, impl :data:`HF_ROW`); an error is reported, not raised."""
    try:
        r = hf_loop(a, hf, data)
    except Exception as e:  # report and go on
        return [dict(part="train", impl=HF_ROW, dtype=a.precision, ok=False, note=f"{type(e).__name__}: {e}"[:300])]
    return [dict(part="train", impl=HF_ROW, dtype=a.precision, loss_first=r["losses"][0], loss_last=r["losses"][-1],
                 tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], s_per_iter=r["s_per_iter"], losses=r["losses"],
                 mfu=mfu(r), ok=None, note="reference: HF LlavaForConditionalGeneration, sdpa attention, "
                 + ("bf16 autocast, fp32 weights" if a.precision == "bf16" else a.precision))]


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each training row's speed-up over the HF + SDPA loop (``vs_hf``), where both were measured."""
    ref = next((r for r in rows if r.get("impl") == HF_ROW and r.get("tokens_per_s")), None)
    for r in rows:
        if ref and r.get("part") == "train" and r is not ref and r.get("tokens_per_s"):
            r["vs_hf"] = r["tokens_per_s"] / ref["tokens_per_s"]
    return rows


def write_results(out: Path, info: dict, rows: list[dict], args: dict | None = None) -> None:
    """Merge ``info`` and ``rows`` into the JSON file ``out`` (made if absent), atomically: every step of
    bench/gpu_quick.sh adds its rows to the one file as soon as it has them."""
    old = json.loads(out.read_text()) if out.is_file() else {"info": {}, "args": {}, "rows": []}
    old["info"].update(info)
    if args:
        old.setdefault("args", {}).update(args)
    old["rows"] = with_ratios(old["rows"] + rows)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(old, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


# ---- report ----------------------------------------------------------------------------------------------------
def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) and v is not None else "-"


def print_table(rows: list[dict], info: dict) -> None:
    print("\n" + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"{'part':7s} {'layers / run':22s} {'dtype':9s} {'max diff':>10s} {'tolerance':>10s} {'ok':>4s} "
          f"{'loss 1st->last':>17s} {'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'speed-up':>8s} {'x HF':>5s}  note")
    for r in rows:
        ok = {True: "yes", False: "NO", None: "-"}[r.get("ok")]
        losses = f"{r['loss_first']:.3f}->{r['loss_last']:.3f}" if "loss_first" in r else "-"
        print(f"{r['part']:7s} {r['impl']:22s} {r['dtype']:9s} {_fmt(r.get('diff'), '10.3g'):>10s} "
              f"{_fmt(r.get('tolerance'), '10.3g'):>10s} {ok:>4s} {losses:>17s} "
              f"{_fmt(r.get('tokens_per_s'), '9.0f'):>9s} "
              f"{_fmt(r.get('tflops'), '8.1f'):>8s} {_fmt(r.get('mfu'), '6.1%'):>6s} "
              f"{_fmt(r.get('speedup'), '8.2f'):>8s} {_fmt(r.get('vs_hf'), '5.2f'):>5s}  {r.get('note', '')}")


#: what bench/gpu_quick.sh's own exit codes of a step mean (timeout's 124 and 137, its skips 125 and 126)
STEP_LABELS = {124: "  TIMED OUT", 137: "  TIMED OUT", 125: "  skipped: no time left", 126: "  skipped: set-up failed"}


#: how a row that holds a check says it could not be run (on this machine: one GPU for a two-rank check, ...)
NOT_MEASURED = "not measured: "


def not_measured(rows: list[dict]) -> list[dict]:
    """The rows whose check could not run here (``ok`` None and a note saying why), as opposed to the reference and
    throughput rows, which hold no check."""
    return [r for r in rows if r.get("ok") is None and str(r.get("note", "")).startswith(NOT_MEASURED)]


def verdict(rows: list[dict]) -> str:
    """The closing line's checks: failed ones, or that all passed, and every row not measured with its reason, so a
    check that did not run is named rather than counted as passed."""
    failed = [r for r in rows if r.get("ok") is False]
    checked = [r for r in rows if r.get("ok") is not None]
    line = f"{len(failed)} check(s) failed" if failed else "all checks passed" if checked else "no check ran"
    skipped = not_measured(rows)
    if skipped:
        line += f"; {len(skipped)} not measured: " + "; ".join(
            f"{r['part']} {r['impl']} ({r['note'][len(NOT_MEASURED):]})" for r in skipped)
    return line


def report(results: Path, steps: Path | None = None) -> int:
    """Print the table of a results file (and the steps of bench/gpu_quick.sh); 1 if a check failed or a step did."""
    if not results.is_file():
        print(f"no results in {results}: no step wrote any")
        data = {"info": {}, "rows": []}
    else:
        data = json.loads(results.read_text())
    print_table(data["rows"], data["info"])
    bad_steps = []
    if steps and steps.is_file():
        print(f"\n{'step':10s} {'rc':>4s} {'seconds':>8s} {'limit':>6s}")
        for line in steps.read_text().splitlines():
            st = json.loads(line)
            label = STEP_LABELS.get(st["rc"], "  failed" if st["rc"] else "")
            print(f"{st['step']:10s} {st['rc']:4d} {st['seconds']:8d} {st['limit']:6d}{label}")
            if st["rc"]:
                bad_steps.append(st["step"])
    failed = [r for r in data["rows"] if r.get("ok") is False]
    checked = [r for r in data["rows"] if r.get("ok") is not None]
    print("\n" + verdict(data["rows"]), end="")
    print(f"; step(s) failed: {', '.join(bad_steps)}" if bad_steps else "")
    return 1 if failed or bad_steps or not checked else 0


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU, local layers only (plumbing check)")
    p.add_argument("--only", default="logits,packing,train,fusions", help="comma-separated parts: logits (HF vs "
                   "Megatron), packing (packed vs unpacked forward, and a packed training row), train (bf16 local/TE, "
                   "FP8 recipes), fusions (a TE training row with every fusion off), hf (the HF + SDPA reference "
                   "loop on the same batches), moe (an MoE LLaVA at EP1: TE grouped GEMM, or local layers), cp (one long "
                   "sample at CP1 and at CP2 with TE's p2p attention: losses and peak memory per rank), vpp (PP2 x "
                   "VPP2 against PP2 through train/run.py: equal losses, tokens/s; needs two GPUs), internvl (the "
                   "InternVL family's logits against HF)")
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
    unknown = a.only - {"logits", "packing", "train", "fusions", "hf", "moe", "cp", "vpp", "internvl"}
    if unknown:
        p.error(f"--only {','.join(sorted(unknown))}: unknown part(s); pick from logits,packing,train,fusions,hf,moe,"
                "cp,vpp,internvl")
    return a


def main(argv=None, run_command=subprocess.run) -> int:
    global _run_command
    _run_command = run_command
    a = parse(argv)
    if a.report:
        return report(a.report, a.steps)
    if not a.tiny:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU is visible; run with --tiny for the CPU plumbing check")
    import signal

    # bench/gpu_quick.sh's time limit sends SIGTERM: leave through the ``finally`` below, which writes the rows so far
    signal.signal(signal.SIGTERM, _on_sigterm)
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
