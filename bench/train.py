#!/usr/bin/env python
"""Training speed on CPU (a benchmark, not a test): our megatron-core training step against a plain PyTorch
loop training the same Hugging Face ``LlavaForConditionalGeneration``, measured in one run. Prints the numbers.

Both sides start from the same weights (the HF directory and the Megatron checkpoint converted from it), read
the same batches (energon loader + ``VLMTaskEncoder``, same seed; the HF side gets each image token expanded
to the image's positions as the HF processor does), freeze the same parts (``--stage``), use Adam(W) with the
same learning-rate schedule, gradient clipping and gradient accumulation, run the same attention kernel (torch's
SDPA: HF's default, and ours with ``--attention-backend sdpa``, local layers' default on a GPU without Transformer
Engine; ``--attention-backend local`` puts our side on megatron-core's local attention, the CPU default) and run
with the same number of torch threads. Measured per side, each in a fresh process:

- steady-state tokens/s (image tokens included) and model TFLOP/s (the trainer's FLOP count, the same for both
  sides) over the iterations after ``--warmup``;
- time to first iteration: from starting the command to the end of the first optimizer step
  (ours: ``train/run.py`` -> torchrun -> ``train/pretrain_vlm.py``; HF: python start, imports, model load);
- the loss of every iteration: the two curves must agree (same model, data and optimizer), which shows that
  both loops do the same work; their largest difference is printed.
- the torch ops one iteration dispatches (the second, each side in one more process; ``--no-count-ops`` skips it),
  counted at torch's dispatcher (forward, backward and optimizer alike: on a GPU each is a kernel launch and host
  time), and where they come from: megatron-core's layers, schedule, DDP and optimizer, megatron-vlm, HF's model,
  torch's autograd engine (the backward of torch's own ops) and optimizer. Target: ours <= 1.5x HF's.

Target: ours / HF tokens/s >= 0.8 at TP=1, in each precision (``--precisions fp32,bf16``: ours in megatron's
bf16 mixed precision, HF under bf16 autocast). Rows: HF loop, ours at TP=1, ours at DP=2 (``--dp 2``, the default:
2 processes with half the threads each), ours at TP=2 with ``--tp 2``.

  python bench/train.py [--iters 12 --warmup 4 --hidden 512 --layers 4 --image-size 224 --mbs 8 --gbs 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---- set-up: model, data, converted checkpoint ---------------------------------------------------------
def build_inputs(a, work: Path, run_command=subprocess.run) -> tuple[Path, Path, Path]:
    """HF LLaVA dir, prepared energon dataset, Megatron checkpoint (TP=1)."""
    from megatron_vlm.convert.build import build_llava
    from megatron_vlm.data.make_wds import make_wds
    from megatron_vlm.data.synthetic import COLOURS, write_image, write_jsonl
    from tests.support.tiny import make_text_model, make_vision_model

    texts = ["what colour is the square ? " + " ".join(COLOURS)] * 4
    text = make_text_model(work / "parts" / "text", "llama", texts=texts, hidden_size=a.hidden,
                           intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
                           num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 128))
    vision = make_vision_model(work / "parts" / "vision", "clip", image_size=a.image_size, patch_size=14,
                               hidden_size=a.vision_hidden, intermediate_size=a.vision_hidden * 4,
                               num_hidden_layers=a.vision_layers, num_attention_heads=a.vision_hidden // 64)
    hf = work / "hf"
    # vocab padded in HF already, so Megatron adds no rows of its own: both softmaxes cover the same logits
    build_llava(text, vision, hf, vocab_size_padding=128)
    names = list(COLOURS)
    rows = []
    for i in range(a.samples):
        write_image(work / "images" / f"{i:05d}.jpg", a.image_size, seed=i)
        rows.append({"id": i, "image": f"{i:05d}.jpg", "question": "what colour is the square ?",
                     "answer": names[i % len(names)]})
    write_jsonl(work / "qa.jsonl", rows)
    data = work / "data"
    make_wds("vqa", work / "qa.jsonl", data, image_root=work / "images", split="1,0,0", progress=False)
    meg = work / "megatron"
    run_command([sys.executable, "convert/hf_to_megatron.py", "--hf-dir", str(hf), "--megatron-dir", str(meg),
                 "--tp", "1"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return hf, data, meg


def thread_env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")


# ---- our side: the user-facing launcher --------------------------------------------------------------
def our_flags(a, work: Path, hf: Path, data: Path, meg: Path, name: str, tp: int, precision: str, iters: int) -> list:
    """The trainer's flags for our side (train/run.py's, which train/pretrain_vlm.py accepts as well)."""
    return ["--device", "cpu", "--tp", str(tp), "--stage", str(a.stage), "--precision", precision,
            "--megatron-load-dir", str(meg), "--tokenizer-load-dir", str(hf), "--data-path", str(data),
            "--save-dir", str(work / "runs"), "--name", name, "--no-save", "--train-iters", str(iters),
            "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.gbs), "--lr", str(a.lr),
            "--seq-length", str(a.seq_length), "--num-workers", str(a.num_workers), "--seed", str(a.seed),
            "--log-interval", str(iters), "--attention-backend", a.attention_backend]


def run_ours(a, work: Path, hf: Path, data: Path, meg: Path, tp: int, precision: str = "fp32", dp: int = 1) -> dict:
    name = f"ours_tp{tp}_dp{dp}_{precision}"
    procs = tp * dp
    cmd = [sys.executable, "train/run.py", "-g", str(procs)] + our_flags(a, work, hf, data, meg, name, tp, precision,
                                                                         a.iters)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=thread_env(max(1, a.threads // procs)), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL if not a.verbose else None)
    rows = [json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return summarize(rows, t0, a.warmup, step_flops(a, hf))


# ---- the reference: a plain PyTorch loop on the HF model ---------------------------------------------
def hf_batch(b, image_token_id: int, tokens_per_image: int, pad_id: int) -> dict:
    """An unexpanded ``VLMBatch`` (one image token per image) -> HF LLaVA inputs: each image token repeated
    ``tokens_per_image`` times (as the HF processor writes it), labels -100 off the loss mask, right padding."""
    import torch

    ids, labels = [], []
    for row_t, row_l, row_m in zip(b.tokens.tolist(), b.labels.tolist(), b.loss_mask.tolist()):
        t_out, l_out = [], []
        for t, lab, m in zip(row_t, row_l, row_m):
            n = tokens_per_image if t == image_token_id else 1
            t_out += [t] * n
            l_out += [-100] * (n - 1) + [lab if m > 0 else -100]
        ids.append(t_out)
        labels.append(l_out)
    width = max(len(r) for r in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.int64)
    lab = torch.full((len(ids), width), -100, dtype=torch.int64)
    for i, (t, l_) in enumerate(zip(ids, labels)):
        input_ids[i, : len(t)] = torch.tensor(t)
        lab[i, : len(l_)] = torch.tensor(l_)
    return {"input_ids": input_ids, "labels": lab, "pixel_values": b.images, "num_tokens": b.num_tokens}


def hf_worker(a) -> None:
    """Runs in its own process (``--hf-worker``): trains the HF model, writes one JSON line per iteration."""
    import torch
    import torch.nn.functional as F
    from transformers import LlavaForConditionalGeneration

    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.data.task_encoder import VLMTaskEncoder

    torch.set_num_threads(a.threads)
    model = LlavaForConditionalGeneration.from_pretrained(str(a.hf_dir), dtype=torch.float32).train()
    # bf16 as HF's Trainer runs it: fp32 weights and optimizer, matmuls under bf16 autocast
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16")
    train_lm, train_vit = a.stage == 2, False
    model.model.language_model.requires_grad_(train_lm)
    model.lm_head.requires_grad_(train_lm)
    model.model.vision_tower.requires_grad_(train_vit)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    warmup = int(0.03 * a.iters)  # train/run.py's defaults: 3% linear warmup, cosine decay to 0

    def lr_factor(step):
        if step < warmup:
            return step / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, a.iters - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    enc = VLMTaskEncoder(a.hf_dir, a.seq_length)
    loader = build_train_loader(a.data_dir, enc, a.mbs, 0, 1, a.num_workers, a.seed)
    data = iter(loader)
    accum = a.gbs // a.mbs
    out = open(a.hf_out, "w")
    for it in range(1, a.iters + 1):
        batches = [hf_batch(next(data), enc.image_token_id, enc.tokens_per_image, enc.pad_token_id)
                   for _ in range(accum)]
        n_loss = sum(int((b["labels"] != -100).sum()) for b in batches)
        counter = op_counter() if a.ops_out and it == 2 else contextlib.nullcontext()
        counter.__enter__()
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for b in batches:
            with autocast:
                logits = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), ignore_index=-100,
                                   reduction="sum")
            (loss / n_loss).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        counter.__exit__(None, None, None)
        if a.ops_out and it == 2:
            Path(a.ops_out).write_text(json.dumps(counter.counts))
        out.write(json.dumps({"iteration": it, "loss": loss_sum / n_loss, "samples": a.gbs,
                              "tokens": sum(b["num_tokens"] for b in batches),
                              "images": sum(b["pixel_values"].shape[0] for b in batches), "time": time.time()}) + "\n")
        out.flush()
    out.close()
    os._exit(0)  # energon's loader workers take seconds to shut down; nothing is left to flush


def run_hf(a, work: Path, hf: Path, data: Path, precision: str = "fp32") -> dict:
    out = work / f"hf_loop_{precision}.jsonl"
    cmd = [sys.executable, __file__, "--hf-worker", "--hf-dir", str(hf), "--data-dir", str(data), "--hf-out", str(out),
           "--precision", precision]
    cmd += [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("iters", "stage", "mbs", "gbs", "lr", "seq_length",
                                                                   "num_workers", "seed", "threads")]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=thread_env(a.threads),
                   stderr=None if a.verbose else subprocess.DEVNULL)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return summarize(rows, t0, a.warmup, step_flops(a, hf))


# ---- torch ops dispatched per iteration ------------------------------------------------------------------
#: (path fragment, where an op comes from), the first match of the innermost frame outside torch that names one
_SOURCES = (("megatron/core/optimizer", "optimizer (megatron-core)"),
            ("megatron/core/distributed", "DDP (megatron-core)"),
            ("megatron/core/pipeline_parallel", "schedule (megatron-core)"),
            ("megatron/core/", "layers (megatron-core)"), ("megatron_vlm/", "megatron-vlm"),
            ("transformers/", "model (HF transformers)"), ("bench/train.py", "training loop"))


def op_source(frame) -> str:
    """Where the op dispatched under ``frame`` comes from: the autograd engine (the backward of torch's own ops),
    torch's optimizers and gradient clipping, or the innermost frame outside torch (and outside the CPU layer's
    device mode, which forwards every call) that :data:`_SOURCES` names."""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if path.endswith("megatron_vlm/runtime/cpu_compat.py"):
            pass
        elif "/torch/" in path:
            if path.endswith("torch/autograd/graph.py") and frame.f_code.co_name == "_engine_run_backward":
                return "autograd engine (backward of torch ops)"
            if "/torch/optim/" in path:
                return "optimizer (torch)"
            if path.endswith("torch/nn/utils/clip_grad.py"):
                return "gradient clipping (torch)"
        else:
            for fragment, source in _SOURCES:
                if fragment in path:
                    return source
        frame = frame.f_back
    return "other"


def op_counter():
    """A ``TorchDispatchMode`` that counts the aten ops dispatched while it is active (forward, backward and
    optimizer alike: each would be a kernel launch on a GPU), by :func:`op_source`: ``.counts`` (source -> ops)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[op_source(sys._getframe(1))] += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


