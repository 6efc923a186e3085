#!/usr/bin/env python
"""Print docs/training.md's sizing table: memory per GPU of 7-8 B and 72 B LLaVA / OneVision runs on 8 GPUs
of 80 GB, computed by the launcher's estimator (megatron_vlm.model.memory), from the published models' shapes.

  python tools/sizing_table.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.model.spec import VLMSpec  # noqa: E402
from megatron_vlm.model import memory  # noqa: E402

CLIP_L336 = dict(vision_family="clip", vision_num_layers=24, vision_hidden_size=1024, vision_ffn_hidden_size=4096,
                 vision_num_attention_heads=16, image_size=336, patch_size=14, vision_feature_layer=-2)
SIGLIP_SO400M = dict(vision_family="siglip", vision_num_layers=27, vision_hidden_size=1152,
                     vision_ffn_hidden_size=4304, vision_num_attention_heads=16, image_size=384, patch_size=14,
                     vision_feature_layer=-2, vision_feature_select_strategy="full", arch="llava_onevision",
                     image_grid_pinpoints=[[384, 384]], vision_aspect_ratio="anyres_max_9")
COMMON = dict(norm_epsilon=1e-6, rotary_base=1e6, max_position_embeddings=32768, image_token_id=0)

MODELS = {
    # name: (language model shapes, vision encoder)
    "LLaVA-1.5-7B (vicuna-7b + CLIP-L/336)": (dict(
        text_family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
        num_query_groups=32, kv_channels=128, vocab_size=32064), CLIP_L336),
    "LLaVA on Llama-3.1-8B + CLIP-L/336": (dict(
        text_family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, kv_channels=128, vocab_size=128320), CLIP_L336),
    "OneVision Qwen2-7B + SigLIP so400m": (dict(
        text_family="qwen2", num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
        num_query_groups=4, kv_channels=128, vocab_size=152064, qkv_bias=True), SIGLIP_SO400M),
    "OneVision Qwen3-8B + SigLIP so400m": (dict(
        text_family="qwen3", num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
        num_query_groups=8, kv_channels=128, vocab_size=151936, qk_layernorm=True), SIGLIP_SO400M),
    "OneVision Qwen2-72B + SigLIP so400m": (dict(
        text_family="qwen2", num_layers=80, hidden_size=8192, ffn_hidden_size=29568, num_attention_heads=64,
        num_query_groups=8, kv_channels=128, vocab_size=152064, qkv_bias=True), SIGLIP_SO400M),
}

# (model, stage, gpus, tp, pp, dist_optim, micro batch, seq length, recompute)
ROWS = [
    ("LLaVA-1.5-7B (vicuna-7b + CLIP-L/336)", 1, 8, 1, 1, False, 16, 2048, None),
    ("LLaVA-1.5-7B (vicuna-7b + CLIP-L/336)", 1, 8, 1, 1, False, 16, 2048, "full"),
    ("LLaVA-1.5-7B (vicuna-7b + CLIP-L/336)", 2, 8, 1, 1, False, 1, 2048, None),
    ("LLaVA-1.5-7B (vicuna-7b + CLIP-L/336)", 2, 8, 1, 1, True, 4, 2048, None),
    ("LLaVA-1.5-7B (vicuna-7b + CLIP-L/336)", 2, 8, 2, 1, True, 4, 2048, None),
    ("LLaVA on Llama-3.1-8B + CLIP-L/336", 2, 8, 2, 1, True, 2, 4096, None),
    ("OneVision Qwen2-7B + SigLIP so400m", 1, 8, 1, 1, False, 4, 8192, "full"),
    ("OneVision Qwen2-7B + SigLIP so400m", 2, 8, 1, 1, True, 1, 8192, None),
    ("OneVision Qwen2-7B + SigLIP so400m", 2, 8, 2, 1, True, 1, 8192, None),
    ("OneVision Qwen2-7B + SigLIP so400m", 2, 8, 4, 1, True, 1, 32768, "full"),
    ("OneVision Qwen3-8B + SigLIP so400m", 2, 8, 2, 1, True, 1, 8192, None),
    ("OneVision Qwen2-72B + SigLIP so400m", 1, 8, 8, 1, False, 1, 8192, None),
    ("OneVision Qwen2-72B + SigLIP so400m", 2, 8, 8, 1, True, 1, 8192, "full"),
    ("OneVision Qwen2-72B + SigLIP so400m", 2, 8, 4, 2, True, 1, 8192, "full"),
    ("OneVision Qwen2-72B + SigLIP so400m", 2, 32, 8, 2, True, 1, 8192, "full"),
    ("OneVision Qwen2-72B + SigLIP so400m", 2, 64, 8, 2, True, 1, 8192, "full"),
]


def spec_of(name: str) -> VLMSpec:
    lm, vision = MODELS[name]
    return VLMSpec(**{**COMMON, **lm, **vision})


def row(name, stage, gpus, tp, pp, dist, mbs, seq, recompute, limit_gib=80.0) -> str:
    layout = memory.Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), micro_batch_size=mbs, grad_accum=8, seq_length=seq,
                           precision="bf16", dist_optim=dist, recompute_granularity=recompute,
                           fused_attention=True, trained=(False, True, stage == 2))
    worst = max(memory.estimate(spec_of(name), layout), key=lambda s: s.total)
    g = [x / memory.GIB for x in (worst.weights, worst.gradients, worst.optimizer, worst.activations, worst.total)]
    fits = "yes" if worst.total <= limit_gib * memory.GIB else "**no**"
    flags = f"`-g {gpus} --tp {tp}" + (f" --pp {pp}" if pp > 1 else "") + (" --dist-optim" if dist else "") + \
        f" --mbs {mbs} --seq-length {seq}" + (f" --recompute-granularity {recompute}" if recompute else "") + "`"
    return (f"| {name} | {stage} | {flags} | {g[0]:.1f} | {g[1]:.1f} | {g[2]:.1f} | {g[3]:.1f} | **{g[4]:.1f}** | "
            f"{fits} |")


def main() -> None:
    print("| model | stage | layout (bf16) | weights | gradients | optimizer | activations | total GiB | fits 80 GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        print(row(*r))


if __name__ == "__main__":
    main()
