"""LLaVA-OneVision videos through the user's commands: make_wds -> stats.py -> train/run.py -> megatron_to_hf.

A tiny OneVision (Qwen2 + SigLIP) with its <video> token is converted and trained on a make_wds ``--format llava``
set that mixes LLaVA-NeXT video records (PyAV clips of several lengths and sizes), image records and text-only
records, so that micro batches mix all three:
- ``data_prep/stats.py`` counts the video tokens the trainer will see (frames chosen by --video-fps/--video-frames);
- ``train/run.py`` stage 2 in bf16 at TP=2 (-g 2): the loss falls; the run resumed from its
  iteration-4 checkpoint gives bit-identical losses and grad norms at iterations 5-8 and identical final weights;
- ``convert/megatron_to_hf.py`` exports it: ``LlavaOnevisionForConditionalGeneration`` whose fp32 logits equal the
  checkpoint's on a batch of images and videos (TP=2), and whose ``generate`` runs on a video's frames as the
  training data gives them (``pixel_values_videos``).
"""

import json
import shutil
import sys

import pytest
import torch

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import load_hf_model, verify_checkpoint
from tests.support import forked_cli

from .conftest import ROOT, script
from .train_helpers import falls, losses, run

pytestmark = pytest.mark.slow

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
# (frames, width, height, fps): 2 s at 10 fps (2 frames), 0.5 s (1), 4 s (4 frames, capped to 3), odd sizes
CLIPS = [(20, 32, 24, 10), (5, 33, 21, 10), (48, 40, 30, 12)]
FLAGS = ("--stage", "2", "--precision", "bf16", "--global-batch-size", "4", "--save-interval", "4",
         "--deterministic", "--video-frames", "3")


