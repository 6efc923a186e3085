#!/usr/bin/env python
"""Data preparation and loading speed (a benchmark, not a test). Prints the numbers.

(a) ``make_wds --format vqa`` on N generated 336x336 JPEGs (every image decoded and checked) against
    ``tar cf`` of the same files, with 1 and 2 workers: throughput ratio make_wds / tar (target >= 0.5)
    and the 1 -> 2 worker speed-up (target near 2). Page cache is warm for both (files read once first).
(b) energon loader + VLMTaskEncoder at 336 px (CLIP-style processor, 576 image tokens): samples/s with
    one worker process (target >= 100 samples/s per worker), and in-process (num_workers 0; torch limited
    to one thread there as in a worker: on a busy machine torch's multi-threaded cat of a batch's images
    otherwise stalls on thread contention).

  python bench/data_prep.py [--n 2000] [--loader-samples 400]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_inputs(root: Path, n: int, size: int) -> Path:
    """N distinct photo-like JPEGs (64 base pictures, each copy with its own marked block)."""
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array

    images = root / "images"
    images.mkdir(parents=True)
    bases = [image_array(size, seed) for seed in range(64)]
    rows = []
    for i in range(n):
        arr = bases[i % 64].copy()
        arr[:16, :16] = (i * 37 % 256, i * 91 % 256, i * 13 % 256)
        Image.fromarray(arr).save(images / f"{i:06d}.jpg", quality=90)
        rows.append({"id": i, "image": f"{i:06d}.jpg", "question": "what colour is the shape ?", "answer": "red"})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return images


def timed(fn, repeat: int = 1) -> tuple[float, float]:
    """Best wall time of ``repeat`` runs, and the CPU seconds (this process + finished children) of that run."""
    import resource

    def cpu():
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    best = (float("inf"), 0.0)
    for _ in range(repeat):
        t, c = time.perf_counter(), cpu()
        fn()
        best = min(best, (time.perf_counter() - t, cpu() - c))
    return best


def decode_floor(images: Path) -> float:
    """Seconds one process spends only in the image check make_wds does (``process_image`` on bytes in memory):
    the floor of make_wds per worker, whatever the rest of the pipeline costs."""
    from megatron_vlm.data.images import process_image

    blobs = [p.read_bytes() for p in sorted(images.iterdir())]

    def run():
        for b in blobs:
            process_image(b)
    return timed(run, repeat=2)[0]


def bench_make_wds(root: Path, n: int) -> dict:
    from megatron_vlm.data.make_wds import make_wds

    images = root / "images"
    tar_out = root / "plain.tar"

    def tar():
        subprocess.run(["tar", "cf", str(tar_out), "-C", str(root), "images", "qa.jsonl"], check=True)

    tar()  # warm the page cache
    t_tar, _ = timed(tar, repeat=3)
    out = {"n": n, "bytes": sum(p.stat().st_size for p in images.iterdir()), "tar_s": t_tar}
    out["decode_floor_s"] = decode_floor(images)
    for workers in (1, 2):
        def run():
            make_wds("vqa", root / "qa.jsonl", root / "wds", image_root=images, shard_size=1000, workers=workers,
                     prepare=False, progress=False, overwrite=True)
        out[f"make_wds_w{workers}_s"], out[f"make_wds_w{workers}_cpu_s"] = timed(run, repeat=2)
    t = time.perf_counter()
    make_wds("vqa", root / "qa.jsonl", root / "wds", image_root=images, shard_size=100, workers=2,
             split="9,1,0", prepare=True, progress=False, overwrite=True)
    out["make_wds_w2_prepare_s"] = time.perf_counter() - t
    return out


def bench_loader(root: Path, samples: int) -> dict:
    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.data.task_encoder import VLMTaskEncoder
    from tests.support.tiny import make_tiny_llava

    hf = make_tiny_llava(root / "llava336", vision_overrides={"image_size": 336, "patch_size": 14})
    enc = VLMTaskEncoder(hf, seq_length=1024)
    out = {"tokens_per_image": enc.tokens_per_image, "pixels": list(enc.geometry.__dict__.values())[1:3]}
    import torch

    torch.set_num_threads(1)  # as in a loader worker; see the note printed with the in-process number
    for workers in (1, 0):
        loader = build_train_loader(root / "wds", enc, micro_batch_size=8, dp_rank=0, dp_world_size=1,
                                    num_workers=workers, seed=0)
        it = iter(loader)
        for _ in range(3):  # start-up: worker fork, first shard open
            next(it)
        t, c = time.perf_counter(), time.process_time()
        seen = 0
        while seen < samples:
            seen += len(next(it).__key__)
        out[f"loader_w{workers}_samples_per_s"] = seen / (time.perf_counter() - t)
        if not workers:
            out["loader_w0_samples_per_cpu_s"] = seen / (time.process_time() - c)
        if workers:
            # energon's savable loader takes ~5 s per worker to shut down; leave it to interpreter exit
            _KEEP.append((loader, it))
    return out


_KEEP: list = []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="number of generated 336x336 JPEGs (default 2000)")
    p.add_argument("--size", type=int, default=336)
    p.add_argument("--loader-samples", type=int, default=400, help="samples timed per loader setting")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="bench_data_", dir=args.work_dir))
    try:
        t = time.perf_counter()
        make_inputs(root, args.n, args.size)
        print(f"generated {args.n} {args.size}x{args.size} JPEGs in {time.perf_counter() - t:.1f} s "
              f"({os.cpu_count()} CPUs visible, load average {os.getloadavg()[0]:.1f} before the runs)")
        a = bench_make_wds(root, args.n)
        mb = a["bytes"] / 1e6
        print(f"(a) tar cf:            {a['tar_s']:.3f} s  {args.n / a['tar_s']:8.0f} samples/s  ({mb:.1f} MB)")
        for w in (1, 2):
            s = a[f"make_wds_w{w}_s"]
            cpu = a[f"make_wds_w{w}_cpu_s"]
            print(f"    make_wds workers={w}: {s:.3f} s  {args.n / s:8.0f} samples/s  ratio to tar {a['tar_s'] / s:.2f}"
                  f"  ({cpu / args.n * 1e3:.2f} CPU ms/sample, all processes)")
        floor = a["decode_floor_s"]
        print(f"    image check alone (decode + size check, 1 process): {floor / args.n * 1e3:.3f} ms/sample: the "
              f"best ratio to tar any make_wds can reach is {a['tar_s'] / floor:.2f} per worker "
              f"({a['tar_s'] / floor * (os.cpu_count() or 1):.2f} with all {os.cpu_count()} CPUs)")
        print(f"    speed-up 1 -> 2 workers: {a['make_wds_w1_s'] / a['make_wds_w2_s']:.2f}x; with the energon "
              f"prepare step (shard size 100, split 9,1,0): {a['make_wds_w2_prepare_s']:.2f} s")
        b = bench_loader(root, args.loader_samples)
        print(f"(b) loader + VLMTaskEncoder at {args.size}px ({b['tokens_per_image']} image tokens/image), batch 8:")
        print(f"    1 worker process: {b['loader_w1_samples_per_s']:.0f} samples/s")
        print(f"    in-process (num_workers=0, torch threads 1): {b['loader_w0_samples_per_s']:.0f} samples/s, "
              f"{b['loader_w0_samples_per_cpu_s']:.0f} samples per CPU-second")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
