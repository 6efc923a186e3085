#!/usr/bin/env python
"""Convert an HF LLaVA directory into a Megatron checkpoint at a chosen TP/PP (torch_dist or legacy torch)."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.cli import (add_debug_flag, parse_pp_layers, positive_float, positive_int, run_cli,  # noqa: E402
                              setup_logging)
from megatron_vlm.convert.streaming import memory_size  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process, preload  # noqa: E402
from megatron_vlm.runtime.lean_imports import WANDB, mark_not_installed  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--hf-dir", required=True, help="HF LlavaForConditionalGeneration directory")
    p.add_argument("--megatron-dir", required=True,
                   help="output checkpoint directory (must not exist unless --overwrite)")
    p.add_argument("--tp", "--tensor-model-parallel-size", type=positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", "--pipeline-model-parallel-size", type=positive_int, default=1,
                   help="pipeline-parallel size")
    p.add_argument("--ep", "--expert-model-parallel-size", type=positive_int, default=1,
                   help="expert-parallel size of a mixture-of-experts LM (divides its experts): the layout of --verify's "
                        "world and of legacy rank files (mp_rank_TT[_PPP]_EEE); torch_dist reshards to any")
    p.add_argument("--etp", "--expert-tensor-parallel-size", type=positive_int, default=None,
                   help="tensor-parallel size inside each expert (default: --tp, as megatron-core)")
    p.add_argument("--pp-layers", default=None,
                   help="uneven language layers per PP stage, e.g. 3,1 (only first/last may differ)")
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=positive_int, default=1, metavar="N",
                   help="virtual pipeline stages (model chunks) per PP rank, as the training run will use: legacy rank "
                        "files then hold model0, model1, ... (Megatron-LM's layout), --verify runs the interleaved "
                        "schedule; torch_dist loads at any layout and only records it")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None, metavar="N",
                   help="the same, as language layers per model chunk (Megatron-LM's other flag; even splits)")
    p.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="torch_dist (megatron dist_checkpointing, reshards on load) or legacy torch rank files")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="weight dtype in the checkpoint (auto: as stored in the HF files)")
    p.add_argument("--verify", action="store_true",
                   help="before the checkpoint is committed, load it into a TPxPP(xEP) Megatron model (local "
                        "processes) and compare fp32 logits with HF; above --tolerance it is deleted (nothing is "
                        "written; with --overwrite the previous checkpoint stays) and the command exits non-zero")
    p.add_argument("--tolerance", type=positive_float, default=1e-4, help="max abs logit difference for --verify")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --megatron-dir")
    p.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="cap on the converter's memory, e.g. 16GB or 800MiB (a bare number is GiB); the conversion "
                        "holds a few tensors at a time and refuses at the start, naming the tensor, when the largest "
                        "does not fit (default: 80%% of the memory available); with --verify, also refused at the "
                        "start when the check would not fit")
    add_debug_flag(p)
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    mark_not_installed([WANDB])  # a conversion never logs: megatron-core's eager import of wandb is skipped
    from megatron_vlm.cli.inputs import check_hf_dir
    from megatron_vlm.cli.overlap import check_output_apart

    check_hf_dir(a.hf_dir, "--hf-dir")
    check_output_apart("--megatron-dir", a.megatron_dir, [("--hf-dir", a.hf_dir)])
    preload(["torch", "transformers"])  # after the input checks: what every conversion imports (megatron-core: where
    # it starts using it), with the collector paused
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    existed = os.path.exists(a.megatron_dir)
    diffs = []

    def verify(tmp_dir):
        from megatron_vlm.convert.verify import VerificationError, verify_checkpoint

        try:
            diffs.append(verify_checkpoint(a.hf_dir, tmp_dir, a.tp, a.pp, tolerance=a.tolerance, ep=a.ep, etp=a.etp))
        except VerificationError as e:
            kept = f"the previous checkpoint in {a.megatron_dir} is unchanged" if existed else \
                f"nothing was written to {a.megatron_dir}"
            raise VerificationError(
                f"--verify: {e}; the new checkpoint was deleted ({kept}). After --dtype bf16/fp16 a difference of "
                "that size is rounding: raise --tolerance; otherwise the conversion is wrong for this model: "
                "rerun with -v and report it") from None

    def verify_fits(spec):
        from megatron_vlm.convert.verify import check_memory

        check_memory(a.hf_dir, spec, a.tp, a.pp, a.max_memory, a.ep, a.etp)

    convert_hf_to_megatron(a.hf_dir, a.megatron_dir, tp=a.tp, pp=a.pp, pp_layers=parse_pp_layers(a.pp_layers),
                           ckpt_format=a.ckpt_format, dtype=a.dtype, overwrite=a.overwrite,
                           check=verify if a.verify else None, ep=a.ep, etp=a.etp, max_memory=a.max_memory,
                           before_write=verify_fits if a.verify else None, vpp=a.num_virtual_stages_per_pipeline_rank,
                           layers_per_virtual_stage=a.num_layers_per_virtual_pipeline_stage)
    from megatron_vlm.checkpoint import layout as ckpt

    vpp = ckpt.CheckpointMeta.load(os.path.join(a.megatron_dir, "release")).vpp
    layout = f"tp={a.tp} pp={a.pp}" + (f" vpp={vpp}" if vpp > 1 else "") + (
        f" ep={a.ep} etp={a.etp or a.tp}" if a.ep > 1 or a.etp else "")
    print(f"wrote {a.ckpt_format} checkpoint ({layout}) to {a.megatron_dir}")
    if a.verify:
        print(f"verify: max |logit diff| HF vs Megatron (fp32, {layout}) = {diffs[0]:.3g} <= {a.tolerance:g}: OK")


if __name__ == "__main__":
    exit_process(run_cli(main))
