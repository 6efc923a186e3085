#!/usr/bin/env python
"""LLaVA-OneVision video tokens and decoding speed at OneVision's 384-px frames (a benchmark, not a test).

(a) Video tokens per video for clips of several lengths with the default frame choice (--video-fps 1,
    --video-frames 32): frames * ceil(27/2)**2 + 1 at 384 px / patch 14, next to the image tokens of a
    OneVision image (one image of 384x384 / 1920x1080, and an image of a multi-image sample).
(b) One 60 s clip (640x360, 30 fps: 1800 frames), mpeg4 (a keyframe every 12 frames) and H.264 (every 250):
    the 32 chosen frames decoded by seeking (energon's AVDecoder, as the task encoder does), and everything
    the task encoder does per video (probe, seek-decode, PIL BICUBIC to 384 px, rescale, normalise), in frames
    per second in one process, against decoding all 1800 frames.
(c) energon loader + AnyresTaskEncoder on a make_wds llava dataset of such clips, one worker process:
    videos/s and frames/s.

  python bench/video.py [--seconds 60] [--videos 8]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DURATIONS = [0.5, 5, 32, 60, 600]


def build_model(root: Path) -> Path:
    from tests.support.tiny import make_tiny_onevision

    return make_tiny_onevision(root / "ov384", vision_overrides={"image_size": 384, "patch_size": 14,
                                                                  "num_hidden_layers": 1},
                               max_grid=6, vision_aspect_ratio="anyres_max_9")


def token_rows(geo, fps: float = 30.0) -> list[tuple[str, int, int]]:
    from megatron_vlm.data.videos import frame_indices

    rows = []
    for seconds in DURATIONS:
        frames = len(frame_indices(round(seconds * fps), fps))
        rows.append((f"video {seconds:g} s at {fps:g} fps", frames, geo.video_tokens(frames)))
    rows.append(("image 384x384 (alone)", geo.num_tiles(384, 384), geo.num_tokens(384, 384)))
    rows.append(("image 1920x1080 (alone)", geo.num_tiles(1080, 1920), geo.num_tokens(1080, 1920)))
    rows.append(("image of a multi-image sample", 1, geo.num_tokens(384, 384, tiled=False)))
    return rows


def clip(seconds: float, codec: str) -> bytes:
    from tests.support.videos import make_video

    return make_video(round(seconds * 30), 640, 360, 30, codec=codec)


def bench_decode(data: bytes, image_processor, repeats: int = 3) -> dict:
    import av
    import torch

    from megatron_vlm.data import videos as vid

    torch.set_num_threads(1)
    info = vid.probe(data)
    idx = vid.frame_indices(info.frames, info.fps)
    best = {}
    for _ in range(repeats):
        t = time.perf_counter()
        frames = vid.decode_frames(data, idx)
        t1 = time.perf_counter()
        vid.frame_pixels(frames, image_processor, 384)
        t2 = time.perf_counter()
        with av.open(io.BytesIO(data)) as c:
            c.streams.video[0].thread_type = "NONE"
            n_all = sum(1 for _ in c.decode(video=0))
        t3 = time.perf_counter()
        for k, v in (("seek", t1 - t), ("encoder", t2 - t + 0.0), ("all", t3 - t2)):
            best[k] = min(best.get(k, v), v)
    return {"frames": len(idx), "total": info.frames, "seek_ms": 1e3 * best["seek"],
            "seek_fps": len(idx) / best["seek"], "encoder_ms": 1e3 * best["encoder"],
            "encoder_fps": len(idx) / best["encoder"], "all_ms": 1e3 * best["all"], "all_frames": n_all}


def bench_loader(hf: Path, root: Path, data: bytes, n: int) -> dict:
    import torch

    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.data.make_wds import make_wds
    from megatron_vlm.model.spec import VLMSpec

    media = root / "media"
    media.mkdir()
    records = []
    for i in range(n):
        (media / f"{i}.mp4").write_bytes(data)
        records.append({"id": i, "video": f"{i}.mp4", "conversations": [
            {"from": "human", "value": "<image>\nwhat happens ?"}, {"from": "gpt", "value": "a bar moves"}]})
    (root / "llava.json").write_text(json.dumps(records))
    make_wds("llava", root / "llava.json", root / "wds", image_root=media, split="1,0,0", progress=False)
    torch.set_num_threads(1)
    enc = task_encoder_for(VLMSpec.from_hf_dir(hf), hf, seq_length=8192)
    loader = build_train_loader(root / "wds", enc, micro_batch_size=1, dp_rank=0, dp_world_size=1, num_workers=1,
                                seed=0)
    it = iter(loader)
    next(it)  # start-up: worker fork, first shard open
    t = time.perf_counter()
    frames = 0
    for _ in range(n):
        frames += int(next(it).num_image_tiles.sum())
    dt = time.perf_counter() - t
    _KEEP.append((loader, it))  # energon's worker shutdown takes seconds; leave it to interpreter exit
    return {"videos_per_s": n / dt, "frames_per_s": frames / dt}


_KEEP: list = []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of the clip (default 60)")
    p.add_argument("--videos", type=int, default=8, help="videos timed through the loader (default 8)")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    from megatron_vlm.data.anyres_encoder import load_image_processor
    from megatron_vlm.model.spec import VLMSpec

    root = Path(tempfile.mkdtemp(prefix="bench_video_", dir=args.work_dir))
    try:
        hf = build_model(root)
        geo = VLMSpec.from_hf_dir(hf).anyres
        print(f"(a) tokens at {geo.tile_size} px / patch {geo.patch_size} ({geo.side}x{geo.side} features, "
              f"pooled to {geo.pooled_side}x{geo.pooled_side} per frame), --video-fps 1 --video-frames 32:")
        print(f"    {'input':>32} {'frames/tiles':>12} {'tokens':>7}")
        for name, n, tokens in token_rows(geo):
            print(f"    {name:>32} {n:>12} {tokens:>7}")
        ip = load_image_processor(hf, "llava_onevision")
        for codec, gop in (("mpeg4", 12), ("libx264", 250)):
            t = time.perf_counter()
            data = clip(args.seconds, codec)
            made = time.perf_counter() - t
            d = bench_decode(data, ip)
            print(f"(b) {args.seconds:g} s clip, 640x360 at 30 fps, {codec} (keyframe every {gop}; "
                  f"{len(data) / 1e6:.1f} MB, encoded in {made:.1f} s): {d['frames']} of {d['total']} frames by "
                  "seeking "
                  f"{d['seek_ms']:.0f} ms ({d['seek_fps']:.0f} frames/s); with the task encoder's resize and "
                  f"normalise {d['encoder_ms']:.0f} ms ({d['encoder_fps']:.0f} frames/s); decoding all "
                  f"{d['all_frames']} frames {d['all_ms']:.0f} ms ({d['all_ms'] / d['seek_ms']:.1f}x the seeks)")
            if codec == "mpeg4":
                loader_data = data
        b = bench_loader(hf, root, loader_data, args.videos)
        print(f"(c) loader + AnyresTaskEncoder, 1 worker process, the mpeg4 clip: {b['videos_per_s']:.2f} videos/s, "
              f"{b['frames_per_s']:.0f} frames/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
