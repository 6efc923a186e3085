#!/usr/bin/env python
"""Convert VQA / LLaVA / OpenAI-chat data into an energon webdataset (see megatron_vlm.data.make_wds).

  python data_prep/make_wds.py --format vqa   --input qa.jsonl|qa.csv --image-root IMAGES --output DATA/energon
  python data_prep/make_wds.py --format llava --input llava_v1_5_mix665k.json --image-root IMAGES --output DATA/energon
  python data_prep/make_wds.py --format chat  --input messages.jsonl[.gz] --output DATA/energon
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_vlm.files import storage  # noqa: E402
from megatron_vlm.cli import add_debug_flag, fraction, positive_int, progress_bars, run_cli  # noqa: E402
from megatron_vlm.cli.overlap import check_output_apart  # noqa: E402
from megatron_vlm.data.make_wds import DEFAULT_MAX_TEXT_CHARS, SUMMARY_FILE, make_wds  # noqa: E402
from megatron_vlm.data.prepare import dataset_layout, interactive_hint  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process  # noqa: E402

FORMAT_HELP = """input formats:
  vqa    jsonl or csv rows {image, question, answer}; optional id. Tars hold K.jpg, K.txt (answer),
         K.json ({"question", "id", "source"}): energon's VQASample with field map
         image=jpg, context=json[question], answers=txt. A row may give a video instead of the image:
         {video, question, answer} -> K.mp4 in place of K.jpg (the dataset is then prepared as
         ConversationSamples, whose loader reads both).
  llava  LLaVA json (array) or jsonl: {id, image (path, list of paths or absent), conversations:
         [{from: human|gpt|system, value}]} with <image> placeholders; all turns are kept. LLaVA-NeXT's
         video records {id, video: path, conversations} too: their <image> placeholder is the video.
  chat   OpenAI chat-completion jsonl or jsonl.gz: {messages: [{role, content}]}, content a string or
         parts of type text, image_url and video_url (base64 data URL, or a path under --image-root).

Videos (mp4/mov, mkv/webm, avi) are stored byte for byte after PyAV checked them (a video stream with a
frame size, frames, a first frame that decodes, a frame rate and a duration); a bad video rejects its record.

Rejected records (unreadable/missing image, <image> count not matching the images, empty answer or
conversation, invalid UTF-8, a path that escapes --image-root, a message longer than --max-text-chars)
go to OUTPUT/rejected.jsonl with their source line and reason. Output is written atomically and is
byte-identical for the same input.

Image paths are relative to --image-root. Absolute paths and '..' that leaves it are refused; so are
symlinks whose target lies outside it, unless --allow-symlinks-outside-image-root is given (for a root
assembled from links into other directories). A refused path rejects its record."""


def main(argv=None) -> int:
    """The command; returns its exit code (errors: one ``error:`` line, exit 2; see megatron_vlm.cli)."""
    return run_cli(_run, argv)


def _run(argv) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, 
        description=__doc__.splitlines()[0],
        epilog=FORMAT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--format", required=True, choices=("vqa", "llava", "chat"),
                   help="input format: vqa (rows of image, question, answer), llava (LLaVA json: conversations "
                   "with <image>), chat (OpenAI chat messages with image_url parts); see 'input formats' below")
    p.add_argument("--input", required=True, type=Path, help="input file (.jsonl, .jsonl.gz, .json, .csv)")
    p.add_argument("--image-root", type=Path, default=None,
                   help="directory image paths are relative to (default: the input file's directory)")
    p.add_argument("--output", required=True,
                   help="output dataset directory (must not exist unless --overwrite), or an object-store URL msc://PROFILE/PATH "
                   "(profile from the MSC config named by MSC_CONFIG): the tars are uploaded there and "
                   "energon prepare runs on the remote copy")
    p.add_argument("--shard-size", type=positive_int, default=1000, help="samples per tar (default 1000)")
    p.add_argument("--split", default="9,1,0", help="train,val,test weights for energon prepare (default 9,1,0)")
    p.add_argument("--workers", type=positive_int, default=1, help="worker processes decoding images (default 1)")
    p.add_argument("--no-prepare", action="store_true",
                   help="only write the tars; run `energon prepare ./` yourself (interactive)")
    p.add_argument("--max-bad-fraction", type=fraction, default=0.01,
                   help="fail when more than this fraction of records is rejected (default 0.01)")
    p.add_argument("--max-text-chars", type=positive_int, default=DEFAULT_MAX_TEXT_CHARS,
                   help="reject a record with a message longer than this many characters "
                   f"(default {DEFAULT_MAX_TEXT_CHARS:,})")
    p.add_argument("--allow-symlinks-outside-image-root", action="store_true",
                   help="follow image symlinks whose target lies outside --image-root (refused by default)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    progress_bars()
    image_root = args.image_root if args.image_root is not None else args.input.parent
    # --output may lie inside --image-root (a dataset beside the images), but not replace a directory there that
    # make_wds did not write: it could hold the images
    replaces_other = os.path.isdir(args.output) and not os.path.isfile(os.path.join(args.output, SUMMARY_FILE))
    check_output_apart("--output", args.output, [("--input", args.input), ("--image-root", image_root)],
                       inside_ok=() if replaces_other else ("--image-root",))

    result = make_wds(
        args.format, args.input, args.output, image_root=args.image_root, shard_size=args.shard_size,
        split=args.split, workers=args.workers, prepare=not args.no_prepare,
        max_bad_fraction=args.max_bad_fraction, overwrite=args.overwrite, progress=not args.no_progress,
        max_text_chars=args.max_text_chars, allow_outside_symlinks=args.allow_symlinks_outside_image_root,
    )
    print(f"wrote {result.written} samples in {len(result.shards)} shards to {result.output} "
          f"({result.rejected} of {result.total} records rejected -> {storage.join(result.output, 'rejected.jsonl')})")
    if result.rejected:
        print("rejected: " + ", ".join(f"{k}: {v}" for k, v in result.reasons.items()))
    if args.no_prepare:
        print(interactive_hint(result.output, dataset_layout(args.format, result.videos), args.split))
    else:
        for name, shards in result.splits.items():
            print(f"split {name}: {len(shards)} shards")
    return 0


if __name__ == "__main__":
    exit_process(main())
