"""The user's commands on a small colour-question dataset, as the end-to-end tests of a model family run them.

- :func:`colour_dataset`: 16 images of four sizes in turn (or some videos among them), each asked "what colour is
  it ?", written as LLaVA json and
  made into an energon dataset by ``data_prep/make_wds.py`` (two shards, all in the train split) and counted by
  ``data_prep/stats.py`` with the model's tokenizer; returns the dataset directory and its train split's counts;
- :func:`train_losses`: ``train/run.py`` in a fresh process (the CPU trainer, ``-g 2``, four iterations logged each
  step) with the run's own flags, returning the losses of its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLOURS = ("red", "green", "blue", "yellow")
QUESTION = "what colour is it ?"
#: :func:`colour_dataset`'s clip (frames, width, height, fps)
VIDEO = (8, 48, 32, 4)


def colour_dataset(root: Path, sizes: list[tuple[int, int]], tokenizer_dir, seq_length: int = 96,
                   videos: int = 0) -> tuple[Path, dict]:
    """(dataset dir, its train split's ``stats.json`` counts) of 16 samples, image ``i`` of size ``sizes[i % 4]``
    under ``root/img``; with ``videos``, every ``16 // videos``-th sample is instead a LLaVA-NeXT video record of
    ``root/img/i.mp4`` (:data:`VIDEO`: 8 frames of 48 x 32 at 4 fps)."""
    from PIL import Image

    from megatron_vlm.cli import run_cli
    from megatron_vlm.data.synthetic import image_array
    from tests.conftest import script
    from tests.support.videos import make_video

    (root / "img").mkdir()
    rows = []
    for i in range(16):
        if videos and i % (16 // videos) == 16 // videos - 1:
            (root / "img" / f"{i}.mp4").write_bytes(make_video(*VIDEO))
            media = {"video": f"{i}.mp4"}
        else:
            Image.fromarray(image_array(sizes[i % 4], i)).save(root / "img" / f"{i}.png")
            media = {"image": f"{i}.png"}
        rows.append({"id": str(i), **media, "conversations": [
            {"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": COLOURS[i % 4]}]})
    (root / "data.json").write_text(json.dumps(rows))
    data = root / "wds"
    assert run_cli(script("data_prep/make_wds.py").main, [
        "--format", "llava", "--input", str(root / "data.json"), "--image-root", str(root / "img"), "--output",
        str(data), "--shard-size", "8", "--split", "1,0,0", "--no-progress"]) == 0
    assert run_cli(script("data_prep/stats.py").main, [str(data), "--tokenizer", str(tokenizer_dir), "--seq-length",
                                                       str(seq_length)]) == 0
    return data, json.loads((data / "stats.json").read_text())["datasets"][str(data)]["train"]


def train_losses(megatron_dir, tokenizer_dir, data, runs: Path, name: str, *flags: str) -> list[float]:
    """The logged losses of ``train/run.py`` on ``data`` from ``megatron_dir`` (CPU, two ranks, four iterations, one
    loader worker, lr 5e-3), with ``flags`` (parallelism, precision, batch sizes, packing) added."""
    from tests.conftest import ROOT
    from tests.support import forked_cli

    argv = ["--device", "cpu", "-g", "2", "--stage", "2", "--megatron-load-dir", str(megatron_dir),
            "--tokenizer-load-dir", str(tokenizer_dir), "--data-path", str(data), "--save-dir", str(runs), "--name",
            name, "--train-iters", "4", "--log-interval", "1", "--num-workers", "1", "--lr", "5e-3", *flags]
    p = forked_cli.run([sys.executable, "train/run.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    steps = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in steps if "loss" in r]
