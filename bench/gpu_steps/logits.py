"""The ``logits`` step of bench/gpu.py: HF ``LlavaForConditionalGeneration`` against the Megatron model loaded from
the converted checkpoint (TP=1, in this process) with each layer implementation, in fp32 with TF32 off (within
:data:`FP32_TOLERANCE`) and in bf16 (within :data:`BF16_FACTOR` x HF's own bf16 error + :data:`BF16_FLOOR`); the
InternVL step reuses its model loading and tolerances."""

from __future__ import annotations


FP32_TOLERANCE = 1e-4
BF16_FACTOR = 2.0
BF16_FLOOR = 1e-3


def no_tf32():
    """fp32 matmuls and convolutions in full fp32 (TF32 off), as the fp32 rows are measured."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def hf_reference(hf_dir, batch, dtype, device):
    """HF logits [B, S, vocab] (fp32 on CPU) of ``batch`` with the model in ``dtype`` on ``device``."""
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    with torch.no_grad():
        out = model(input_ids=batch.hf_input_ids.to(device), pixel_values=batch.images.to(device, dtype)).logits
    del model
    return out.float().cpu()


def megatron_logits(meg_dir, batch, impl: str, dtype, device: str):
    """Logits of the checkpoint loaded into a TP=1 model with ``impl`` layers in ``dtype`` (in this process)."""
    import dataclasses

    import torch

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.verify import megatron_forward_logits
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.model.spec import VLMSpec

    iter_dir = ckpt.resolve_iteration_dir(meg_dir)
    with single_process_world(device):
        spec = VLMSpec.load(iter_dir)
        opts = ModelOptions(seq_length=batch.combined_length, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            use_te=impl == "transformer_engine", perform_initialization=False)
        model = build_model(spec, opts)
        if device == "cuda":
            model.cuda()
        ckpt.load_model_weights(model, iter_dir)
        model = model.to(dtype).eval()  # as megatron's Float16Module casts it (the ViT's conv1 included)
        logits = megatron_forward_logits(model, dataclasses.replace(batch, images=batch.images.to(dtype)))
        del model
    return logits.float()[:, : batch.combined_length, : spec.vocab_size]


def check_logits(hf, meg, impls, device: str) -> list[dict]:
    """Rows of the logits table: (impl, dtype, max |diff| vs HF fp32, tolerance, pass)."""
    import torch

    from megatron_vlm.convert.verify import reference_batch
    from megatron_vlm.model.spec import VLMSpec

    no_tf32()
    spec = VLMSpec.from_hf_dir(hf)
    batch = reference_batch(spec)
    ref = hf_reference(hf, batch, torch.float32, device)[..., : spec.vocab_size]
    hf_bf16 = hf_reference(hf, batch, torch.bfloat16, device)[..., : spec.vocab_size]
    hf_bf16_err = (hf_bf16 - ref).abs().max().item()
    rows = [dict(part="logits", impl="HF transformers", dtype="bf16", diff=hf_bf16_err, tolerance=None, ok=None,
                 note="HF bf16 vs HF fp32: the yardstick")]
    for impl in impls:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                got = megatron_logits(meg, batch, impl, dtype, device)
            except Exception as e:  # report and go on: one broken implementation must not hide the others
                rows.append(dict(part="logits", impl=impl, dtype=name, diff=None, tolerance=None, ok=False,
                                 note=f"{type(e).__name__}: {e}"[:300]))
                continue
            diff = (got - ref).abs().max().item()
            tol = FP32_TOLERANCE if dtype == torch.float32 else BF16_FACTOR * hf_bf16_err + BF16_FLOOR
            rows.append(dict(part="logits", impl=impl, dtype=name, diff=diff, tolerance=tol, ok=diff <= tol,
                             note="TF32 off" if dtype == torch.float32 else f"<= {BF16_FACTOR:g} x HF bf16 + "
                             f"{BF16_FLOOR:g}"))
    return rows
