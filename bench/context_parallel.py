#!/usr/bin/env python
"""Context parallelism's memory and vision work: the peak memory per rank of one training step on ONE long OneVision
video sample at CP1, CP2 and CP4, and each rank's share of the vision encoder, on CPU (local layers: the reference
attention), measured in one run (a benchmark, not a test).

The model is a OneVision at OneVision's 384-px frames and patch 14 (729 patches a frame, 196 positions after pooling,
+1 per video) with SigLIP-400M's depth (``--vision-layers`` 27) at a CPU's width (``--vision-hidden`` 64), trained
(``--unfreeze-vit``, the default here: its activations count) or frozen (``--freeze-vit``), and a small language model
(random weights): the sample is the size a real one is, the layers small enough for a CPU. Each CP size runs in its
own local world of CP ranks (gloo), one step (stage 2, fp32) of the same sample from the same weights, with the
vision encoder's tiles shared out over the CP ranks (``--vision-cp-split``, the default) and without it (every rank
encodes every frame). Every rank reports its peak resident memory during the step (Linux VmHWM, reset when the step
begins) above what it held when the step began (model, optimizer, libraries), and its vision encoder's forward
passes: frames encoded, and this process's CPU seconds from the encoder's input to its gathered output. Printed per
run: the step's loss (the same at every CP: one model, one sample), the peak per rank above the start and its ratio to
CP1's, the frames and vision CPU seconds of the busiest rank and that ratio, the step's seconds, and the
``--dry-run`` estimate's activations for the same layout (megatron_vlm.model.memory).

  python bench/context_parallel.py [--frames 24] [--cp 1,2,4] [--vision-layers 27] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(root: Path, layers: int, heads: int, vision_layers: int, vision_hidden: int) -> Path:
    """A OneVision at 384 px / patch 14 with ``vision_layers`` ViT layers of ``vision_hidden`` (head dim 64), the tiny
    Qwen2 LM with ``layers`` layers of ``heads`` heads (one KV head)."""
    from tests.support.tiny import make_tiny_onevision

    vision = {"image_size": 384, "patch_size": 14, "num_hidden_layers": vision_layers, "hidden_size": vision_hidden,
              "intermediate_size": 4 * vision_hidden, "num_attention_heads": max(1, vision_hidden // 64)}
    return make_tiny_onevision(root / "ov384", vision_overrides=vision,
                               max_grid=6, vision_aspect_ratio="anyres_max_9",
                               text_overrides={"num_hidden_layers": layers, "num_attention_heads": heads,
                                               "num_key_value_heads": 1, "max_position_embeddings": 32768})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--frames", type=int, default=24, help="frames of the video (729 patches, 196 positions each; "
                   "default 24)")
    p.add_argument("--cp", default="1,2,4", help="context-parallel sizes, each its own world (default 1,2,4)")
    p.add_argument("--layers", type=int, default=1, help="language-model layers (default 1)")
    p.add_argument("--heads", type=int, default=2, help="attention heads of the language model (default 2)")
    p.add_argument("--vision-layers", type=int, default=27, help="vision encoder layers (default 27: SigLIP-400M's)")
    p.add_argument("--vision-hidden", type=int, default=64, help="vision encoder width (default 64; SigLIP-400M's "
                   "1152 does not fit a CPU's memory at this length)")
    p.add_argument("--freeze-vit", action="store_true", help="freeze the vision encoder (default: it trains, so its "
                   "activations are kept)")
    p.add_argument("--no-unsplit", action="store_true", help="skip the runs without --vision-cp-split")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.cp.split(",")]

    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.runtime.spawn import run_world
    from megatron_vlm.model.spec import VLMSpec
    from tests.support.memory_jobs import step_peak_jobs
    from tests.support.train_jobs import long_video_batch
    from megatron_vlm.model import memory
    from megatron_vlm.training.config import TrainConfig

    with tempfile.TemporaryDirectory(prefix="bench_cp_", dir=a.work_dir) as tmp:
        root = Path(tmp)
        hf = build_model(root, a.layers, a.heads, a.vision_layers, a.vision_hidden)
        meg = convert_hf_to_megatron(hf, root / "meg", tp=1)
        positions = a.frames * 196 + 1 + 80  # the video and its question and answer
        seq = -(-positions // 64) * 64
        (sample,) = long_video_batch(hf, frames=a.frames, seq_length=seq, side=32, others=False)
        spec = VLMSpec.from_hf_dir(hf)
        print(f"one sample: a {a.frames}-frame video, {int(sample.num_tokens)} positions (--seq-length {seq}); "
              f"LM {spec.num_layers} layer(s), hidden {spec.hidden_size}, {spec.num_attention_heads} heads; "
              f"vision 384 px, patch 14, {a.vision_layers} layers of {a.vision_hidden}, "
              f"{'frozen' if a.freeze_vit else 'trained'}", flush=True)
        rows = []
        for cp in sizes:
            for split in ((True,) if cp == 1 or a.no_unsplit else (False, True)):
                job = dict(name=f"cp{cp}", cp=cp, seq_length=seq, micro_batch_size=1, stage=2,
                           freeze_vit=a.freeze_vit, vision_cp_split=split, time_vision=True)
                t0 = time.perf_counter()
                r = run_world(step_peak_jobs, cp, str(meg), str(hf), [sample], [job])[0][0]
                extra = [m["peak"] - m["before"] for m in r["ranks"]]
                cfg = TrainConfig(device="cpu", gpus=cp, cp=cp, seq_length=seq, micro_batch_size=1,
                                  global_batch_size=1, stage=2, precision="fp32", transformer_impl="local",
                                  freeze_vit=a.freeze_vit, vision_cp_split=split)
                est = memory.estimate(spec, memory.Layout.of_config(cfg, fused_attention=False))[0].activations
                busiest = max(r["ranks"], key=lambda m: m["vision_cpu_s"])
                rows.append(dict(cp=cp, split=split, loss=r["loss"], peak_extra=max(extra), peak_extra_ranks=extra,
                                 peak=max(m["peak"] for m in r["ranks"]), step_s=max(m["seconds"] for m in r["ranks"]),
                                 vision_tiles=[m["vision_tiles"] for m in r["ranks"]],
                                 vision_cpu_s=busiest["vision_cpu_s"], vision_s=busiest["vision_s"],
                                 estimate_activations=est, world_s=time.perf_counter() - t0))
                print(f"  CP{cp}{'' if split else ' unsplit'}: loss {r['loss']:.6f}, peak per rank above the start "
                      f"{max(extra) / 2**30:.3f} GiB (ranks: {', '.join(f'{x / 2**30:.3f}' for x in extra)}), "
                      f"frames per rank {rows[-1]['vision_tiles']}, vision {busiest['vision_cpu_s']:.1f} CPU-s, "
                      f"step {rows[-1]['step_s']:.1f} s", flush=True)
    base = rows[0]
    print(f"\n{'CP':>3} {'split':>5} {'loss':>10} {'peak/rank GiB':>14} {'x CP1':>7} {'1/CP':>6} {'frames':>7} "
          f"{'vision CPU-s':>12} {'x CP1':>6} {'estimate GiB':>13} {'x CP1':>7} {'step s':>7}")
    for r in rows:
        r["ratio"] = r["peak_extra"] / base["peak_extra"]
        r["vision_ratio"] = r["vision_cpu_s"] / base["vision_cpu_s"]
        r["estimate_ratio"] = r["estimate_activations"] / base["estimate_activations"]
        print(f"{r['cp']:>3} {'on' if r['split'] else 'off':>5} {r['loss']:>10.6f} {r['peak_extra'] / 2**30:>14.3f} "
              f"{r['ratio']:>7.3f} {1 / r['cp']:>6.3f} {max(r['vision_tiles']):>7} {r['vision_cpu_s']:>12.2f} "
              f"{r['vision_ratio']:>6.3f} {r['estimate_activations'] / 2**30:>13.3f} {r['estimate_ratio']:>7.3f} "
              f"{r['step_s']:>7.1f}")
    same = max(abs(r["loss"] - base["loss"]) / abs(base["loss"]) for r in rows)
    print(f"\nlosses agree within {same:.1e} (relative); {int(sample.num_tokens)} positions")
    if a.out:
        a.out.write_text(json.dumps({"frames": a.frames, "positions": int(sample.num_tokens), "seq_length": seq,
                                     "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
