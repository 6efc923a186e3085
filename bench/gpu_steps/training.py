"""The ``train`` step of bench/gpu.py (and its ``fusions`` row): one training run through the real launcher
train/run.py (:func:`train_run`: its command, its log appended to :data:`TRAIN_LOG`, its summary; the MoE and VPP
steps start theirs with it too), the SIGTERM hand-off that lets a running child end its own workers first
(:func:`on_sigterm`), and the rows of local vs TE layers, each FP8 recipe vs TE bf16, fusions off and the packed run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT, curve_diff, mfu, run_command, train_bench
from .packing import packing_flags

#: the FP8 recipes ``--recipes`` trains with by default on CUDA
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


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
        res = run_command(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    text = log_path.read_bytes()[start:].decode(errors="replace")
    if res.returncode:
        lines = [ln for ln in text.splitlines() if "rror" in ln or "needs" in ln] or text.splitlines()[-3:]
        return {"name": name, "error": (lines[-1] if lines else f"exit {res.returncode}")[:300]}
    rows = [json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    tb = train_bench()
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


def on_sigterm(*_):
    """bench/gpu.py's SIGTERM handler: leave at once (exit 143), or, while a training child runs, once it has
    returned (:class:`_child_running`)."""
    if _CHILD["running"]:
        _CHILD["terminated"] = True
    else:
        sys.exit(143)


#: every fusion switched off, with Megatron-LM's flag names (the "fusions off" training row)
NO_FUSIONS = ("--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
              "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
              "--no-cross-entropy-loss-fusion")


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
