"""LLaVA-OneVision videos on the data side: frame choice, decoding, pixels, make_wds, the task encoder, stats.

Videos are made here with PyAV (tests.support.videos): mpeg4 in mp4 at odd sizes, H.264 with B-frames,
VP8 in webm (energon seeks those by time), a clip longer than --video-frames seconds and one shorter than 1 s.
"""

from __future__ import annotations

import base64
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_vlm.data import videos as vid
from megatron_vlm.data.conversation import Reject, from_chat, from_llava, from_vqa
from tests.support.videos import broken_videos, make_video

# (frames, width, height, fps, codec, container): odd sizes, < 1 s, > 32 s, B-frames, webm
CLIPS = [(25, 33, 21, 10, "mpeg4", "mp4"), (5, 48, 32, 7, "mpeg4", "mp4"), (700, 32, 24, 10, "mpeg4", "mp4"),
         (40, 48, 32, 12, "libx264", "mp4"), (30, 48, 32, 5, "libvpx", "webm")]


@pytest.fixture(scope="module")
def clips():
    return {c: make_video(c[0], c[1], c[2], c[3], c[4], c[5]) for c in CLIPS}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.support.tiny import make_tiny_onevision

    root = tmp_path_factory.mktemp("video_hf")
    return {"ov": make_tiny_onevision(root / "ov"),
            "next": make_tiny_onevision(root / "next", "llama", "clip", arch="llava_next", vision_feature_layer=-2)}


def _decode_all(data: bytes) -> list[np.ndarray]:
    import av

    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


@pytest.mark.parametrize("frames,fps,video_fps,max_frames,want", [
    (40, 10, 1, 32, [0, 10, 20, 30]),  # one per second
    (5, 7, 1, 32, [0]),  # shorter than a second: its first frame
    (700, 10, 1, 32, np.linspace(0, 699, 32, dtype=int).tolist()),  # 70 s > 32 frames: spread, the last included
    (100, 29.97, 1, 32, [0, 30, 60, 90]),  # round(29.97)
    (100, 25, 2, 32, list(range(0, 100, 12))),  # round(12.5) = 12, Python's (and LLaVA-NeXT's) rounding
    (6, 0.4, 1, 32, [0, 1, 2, 3, 4, 5]),  # slower than 0.5 fps: every frame (LLaVA-NeXT's step would be 0)
    (40, 10, 1, 3, [0, 19, 39]),
])
def test_frame_choice_is_llava_next_rule(frames, fps, video_fps, max_frames, want):
    assert vid.frame_indices(frames, fps, video_fps, max_frames) == want
    assert np.linspace(0, 699, 32, dtype=int).tolist()[-1] == 699 and np.linspace(0, 699, 32, dtype=int)[1] == 22


def test_probe_and_seek_decode_equal_a_full_decode(clips):
    for (n, w, h, fps, codec, container), data in clips.items():
        info = vid.probe(data)
        assert (info.frames, info.fps, info.width, info.height) == (n, fps, w, h), (codec, container)
        idx = vid.frame_indices(info.frames, info.fps)
        got = vid.decode_frames(data, idx)
        full = _decode_all(data)
        assert len(full) == n and got.shape == (len(idx), 3, h, w) and got.dtype == torch.uint8
        for k, i in enumerate(idx):  # energon seeks to each chosen frame: the same pixels as decoding all
            assert np.array_equal(got[k].permute(1, 2, 0).numpy(), full[i]), (codec, container, i)


def test_frame_pixels_equal_the_image_processors_base_tile(models, clips):
    """Frames are squashed to the tile with PIL BICUBIC, rescaled and normalised exactly as HF's OneVision image
    processor makes an image's base tile (the frame LLaVA-NeXT's SigLIP processor gives)."""
    from megatron_vlm.data.anyres_encoder import load_image_processor

    ip = load_image_processor(models["ov"], "llava_onevision")
    frames = vid.decode_frames(clips[CLIPS[0]], [0, 10, 20])
    px = vid.frame_pixels(frames, ip, 20)
    assert px.shape == (3, 3, 20, 20) and px.dtype == torch.float32
    for k in range(3):
        base = ip(images=[Image.fromarray(frames[k].permute(1, 2, 0).numpy())], return_tensors="pt")["pixel_values"]
        assert torch.equal(px[k], base[0][0])
    assert not torch.equal(px[0], px[1])