def count_our_ops(a) -> None:
    """Runs in its own process (``--ours-ops-worker``): our trainer in this process (train/pretrain_vlm.py's main,
    one rank), counting the ops of its second step (the first makes megatron-core's lazy state)."""
    import torch

    from megatron_vlm.training import step

    torch.set_num_threads(a.threads)
    original, seen, counts = step.train_step, [], {}

    def counted(*args, **kwargs):
        seen.append(1)
        if len(seen) != 2:
            return original(*args, **kwargs)
        with op_counter() as c:
            out = original(*args, **kwargs)
        counts.update(c.counts)
        return out

    step.train_step = counted
    sys.path.insert(0, str(ROOT / "train"))
    import pretrain_vlm

    pretrain_vlm.main(a.ours_flags)
    Path(a.ops_out).write_text(json.dumps(counts))
    os._exit(0)


def count_ops(a, work: Path, hf: Path, data: Path, meg: Path, precision: str) -> dict:
    """{side: {source: ops}} of one iteration (the second) of each side, each counted in its own process."""
    out = {}
    for side in ("hf", "ours"):
        path = work / f"ops_{side}_{precision}.json"
        if side == "hf":
            cmd = [sys.executable, __file__, "--hf-worker", "--hf-dir", str(hf), "--data-dir", str(data),
                   "--hf-out", str(work / "hf_ops.jsonl"), "--precision", precision, "--ops-out", str(path),
                   "--iters=2"] + [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in (
                       "stage", "mbs", "gbs", "lr", "seq_length", "num_workers", "seed", "threads")]
        else:
            flags = our_flags(a, work, hf, data, meg, f"ops_{precision}", 1, precision, 2)
            cmd = [sys.executable, __file__, "--ours-ops-worker", "--ops-out", str(path), f"--threads={a.threads}",
                   "--ours-flags", *flags]
        subprocess.run(cmd, check=True, cwd=ROOT, env=thread_env(a.threads), stdout=subprocess.DEVNULL,
                       stderr=None if a.verbose else subprocess.DEVNULL)
        out[side] = json.loads(path.read_text())
    return out


