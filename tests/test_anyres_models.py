"""LLaVA-OneVision and LLaVA-NeXT end to end on tiny models: build, HF -> Megatron -> HF, logits, training, export.

One 2-process world computes, for images of four sizes in one batch (one downsampled by OneVision's anyres_max_N,
one a single grid tile) and, for OneVision, a 3-frame video and a sample with an image and a 2-frame video, the
fp32 logits at TP=1, TP=2 and PP=2 (against HF's pixel_values_videos path), trains 3 steps at TP=2 and at PP=2 on
micro batches mixing images of four sizes, videos of 3 and 1 frames made with PyAV and a text-only sample (the same
batches: the losses must agree and fall, and image_newline's gradient must be identical on both TP ranks; again in
bf16 at TP=2, within 1% of fp32), saves the TP=2 run and loads it again; the saved run is exported to HF and must
give the same logits and generate, from a video too.
"""

import io

import pytest
import torch
from PIL import Image

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import hf_logits, load_hf_model, max_logit_diff, reference_batch
from megatron_vlm.data.anyres_encoder import AnyresTaskEncoder, VideoNotSupportedError, task_encoder_for
from megatron_vlm.data.conversation import vqa_messages
from megatron_vlm.data.synthetic import image_array
from megatron_vlm.runtime.spawn import run_world
from megatron_vlm.model.spec import VLMSpec
from tests.support.anyres_jobs import anyres_jobs