BAD_REASONS = {
    "undecodable": "unreadable video: Invalid data found when processing input",
    "truncated": "unreadable video: truncated (1 of the 10 frames its index lists)",
    "no_frames": "unreadable video: no frames",
    "audio_only": "unreadable video: no video stream (an audio-only file)",
    "jpeg": "unreadable video: a jpeg_pipe file, not a video container (mp4/mov, mkv/webm or avi)",
}


def test_bad_videos_are_rejected_with_their_reason(clips):
    for name, data in broken_videos().items():
        with pytest.raises(Reject) as e:
            vid.check_video(data)
        assert str(e.value) == BAD_REASONS[name], name
    for (*_, container), data in clips.items():
        assert vid.check_video(data) == ({"mp4": "mp4", "webm": "mkv"}[container], data)  # byte for byte


@pytest.mark.parametrize("fn,record,reason", [
    (from_llava, {"image": "a.jpg", "video": "v.mp4", "conversations": [{"from": "human", "value": "<image>"},
                                                                       {"from": "gpt", "value": "a"}]},
     "both 'image' and 'video'; a LLaVA-NeXT record holds one of them"),
    (from_llava, {"video": "v.mp4", "conversations": [{"from": "human", "value": "<image> <image>"},
                                                      {"from": "gpt", "value": "a"}]},
     "2 <image> placeholder(s) but 1 video(s)"),
    (from_llava, {"video": "v.mp4", "conversations": [{"from": "human", "value": "<video>\nq"},
                                                      {"from": "gpt", "value": "a"}]},
     "<video> in the text of turn 0; a video is a 'video' field (its placeholder is <image>, as in LLaVA-NeXT) or "
     "a video_url part"),
    (from_vqa, {"image": "a.jpg", "video": "v.mp4", "question": "q", "answer": "a"},
     "both an image and a video; a VQA row holds one of them"),
    (from_vqa, {"video": "v.mp4", "question": "<image> <image>", "answer": "a"},
     "2 <image> placeholders in the question but 1 video"),
    (from_chat, {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]},
                              {"role": "assistant", "content": "a"}]}, "message 0: video part without a url"),
])
def test_video_records_that_cannot_be_samples_are_rejected(fn, record, reason):
    with pytest.raises(Reject) as e:
        fn(record)
    assert str(e.value) == reason


def test_video_records_of_each_format(clips):
    llava = from_llava({"video": "v.mp4", "conversations": [{"from": "human", "value": "<image>\nwhat happens ?"},
                                                            {"from": "gpt", "value": "nothing"}]})
    assert llava.videos == ["v.mp4"] and llava.images == []
    assert llava.messages[0]["content"] == [{"type": "video"}, {"type": "text", "text": "what happens ?"}]
    vqa = from_vqa({"video": "v.mp4", "question": "what ?", "answer": "red"})
    assert vqa.videos == ["v.mp4"] and vqa.messages[0]["content"][0] == {"type": "video"}
    chat = from_chat({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, {"type": "image_url", "image_url":
                                                                                      "i.png"}, {"type": "text",
                                                                                                 "text": "?"}]},
        {"role": "assistant", "content": "ok"}]})
    assert chat.videos == ["data:video/mp4;base64,AAAA"] and chat.images == ["i.png"]
    assert [p["type"] for p in chat.messages[0]["content"]] == ["video", "image", "text"]