# ---- numbers ---------------------------------------------------------------------------------------------
def step_flops(a, hf: Path):
    """Model FLOPs of an iteration (the trainer's own count, ``megatron_vlm.training.flops``), for both sides."""
    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.training.flops import StepFlops

    return StepFlops(VLMSpec.from_hf_dir(hf), train_vit=False, train_projector=True, train_lm=a.stage == 2)


def summarize(rows: list[dict], t0: float, warmup: int, flops) -> dict:
    """tokens/s, samples/s and model TFLOP/s over iterations after ``warmup`` (timed from the end of iteration
    ``warmup``)."""
    if len(rows) <= warmup:
        raise SystemExit(f"only {len(rows)} iterations recorded; need more than --warmup {warmup}")
    steady = rows[warmup:]
    dt = steady[-1]["time"] - rows[warmup - 1]["time"] if warmup else steady[-1]["time"] - t0
    return {
        "tflops": sum(flops(r["samples"], r["tokens"], r["images"]) for r in steady) / dt / 1e12,
        "tokens_per_s": sum(r["tokens"] for r in steady) / dt,
        "samples_per_s": sum(r["samples"] for r in steady) / dt,
        "s_per_iter": dt / len(steady),
        "first_iter_s": rows[0]["time"] - t0,
        "losses": [r["loss"] for r in rows],
        "tokens_per_iter": sum(r["tokens"] for r in rows) / len(rows),
    }


