#!/usr/bin/env python
"""Sequence packing against padding on a realistic length mix (a benchmark, not a test): real tokens/s of the
trainer's step, packed and padded, measured in one run. Prints the numbers.

The samples follow LLaVA-1.5's mix665k as ``data_prep/stats.py`` counts such a set (image-expanded lengths, at
576 image tokens per 336-px CLIP image): short single-question VQA (VQAv2/GQA/OKVQA-like, the bulk), multi-question
VQA and OCR conversations, LLaVA-Instruct conversations, text-only ShareGPT conversations, anyres images (a 2x2
grid + base tile: 5 tiles) and a few videos (6 frames). Tiles and frames enter the model as images of 576
positions each (the language model sees the positions an anyres image or a video of that size gives, and the
vision encoder runs once per tile or frame). Every sample is truncated to ``--seq-length`` (4096) as the task
encoder truncates.

Both sides train the same samples with the same model, built with megatron's local layers on CPU (Transformer
Engine on a GPU, ``--device cuda``) through the trainer's own ``build_training`` and ``train_step``:

- padded: micro batches of ``--pad-micro-batch`` samples in data order, each row padded to the micro batch's
  longest sample (the trainer's batching without packing);
- packed: the packing task encoder's hooks (first-fit decreasing over a buffer of ``--buffer`` samples) into rows
  of ``--pack-factor`` x ``--seq-length`` positions, one 'thd' row per micro batch.

Printed per side: real (non-pad) tokens/s (best of ``--repeats`` timed passes over all samples, after one warm-up
micro batch), the padding fraction (pad positions / positions the language model ran) and the rows run; then the
ratio packed / padded (target: >= 1.5). ``--tiny`` runs a seconds-long smoke version (the suite runs it).

  python bench/packing.py [--seq-length 4096 --samples 48 --pack-factor 2 --pad-micro-batch 2 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IMAGE_TOKENS = 576  # a 336-px CLIP ViT-L/14 image (LLaVA-1.5)

#: (share, kind, images per sample, text tokens low, high): mix665k-like, as data_prep/stats.py counts such a set
MIX = [
    (0.52, "vqa", 1, 40, 250),
    (0.18, "vqa-multi", 1, 250, 1000),
    (0.12, "conversation", 1, 150, 700),
    (0.08, "text", 0, 300, 3500),
    (0.07, "anyres", 5, 40, 400),
    (0.03, "video", 6, 20, 120),
]


def lengths(n: int, seed: int, image_tokens: int, seq_length: int, scale: float = 1.0) -> list[tuple[str, int, int]]:
    """(kind, images, text tokens) of ``n`` samples drawn from :data:`MIX` (truncated as the task encoder does:
    text cut, media kept whole)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r, acc = rng.random(), 0.0
        for share, kind, images, lo, hi in MIX:
            acc += share
            if r <= acc:
                break
        text = max(4, int(rng.uniform(lo, hi) * scale))
        text = min(text, seq_length - images * image_tokens)
        out.append((kind, images, text))
    return out