@pytest.fixture(scope="module")
def video_data(tmp_path_factory, clips):
    """make_wds in the three formats on inputs mixing videos, images, text-only records and bad videos."""
    from megatron_vlm.data.make_wds import make_wds

    root = tmp_path_factory.mktemp("video_data")
    media = root / "media"
    media.mkdir()
    names = {}
    for i, (c, data) in enumerate(clips.items()):
        names[c] = f"v{i}.{c[5]}"
        (media / names[c]).write_bytes(data)
    for name, data in broken_videos().items():
        (media / f"{name}.mp4").write_bytes(data)
    Image.new("RGB", (40, 30), (200, 20, 20)).save(media / "i.png")
    short, odd, long = names[CLIPS[1]], names[CLIPS[0]], names[CLIPS[2]]
    vqa = [{"id": "v", "video": odd, "question": "what colour ?", "answer": "red"},
           {"id": "i", "image": "i.png", "question": "what colour ?", "answer": "red"},
           {"id": "s", "video": short, "question": "<image>\nwhat ?", "answer": "blue"}]
    vqa += [{"id": name, "video": f"{name}.mp4", "question": "q", "answer": "a"} for name in broken_videos()]
    vqa += [{"id": "missing", "video": "missing.mp4", "question": "q", "answer": "a"}]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in vqa))
    llava = [{"id": "lv", "video": long, "conversations": [{"from": "human", "value": "<image>\nwhat happens ?"},
                                                           {"from": "gpt", "value": "a bar moves"}]},
             {"id": "li", "image": "i.png", "conversations": [{"from": "human", "value": "<image>\ncolour ?"},
                                                              {"from": "gpt", "value": "red"}]},
             {"id": "lt", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}]
    (root / "llava.json").write_text(json.dumps(llava))
    url = "data:video/mp4;base64," + base64.b64encode(clips[CLIPS[1]]).decode()
    chat = [{"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                       {"type": "text", "text": "and this ?"},
                                                       {"type": "image_url", "image_url": "i.png"}]},
                          {"role": "assistant", "content": "red"}]},
            {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": names[CLIPS[4]]},
                                                       {"type": "text", "text": "what ?"}]},
                          {"role": "assistant", "content": "blue"}]}]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    out = {}
    for fmt, name in (("vqa", "qa.jsonl"), ("llava", "llava.json"), ("chat", "chat.jsonl")):
        out[fmt] = make_wds(fmt, root / name, root / fmt, image_root=media, split="1,0,0", progress=False,
                            max_bad_fraction=1.0)
    return root, out, names


def _members(path) -> dict[str, bytes]:
    with tarfile.open(path) as t:
        return {m.name: t.extractfile(m).read() for m in t if m.isfile()}


def test_make_wds_stores_videos_byte_for_byte_and_rejects_bad_ones(video_data, clips):
    root, out, names = video_data
    vqa = out["vqa"]
    assert (vqa.total, vqa.written, vqa.videos, vqa.rejected) == (9, 3, 2, 6)
    assert vqa.reasons == {"missing video": 1, "unreadable video": 5}
    rejected = {json.loads(line)["id"]: json.loads(line)["reason"]
                for line in (root / "vqa" / "rejected.jsonl").read_text().splitlines()}
    assert rejected == {**BAD_REASONS, "missing": "missing video 'missing.mp4'"}
    m = _members(root / "vqa" / "000000.tar")
    assert m["000000000.mp4"] == clips[CLIPS[0]] and m["000000002.mp4"] == clips[CLIPS[1]]
    assert "000000001.jpg" in m and m["000000000.txt"] == b"red"
    assert "ConversationSample" in (root / "vqa" / ".nv-meta" / "dataset.yaml").read_text()  # VQASample has no video
    m = _members(root / "llava" / "000000.tar")
    assert m["000000000.vid0.mp4"] == clips[CLIPS[2]] and "000000001.img0.png" in m and out["llava"].videos == 1
    m = _members(root / "chat" / "000000.tar")
    assert m["000000000.vid0.mp4"] == clips[CLIPS[1]] and m["000000001.vid0.mkv"] == clips[CLIPS[4]]
    assert json.loads((root / "vqa" / "make_wds.json").read_text())["videos"] == 2


def _encoded(hf_dir, data_dir, seq_length=512, batch_size=None, **kw):
    """Every training sample of a prepared dataset through the energon loader and the model's task encoder."""
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.data.loader import build_eval_loader
    from megatron_vlm.model.spec import VLMSpec

    enc = task_encoder_for(VLMSpec.from_hf_dir(hf_dir), hf_dir, seq_length, **kw)
    return enc, list(build_eval_loader(data_dir, enc, batch_size or 1, 0, 1, 0, split="train"))


