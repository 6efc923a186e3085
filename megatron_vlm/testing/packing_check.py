"""Packed vs unpacked forward on a GPU (Transformer Engine attention): the check behind the ``gpu`` test of
tests/test_packing.py and the ``packing`` part of bench/gpu.py.

The same samples run as separate rows (padded, 'sbhd') and as one packed row ('thd' with image-expanded
``cu_seqlens``), in bf16; each sample's logits and summed token loss are compared position by position. bf16 has
no exact answer, so the yardstick is the unpacked model's own bf16 error against fp32 (as bench/gpu.py does for
logits): packed bf16 must be no further from the unpacked fp32 logits than ``factor`` x that error + ``floor``,
and each sample's loss must agree with the unpacked bf16 loss to ``loss_rtol``.
"""

from __future__ import annotations

import torch


def _samples(enc, n: int):
    from megatron.energon import VQASample
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array

    questions = ["what colour is the shape ?", "describe the picture in a few words please", "what ?"]
    answers = ["red", "a red square on a smooth gradient background", "yes"]
    meta = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    return [enc.encode_sample(VQASample(__key__=f"s{i}", image=Image.fromarray(image_array((40, 30), i)),
                                        context=questions[i % 3], answers=answers[i % 3], answer_weights=None, **meta))
            for i in range(n)]


def packed_vs_unpacked(meg_dir, hf_dir, n_samples: int = 3, seq_length: int = 256, factor: float = 2.0,
                       floor: float = 1e-3, loss_rtol: float = 1e-2) -> dict:
    """Compare packed and unpacked forwards of ``n_samples`` samples with the checkpoint ``meg_dir`` (TP=1) on
    CUDA; returns the differences, tolerances and ``ok``."""
    from megatron_vlm import checkpoint as ckpt
    from megatron_vlm.data.packing import PackingTaskEncoder, packed_seq_params
    from megatron_vlm.model import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.spec import VLMSpec

    iter_dir = ckpt.resolve_iteration_dir(meg_dir)
    spec = VLMSpec.load(iter_dir)
    enc = PackingTaskEncoder(hf_dir, seq_length, image_token_id=spec.image_token_id, spec=spec,
                             packed_seq_length=seq_length * n_samples)
    samples = _samples(enc, n_samples)
    unpacked = super(PackingTaskEncoder, enc).batch(samples)  # the plain VLMTaskEncoder batch: separate rows
    packed = enc.batch([enc.pack_selected_samples(samples)])
    cu = packed.cu_seqlens.tolist()
    with single_process_world("cuda"):
        def forward(dtype, batch, packed_params=None, with_labels=True):
            model = build_model(spec, ModelOptions(seq_length=enc.packed_seq_length, params_dtype=dtype,
                                                   bf16=dtype == torch.bfloat16, use_te=True,
                                                   perform_initialization=False)).cuda()
            ckpt.load_model_weights(model, iter_dir)
            model = model.to(dtype).eval()
            kw = {} if packed_params is None else {"packed_seq_params": packed_params}
            with torch.no_grad():
                out, mask = model(batch.images.cuda().to(dtype), batch.tokens.cuda(), None, None,
                                  batch.labels.cuda() if with_labels else None,
                                  batch.loss_mask.cuda() if with_labels else None, None,
                                  batch.num_image_tiles.cuda(), **kw)
            return out.float().cpu(), (mask.float().cpu() if mask is not None else None)

        params = packed_seq_params(packed.cu_seqlens.cuda(), packed.max_seqlen)
        ref32, _ = forward(torch.float32, unpacked, with_labels=False)
        ref16, _ = forward(torch.bfloat16, unpacked, with_labels=False)
        got16, _ = forward(torch.bfloat16, packed, params, with_labels=False)
        loss_u, mask_u = forward(torch.bfloat16, unpacked)
        loss_p, mask_p = forward(torch.bfloat16, packed, params)
    vocab = spec.vocab_size
    yard, diff, loss_diff = 0.0, 0.0, 0.0
    for i, s in enumerate(samples):
        n, a = s.num_tokens, cu[i]
        assert cu[i + 1] - a == n
        r32, r16, g16 = ref32[i, :n, :vocab], ref16[i, :n, :vocab], got16[0, a:a + n, :vocab]
        yard = max(yard, (r16 - r32).abs().max().item())
        diff = max(diff, (g16 - r32).abs().max().item())
        assert torch.equal(mask_u[i, :n], mask_p[0, a:a + n])  # the same loss positions
        lu = (loss_u[i, :n] * mask_u[i, :n]).sum().item()
        lp = (loss_p[0, a:a + n] * mask_p[0, a:a + n]).sum().item()
        loss_diff = max(loss_diff, abs(lp - lu) / abs(lu))
    tol = factor * yard + floor
    return dict(logit_diff=diff, logit_tolerance=tol, unpacked_bf16_error=yard, loss_rel_diff=loss_diff,
                loss_rtol=loss_rtol, samples=n_samples, cu_seqlens=cu,
                ok=diff <= tol and loss_diff <= loss_rtol)