def encoded_samples(spec, mix: list, seed: int) -> list:
    """VLMSample objects with these shapes: random token ids, the image token at the start of the text of an
    image sample, the loss on the last third (the answer)."""
    import torch

    from megatron_vlm.data.task_encoder import VLMSample

    g = torch.Generator().manual_seed(seed)
    meta = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    out = []
    for i, (_, images, text) in enumerate(mix):
        x = torch.randint(10, spec.vocab_size - 1, (text + images + 1,), generator=g)
        x[x == spec.image_token_id] = 11
        x[1:1 + images] = spec.image_token_id
        mask = torch.zeros(text + images, dtype=torch.float32)
        mask[-max(1, text // 3):] = 1
        out.append(VLMSample(__key__=f"s{i}", **meta, tokens=x[:-1].clone(), labels=x[1:].clone(), loss_mask=mask,
                             num_tokens=text + images * IMAGE_TOKENS_OF[0],
                             images=torch.rand(images, 3, spec.image_size, spec.image_size, generator=g)))
    return out


IMAGE_TOKENS_OF = [IMAGE_TOKENS]  # tokens per image of the model in use (set by main)


def measure(a, hf: Path, meg: Path) -> dict:
    """Per-rank job (a one-process world): both sides' timings."""
    import torch

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.data.packing import packing_task_encoder_for
    from megatron_vlm.runtime import distributed
    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.training.build import build_training
    from megatron_vlm.training.config import TrainConfig
    from megatron_vlm.training.step import train_step

    iter_dir = ckpt.resolve_iteration_dir(meg)
    spec = VLMSpec.load(iter_dir)
    IMAGE_TOKENS_OF[0] = spec.num_image_tokens
    psl = a.pack_factor * a.seq_length
    rt = distributed.setup(1, 1, device=a.device, seed=1234)
    enc = packing_task_encoder_for(spec, hf, a.seq_length, psl, image_token_id=spec.image_token_id)
    mix = lengths(a.samples, a.seed, spec.num_image_tokens, a.seq_length, a.text_scale)
    samples = encoded_samples(spec, mix, a.seed)
    padded = [super(type(enc), enc).batch(samples[i:i + a.pad_micro_batch])
              for i in range(0, len(samples), a.pad_micro_batch)]
    packs = []
    for i in range(0, len(samples), a.buffer):
        packs += [enc.batch([enc.pack_selected_samples(p)]) for p in enc.select_samples_to_pack(samples[i:i + a.buffer])]
    real = sum(s.num_tokens for s in samples)
    k = spec.num_image_tokens
    padded_positions = sum(b.tokens.shape[0] * (b.tokens.shape[1] + (k - 1) * max(
        int((row == spec.image_token_id).sum()) for row in b.tokens)) for b in padded)
    cfg = TrainConfig(device=a.device, stage=2, freeze_vit=False, lr=1e-5, min_lr=0.0, lr_warmup_fraction=0.0,
                      lr_decay_style="constant", seq_length=a.seq_length, precision=a.precision,
                      train_iters=1000, global_batch_size=1, micro_batch_size=1, packing_buffer_size=a.buffer,
                      packed_seq_length=psl)
    training = build_training(cfg, spec, init_from=iter_dir)
    dev = rt.device

    def timed(batches, mbs):
        import copy

        c = copy.copy(cfg)
        c.micro_batch_size = mbs
        train_step(training, batches[:1], c, dev)  # warm-up
        best = None
        for _ in range(a.repeats):
            if dev != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for j in range(0, len(batches), a.step_micro_batches):
                train_step(training, batches[j:j + a.step_micro_batches], c, dev)
            if dev != "cpu":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        return best

    t_pad = timed(padded, a.pad_micro_batch)
    t_pack = timed(packs, 1)
    kinds = {}
    for kind, _, _ in mix:
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(samples=len(samples), kinds=kinds, real_tokens=real, mean_length=real / len(samples),
                impl=training.impl,
                padded=dict(rows=sum(b.tokens.shape[0] for b in padded), positions=padded_positions,
                            padding=1 - real / padded_positions, seconds=t_pad, tokens_per_s=real / t_pad),
                packed=dict(rows=len(packs), positions=len(packs) * psl, padding=1 - real / (len(packs) * psl),
                            seconds=t_pack, tokens_per_s=real / t_pack))


def build_model(a, work: Path) -> tuple[Path, Path]:
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.tiny import make_tiny_llava

    hf = make_tiny_llava(work / "hf", "llama", "clip", vision_overrides={"image_size": a.image_size,
                                                                         "patch_size": a.patch_size},
                         text_overrides={"hidden_size": a.hidden, "intermediate_size": a.hidden * 2,
                                         "num_hidden_layers": a.layers})
    return hf, convert_hf_to_megatron(hf, work / "meg", tp=1)


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--seq-length", type=int, default=4096, help="per-sample limit (default 4096)")
    p.add_argument("--samples", type=int, default=48, help="samples per side (default 48)")
    p.add_argument("--pack-factor", type=int, default=2, help="--packed-seq-length = this x --seq-length (2)")
    p.add_argument("--buffer", type=int, default=48, help="--packing-buffer-size: samples packed together (48: "
                   "the whole default mix, as a training run's buffer of hundreds of samples packs; 16 leaves a "
                   "quarter of the packs padding)")
    p.add_argument("--pad-micro-batch", type=int, default=2, help="padded side: samples per micro batch (2)")
    p.add_argument("--step-micro-batches", type=int, default=4, help="micro batches per optimizer step (4)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per side; the best is kept (1)")
    p.add_argument("--hidden", type=int, default=64, help="language model hidden size (64)")
    p.add_argument("--layers", type=int, default=2, help="language model layers (2)")
    p.add_argument("--image-size", type=int, default=48, help="vision input size; with --patch-size 2: 576 "
                                                              "image tokens (48)")
    p.add_argument("--patch-size", type=int, default=2, help="vision patch size (2)")
    p.add_argument("--text-scale", type=float, default=1.0, help="scale the mix's text lengths (1.0)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (local layers) or cuda (TE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--tiny", action="store_true", help="smoke run: 8 samples, --seq-length 1024, 64 tokens per "
                                                       "image (seconds; the suite runs it)")
    a = p.parse_args(argv)
    if a.tiny:
        a.seq_length, a.samples, a.image_size, a.buffer, a.text_scale = 1024, 8, 16, 8, 0.25
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    from megatron_vlm.runtime.spawn import run_world

    with tempfile.TemporaryDirectory(prefix="mvlm-bench-packing-") as tmp:
        hf, meg = build_model(a, Path(tmp))
        r = run_world(measure, 1, a, hf, meg)[0]
    ratio = r["packed"]["tokens_per_s"] / r["padded"]["tokens_per_s"]
    r["ratio"] = ratio
    print(f"{r['samples']} samples {r['kinds']}, mean {r['mean_length']:.0f} image-expanded positions, "
          f"--seq-length {a.seq_length}, {a.device} ({r['impl']} layers, {a.precision})")
    for side in ("padded", "packed"):
        s = r[side]
        print(f"  {side:7s} {s['rows']:3d} rows  padding {100 * s['padding']:5.1f}%  {s['seconds']:7.2f} s  "
              f"{s['tokens_per_s']:9.0f} real tokens/s")
    print(f"  packed / padded real tokens/s: {ratio:.2f}x (target >= 1.5)")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