def test_task_encoder_mixes_videos_images_and_text_in_one_batch(models, video_data):
    root, out, names = video_data
    enc, batches = _encoded(models["ov"], root / "llava", batch_size=3)
    geo = enc.spec.anyres
    assert len(batches) == 1 and batches[0].tokens.shape[0] == 3
    b = batches[0]
    vid_id, img_id = enc.spec.video_token_id, enc.spec.image_token_id
    kinds = [int(t) for t in b.tokens.flatten() if int(t) in (vid_id, img_id)]
    assert sorted(kinds) == sorted([vid_id, img_id])  # one video, one image, one text-only sample
    v = kinds.index(vid_id)
    assert b.num_image_tiles[v] == 32 and b.num_image_tokens[v] == 32 * geo.pooled_side**2 + 1 == 129
    assert b.image_sizes[v].tolist() == [24, 32]  # the video's frame size
    assert b.images.shape[0] == int(b.num_image_tiles.sum())
    # the frames are the chosen ones, as decoded by energon and squashed to the tile
    data = (root / "media" / names[CLIPS[2]]).read_bytes()
    idx = vid.frame_indices(700, 10.0)
    first = int(b.num_image_tiles[:v].sum())
    want = vid.frame_pixels(vid.decode_frames(data, idx), enc.image_processor, geo.tile_size)
    assert torch.equal(b.images[first:first + 32], want)


def test_video_token_counts_follow_the_flags(models, video_data):
    root, out, names = video_data
    for fps, frames, want in ((1, 32, [(3, 13), (1, 5)]), (2, 2, [(2, 9), (2, 9)])):
        enc, batches = _encoded(models["ov"], root / "vqa", video_fps=fps, video_frames=frames)
        vids = [(int(bt.num_image_tiles[0]), int(bt.num_image_tokens[0])) for bt in batches
                if enc.spec.video_token_id in bt.tokens]
        # 25 frames at 10 fps: 0, 10, 20 (--video-fps 2: 0, 5, .., 20 -> over 2: 0, 24); 5 at 7 fps: 0 (0, 4)
        assert vids == want


def test_truncation_never_cuts_inside_a_video_and_a_video_too_long_is_a_counted_skip(models, clips):
    from megatron.energon import SkipSample

    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.model.spec import VLMSpec

    spec = VLMSpec.from_hf_dir(models["ov"])
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "video"},
                                         {"type": "text", "text": "what happens ?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a bar moves"}]},
            {"role": "user", "content": [{"type": "video"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "the same"}]}]
    data = clips[CLIPS[0]]  # 3 frames: 13 tokens
    full = task_encoder_for(spec, models["ov"], 512).encode_conversation(msgs, [], "k", [data, data])
    assert full["num_image_tokens"].tolist() == [13, 13]
    second = [i for i, t in enumerate(full["tokens"].tolist()) if t == spec.video_token_id][1]
    seq = second + 12 + 12  # one position short of the second video: it goes, with its frames, and what follows
    enc = task_encoder_for(spec, models["ov"], seq)
    cut = enc.encode_conversation(msgs, [], "k", [data, data])
    assert cut["num_image_tokens"].tolist() == [13] and cut["images"].shape[0] == 3
    assert cut["tokens"].tolist() == full["tokens"][:second].tolist() and cut["num_tokens"] == second + 12
    small = task_encoder_for(spec, models["ov"], 20)
    with pytest.raises(SkipSample):
        small.encode_conversation(msgs, [], "k", [data, data])
    assert small.skipped == {"0 images and 2 videos need 26 > seq_length 20 tokens": 1}


def test_a_video_for_a_model_that_is_not_onevision_stops_with_the_arch_named(models, video_data, tmp_path_factory):
    """Not a skip: energon passes the error on (a FatalSampleError) and the run stops with its one line, found as
    the trainer's entry point finds it (skip_error_line)."""
    from megatron.energon.errors import FatalSampleError

    from megatron_vlm.data.skips import skip_error_line
    from tests.data_fixtures import tiny_llava

    root, out, names = video_data
    for hf, arch in ((models["next"], "llava_next"), (tiny_llava(tmp_path_factory), "llava")):
        with pytest.raises(FatalSampleError) as e:
            _encoded(hf, root / "chat")
        assert skip_error_line(e.value) == (
            f"sample 000000000 has a video, but the model is {arch}, and only llava_onevision and internvl models take videos; "
            "build the model with convert/build_llava.py --arch llava_onevision (it adds '<video>'), or leave the "
            "video samples out of --data-path")


