"""LLaVA-OneVision through the user's commands: make_wds -> hf_to_megatron -> train/run.py -> megatron_to_hf.

A tiny OneVision (Qwen2 + SigLIP, anyres tiles, anyres_max_2) trains on a make_wds VQA set whose images keep
their original sizes (square, tall, wide, large enough to be downsampled, smaller than a tile):
- stage 1 at DP=2 with the distributed optimizer in bf16 (the projector and image_newline train, as LLaVA-NeXT
  trains them; the LM and the ViT stay bit-identical in the export; the loss falls);
- stage 2 from stage 1's checkpoint at PP=2 in bf16, 8 iterations; the same run resumed from its iteration-4
  checkpoint gives bit-identical losses and grad norms at iterations 5-8 and identical final weights;
- the stage-2 checkpoint exports to ``LlavaOnevisionForConditionalGeneration``: its fp32 logits equal the
  checkpoint's (four image sizes in one batch), and HF ``generate`` runs.
tests/test_anyres_models.py asserts the numbers (logits at TP/PP, equal losses across layouts) in one world.
"""

import json
import shutil
import sys

import pytest
import torch

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import load_hf_model, reference_batch, verify_checkpoint
from megatron_vlm.model.spec import VLMSpec
from tests.support import forked_cli

from .conftest import ROOT
from .train_helpers import falls, losses, run

pytestmark = pytest.mark.slow

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
# (width, height) at 20-px tiles, grids up to 3 x 3: one tile, tall, wide, downsampled (anyres_max_2), small
SIZES = [(20, 20), (24, 50), (61, 33), (60, 60), (15, 9)]
STAGE2 = ("--pp", "2", "--stage", "2", "--precision", "bf16", "--global-batch-size", "4", "--save-interval", "4",
          "--deterministic")


@pytest.fixture(scope="module")
def ov(tmp_path_factory):
    """The tiny OneVision, converted at TP=2, and a make_wds VQA set of coloured images of five sizes."""
    from PIL import Image

    from tests.support.tiny import make_tiny_onevision

    root = tmp_path_factory.mktemp("anyres_cli")
    hf = make_tiny_onevision(root / "hf")
    (root / "img").mkdir()
    rows = []
    for i in range(60):
        c = list(COLOURS)[i % 4]
        Image.new("RGB", SIZES[i % len(SIZES)], COLOURS[c]).save(root / "img" / f"{i}.png")
        rows.append({"image": f"{i}.png", "question": "what colour is the shape ?", "answer": c, "id": str(i)})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    forked_cli.run([sys.executable, "data_prep/make_wds.py", "--format", "vqa", "--input", str(root / "qa.jsonl"),
                    "--image-root", str(root / "img"), "--output", str(root / "data"), "--shard-size", "20",
                    "--no-progress"], check=True, cwd=ROOT, capture_output=True)
    meg = convert_hf_to_megatron(hf, root / "meg", tp=2)
    return {"root": root, "hf": hf, "meg": meg, "data": root / "data", "ckpt": root / "ckpt"}


def args(s, name, load, *extra, iters=8, lr="5e-3"):
    return ["--device", "cpu", "-g", "2", "--megatron-load-dir", str(load), "--tokenizer-load-dir", str(s["hf"]),
            "--data-path", str(s["data"]), "--save-dir", str(s["ckpt"]), "--name", name, "--micro-batch-size", "2",
            "--seq-length", "128", "--log-interval", "2", "--num-workers", "1", "--train-iters", str(iters),
            "--lr", lr, *extra]


@pytest.fixture(scope="module")
def stage1(ov):
    out = run(args(ov, "stage1", ov["meg"], "--tp", "1", "--stage", "1", "--dist-optim", "--precision", "bf16",
                   "--global-batch-size", "4", iters=12, lr="5e-2"))
    assert "dp=2" in out, out[-3000:]
    return ov["ckpt"] / "stage1"


@pytest.fixture(scope="module")
def stage2(ov, stage1):
    out = run(args(ov, "stage2", stage1, *STAGE2))
    assert "pp=2" in out, out[-3000:]
    return ov["ckpt"] / "stage2"


def test_stage1_dp2_bf16_trains_only_the_projector_and_image_newline(ov, stage1, tmp_path):
    falls(losses(stage1), factor=0.995)  # only the projector and image_newline learn, under a frozen random LM
    out = convert_megatron_to_hf(stage1, tmp_path / "hf")
    a, b = HFReader(ov["hf"]), HFReader(out)
    assert a.names() == b.names()
    for n in a.names():
        # bf16 training keeps the model's weights in bf16: a frozen fp32 weight comes back rounded to bf16
        same = torch.equal(a.get(n).to(torch.bfloat16).to(b.get(n).dtype), b.get(n))
        trains = n.startswith("multi_modal_projector.") or n == "image_newline"
        assert same != trains, f"{n}: {'not trained' if same else 'frozen but changed'}"


def test_stage2_pp2_resume_is_exact_and_exports_to_hf_that_generates(ov, stage1, stage2, tmp_path):
    full = losses(stage2)
    assert sorted(full) == list(range(1, 9))
    falls(full, factor=0.9)

    part = ov["ckpt"] / "part"
    shutil.copytree(stage2, part, ignore=shutil.ignore_patterns("iter_0000008", "tensorboard", "wandb"))
    (part / "latest_checkpointed_iteration.txt").write_text("4")
    (part / "metrics.jsonl").unlink()
    out = run(args(ov, "part", stage1, *STAGE2))
    assert "at iteration 4" in out, out[-3000:]
    resumed = losses(part)
    assert sorted(resumed) == [5, 6, 7, 8]
    for key in ("loss", "grad_norm"):
        assert [resumed[i][key] for i in resumed] == [full[i][key] for i in resumed], key

    a = convert_megatron_to_hf(stage2, tmp_path / "full_hf", tokenizer_dir=ov["hf"])
    b = convert_megatron_to_hf(part, tmp_path / "part_hf", tokenizer_dir=ov["hf"])
    ra, rb = HFReader(a), HFReader(b)
    assert ra.names() == rb.names() and all(torch.equal(ra.get(n), rb.get(n)) for n in ra.names())
    orig = HFReader(ov["hf"])
    assert not torch.equal(orig.get("image_newline"), ra.get("image_newline").to(orig.get("image_newline").dtype))

    assert verify_checkpoint(a, stage2, tp=1, pp=2) < 1e-4  # fp32 logits on images of four sizes in one batch
    model = load_hf_model(a)
    assert type(model).__name__ == "LlavaOnevisionForConditionalGeneration"
    inputs = reference_batch(VLMSpec.from_hf_dir(a)).hf_sample(0)
    gen = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert inputs["input_ids"].shape[1] < gen.shape[1] <= inputs["input_ids"].shape[1] + 3
