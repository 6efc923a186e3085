#!/usr/bin/env python
"""Count samples and tokens of prepared energon datasets and write a blend (see megatron_vlm.data.stats).

  python data_prep/stats.py DATA/energon [DATA2/energon ...] --tokenizer HF_LLAVA_DIR [--seq-length 2048]

Writes stats.json (per dataset and split: samples, images, text tokens with the model's chat template, image
tokens, videos and their tokens (frames chosen by --video-fps/--video-frames, as training chooses them), samples
over --seq-length) and metadataset.yaml, an energon metadataset blending the datasets by weight (default: their
train sample counts) that training can take as --data-path. They go into --output-dir; for one dataset that
defaults to the dataset's own directory (beside its make_wds.json), and several datasets need --output-dir. The
paths are printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_vlm.files.atomic import atomic_write_text  # noqa: E402
from megatron_vlm.cli import InputError, add_debug_flag, positive_int, progress_bars, run_cli, weight_list  # noqa: E402
from megatron_vlm.cli.inputs import check_tokenizer_dir  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process  # noqa: E402


def main(argv=None) -> int:
    """The command; returns its exit code (errors: one ``error:`` line, exit 2; see megatron_vlm.cli)."""
    return run_cli(_run, argv)


def _run(argv) -> int:
    from megatron_vlm.data.limits import DEFAULT_MAX_TEXT_BYTES  # not megatron_vlm.data.stats: energon is heavy

    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("datasets", nargs="+", type=Path, help="prepared energon dataset directories")
    p.add_argument("--tokenizer", required=True, type=Path,
                   help="HF LLaVA directory (tokenizer, chat template, processor)")
    p.add_argument("--seq-length", type=positive_int, default=2048, help="training sequence length (default 2048)")
    p.add_argument("--weights", type=weight_list, default=None, help="comma-separated blend weights, one per "
                   "dataset, not negative, at least one positive (default: train sample counts)")
    p.add_argument("--max-text-bytes", type=positive_int, default=DEFAULT_MAX_TEXT_BYTES,
                   help="samples whose text is larger are counted as over --seq-length without tokenizing "
                   f"them, which keeps time and memory bounded (default {DEFAULT_MAX_TEXT_BYTES})")
    p.add_argument("--video-fps", type=float, default=1.0, metavar="N", help="LLaVA-OneVision videos: one frame "
                   "every round(fps / N) frames, as train/run.py --video-fps (default 1: one per second)")
    p.add_argument("--video-frames", type=positive_int, default=32, metavar="N", help="at most N frames per video, "
                   "evenly spaced, as train/run.py --video-frames (default 32)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where stats.json and metadataset.yaml go (default, for one dataset: its own directory; "
                   "required for several)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (one is drawn only when stderr is a terminal)")
    add_debug_flag(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    progress_bars()

    for d in args.datasets:
        if not (d / ".nv-meta" / "split.yaml").is_file():
            raise InputError(f"{d} is not a prepared energon dataset (no .nv-meta/split.yaml); write it with "
                             "data_prep/make_wds.py")
    weights = args.weights
    if weights is not None and len(weights) != len(args.datasets):
        raise InputError(f"--weights has {len(weights)} values for {len(args.datasets)} datasets")
    if args.output_dir is None and len(args.datasets) > 1:
        raise InputError(f"--output-dir is needed to blend {len(args.datasets)} datasets: name the directory for "
                         "stats.json and metadataset.yaml (e.g. the one that holds the datasets)")
    check_tokenizer_dir(args.tokenizer, "--tokenizer")

    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.data.stats import metadataset_yaml, summarize
    from megatron_vlm.model.spec import VLMSpec

    if not args.video_fps > 0:
        raise InputError(f"--video-fps {args.video_fps}: must be positive")
    te = task_encoder_for(VLMSpec.from_hf_dir(args.tokenizer), args.tokenizer, args.seq_length,
                          video_fps=args.video_fps, video_frames=args.video_frames)
    summary = summarize(args.datasets, te, args.seq_length, progress=not args.no_progress,
                        max_text_bytes=args.max_text_bytes)
    if weights is None:
        weights = [float(summary["datasets"][str(d)].get("train", {}).get("samples", 0)) for d in args.datasets]
        if not any(weights):
            raise InputError(f"no dataset among {', '.join(map(str, args.datasets))} has training samples, so the "
                             "blend would be empty; prepare datasets with a train split (make_wds --split)")
    out_dir = args.output_dir or args.datasets[0]
    yaml_path = out_dir / "metadataset.yaml"
    splits = [s for s in ("train", "val") if summary["total"].get(s, {}).get("samples")]
    summary["blend"] = {"metadataset": str(yaml_path), "weights": dict(zip(map(str, args.datasets), weights))}
    atomic_write_text(out_dir / "stats.json", json.dumps(summary, indent=2) + "\n")
    datasets = list(zip(args.datasets, weights))
    atomic_write_text(yaml_path, metadataset_yaml(yaml_path, [d for d in datasets if d[1] > 0], splits))
    for name, per in summary["datasets"].items():
        for split, s in per.items():
            videos = f", {s['videos']} videos ({s['video_tokens']} video tokens)" if s.get("videos") else ""
            print(f"{name} {split}: {s['samples']} samples, {s['images']} images, {s['text_tokens']} text + "
                  f"{s['image_tokens']} image tokens{videos}, {s['over_seq_length']} over {args.seq_length}"
                  + (f" ({s['too_long_to_count']} too long to tokenize)" if s.get("too_long_to_count") else ""))
    print(f"wrote {out_dir / 'stats.json'} and {yaml_path}")
    return 0


if __name__ == "__main__":
    exit_process(main())
