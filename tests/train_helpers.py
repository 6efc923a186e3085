"""The `train/run.py` tests' shared parts: a coloured-square VQA dataset prepared with make_wds and the tiny LLaVA
converted at TP=2 (the module fixture ``setup``), the launcher's arguments, the launch itself (a forked command),
and the logged losses. Used by test_train, test_anyres_run, test_video_run and test_remote_storage; test modules do
not import each other."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from tests.support import forked_cli

from .conftest import ROOT

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


@pytest.fixture(scope="module")
def setup(hf_models, tmp_path_factory):
    """A coloured-square VQA dataset prepared with make_wds, and the tiny LLaVA converted at TP=2."""
    from PIL import Image

    root = tmp_path_factory.mktemp("train")
    (root / "img").mkdir()
    rows = []
    for i in range(96):
        c = list(COLOURS)[i % 4]
        Image.new("RGB", (32, 32), COLOURS[c]).save(root / "img" / f"{i}.jpg")
        rows.append({"image": f"{i}.jpg", "question": "what colour is the shape ?", "answer": c, "id": str(i)})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    forked_cli.run([sys.executable, "data_prep/make_wds.py", "--format", "vqa", "--input", str(root / "qa.jsonl"),
                    "--image-root", str(root / "img"), "--output", str(root / "data"), "--shard-size", "24",
                    "--no-progress"], check=True, cwd=ROOT, capture_output=True)
    meg = convert_hf_to_megatron(hf_models["llama_clip"], root / "meg", tp=2)
    return {"root": root, "hf": hf_models["llama_clip"], "meg": meg, "data": root / "data"}


def args(s, name, *extra, iters=16, lr="2e-3"):
    return ["--device", "cpu", "-g", "2", "--megatron-load-dir", str(s["meg"]), "--tokenizer-load-dir", str(s["hf"]),
            "--data-path", str(s["data"]), "--save-dir", str(s["root"] / "ckpt"), "--name", name,
            "--micro-batch-size", "4", "--seq-length", "64", "--log-interval", "4", "--num-workers", "1",
            "--train-iters", str(iters), "--lr", lr, *extra]


def launch(argv, env=None):
    return forked_cli.start([sys.executable, "train/run.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def run(argv, env=None):
    p = launch(argv, env)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-6000:]
    return out


def losses(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if "loss" in r}  # a resumed run re-logs iterations after its checkpoint


def val_losses(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["val_loss"] for r in rows if "val_loss" in r}


def falls(ls: dict, factor=0.8):
    its = sorted(i for i in ls if not ls[i]["skipped"])
    first = sum(ls[i]["loss"] for i in its[:3]) / 3
    last = sum(ls[i]["loss"] for i in its[-3:]) / 3
    assert last < factor * first, f"loss did not fall: first {first:.3f} last {last:.3f}"
