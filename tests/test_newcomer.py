"""A newcomer follows the README with realistic parts (issue 27): a Qwen2-Instruct-shaped LM (byte-level BPE with
ChatML specials and template, more embedding rows than tokens, built on the fly), a SigLIP vision encoder and
LLaVA json data, through the README's commands in order:

build_llava -> make_wds --format llava -> stats.py -> hf_to_megatron --tp 2 --verify -> train/run.py stage 1 ->
stage 2 from stage 1's run -> the same command again (finished: says so, starts nothing) -> a longer
--train-iters (refused without a scheduler flag; with --override-opt-param-scheduler it trains at the new
schedule's learning rates, not 0) -> megatron_to_hf of the run directory -> HF generate.

Each step checks what a newcomer would otherwise find broken later: the image token id the config, tokenizer,
checkpoints and export agree on; the LM's chat template kept; stats written beside the dataset; the embedding
rows of the LM kept; a stage-1 run trains only the projector.
"""

from __future__ import annotations

import json
import math
import sys
import time

import pytest

from tests.support import forked_cli

from .conftest import ROOT, script

pytestmark = [pytest.mark.slow, pytest.mark.one_lane(
    "3.11",
    reason="the README's commands in order on realistic parts; their conversion, training and export steps are "
           "held in both lanes by the modules named",
    covered_by=("test_convert", "test_train", "test_lm_families"))]


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def cli(capsys, rel, *args) -> str:
    from megatron_vlm.cli import run_cli

    rc = run_cli(script(rel).main, [str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    return out.out + out.err


def train(*args, timeout=600):
    p = forked_cli.run([sys.executable, "train/run.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def metrics(run_dir) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if "loss" in r}


def test_the_readme_path_with_a_qwen2_instruct_shaped_lm(tmp_path, capsys):
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from tests.support.tiny import make_text_model, make_vision_model

    # 0. the user's parts: an instruct LM with its own ChatML template and 384 rows for ~300 tokens, SigLIP
    lm = make_text_model(tmp_path / "qwen2-instruct", "qwen2", tokenizer="chatml", vocab_rows=384)
    vit = make_vision_model(tmp_path / "siglip", "siglip")
    lm_template = AutoTokenizer.from_pretrained(str(lm)).chat_template
    (tmp_path / "images").mkdir()
    records = []
    for i in range(24):
        c = list(COLOURS)[i % 4]
        Image.new("RGB", (40 + i, 32), COLOURS[c]).save(tmp_path / "images" / f"{i}.jpg")
        records.append({"id": str(i), "image": f"{i}.jpg", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is the shape?"}, {"from": "gpt", "value": c}]})
    (tmp_path / "llava.json").write_text(json.dumps(records))

    # 1. build: the LM's template is kept (taught image parts), its rows kept, <image> after its own specials
    hf = tmp_path / "llava-hf"
    cli(capsys, "convert/build_llava.py", "--text-model", lm, "--vision-model", vit, "--save-dir", hf)
    cfg = AutoConfig.from_pretrained(str(hf))
    tok = AutoTokenizer.from_pretrained(str(hf))
    image_id = tok.convert_tokens_to_ids("<image>")
    assert cfg.image_token_id == image_id > tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.text_config.vocab_size == 384
    assert lm_template in tok.chat_template
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                         "text": "hi"}]}],
                                       tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>") and rendered.count("<image>") == 1, rendered

    # 2. make_wds (LLaVA json) and stats (written into the dataset, paths printed)
    data = tmp_path / "data"
    cli(capsys, "data_prep/make_wds.py", "--format", "llava", "--input", tmp_path / "llava.json", "--image-root",
        tmp_path / "images", "--output", data, "--split", "1,0,0", "--no-progress")
    out = cli(capsys, "data_prep/stats.py", data, "--tokenizer", hf, "--seq-length", 256, "--no-progress")
    assert str(data / "stats.json") in out and (data / "metadataset.yaml").is_file()
    stats = json.loads((data / "stats.json").read_text())["total"]["train"]
    assert stats["samples"] == 24 and stats["image_tokens"] == 24 * cfg.image_seq_length

    # 3. HF -> Megatron at TP=2, verified
    meg = tmp_path / "llava-mcore"
    out = cli(capsys, "convert/hf_to_megatron.py", "--hf-dir", hf, "--megatron-dir", meg, "--tp", "2", "--verify")
    assert "verify: max |logit diff|" in out
    assert json.loads((meg / "release" / "vlm_spec.json").read_text())["image_token_id"] == image_id

    runs = tmp_path / "runs"
    common = ("--device", "cpu", "-g", "2", "--tokenizer-load-dir", hf, "--data-path", data, "--save-dir", runs,
              "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "256", "--log-interval", "1",
              "--num-workers", "1")
    # 4. stage 1 (projector only) at TP=2
    rc, log = train(*common, "--tp", "2", "--stage", "1", "--megatron-load-dir", meg, "--name", "stage1",
                    "--train-iters", "3", "--save-interval", "3")
    assert rc == 0, log[-4000:]
    assert "the chat template closes assistant turns with '<|im_end|>'" in log
    assert (runs / "stage1" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # stage 1 trained the projector alone: its export differs from the built model in the projector only
    import torch

    from megatron_vlm.convert.hf_io import HFReader

    cli(capsys, "convert/megatron_to_hf.py", "--megatron-dir", runs / "stage1", "--hf-dir", tmp_path / "stage1-hf")
    built, s1 = HFReader(hf), HFReader(tmp_path / "stage1-hf")
    assert built.names() == s1.names()
    changed = {n for n in built.names() if not torch.equal(built.get(n).to(s1.get(n).dtype), s1.get(n))}
    assert changed and all("multi_modal_projector" in n for n in changed), sorted(changed)

    # 5. stage 2 from stage 1's run, DP=2 with the distributed optimizer
    stage2 = (*common, "--tp", "1", "--stage", "2", "--megatron-load-dir", runs / "stage1", "--name", "stage2",
              "--dist-optim", "--lr", "1e-3", "--lr-warmup-fraction", "0", "--save-interval", "2")
    rc, log = train(*stage2, "--train-iters", "4")
    assert rc == 0, log[-4000:]
    first = metrics(runs / "stage2")
    assert sorted(first) == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in first.values())

    # 6. the same command again: the run is finished, it says so and starts nothing
    t0 = time.monotonic()
    rc, log = train(*stage2, "--train-iters", "4")
    assert rc == 0 and "is already at iteration 4 of --train-iters 4" in log, log[-3000:]
    assert "node 0/1" not in log and time.monotonic() - t0 < 30

    # 7. extend: refused without a scheduler flag (it would train at lr 0), trains with the command line's
    rc, log = train(*stage2, "--train-iters", "6")
    assert rc == 2 and "--override-opt-param-scheduler" in log and "--use-checkpoint-opt-param-scheduler" in log
    rc, log = train(*stage2, "--train-iters", "6", "--override-opt-param-scheduler")
    assert rc == 0, log[-4000:]
    extended = metrics(runs / "stage2")
    assert sorted(extended) == [1, 2, 3, 4, 5, 6]
    want = {i: 1e-3 * 0.5 * (1 + math.cos(math.pi * i / 6)) for i in (5, 6)}  # cosine over the new length
    assert {i: extended[i]["lr"] for i in (5, 6)} == pytest.approx(want, rel=1e-6)

    # 8. export the run directory (its newest iteration, its tokenizer) and generate
    out_dir = tmp_path / "llava-out"
    cli(capsys, "convert/megatron_to_hf.py", "--megatron-dir", runs / "stage2", "--hf-dir", out_dir)
    import torch

    from megatron_vlm.convert.verify import load_hf_model

    model = load_hf_model(out_dir)
    out_tok = AutoTokenizer.from_pretrained(str(out_dir))
    assert model.config.image_token_id == out_tok.convert_tokens_to_ids("<image>") == image_id
    assert model.config.text_config.vocab_size == 384
    prompt = out_tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}],
        tokenize=False, add_generation_prompt=True)
    ids = out_tok(prompt.replace("<image>", "<image>" * cfg.image_seq_length), return_tensors="pt",
                  add_special_tokens=False)
    pixels = torch.randn(1, 3, cfg.vision_config.image_size, cfg.vision_config.image_size)
    gen = model.generate(**ids, pixel_values=pixels, max_new_tokens=4, do_sample=False,
                         pad_token_id=out_tok.pad_token_id)
    assert gen.shape[1] > ids["input_ids"].shape[1]