HF_ROW = "HF transformers, plain PyTorch loop"
OURS_ROW = "megatron-vlm train/run.py, TP=1"


def run_all(a, work: Path, hf: Path, data: Path, meg: Path, precision: str) -> dict:
    results = {HF_ROW: run_hf(a, work, hf, data, precision), OURS_ROW: run_ours(a, work, hf, data, meg, 1, precision)}
    if a.tp == 2:
        results["megatron-vlm train/run.py, TP=2 (2 processes)"] = run_ours(a, work, hf, data, meg, 2, precision)
    if a.dp == 2:
        results["megatron-vlm train/run.py, DP=2 (2 processes)"] = run_ours(a, work, hf, data, meg, 1, precision, 2)
    return results


def report(a, precision: str, results: dict) -> None:
    ref = results[HF_ROW]
    print(f"\n{precision}: {a.iters} iterations per side, tokens/s over the last {a.iters - a.warmup} "
          f"(~{ref['tokens_per_iter']:.0f} tokens per iteration, image tokens included)")
    print(f"{'':48s} {'tokens/s':>9s} {'samples/s':>9s} {'s/iter':>7s} {'TFLOP/s':>8s} {'x HF':>6s} "
          f"{'first iter':>10s}")
    for name, r in results.items():
        print(f"{name:48s} {r['tokens_per_s']:9.0f} {r['samples_per_s']:9.2f} {r['s_per_iter']:7.2f} "
              f"{r['tflops']:8.3f} {r['tokens_per_s'] / ref['tokens_per_s']:6.2f} {r['first_iter_s']:9.1f}s")
    ours = results[OURS_ROW]
    diff = max(abs(x - y) for x, y in zip(ours["losses"], ref["losses"]))
    print(f"ratio ours/HF at TP=1 ({precision}): {ours['tokens_per_s'] / ref['tokens_per_s']:.2f} (target >= 0.8)")
    print(f"loss curves: ours {ours['losses'][0]:.4f} -> {ours['losses'][-1]:.4f}, HF {ref['losses'][0]:.4f} -> "
          f"{ref['losses'][-1]:.4f}; largest per-iteration difference {diff:.2e}"
          + (" (same work on both sides)" if precision == "fp32" else " (bf16 rounding differs between the sides)"),
          flush=True)


