"""The ``internvl`` step of bench/gpu.py: an InternVL built by ``build_llava --arch internvl`` (a Qwen2-style LM, an
InternViT with layer scales, 448-px tiles) and converted once in ``<inputs>/internvl``, its logits on the reference
batch of multi-tile images against HF's ``InternVLForConditionalGeneration``: fp32 with TF32 off and bf16, with
the ``logits`` step's tolerances."""

from __future__ import annotations

from pathlib import Path

from .logits import BF16_FACTOR, BF16_FLOOR, FP32_TOLERANCE, megatron_logits, no_tf32


INTERNVL_TILE = 448  # InternViT's tile: 32 x 32 patches of 14, 256 tokens after the pixel shuffle


def build_internvl_inputs(a, inputs: Path) -> tuple[Path, Path]:
    """(HF InternVL dir, converted TP1 checkpoint), built once in ``inputs/internvl``: ``build_llava --arch internvl``
    from a Qwen2-style LM (``--hidden``, 4 layers) and a vision-only InternViT (``--vision-hidden``, 4 layers with
    layer scales, InternViT-300M's norms and biases; ``--image-size`` with --tiny, else 448 px)."""
    import torch
    from transformers import InternVLVisionConfig, InternVLVisionModel

    from megatron_vlm.convert.build import build_llava
    from megatron_vlm.convert.build_internvl import default_image_processor
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.data.synthetic import COLOURS
    from tests.support.tiny import make_text_model

    work = inputs / "internvl"
    hf, meg = work / "hf", work / "megatron"
    if (meg / "latest_checkpointed_iteration.txt").is_file():
        return hf, meg
    tile = a.image_size if a.tiny else INTERNVL_TILE
    texts = ["what colour is the square ? " + " ".join(COLOURS)] * 4
    text = make_text_model(work / "text", "qwen2", texts=texts, hidden_size=a.hidden, num_hidden_layers=4,
                           num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
                           tokenizer="chatml")
    vh = a.vision_hidden
    vcfg = InternVLVisionConfig(hidden_size=vh, intermediate_size=4 * vh, num_hidden_layers=4,
                                num_attention_heads=max(1, vh // 64), image_size=[tile, tile], patch_size=[14, 14],
                                attention_bias=True, norm_type="layer_norm", layer_norm_eps=1e-6)
    torch.manual_seed(a.seed)
    vit = InternVLVisionModel(vcfg)
    with torch.no_grad():  # HF initialises the layer scales to 0.1, position embeddings and the class token to 0
        for name, p in vit.named_parameters():
            if name.endswith(("lambda_1", "lambda_2")) or "position_embeddings" in name or "cls_token" in name:
                p.add_(0.5 * torch.randn_like(p))
    vit.save_pretrained(str(work / "vit"))
    default_image_processor(tile).save_pretrained(str(work / "vit"))
    build_llava(text, work / "vit", hf, arch="internvl", vocab_size_padding=128)
    convert_hf_to_megatron(hf, meg, tp=1)  # in this process: one interpreter start less than the CLI
    return hf, meg


def internvl_hf_logits(hf_dir, batch, dtype, device):
    """HF InternVL's logits of each sample of ``batch`` alone (fp32 on CPU; zero beyond a sample's length)."""
    import torch
    from transformers import InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    out = torch.zeros(*batch.hf_input_ids.shape, model.config.text_config.vocab_size)
    with torch.no_grad():
        for b in range(batch.num_samples):
            inputs = batch.hf_sample(b)
            logits = model(input_ids=inputs["input_ids"].to(device),
                           pixel_values=inputs["pixel_values"].to(device, dtype)).logits[0]
            out[b, :logits.shape[0]] = logits.float().cpu()
    del model
    return out


def check_internvl(a, inputs: Path) -> list[dict]:
    """The InternVL rows: HF bf16 vs fp32 (the yardstick), then each of ``--impls`` in fp32 (TF32 off, 1e-4) and bf16
    (the yardstick's bound) on the reference batch of multi-tile images."""
    import torch

    from megatron_vlm.convert.verify import max_logit_diff, reference_batch
    from megatron_vlm.model.spec import VLMSpec

    row = dict(part="internvl")
    try:
        hf, meg = build_internvl_inputs(a, inputs)
    except Exception as e:  # report and go on
        return [dict(row, impl="set-up", dtype="-", ok=False, note=f"{type(e).__name__}: {e}"[:300])]
    no_tf32()
    spec = VLMSpec.from_hf_dir(hf)
    batch = reference_batch(spec)
    ref = internvl_hf_logits(hf, batch, torch.float32, a.device)
    yard = max_logit_diff(ref, internvl_hf_logits(hf, batch, torch.bfloat16, a.device), spec.vocab_size, batch)
    tiles = batch.num_image_tiles.tolist()
    rows = [dict(row, impl="HF transformers", dtype="bf16", diff=yard, tolerance=None, ok=None,
                 note=f"HF bf16 vs HF fp32: the yardstick; tiles per image {tiles}, {spec.num_image_tokens} tokens "
                      "each")]
    for impl in a.impls:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                got = megatron_logits(meg, batch, impl, dtype, a.device)
            except Exception as e:  # report and go on
                rows.append(dict(row, impl=impl, dtype=name, ok=False, note=f"{type(e).__name__}: {e}"[:300]))
                continue
            diff = max_logit_diff(ref, got, spec.vocab_size, batch)
            tol = FP32_TOLERANCE if dtype == torch.float32 else BF16_FACTOR * yard + BF16_FLOOR
            rows.append(dict(row, impl=impl, dtype=name, diff=diff, tolerance=tol, ok=diff <= tol,
                             note="TF32 off" if dtype == torch.float32 else
                             f"<= {BF16_FACTOR:g} x HF bf16 + {BF16_FLOOR:g}"))
    return rows