TOL = 1e-4
SEQ = 96
# (width, height) of the training images: square, tall, large (downsampled), small
TRAIN_SIZES = [(20, 20), (33, 50), (61, 47), (15, 9)]
ROUND_TRIPS = [("llava_onevision", "torch_dist"), ("llava_onevision", "torch"), ("llava_next", "torch_dist"),
               ("llava_next", "torch")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.support.tiny import make_tiny_onevision

    root = tmp_path_factory.mktemp("anyres_hf")
    return {"llava_onevision": make_tiny_onevision(root / "ov"),
            "llava_next": make_tiny_onevision(root / "next", "llama", "clip", arch="llava_next",
                                              vision_feature_layer=-2)}


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("anyres_meg")
    return {(arch, fmt): convert_hf_to_megatron(models[arch], root / f"{arch}_{fmt}", tp=2, pp=2, ckpt_format=fmt)
            for arch, fmt in ROUND_TRIPS}


def _samples(encoder):
    out = []
    for i, size in enumerate(TRAIN_SIZES):
        image = Image.fromarray(image_array(size, i))
        out.append(encoder.encode_conversation(vqa_messages("what colour is the shape ?", ["red", "blue"][i % 2]),
                                               [image], str(i)))
    return out


def _video_samples(encoder):
    """A 25-frame clip at 10 fps (3 frames chosen), one of 5 frames (1 chosen) with an image, a text-only one."""
    from tests.support.videos import make_video

    long, short = make_video(25, 33, 21, fps=10), make_video(5, 48, 32, fps=7)
    user = [{"type": "video"}, {"type": "text", "text": "what colour is the shape ?"}]
    return [encoder.encode_conversation(vqa_messages("what happens ?", "red", "video"), [], "v0", [long]),
            encoder.encode_conversation([{"role": "user", "content": user + [{"type": "image"}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
                                        [Image.fromarray(image_array((30, 40), 9))], "v1", [short]),
            encoder.encode_conversation([{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], [], "t")]


@pytest.fixture(scope="module")
def world(models, converted, tmp_path_factory):
    from megatron_vlm.data.anyres_encoder import AnyresSample

    ov = models["llava_onevision"]
    spec = VLMSpec.from_hf_dir(ov)
    enc = task_encoder_for(spec, ov, SEQ)
    samples = [AnyresSample(__key__=str(i), __restore_key__=(), __subflavors__=None, **s)
               for i, s in enumerate(_samples(enc) + _video_samples(enc))]
    micro = [enc.batch(samples[:2] + samples[4:6]), enc.batch(samples[2:4] + samples[6:] + samples[4:5])]
    run = tmp_path_factory.mktemp("anyres_run") / "tp2"
    batches = {arch: reference_batch(VLMSpec.from_hf_dir(d)) for arch, d in models.items()}
    ov_dir = str(converted[("llava_onevision", "torch_dist")])
    train = dict(micro_batches=micro, steps=3, seq_length=SEQ)
    jobs = [
        dict(megatron_dir=ov_dir, tp=1, pp=1, batch=batches["llava_onevision"]),
        dict(megatron_dir=ov_dir, tp=2, pp=1, batch=batches["llava_onevision"], train={**train, "save": str(run)}),
        dict(megatron_dir=ov_dir, tp=1, pp=2, batch=batches["llava_onevision"], train=train),
        dict(megatron_dir=str(run), tp=1, pp=2, batch=batches["llava_onevision"]),
        dict(megatron_dir=str(converted[("llava_next", "torch_dist")]), tp=2, pp=1, batch=batches["llava_next"]),
        dict(megatron_dir=str(converted[("llava_next", "torch_dist")]), tp=1, pp=2, batch=batches["llava_next"]),
        dict(megatron_dir=ov_dir, tp=2, pp=1, batch=batches["llava_onevision"], train={**train, "precision": "bf16"}),
    ]
    return run_world(anyres_jobs, 2, jobs)[0], batches, run, micro


@pytest.mark.slow
def test_logits_match_hf_at_tp1_tp2_pp2(models, world):
    results, batches, _, _ = world
    for arch, idx in (("llava_onevision", (0, 1, 2)), ("llava_next", (4, 5))):
        spec = VLMSpec.from_hf_dir(models[arch])
        batch = batches[arch]
        assert len(set(batch.num_image_tokens.tolist()[:4])) == 4  # four image sizes, four token counts
        if arch == "llava_onevision":  # a 3-frame video alone, a 2-frame one after an image
            assert batch.tokens.shape[0] == 6 and [batch.items(b)[1] for b in (4, 5)] == [[True], [False, True]]
            assert batch.num_image_tiles.tolist()[4:] == [3, 3, 2]
        ref = hf_logits(models[arch], batch)
        for i in idx:
            diff = max_logit_diff(ref, results[i]["logits"][:, : ref.shape[1]], spec.vocab_size, batch)
            assert diff < TOL, f"{arch} job {i}: max |logit diff| {diff}"
    ov = VLMSpec.from_hf_dir(models["llava_onevision"]).anyres
    sizes = batches["llava_onevision"].image_sizes.tolist()
    assert any(ov.downsampled_size(*ov.unpadded_grid(*s)) is not None for s in sizes)  # downsampling covered
    assert any(ov.num_tiles(*s) == 2 for s in sizes)  # a single grid tile covered


@pytest.mark.slow
def test_training_tp2_pp2_bf16_same_losses_falling_newline_grad_equal_over_tp(models, world):
    results, _, _, micro = world
    tp2, pp2 = results[1], results[2]
    spec = VLMSpec.from_hf_dir(models["llava_onevision"])
    kinds = [[int(t) == spec.video_token_id for t in b.tokens.flatten() if int(t) in spec.media_token_ids]
             for b in micro]
    videos = [[int(n) for n, v in zip(b.num_image_tokens, k) if v] for b, k in zip(micro, kinds)]
    images = [int(n) for b, k in zip(micro, kinds) for n, v in zip(b.num_image_tokens, k) if not v]
    assert videos == [[13, 5], [13]] and len(images) == 5 and len(set(images)) == 4  # 3- and 1-frame videos
    assert max(abs(a - b) for a, b in zip(tp2["losses"], pp2["losses"])) < 1e-5, (tp2["losses"], pp2["losses"])
    assert tp2["losses"][-1] < tp2["losses"][0] - 0.05, tp2["losses"]
    assert tp2["newline_equal"] and all(all(f) for f in tp2["newline_equal"])  # every step, nonzero, TP-equal
    bf16 = results[6]  # megatron's Float16Module + mixed-precision optimizer, as GPU users train
    assert abs(bf16["losses"][0] - tp2["losses"][0]) < 0.01 * tp2["losses"][0], (bf16["losses"], tp2["losses"])
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.05, bf16["losses"]
    assert bf16["newline_equal"] and all(all(f) for f in bf16["newline_equal"])


@pytest.mark.slow
def test_trained_checkpoint_exports_loads_and_generates(models, world, tmp_path):
    results, batches, run, _ = world
    spec = VLMSpec.from_hf_dir(models["llava_onevision"])
    out = convert_megatron_to_hf(run, tmp_path / "hf", tokenizer_dir=models["llava_onevision"])
    batch = batches["llava_onevision"]
    ref = hf_logits(out, batch)
    got = results[3]["logits"]
    assert max_logit_diff(ref, got[:, : ref.shape[1]], spec.vocab_size, batch) < TOL
    assert max_logit_diff(ref, results[0]["logits"][:, : ref.shape[1]], spec.vocab_size, batch) > 1e-3  # trained
    model = load_hf_model(out)
    assert type(model).__name__ == "LlavaOnevisionForConditionalGeneration"
    for b in (0, 4, 5):  # an image; a video (pixel_values_videos); an image and a video
        inputs = batch.hf_sample(b)
        assert ("pixel_values_videos" in inputs) == (b > 3) and ("pixel_values" in inputs) == (b != 4)
        gen = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        n = inputs["input_ids"].shape[1]
        assert n < gen.shape[1] <= n + 3  # (it may stop early at eos)
        assert int(gen[0, n]) == int(got[b, n - 1, : spec.vocab_size].argmax())  # greedy = Megatron's argmax


@pytest.mark.parametrize("arch,fmt", ROUND_TRIPS)
def test_round_trip_is_byte_identical(arch, fmt, models, converted, tmp_path):
    out = convert_megatron_to_hf(converted[(arch, fmt)], tmp_path / "hf")
    a, b = HFReader(models[arch]), HFReader(out)
    assert a.names() == b.names() and "image_newline" in a.names()
    assert "vision_tower.post_layernorm.weight" in a.names()  # kept although the features precede it
    for n in a.names():
        ta, tb = a.get(n), b.get(n)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), n
    assert VLMSpec.from_hf_dir(out).to_json() == VLMSpec.from_hf_dir(models[arch]).to_json()


def test_task_encoder_tiles_and_counts_equal_hf_processor(models):
    from megatron_vlm.data.anyres_encoder import load_image_processor

    ov = models["llava_onevision"]
    spec = VLMSpec.from_hf_dir(ov)
    enc = task_encoder_for(spec, ov, SEQ)
    assert isinstance(enc, AnyresTaskEncoder)
    proc = load_image_processor(ov, "llava_onevision")
    for i, (w, h) in enumerate(TRAIN_SIZES):
        image = Image.fromarray(image_array((w, h), i))
        s = enc.encode_conversation(vqa_messages("what colour ?", "red"), [image])
        hf = proc(images=[image], return_tensors="pt")
        assert s["image_sizes"].tolist() == [[h, w]] == hf["image_sizes"].tolist()  # original size kept
        assert torch.equal(s["images"], hf["pixel_values"][0])  # every tile, as HF's processor makes them
        assert s["num_image_tokens"].tolist() == [spec.anyres.num_tokens(h, w)]
        assert s["num_tokens"] == len(s["tokens"]) - 1 + spec.anyres.num_tokens(h, w)
    two = enc.encode_conversation([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                 {"type": "text", "text": "same ?"}]},
                                   {"role": "assistant", "content": [{"type": "text", "text": "no"}]}],
                                  [Image.fromarray(image_array((40, 30), 0))] * 2)
    assert two["num_image_tiles"].tolist() == [1, 1]  # OneVision: several images -> base tiles only
    assert two["num_image_tokens"].tolist() == [spec.anyres.side ** 2 + 1] * 2
    from megatron_vlm.data.images import process_image
    from megatron_vlm.data.synthetic import image_bytes

    for fmt in ("PNG", "WEBP", "JPEG"):  # make_wds stores every image at its original size
        ext, data = process_image(image_bytes((61, 47), 0, fmt), jpeg_only=fmt == "PNG")
        assert Image.open(io.BytesIO(data)).size == (61, 47), (fmt, ext)
    video = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "no"}]}]
    nxt = task_encoder_for(VLMSpec.from_hf_dir(models["llava_next"]), models["llava_next"], SEQ)
    with pytest.raises(VideoNotSupportedError, match="has a video, but the model is llava_next, and only "
                                                     "llava_onevision and internvl models take videos"):
        nxt.encode_conversation(video, [])  # OneVision takes videos (tests/test_video_data.py), LLaVA-NeXT not


