#!/usr/bin/env python
"""Count samples and tokens of prepared energon datasets and write a blend (see megatron_vlm.data.stats).

  python data_prep/stats.py DATA/energon [DATA2/energon ...] --tokenizer HF_LLAVA_DIR [--seq-length 2048]

Writes OUT_DIR/stats.json (per dataset and split: samples, images, text tokens with the model's chat
template, image tokens, samples over --seq-length) and OUT_DIR/metadataset.yaml, an energon metadataset
blending the datasets by weight (default: their train sample counts) that training can take as data path.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_vlm.atomic import atomic_write_text  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("datasets", nargs="+", type=Path, help="prepared energon dataset directories")
    p.add_argument("--tokenizer", required=True, type=Path, help="HF LLaVA directory (tokenizer, chat template, processor)")
    p.add_argument("--seq-length", type=int, default=2048, help="training sequence length (default 2048)")
    p.add_argument("--weights", default=None, help="comma-separated blend weights, one per dataset "
                   "(default: train sample counts)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where stats.json and metadataset.yaml go (default: the first dataset's parent)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    from megatron_vlm.data.stats import metadataset_yaml, summarize
    from megatron_vlm.data.task_encoder import VLMTaskEncoder

    for d in args.datasets:
        if not (d / ".nv-meta" / "split.yaml").is_file():
            print(f"error: {d} is not a prepared energon dataset (no .nv-meta/split.yaml)", file=sys.stderr)
            return 2
    weights = None
    if args.weights:
        weights = [float(w) for w in args.weights.split(",")]
        if len(weights) != len(args.datasets):
            print(f"error: --weights has {len(weights)} values for {len(args.datasets)} datasets", file=sys.stderr)
            return 2
    te = VLMTaskEncoder(args.tokenizer, args.seq_length)
    summary = summarize(args.datasets, te, args.seq_length, progress=not args.no_progress)
    if weights is None:
        weights = [float(summary["datasets"][str(d)].get("train", {}).get("samples", 0)) for d in args.datasets]
    out_dir = args.output_dir or args.datasets[0].absolute().parent
    yaml_path = out_dir / "metadataset.yaml"
    splits = [s for s in ("train", "val") if summary["total"].get(s, {}).get("samples")]
    summary["blend"] = {"metadataset": str(yaml_path), "weights": dict(zip(map(str, args.datasets), weights))}
    atomic_write_text(out_dir / "stats.json", json.dumps(summary, indent=2) + "\n")
    datasets = list(zip(args.datasets, weights))
    atomic_write_text(yaml_path, metadataset_yaml(yaml_path, [d for d in datasets if d[1] > 0], splits))
    for name, per in summary["datasets"].items():
        for split, s in per.items():
            print(f"{name} {split}: {s['samples']} samples, {s['images']} images, {s['text_tokens']} text + "
                  f"{s['image_tokens']} image tokens, {s['over_seq_length']} over {args.seq_length}")
    print(f"wrote {out_dir / 'stats.json'} and {yaml_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
