#!/usr/bin/env python
"""Convert a Megatron checkpoint (converted or from training, any iteration, either format) to an HF LLaVA dir."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.cli import run_cli, setup_logging  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--megatron-dir", required=True,
                   help="checkpoint directory (with latest_checkpointed_iteration.txt) or one iteration directory; "
                        "written by megatron-vlm or by Megatron-LM")
    p.add_argument("--hf-config", default=None,
                   help="HF LLaVA directory or config.json describing a checkpoint that Megatron-LM wrote (checked "
                        "against the checkpoint's shapes and args; tokenizer, processor and the HF-only weights are "
                        "taken from that directory); not needed for megatron-vlm checkpoints")
    p.add_argument("--iteration", default=None,
                   help="iteration to export (an integer or 'release'; default: the tracker's latest)")
    p.add_argument("--hf-dir", required=True, help="output HF directory (must not exist unless --overwrite)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="where to take tokenizer/processor files from (default: <megatron-dir>/tokenizer, or the "
                        "--hf-config directory)")
    p.add_argument("--tp", type=int, default=None, help="expected TP of the checkpoint (checked if given)")
    p.add_argument("--pp", type=int, default=None, help="expected PP of the checkpoint (checked if given)")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size limit")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --hf-dir")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf

    it = a.iteration if a.iteration in (None, "release") else int(a.iteration)
    convert_megatron_to_hf(a.megatron_dir, a.hf_dir, iteration=it, tokenizer_dir=a.tokenizer_dir, tp=a.tp, pp=a.pp,
                           overwrite=a.overwrite, max_shard_bytes=int(a.max_shard_size_gb * 2**30),
                           hf_config=a.hf_config)
    print(f"wrote HF LLaVA model to {a.hf_dir}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