def test_stats_counts_each_images_tokens_from_its_size(models, tmp_path):
    import json

    from megatron_vlm.data.make_wds import make_wds
    from megatron_vlm.data.stats import dataset_stats

    ov = models["llava_onevision"]
    spec = VLMSpec.from_hf_dir(ov)
    enc = task_encoder_for(spec, ov, SEQ)
    rows, want = [], 0
    (tmp_path / "img").mkdir()
    for i, (w, h) in enumerate(TRAIN_SIZES):
        Image.fromarray(image_array((w, h), i)).save(tmp_path / "img" / f"{i}.png")
        rows.append({"id": i, "image": f"{i}.png", "question": "what colour ?", "answer": "red"})
        want += spec.anyres.num_tokens(h, w)
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_wds("vqa", tmp_path / "qa.jsonl", tmp_path / "wds", image_root=tmp_path / "img", shard_size=10, workers=1,
             split="1,0,0", prepare=True, progress=False)
    got = dataset_stats(tmp_path / "wds", enc)["train"]
    assert got["images"] == 4 and got["image_tokens"] == want


@pytest.mark.parametrize("edit,expect", [
    ({"image_grid_pinpoints": [[20, 30]]}, "[20, 30] is not a multiple of the tile size 20"),
    ({"vision_aspect_ratio": "anyres"}, "vision_aspect_ratio 'anyres' is not supported; use 'anyres_max_N'"),
    ({"model_type": "qwen2_vl"},
     "Qwen2-VL (model_type 'qwen2_vl') is not supported yet; megatron-vlm converts Qwen2.5-VL"),
])
def test_bad_anyres_config_is_one_line_error(edit, expect, models, tmp_path, capsys):
    import json
    import shutil

    from megatron_vlm.cli import run_cli

    from .conftest import script

    bad = tmp_path / "bad"
    shutil.copytree(models["llava_onevision"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(edit)
    (bad / "config.json").write_text(json.dumps(cfg))
    rc = run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(bad), "--megatron-dir",
                                                             str(tmp_path / "out")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and line.startswith("error: ") and expect in line, line
    assert not (tmp_path / "out").exists()
