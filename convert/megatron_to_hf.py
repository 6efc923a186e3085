#!/usr/bin/env python
"""Convert a Megatron checkpoint (converted or from training, any iteration, either format) to an HF LLaVA dir."""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.cli import (add_debug_flag, iteration, positive_float, positive_int, run_cli,  # noqa: E402
                              setup_logging)
from megatron_vlm.convert.streaming import memory_size  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process, preload  # noqa: E402
from megatron_vlm.runtime.lean_imports import WANDB, mark_not_installed  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--megatron-dir", required=True,
                   help="checkpoint directory (with latest_checkpointed_iteration.txt: a converted checkpoint or a "
                        "training run) or one of its iteration directories (iter_XXXXXXX, release); written by "
                        "megatron-vlm or by Megatron-LM")
    p.add_argument("--hf-config", default=None,
                   help="HF LLaVA directory or config.json describing a checkpoint that Megatron-LM wrote (checked "
                        "against the checkpoint's shapes and args; tokenizer, processor and the HF-only weights are "
                        "taken from that directory); not needed for megatron-vlm checkpoints")
    p.add_argument("--iteration", type=iteration, default=None,
                   help="iteration to export (an integer or 'release'; default: the tracker's latest; with an "
                        "iteration directory as --megatron-dir it must name that one)")
    p.add_argument("--hf-dir", required=True, help="output HF directory (must not exist unless --overwrite)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="where to take tokenizer/processor files from (default: the checkpoint directory's "
                        "tokenizer/, also when --megatron-dir is one of its iteration directories; or the --hf-config "
                        "directory)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weight dtype of the HF model (auto: the checkpoint's, from its ckpt_meta.json: a training "
                        "run's precision, e.g. bf16, or the dtype a converted checkpoint was written in)")
    p.add_argument("--tp", "--tensor-model-parallel-size", type=positive_int, default=None,
                   help="expected TP of the checkpoint (checked if given)")
    p.add_argument("--pp", "--pipeline-model-parallel-size", type=positive_int, default=None,
                   help="expected PP of the checkpoint (checked if given)")
    p.add_argument("--max-shard-size-gb", type=positive_float, default=5.0,
                   help="safetensors shard size limit in GiB (at least 0.01)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --hf-dir")
    p.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="cap on the converter's memory, e.g. 16GB or 800MiB (a bare number is GiB); the export "
                        "holds a few tensors at a time and refuses at the start, naming the tensor, when the largest "
                        "does not fit (default: 80%% of the memory available)")
    add_debug_flag(p)
    a = p.parse_args(argv)
    if a.max_shard_size_gb < 0.01:
        p.error(f"argument --max-shard-size-gb: {a.max_shard_size_gb:g} is below 0.01 GiB (10 MiB); a model "
                "would be split into thousands of files")
    setup_logging(a.verbose)
    mark_not_installed([WANDB])  # a conversion never logs: megatron-core's eager import of wandb is skipped
    from megatron_vlm.files import storage
    from megatron_vlm.checkpoint.checks import ITERATION_DIR_RE, check_checkpoint
    from megatron_vlm.cli.inputs import check_tokenizer_dir
    from megatron_vlm.cli.overlap import check_output_apart

    run = a.megatron_dir  # the checkpoint directory: a run's iteration directory lies in it
    if storage.is_remote(a.megatron_dir):
        if ITERATION_DIR_RE.fullmatch(a.megatron_dir.rstrip("/").rsplit("/", 1)[-1]):
            run = a.megatron_dir.rstrip("/").rsplit("/", 1)[0]
    else:
        it_dir = check_checkpoint(a.megatron_dir, a.iteration)
        if it_dir == Path(a.megatron_dir) and ITERATION_DIR_RE.fullmatch(it_dir.absolute().name):
            run = str(it_dir.absolute().parent)  # it holds the tokenizer
        default_tok = os.path.join(run, "tokenizer")
        if a.tokenizer_dir is None and os.path.isdir(default_tok):
            check_tokenizer_dir(default_tok, "the checkpoint's tokenizer directory")
    if a.tokenizer_dir is not None:  # copied into --hf-dir: an HF dir without a tokenizer looks complete but is not
        check_tokenizer_dir(a.tokenizer_dir, "--tokenizer-dir")
    hf_config = a.hf_config and (os.path.dirname(os.path.abspath(a.hf_config)) if a.hf_config.endswith(".json")
                                 else a.hf_config)
    check_output_apart("--hf-dir", a.hf_dir, [
        ("--megatron-dir", a.megatron_dir), ("the checkpoint directory of --megatron-dir", run if run != a.megatron_dir
                                             else None),
        ("--tokenizer-dir", a.tokenizer_dir), ("--hf-config", hf_config)])
    preload(["torch", "transformers"])  # after the input checks: what every conversion imports (megatron-core: where
    # it starts using it), with the collector paused
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf

    from megatron_vlm.model.spec import family_name

    out = convert_megatron_to_hf(a.megatron_dir, a.hf_dir, iteration=a.iteration, tokenizer_dir=a.tokenizer_dir,
                                 tp=a.tp, pp=a.pp, overwrite=a.overwrite,
                                 max_shard_bytes=int(a.max_shard_size_gb * 2**30), hf_config=a.hf_config,
                                 dtype=None if a.dtype == "auto" else a.dtype, max_memory=a.max_memory)

    arch = json.loads((Path(out) / "config.json").read_text()).get("model_type")
    print(f"wrote HF {family_name(arch)} model to {a.hf_dir}")


if __name__ == "__main__":
    exit_process(run_cli(main))