def test_stats_count_video_tokens(models, video_data):
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.data.stats import dataset_stats
    from megatron_vlm.model.spec import VLMSpec

    root, out, names = video_data
    spec = VLMSpec.from_hf_dir(models["ov"])
    for fps, frames, want in ((1, 32, (4, 13 + 5)), (2, 2, (4, 9 + 9))):
        enc = task_encoder_for(spec, models["ov"], 512, video_fps=fps, video_frames=frames)
        got = dataset_stats(root / "vqa", enc)["train"]
        assert (got["samples"], got["videos"], got["images"]) == (3, 2, 1)
        assert (got["video_frames"], got["video_tokens"]) == want
        assert got["tokens"] == got["text_tokens"] + got["image_tokens"] + got["video_tokens"]
        # the task encoder's own counts agree (it trains on a sample's tokens but the last, whose label it is)
        _, batches = _encoded(models["ov"], root / "vqa", video_fps=fps, video_frames=frames)
        assert sum(b.num_tokens + 1 for b in batches) == got["tokens"]


def test_a_partial_last_batch_is_padded_with_its_last_rows_videos(models, clips):
    """Evaluation fills a short micro batch with copies of its last row: the row's videos (frames, token
    counts) are copied with it, as its images are."""
    from megatron_vlm.data.anyres_encoder import AnyresSample, task_encoder_for
    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.training.step import pad_micro_batch

    spec = VLMSpec.from_hf_dir(models["ov"])
    enc = task_encoder_for(spec, models["ov"], 512)
    image = Image.new("RGB", (40, 30), (9, 9, 9))
    rows = [enc.encode_conversation([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]},
                                     {"role": "assistant", "content": [{"type": "text", "text": "b"}]}], [image]),
            enc.encode_conversation([{"role": "user", "content": [{"type": "image"}, {"type": "video"}]},
                                     {"role": "assistant", "content": [{"type": "text", "text": "b"}]}], [image], "k",
                                    [clips[CLIPS[0]]])]
    batch = enc.batch([AnyresSample(__key__=str(i), __restore_key__=(), **r) for i, r in enumerate(rows)])
    padded = pad_micro_batch(batch, 3, spec.media_token_ids)
    assert padded.tokens.shape[0] == 3 and torch.equal(padded.tokens[2], padded.tokens[1])
    last = rows[1]
    assert padded.num_image_tokens.tolist() == batch.num_image_tokens.tolist() + last["num_image_tokens"].tolist()
    assert padded.num_image_tiles.tolist() == batch.num_image_tiles.tolist() + last["num_image_tiles"].tolist()
    assert torch.equal(padded.images[batch.images.shape[0]:], last["images"]) and padded.loss_mask[2].sum() == 0


def test_train_flags_video_fps_and_frames(tmp_path):
    """--video-fps / --video-frames: LLaVA-NeXT's defaults (1, 32), checked, kept in the run's YAML."""
    from megatron_vlm.training.config import ConfigError, TrainConfig

    req = ["--data-path", "d", "--tokenizer-load-dir", "t", "--megatron-load-dir", "m", "--train-iters", "1"]
    c = TrainConfig.from_args(req)
    assert (c.video_fps, c.video_frames) == (1.0, 32)
    c = TrainConfig.from_args([*req, "--video-fps", "0.5", "--video-frames", "8"])
    assert (c.video_fps, c.video_frames) == (0.5, 8)
    (tmp_path / "c.yaml").write_text(c.to_yaml())
    assert (TrainConfig.from_yaml(tmp_path / "c.yaml").video_fps, TrainConfig.from_yaml(tmp_path / "c.yaml")
            .video_frames) == (0.5, 8)
    for flag, value, msg in (("--video-fps", "0", "--video-fps 0.0: must be positive"),
                             ("--video-frames", "0", "--video-frames 0: must be at least 1")):
        with pytest.raises(ConfigError) as e:
            TrainConfig.from_args([*req, flag, value])
        assert msg in str(e.value)