@pytest.fixture(scope="module")
def ov(tmp_path_factory):
    from PIL import Image

    from tests.support.tiny import make_tiny_onevision
    from tests.support.videos import make_video

    root = tmp_path_factory.mktemp("video_cli")
    hf = make_tiny_onevision(root / "hf")
    media = root / "media"
    media.mkdir()
    records = []
    for i in range(48):
        c = list(COLOURS)[i % 4]
        kind = ("video", "image", "text")[i % 3]
        turns = [{"from": "human", "value": "<image>\nwhat colour is it ?"}, {"from": "gpt", "value": c}]
        if kind == "video":
            n, w, h, fps = CLIPS[(i // 3) % len(CLIPS)]
            (media / f"{i}.mp4").write_bytes(make_video(n, w, h, fps, colour=COLOURS[c]))
            records.append({"id": str(i), "video": f"{i}.mp4", "conversations": turns})
        elif kind == "image":
            Image.new("RGB", (20 + i % 30, 20 + i % 17), COLOURS[c]).save(media / f"{i}.png")
            records.append({"id": str(i), "image": f"{i}.png", "conversations": turns})
        else:
            records.append({"id": str(i), "conversations": [{"from": "human", "value": f"say {c}"},
                                                            {"from": "gpt", "value": c}]})
    (root / "llava.json").write_text(json.dumps(records))
    forked_cli.run([sys.executable, "data_prep/make_wds.py", "--format", "llava", "--input", str(root / "llava.json"),
                    "--image-root", str(media), "--output", str(root / "data"), "--shard-size", "16",
                    "--split", "1,0,0", "--no-progress"], check=True, cwd=ROOT, capture_output=True)
    meg = convert_hf_to_megatron(hf, root / "meg", tp=2)
    return {"root": root, "hf": hf, "meg": meg, "data": root / "data", "ckpt": root / "ckpt", "media": media}


def args(s, name, *extra, iters=8):
    return ["--device", "cpu", "-g", "2", "--megatron-load-dir", str(s["meg"]), "--tokenizer-load-dir", str(s["hf"]),
            "--data-path", str(s["data"]), "--save-dir", str(s["ckpt"]), "--name", name, "--micro-batch-size", "2",
            "--seq-length", "128", "--log-interval", "2", "--num-workers", "1", "--train-iters", str(iters),
            "--lr", "5e-3", *FLAGS, *extra]


def test_make_wds_and_stats_count_the_videos(ov, tmp_path, capsys):
    summary = json.loads((ov["data"] / "make_wds.json").read_text())
    assert (summary["written"], summary["videos"], summary["rejected"]) == (48, 16, 0)
    rc = script("data_prep/stats.py").main([str(ov["data"]), "--tokenizer", str(ov["hf"]), "--seq-length", "128",
                                            "--video-frames", "3", "--output-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    got = json.loads((tmp_path / "stats.json").read_text())["datasets"][str(ov["data"])]["train"]
    # 16 videos: 6 of 20 frames at 10 fps (0, 10), 5 of 5 (0), 5 of 48 at 12 fps (0, 12, 24, 36 -> 0, 23, 47)
    assert (got["samples"], got["images"], got["videos"], got["video_frames"]) == (48, 16, 16, 6 * 2 + 5 + 5 * 3)
    assert got["video_tokens"] == 32 * 4 + 16  # 2x2 pooled features per frame (20-px tiles, patch 6), + 1 each
    assert "16 videos (144 video tokens)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tp2(ov):
    out = run(args(ov, "tp2", "--tp", "2"))
    assert "tp=2" in out, out[-3000:]
    return ov["ckpt"] / "tp2"


def test_stage2_bf16_tp2_loss_falls_and_resume_is_exact(ov, tp2):
    # PP=2 with videos is trained in tests/test_anyres_models.py's world (equal losses to TP=2), and anyres
    # training at PP=2 through train/run.py in tests/test_anyres_run.py: no third launch here
    full = losses(tp2)
    assert sorted(full) == list(range(1, 9))
    falls(full, factor=0.9)

    part = ov["ckpt"] / "part"
    shutil.copytree(tp2, part, ignore=shutil.ignore_patterns("iter_0000008", "tensorboard", "wandb"))
    (part / "latest_checkpointed_iteration.txt").write_text("4")
    (part / "metrics.jsonl").unlink()
    out = run(args(ov, "part", "--tp", "2"))
    assert "at iteration 4" in out, out[-3000:]
    resumed = losses(part)
    assert sorted(resumed) == [5, 6, 7, 8]
    for key in ("loss", "grad_norm"):
        assert [resumed[i][key] for i in resumed] == [full[i][key] for i in resumed], key
    assert all(full[i]["tokens"] > 0 for i in full)


def test_export_matches_the_checkpoint_and_generates_from_a_video(ov, tp2, tmp_path):
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.model.spec import VLMSpec

    out = tmp_path / "hf"
    forked_cli.run([sys.executable, "convert/megatron_to_hf.py", "--megatron-dir", str(tp2), "--hf-dir", str(out)],
                   check=True, cwd=ROOT, capture_output=True)
    assert (out / "video_preprocessor_config.json").read_bytes() == (ov["hf"] / "video_preprocessor_config.json"
                                                                     ).read_bytes()
    a, b = HFReader(ov["hf"]), HFReader(out)
    assert not torch.equal(a.get("image_newline"), b.get("image_newline").to(a.get("image_newline").dtype))
    assert verify_checkpoint(out, tp2, tp=2) < 1e-4  # fp32 logits; the reference batch holds videos

    spec = VLMSpec.from_hf_dir(out)
    enc = task_encoder_for(spec, out, 128, video_frames=3)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what colour is it ?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    s = enc.encode_conversation(messages, [], "gen", [(ov["media"] / "0.mp4").read_bytes()])  # frames 0, 10
    assert s["images"].shape == (2, 3, 20, 20) and s["num_image_tokens"].tolist() == [9]
    ids = enc.tokenizer(enc.chat.render(messages[:1], add_generation_prompt=True), add_special_tokens=False)
    ids = ids["input_ids"]
    v = ids.index(spec.video_token_id)
    prompt = ids[:v] + [spec.video_token_id] * 9 + ids[v + 1:]  # as HF's processor expands the video token
    model = load_hf_model(out)
    gen = model.generate(input_ids=torch.tensor([prompt]), pixel_values_videos=s["images"][None], max_new_tokens=3,
                         do_sample=False)
    assert len(prompt) < gen.shape[1] <= len(prompt) + 3
