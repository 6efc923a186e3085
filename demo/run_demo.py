#!/usr/bin/env python
"""megatron-vlm end-to-end demo on an embedded default (no downloads, CPU only).

1. builds a tiny Llama-style LM (with a BPE tokenizer trained on the demo's own text) and a tiny CLIP from
   configs, and runs convert/build_llava.py on them;
2. generates a coloured-shapes VQA dataset (colour, shape, position, count questions) and runs
   data_prep/make_wds.py on the training part (the held-out part is never trained on);
3. convert/hf_to_megatron.py --tp 2, then train/run.py --device cpu -g 2 --tp 2: stage 1 (projector), then
   stage 2 from stage 1's checkpoint (vision encoder unfrozen, since it starts random), which answers held-out
   images every ``--eval-generate-interval`` iterations with the model being trained (the accuracy in its log);
4. convert/megatron_to_hf.py on the last checkpoint, then eval/evaluate.py (HF ``generate``) on the held-out images:
   exact-match accuracy per question type next to the majority-answer baseline, the in-loop accuracy of the last
   iteration beside the export's on the same samples (they are equal), a loss and accuracy curve PNG and example
   images.
Every step is the user-facing command, printed before it runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demo"))

import shapes  # noqa: E402

#: tokens generated per held-out answer (every demo answer is one word)
MAX_NEW_TOKENS = 10


#: How each command runs: ``subprocess.run``; the test passes tests.support.forked_cli.run (main's
#: ``run_command``), which runs the same command as its own process without importing torch again.
_run_command = subprocess.run


def run(cmd: list[str]) -> None:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    t = time.time()
    _run_command(cmd, check=True, cwd=ROOT)
    print(f"  [{time.time() - t:.1f} s]", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "demo_out"), help="output directory (replaced)")
    p.add_argument("--train-samples", type=int, default=3000, help="training images")
    p.add_argument("--eval-samples", type=int, default=400, help="held-out images (never trained on)")
    p.add_argument("--image-size", type=int, default=48, help="image side in pixels (patch 8)")
    p.add_argument("--stage1-iters", type=int, default=40, help="stage 1 iterations (projector only)")
    p.add_argument("--stage2-iters", type=int, default=400, help="stage 2 iterations (everything trains)")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--stage1-lr", type=float, default=2e-3)
    p.add_argument("--stage2-lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=128, help="LM hidden size")
    p.add_argument("--layers", type=int, default=2, help="LM layers")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel size (2 processes)")
    p.add_argument("--eval-generate-interval", type=int, default=100,
                   help="stage 2 answers held-out images every N iterations (and at its last)")
    p.add_argument("--eval-generate-samples", type=int, default=100, help="held-out images answered each time")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_models(a, out: Path) -> Path:
    from tests.support.tiny import make_text_model, make_vision_model

    text = make_text_model(out / "parts" / "text", "llama", texts=shapes.corpus(), hidden_size=a.hidden,
                           intermediate_size=a.hidden * 2, num_hidden_layers=a.layers, num_attention_heads=4,
                           num_key_value_heads=2)
    vision = make_vision_model(out / "parts" / "vision", "clip", image_size=a.image_size, patch_size=8,
                               hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
    run([sys.executable, "convert/build_llava.py", "--text-model", str(text), "--vision-model", str(vision),
         "--save-dir", str(out / "hf")])
    return out / "hf"


def train_args(a, out: Path, name: str, load: Path, stage: int, iters: int, lr: float) -> list[str]:
    return [sys.executable, "train/run.py", "--device", "cpu", "-g", "2", "--tp", str(a.tp), "--stage", str(stage),
            "--megatron-load-dir", str(load), "--tokenizer-load-dir", str(out / "hf"),
            "--data-path", str(out / "data"), "--save-dir", str(out / "runs"), "--name", name,
            "--train-iters", str(iters), "--global-batch-size", str(a.global_batch_size),
            "--micro-batch-size", str(a.micro_batch_size), "--lr", str(lr), "--seq-length", "128",
            "--log-interval", "10", "--save-interval", str(iters), "--num-workers", "1", "--seed", str(a.seed)]


def evaluate(out: Path, manifest: Path) -> tuple[dict, list[dict]]:
    """eval/evaluate.py on the export; its rows joined to the manifest (make_wds keys a record by its input index)."""
    preds = out / "eval" / "predictions.jsonl"
    run([sys.executable, "eval/evaluate.py", "--model", str(out / "hf_final"), "--data-path", str(out / "heldout"),
         "--split", "val", "--output", str(preds), "--max-new-tokens", str(MAX_NEW_TOKENS), "--device", "cpu",
         "--no-progress"])
    source = [json.loads(x) for x in manifest.read_text().splitlines()]
    rows = []
    for p in (json.loads(x) for x in preds.read_text().splitlines()):
        r = dict(source[int(p["id"])])
        r.update(prediction=p["prediction"], correct=p["correct"])
        rows.append(r)
    acc = {}
    for t in shapes.QUESTIONS:
        sel = [r for r in rows if r["type"] == t]
        acc[t] = sum(r["correct"] for r in sel) / max(len(sel), 1)
    acc["overall"] = sum(r["correct"] for r in rows) / max(len(rows), 1)
    return acc, rows


def in_loop(out: Path) -> dict:
    """Stage 2's held-out accuracy at its last answering (metrics.jsonl)."""
    records = [json.loads(x) for x in (out / "runs" / "stage2" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_exact" in r][-1]
    return {"iteration": last["iteration"], "exact": last["eval_exact"], "samples": last["eval_samples"]}


def plot(out: Path, rows: list[dict], image_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0
    for stage in ("stage1", "stage2"):
        records = [json.loads(x) for x in (out / "runs" / stage / "metrics.jsonl").read_text().splitlines()]
        pts = {p["iteration"]: p["loss"] for p in records if "loss" in p and not p["skipped"]}
        its = sorted(pts)
        ax.plot([offset + i for i in its], [pts[i] for i in its], label=stage)
        scored = {p["iteration"]: p["eval_exact"] for p in records if "eval_exact" in p}
        if scored:
            acc.plot([offset + i for i in sorted(scored)], [100 * scored[i] for i in sorted(scored)], "o-",
                     label=f"{stage}, answered during training")
        offset += its[-1] if its else 0
    ax.set_xlabel("iteration (stage 2 continues after stage 1)")
    ax.set_ylabel("training loss (assistant tokens)")
    ax.set_yscale("log")
    ax.legend()
    acc.set_xlabel("iteration")
    acc.set_ylabel("held-out accuracy, exact match (%)")
    acc.set_ylim(0, 100)
    acc.legend()
    fig.tight_layout()
    fig.savefig(out / "eval" / "loss_curve.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(2, 4, figsize=(10, 5.5))
    for ax, r in zip(axes.flat, rows[:8]):
        ax.imshow(Image.open(image_dir / r["image"]))
        ok = "ok" if r["correct"] else "WRONG"
        ax.set_title(f"{r['question']}\nanswer: {r['answer']} | pred: {r['prediction']} ({ok})", fontsize=7)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / "eval" / "examples.png", dpi=100)
    plt.close(fig)


def main(argv=None, run_command=subprocess.run) -> dict:
    global _run_command
    _run_command = run_command
    a = parse(argv)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    print("== 1. tiny LM + CLIP from configs, then build_llava")
    build_models(a, out)
    print("\n== 2. synthetic shapes VQA data")
    train_manifest = shapes.write_split(out / "src" / "train", a.train_samples, a.seed, a.image_size)
    eval_manifest = shapes.write_split(out / "src" / "heldout", a.eval_samples, a.seed + 10_000, a.image_size)
    run([sys.executable, "data_prep/make_wds.py", "--format", "vqa", "--input", str(train_manifest),
         "--output", str(out / "data"), "--split", "1,0,0", "--shard-size", "500"])
    run([sys.executable, "data_prep/make_wds.py", "--format", "vqa", "--input", str(eval_manifest),
         "--output", str(out / "heldout"), "--split", "0,1,0", "--shard-size", "500"])
    print("\n== 3. convert to Megatron and train (stage 1, then stage 2)")
    run([sys.executable, "convert/hf_to_megatron.py", "--hf-dir", str(out / "hf"), "--megatron-dir",
         str(out / "megatron"), "--tp", str(a.tp)])
    run(train_args(a, out, "stage1", out / "megatron", 1, a.stage1_iters, a.stage1_lr))
    run(train_args(a, out, "stage2", out / "runs" / "stage1", 2, a.stage2_iters, a.stage2_lr) + [
        "--unfreeze-vit", "--eval-generate-data", str(out / "heldout"), "--eval-generate-interval",
        str(a.eval_generate_interval), "--eval-generate-samples", str(a.eval_generate_samples),
        "--eval-generate-max-new-tokens", str(MAX_NEW_TOKENS)])
    print("\n== 4. back to HF and evaluate on held-out images")
    run([sys.executable, "convert/megatron_to_hf.py", "--megatron-dir", str(out / "runs" / "stage2"), "--hf-dir",
         str(out / "hf_final")])
    (out / "eval").mkdir()
    acc, rows = evaluate(out, eval_manifest)
    base = shapes.majority_baseline(train_manifest, rows)
    plot(out, rows, eval_manifest.parent)
    live = in_loop(out)
    # the in-loop answers are the first K samples of the split, which eval/evaluate.py lists first
    live["export_exact"] = sum(r["correct"] for r in rows[:live["samples"]]) / live["samples"]
    result = {"accuracy": acc, "majority_baseline": base, "seconds": time.time() - t0, "eval_samples": len(rows),
              "in_loop": live}
    (out / "eval" / "results.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'question type':15s} {'accuracy':>9s} {'majority baseline':>18s}")
    for t in list(shapes.QUESTIONS) + ["overall"]:
        print(f"{t:15s} {acc[t]:9.1%} {base[t]:18.1%}")
    print(f"\nanswered during training at iteration {live['iteration']}: accuracy {live['exact']:.1%} on the first "
          f"{live['samples']} held-out images; eval/evaluate.py on the export of that iteration: "
          f"{live['export_exact']:.1%} on the same images")
    print(f"\ndemo finished in {result['seconds'] / 60:.1f} min; loss curve, examples and predictions in {out / 'eval'}")
    return result


if __name__ == "__main__":
    main()
