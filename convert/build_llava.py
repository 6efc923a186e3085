#!/usr/bin/env python
"""Build an HF LLaVA directory from an HF causal LM and an HF vision encoder (CLIP or SigLIP).

--arch llava_onevision (or llava_next) builds the anyres model instead: image grid pinpoints, image_newline and
(OneVision) anyres_max_N downsampling; e.g. a OneVision-style model from Qwen2/Qwen3 + SigLIP so400m as published
(27 layers; LLaVA-OneVision reads the output of its 26th layer):
  --arch llava_onevision --vision-feature-layer -2

--arch internvl builds an InternVL3/3.5 model: --vision-model is an InternVL -HF checkpoint, whose InternViT (and
projector, when its width is the LM's) the new model takes, e.g. OpenGVLab/InternVL3_5-1B-HF with another Qwen3 LM."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.cli import add_debug_flag, nonneg_int, positive_int, run_cli, setup_logging  # noqa: E402
from megatron_vlm.runtime.gc_freeze import exit_process  # noqa: E402
from megatron_vlm.model.spec import SUPPORTED_TEXT, SUPPORTED_VISION  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--text-model", required=True,
                   help=f"HF causal LM directory ({', '.join(SUPPORTED_TEXT)})")
    p.add_argument("--vision-model", required=True,
                   help=f"HF {'/'.join(SUPPORTED_VISION)} directory (vision-only or the full dual encoder); --arch "
                        "internvl: an InternVL -HF checkpoint (its InternViT, and its projector when its width is the "
                        "LM's) or a vision-only InternViT")
    p.add_argument("--save-dir", required=True, help="output LLaVA directory (must not exist unless --overwrite)")
    p.add_argument("--vocab-size-padding", type=positive_int, default=None,
                   help="embedding rows: by default the LM's, or the next multiple of 64 when the added <image>/<pad> "
                        "do not fit (vicuna's 32000 -> 32064, as llava-1.5); N: round up to a multiple of N; the "
                        "tokenizer is unchanged")
    p.add_argument("--chat-template", default="keep", metavar="keep|llava|FILE",
                   help="keep (default): the text model's own chat template, with image parts rendered as the image "
                        "token (LLaVA-1.5's if it has none); llava: LLaVA-1.5's 'USER: ... ASSISTANT:'; or a Jinja "
                        "file")
    p.add_argument("--vision-feature-layer", type=int, default=None,
                   help="vision hidden state the projector reads (HF index; -2 = second to last layer). Default: -2; "
                        "--arch internvl: the InternVL checkpoint's (-1)")
    p.add_argument("--vision-feature-select-strategy", choices=["default", "full"], default=None,
                   help="'default' drops the CLS token (CLIP), 'full' keeps all tokens (default: default for "
                        "CLIP, full for SigLIP)")
    p.add_argument("--image-token", default="<image>", help="image placeholder token added to the tokenizer")
    p.add_argument("--no-projector-bias", action="store_true", help="projector linear layers without bias")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weight dtype of the saved model (auto: the text model's)")
    p.add_argument("--arch", choices=["llava", "llava_next", "llava_onevision", "internvl"], default="llava",
                   help="llava: one tile per image; llava_next / llava_onevision: anyres tiles with image_newline; "
                        "internvl: InternVL3/3.5 (InternViT, pixel shuffle, GotOcr2's dynamic tiles)")
    p.add_argument("--image-grid-pinpoints", default=None,
                   help="anyres resolutions as HxW,HxW,... (multiples of the vision image size; default: every "
                        "grid up to --max-grid x --max-grid tiles)")
    p.add_argument("--max-grid", type=positive_int, default=6,
                   help="default pinpoints: rows, cols in 1..N tiles (OneVision: 6)")
    p.add_argument("--vision-aspect-ratio", default="anyres_max_9",
                   help="OneVision: downsample the grid's features to about N tiles (anyres_max_N)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the projector initialisation")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save-dir")
    add_debug_flag(p)
    a = p.parse_args(argv)
    if not a.image_token.strip() or a.image_token != a.image_token.strip():
        p.error(f"argument --image-token: {a.image_token!r} must be a non-empty token without surrounding spaces")
    pins = None
    if a.image_grid_pinpoints:
        try:
            pins = [[int(v) for v in item.lower().split("x")] for item in a.image_grid_pinpoints.split(",")]
        except ValueError:
            pins = None
        if not pins or any(len(p_) != 2 or min(p_) < 1 for p_ in pins):
            p.error(f"argument --image-grid-pinpoints: {a.image_grid_pinpoints!r} must be HxW,HxW,... "
                    "(e.g. 384x768,768x384)")
    if a.chat_template not in ("keep", "llava") and not os.path.isfile(a.chat_template):
        p.error(f"argument --chat-template: {a.chat_template!r} is not keep, llava or a Jinja template file")
    if a.arch != "llava_onevision" and a.vision_aspect_ratio != "anyres_max_9":
        p.error("argument --vision-aspect-ratio: only --arch llava_onevision downsamples")
    from megatron_vlm.model.anyres import AnyresConfigError, parse_vision_aspect_ratio

    try:
        parse_vision_aspect_ratio(a.vision_aspect_ratio)
    except AnyresConfigError as e:
        p.error(f"argument --vision-aspect-ratio: {e}")
    setup_logging(a.verbose)
    from megatron_vlm.cli.inputs import check_hf_dir
    from megatron_vlm.cli.overlap import check_output_apart

    check_hf_dir(a.text_model, "--text-model")
    check_hf_dir(a.vision_model, "--vision-model")
    check_output_apart("--save-dir", a.save_dir, [("--text-model", a.text_model), ("--vision-model", a.vision_model)])
    from megatron_vlm.convert.build import build_llava

    build_llava(a.text_model, a.vision_model, a.save_dir, vocab_size_padding=a.vocab_size_padding,
                vision_feature_layer=a.vision_feature_layer,
                vision_feature_select_strategy=a.vision_feature_select_strategy, image_token=a.image_token,
                projector_bias=not a.no_projector_bias, dtype=a.dtype, seed=a.seed, overwrite=a.overwrite,
                arch=a.arch, grid_pinpoints=pins, vision_aspect_ratio=a.vision_aspect_ratio, max_grid=a.max_grid,
                chat_template=a.chat_template)
    # the result is logged once, by build_llava ("saved LLaVA (<lm> + <vision>, vocab ...) to DIR")


if __name__ == "__main__":
    exit_process(run_cli(main))
