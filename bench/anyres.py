#!/usr/bin/env python
"""Anyres (LLaVA-OneVision) image tokens and loader speed at OneVision's 384-px tiles (a benchmark, not a test).

(a) For images of common sizes: the tile grid HF's image processor picks from OneVision's 6 x 6 pinpoints, the
    tiles the vision encoder runs, and the image tokens per image for OneVision (anyres_max_9), for LLaVA-NeXT's
    packing of the same grid (no downsampling) and for plain LLaVA (one 384-px tile: 729 tokens).
(b) energon loader + AnyresTaskEncoder (tiles from LlavaOnevisionImageProcessorPil) on a make_wds VQA dataset
    of images of those sizes kept at their original size: samples/s and tiles/s with one worker process.

  python bench/anyres.py [--n 200] [--loader-samples 100]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [(384, 384), (640, 480), (480, 640), (1024, 768), (1280, 720), (1920, 1080), (336, 1000), (2048, 2048)]


def build_model(root: Path) -> Path:
    from tests.support.tiny import make_tiny_onevision

    return make_tiny_onevision(root / "ov384", vision_overrides={"image_size": 384, "patch_size": 14,
                                                                  "num_hidden_layers": 1},
                               max_grid=6, vision_aspect_ratio="anyres_max_9")


def token_table(spec) -> list[dict]:
    from dataclasses import replace

    geo = spec.anyres
    nxt = replace(geo, max_tiles=None)
    rows = []
    for w, h in SIZES:
        rows.append(dict(size=f"{w}x{h}", grid="x".join(map(str, geo.grid(h, w))), tiles=geo.num_tiles(h, w),
                         onevision=geo.num_tokens(h, w), next=nxt.num_tokens(h, w), llava=geo.side ** 2))
    return rows


def make_dataset(root: Path, n: int) -> Path:
    from PIL import Image

    from megatron_vlm.data.make_wds import make_wds
    from megatron_vlm.data.synthetic import image_array

    images = root / "images"
    images.mkdir(parents=True)
    rows = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        Image.fromarray(image_array((w, h), i % 64)).save(images / f"{i:05d}.jpg", quality=90)
        rows.append({"id": i, "image": f"{i:05d}.jpg", "question": "what colour is the shape ?", "answer": "red"})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_wds("vqa", root / "qa.jsonl", root / "wds", image_root=images, shard_size=100, workers=2, prepare=True,
             progress=False)
    return root / "wds"


def bench_loader(hf: Path, wds: Path, samples: int) -> dict:
    import torch

    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.model.spec import VLMSpec

    torch.set_num_threads(1)
    enc = task_encoder_for(VLMSpec.from_hf_dir(hf), hf, seq_length=8192)
    loader = build_train_loader(wds, enc, micro_batch_size=8, dp_rank=0, dp_world_size=1, num_workers=1, seed=0)
    it = iter(loader)
    for _ in range(2):  # start-up: worker fork, first shard open
        next(it)
    t = time.perf_counter()
    seen = tiles = 0
    while seen < samples:
        b = next(it)
        seen += len(b.__key__)
        tiles += int(b.num_image_tiles.sum())
    dt = time.perf_counter() - t
    _KEEP.append((loader, it))  # energon's worker shutdown takes seconds; leave it to interpreter exit
    return {"samples_per_s": seen / dt, "tiles_per_s": tiles / dt, "tiles_per_sample": tiles / seen}


_KEEP: list = []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="images in the generated dataset (default 200)")
    p.add_argument("--loader-samples", type=int, default=100, help="samples timed through the loader")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    from megatron_vlm.model.spec import VLMSpec

    root = Path(tempfile.mkdtemp(prefix="bench_anyres_", dir=args.work_dir))
    try:
        hf = build_model(root)
        spec = VLMSpec.from_hf_dir(hf)
        geo = spec.anyres
        print(f"(a) image tokens per image: {geo.tile_size}-px tiles at patch {geo.patch_size} "
              f"({geo.side}x{geo.side} = {geo.side ** 2} features per tile), {len(geo.grid_pinpoints)} pinpoints, "
              f"anyres_max_{geo.max_tiles}")
        print(f"    {'image WxH':>10} {'grid':>5} {'tiles':>5} {'OneVision':>9} {'NeXT':>6} {'LLaVA':>6}")
        for r in token_table(spec):
            print(f"    {r['size']:>10} {r['grid']:>5} {r['tiles']:>5} {r['onevision']:>9} {r['next']:>6} "
                  f"{r['llava']:>6}")
        wds = make_dataset(root, args.n)
        b = bench_loader(hf, wds, args.loader_samples)
        print(f"(b) loader + AnyresTaskEncoder (LlavaOnevisionImageProcessorPil), batch 8, 1 worker process: "
              f"{b['samples_per_s']:.1f} samples/s, {b['tiles_per_s']:.0f} tiles/s "
              f"({b['tiles_per_sample']:.1f} tiles per sample)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