def report_ops(precision: str, ops: dict) -> None:
    """Ops per iteration of each side, and where they come from (:func:`op_source`)."""
    hf, ours = sum(ops["hf"].values()), sum(ops["ours"].values())
    print(f"torch ops dispatched in one iteration ({precision}; the second): HF {hf}, ours {ours}: {ours / hf:.2f}x "
          "HF (target <= 1.5)")
    for side in ("hf", "ours"):
        rows = sorted(ops[side].items(), key=lambda kv: -kv[1])
        print(f"  {'HF' if side == 'hf' else 'ours':4s} " + ", ".join(f"{k} {v}" for k, v in rows), flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=12, help="optimizer steps per side")
    p.add_argument("--warmup", type=int, default=4, help="first iterations left out of the tokens/s")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2), help="1: projector trains; 2: LM + projector")
    p.add_argument("--hidden", type=int, default=512, help="LM hidden size (head dim 64)")
    p.add_argument("--layers", type=int, default=4, help="LM layers")
    p.add_argument("--vision-hidden", type=int, default=384, help="ViT hidden size (head dim 64)")
    p.add_argument("--vision-layers", type=int, default=4, help="ViT layers")
    p.add_argument("--image-size", type=int, default=224, help="image side (patch 14: (side/14)^2 image tokens)")
    p.add_argument("--mbs", type=int, default=8, help="micro batch size")
    p.add_argument("--gbs", type=int, default=16, help="global batch size (gradient accumulation gbs/mbs)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--samples", type=int, default=256, help="images in the generated dataset")
    p.add_argument("--num-workers", type=int, default=1, help="data-loader workers per side")
    p.add_argument("--attention-backend", default="sdpa", choices=("sdpa", "local"),
                   help="our side's core attention: sdpa (default: the kernel HF's loop runs, and local layers' "
                   "default on CUDA) or local (megatron-core's full score matrix, local layers' default on CPU)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per side (TP=1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tp", type=int, default=1, choices=(1, 2), help="2: also time our step at TP=2")
    p.add_argument("--dp", type=int, default=2, choices=(1, 2), help="2: also time our step at DP=2 (2 processes, "
                   "half the threads each; the global batch is split over them)")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32 and/or bf16 (both sides run "
                   "in it: ours with megatron's Float16Module + fp32 main params, HF under bf16 autocast)")
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)  # the HF worker's
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--verbose", action="store_true", help="show the training processes' logs")
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--hf-out", help=argparse.SUPPRESS)
    p.add_argument("--no-count-ops", dest="count_ops", action="store_false", help="skip counting the torch ops "
                   "of one iteration of each side (two more processes per precision, ~10 s each)")
    p.add_argument("--ours-ops-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ops-out", help=argparse.SUPPRESS)
    p.add_argument("--ours-flags", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.hf_worker:
        hf_worker(a)
        return 0
    if a.ours_ops_worker:
        count_our_ops(a)
        return 0
    if a.gbs % a.mbs:
        raise SystemExit(f"--gbs {a.gbs} must be a multiple of --mbs {a.mbs}")
    import logging

    logging.disable(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="bench_train_", dir=a.work_dir))
    try:
        t = time.perf_counter()
        hf, data, meg = build_inputs(a, work)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(hf))
        import torch
        from transformers import LlavaForConditionalGeneration

        with torch.device("meta"):
            n_params = sum(p.numel() for p in LlavaForConditionalGeneration(cfg).parameters())
        print(f"set-up (models, {a.samples}-image dataset, conversion) {time.perf_counter() - t:.1f} s; "
              f"LLaVA of {n_params / 1e6:.1f}M parameters (LM hidden {a.hidden} x {a.layers} layers, ViT "
              f"{a.vision_hidden} x {a.vision_layers} at {a.image_size}px), stage {a.stage}, micro batch {a.mbs}, "
              f"global batch {a.gbs}, attention: HF sdpa, ours {a.attention_backend}, {a.threads} torch threads, "
              f"{os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        for precision in a.precisions.split(","):
            report(a, precision, run_all(a, work, hf, data, meg, precision))
            if a.count_ops:
                report_ops(precision, count_ops(a, work, hf, data, meg, precision))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
