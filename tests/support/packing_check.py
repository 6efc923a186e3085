"""Packed vs unpacked, as numbers.

- :func:`equivalence_jobs` (per rank, in a local world): one training step of the same samples packed and
  unpacked with the trainer's build and step, on CPU with local layers at any TP/PP/DP and precision
  (tests/test_packing_equivalence.py); :func:`sample_sets` makes the samples (images, anyres tiles, videos, an
  image-first sample, identical samples).
- :func:`packed_vs_unpacked`: forward on a GPU (Transformer Engine attention), the check behind the ``gpu`` test
  of tests/test_packing.py and the ``packing`` part of bench/gpu.py:

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
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.data.packing import PackingTaskEncoder, packed_seq_params
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.model.spec import VLMSpec

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


# ---- packed == unpacked through the trainer's step, on CPU (local layers) -------------------------------------
def image_first(fields: dict, media_ids) -> dict:
    """A copy of an encoded sample's fields cut to start at its first image/video token (a sample whose image is
    its first token: it may only open a pack, see :func:`megatron_vlm.data.packing.select_packs`)."""
    tokens = fields["tokens"]
    k = int(torch.isin(tokens, torch.tensor(sorted(media_ids))).nonzero()[0])
    return {**fields, "tokens": tokens[k:], "labels": fields["labels"][k:], "loss_mask": fields["loss_mask"][k:],
            "num_tokens": int(fields["num_tokens"]) - k}


def _as_samples(encoder, sample_fields: list[dict]) -> list:
    from megatron_vlm.data.anyres_encoder import AnyresSample
    from megatron_vlm.data.task_encoder import VLMSample

    cls = AnyresSample if encoder.spec.is_anyres else VLMSample
    meta = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    return [cls(__key__=f"s{i}", **meta, **f) for i, f in enumerate(sample_fields)]


def _grads(training) -> dict:
    """This rank's reduced gradients of the last step (megatron DDP's fp32 ``main_grad`` buffers; every chunk's)."""
    return {n: p.main_grad.detach().float().clone() for n, p in training.named_parameters() if p.requires_grad}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def equivalence_jobs(jobs: list[dict], models: dict, sample_sets: dict) -> list | None:
    """Per job, one training step of the same samples unpacked (each DP rank's share as one micro batch of
    separate rows) and packed (each DP rank's share packed into ``packed_seq_length`` rows by the packing task
    encoder's own hooks), with the trainer's :func:`~megatron_vlm.training.build.build_training` and
    :func:`~megatron_vlm.training.step.train_step` at lr 0 and no clipping (so the weights stay and the reduced
    gradients can be read). Returns per job (rank 0): the two summed losses, loss-token counts and grad norms,
    the largest per-tensor relative gradient difference ``|g_packed - g_unpacked| / |g_unpacked|`` over all
    ranks and tensors, and ``pack_sizes``: every rank's samples per pack.

    ``models``: name -> (converted Megatron dir, HF dir). Job keys: ``name``, ``model`` (a key of ``models``),
    ``samples`` (a key of ``sample_sets``: lists of encoded-sample fields), ``packed_seq_length``,
    TrainConfig fields (tp, pp, cp, precision, attention_backend, ...), ``broken`` (attention across the samples of a
    pack: the local 'thd' attention, or sdpa's mask, given one segment for the whole row, the defect the comparison
    must catch; with ``cp`` > 1 the
    context-parallel attention's mask at contiguous positions instead, :func:`contiguous_cp_mask`),
    ``unpacked_micro_batches`` (the unpacked share in that many micro batches, default 1: virtual pipeline stages
    need as many micro batches as pipeline stages, packed and unpacked).

    Each job's result also has ``patches``: every rank's (changes to megatron-core's modules and classes since the
    rank started that no active registry patch holds, the active patches, those active at the start) after the job
    (:func:`megatron_vlm.runtime.mcore_patches.unregistered`; the snapshot is taken before anything else runs)."""
    from megatron_vlm.runtime import mcore_patches

    at_start, started = mcore_patches.snapshot(), mcore_patches.active()
    import copy

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.data.packing import packing_task_encoder_for
    from megatron_vlm.model import sdpa_attention
    from megatron_vlm.model.cp_attention import ContextParallelAttention
    from megatron_vlm.runtime import cpu_compat
    from megatron_vlm.model.spec import VLMSpec
    from tests.support.train_jobs import _setup, job_config
    from megatron_vlm.training import batch_feed
    from megatron_vlm.training.build import build_training, release
    from megatron_vlm.training.step import train_step
    from megatron_vlm.training.trainer import pad_multiple
    from megatron_vlm.model.context_parallel import length_multiple

    out = []
    encoders, fp32 = {}, {}
    for job in jobs:
        megatron_dir, hf_dir = models[job["model"]]
        iter_dir = ckpt.resolve_iteration_dir(megatron_dir)
        spec = VLMSpec.load(iter_dir)
        fields = {k: v for k, v in job.items() if k not in ("samples", "broken", "model", "unpacked_micro_batches")}
        samples_fields = sample_sets[job["samples"]]
        psl = fields.pop("packed_seq_length")
        fields.update(lr=0.0, min_lr=0.0, clip_grad=0.0, packing_buffer_size=len(samples_fields),
                      packed_seq_length=psl, micro_batch_size=1)
        cfg = job_config(fields, 1, len(samples_fields))
        rt = _setup(cfg, spec)
        # context parallelism: each sample of a pack, and the unpacked rows, padded as the trainer pads them
        multiple, sample_multiple = pad_multiple(cfg), length_multiple(cfg.cp)
        key = (job["model"], psl, cfg.seq_length, multiple, sample_multiple)
        if key not in encoders:
            encoders[key] = packing_task_encoder_for(spec, hf_dir, cfg.seq_length, psl,
                                                     image_token_id=spec.image_token_id, pad_to_multiple_of=multiple,
                                                     sample_multiple=sample_multiple)
        enc = encoders[key]
        samples = _as_samples(enc, samples_fields)
        per_rank = len(samples) // rt.dp
        mine = samples[rt.dp_rank * per_rank:(rt.dp_rank + 1) * per_rank]
        reads = batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp)
        k = len(mine) // job.get("unpacked_micro_batches", 1)
        unpacked = [super(type(enc), enc).batch(mine[i:i + k])  # the architecture's plain batch: separate rows
                    for i in range(0, len(mine), k)]
        selected = enc.select_samples_to_pack(mine)
        packs = [enc.batch([enc.pack_selected_samples(p)]) for p in selected]
        pack_sizes: list = [None] * torch.distributed.get_world_size()  # samples per pack, on every rank
        torch.distributed.all_gather_object(pack_sizes, [len(p) for p in selected])
        ucfg = copy.copy(cfg)
        ucfg.micro_batch_size = k
        training = build_training(cfg, spec, init_from=iter_dir)
        results, grads = {}, {}
        segments, mask, sdpa_mask = cpu_compat.segments, ContextParallelAttention.mask, sdpa_attention.segment_mask
        for name, batches, c, packing in (("unpacked", unpacked, ucfg, False), ("packed", packs, cfg, True)):
            if job.get("broken") and packing:
                if cfg.cp > 1:
                    ContextParallelAttention.mask = contiguous_cp_mask
                elif cfg.attention_backend == "sdpa":
                    sdpa_attention.segment_mask = lambda cu, total, causal: sdpa_mask(cu[[0, -1]], total, causal)
                else:
                    cpu_compat.segments = lambda cu, total: [(0, total)]
            try:
                fed = batch_feed.distribute(batches if reads else [None] * len(batches), rt.device)
                r = train_step(training, fed, c, rt.device)
            finally:
                cpu_compat.segments, ContextParallelAttention.mask = segments, mask
                sdpa_attention.segment_mask = sdpa_mask
            results[name] = r
            grads[name] = _grads(training)
        layout = (job["model"], job["samples"], cfg.tp, cfg.pp)
        if cfg.precision == "fp32":
            fp32[layout] = (grads["unpacked"], results["unpacked"])
        # bf16's own error: the unpacked bf16 step against the unpacked fp32 step of an earlier job (same layout)
        ref32 = fp32.get(layout) if cfg.precision != "fp32" else None
        u, p = results["unpacked"], results["packed"]
        u32 = ref32[1] if ref32 else None
        out.append(dict(name=job.get("name"), loss_sum=(u.loss_sum, p.loss_sum),
                        loss_tokens=(u.loss_tokens, p.loss_tokens), grad_norm=(u.grad_norm, p.grad_norm),
                        samples=(u.samples, p.samples), tokens=(u.tokens, p.tokens),
                        loss_rel=_rel(p.loss_sum, u.loss_sum), grad_norm_rel=_rel(p.grad_norm, u.grad_norm),
                        grad_rel=_worst(grads["packed"], grads["unpacked"]),
                        precision_grad_rel=_worst(grads["unpacked"], ref32[0]) if ref32 else None,
                        precision_loss_rel=_rel(u.loss_sum, u32.loss_sum) if u32 else None,
                        precision_grad_norm_rel=_rel(u.grad_norm, u32.grad_norm) if u32 else None, packs=len(packs),
                        pack_sizes=pack_sizes))
        release(training)
        del training
        patches: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(patches, (mcore_patches.unregistered(at_start), mcore_patches.active(),
                                                      started))
        out[-1]["patches"] = patches
    return out if torch.distributed.get_rank() == 0 else None


def contiguous_cp_mask(self, cu_seqlens, cp: int, rank: int, device) -> torch.Tensor:
    """The negative control of the context-parallel attention's mask: per sample causal, but with positions as if
    rank r held the r-th 1/cp of the row (megatron-core gives it chunks r and 2 x cp - 1 - r of 2 x cp)."""
    cu = torch.as_tensor([int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)])
    n = int(cu[-1]) // cp
    q, k = torch.arange(rank * n, (rank + 1) * n), torch.arange(int(cu[-1]))
    seg_q, seg_k = (torch.bucketize(x, cu[1:], right=True) for x in (q, k))
    return ((seg_q[:, None] != seg_k[None, :]) | (k[None, :] > q[:, None]))[None, None].to(device)


def _worst(grads: dict, ref: dict) -> float:
    """Largest per-tensor ``|grads - ref| / |ref|`` over this world's ranks (collective)."""
    worst = torch.zeros(1, dtype=torch.float64)
    for n, g in ref.items():
        r, d = g.norm().item(), (grads[n] - g).norm().item()
        if r > 0 or d > 0:
            worst = torch.maximum(worst, torch.tensor([d / max(r, 1e-30)], dtype=torch.float64))
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    return float(worst.item())


def sample_sets(encoder) -> dict:
    """Encoded-sample fields for :func:`equivalence_jobs`, from ``encoder`` (a plain or anyres task encoder):

    - ``mixed``: questions and answers of different lengths, images of different sizes (anyres: one tile to a
      grid; OneVision: a two-image sample, a video, a video with an image, a text-only sample), and one sample cut
      to start at its image token;
    - ``identical``: six copies of one sample (the first-iteration loss and grad norm of a dataset of identical
      samples)."""
    from PIL import Image

    from megatron_vlm.data.conversation import vqa_messages
    from megatron_vlm.data.synthetic import image_array
    from tests.support.train_jobs import ANSWERS, IMAGE_SIZES, QUESTIONS

    anyres = encoder.spec.is_anyres
    sizes = IMAGE_SIZES if anyres else IMAGE_SIZES[:1]
    mixed = [encoder.encode_conversation(vqa_messages(QUESTIONS[i % 4], ANSWERS[(3 * i) % 4]),
                                         [Image.fromarray(image_array(sizes[i % len(sizes)], i))], str(i))
             for i in range(6)]
    media = {encoder.image_token_id}
    if getattr(encoder, "video_token_id", None) is not None:
        from tests.support.videos import make_video

        media.add(encoder.video_token_id)
        clip, short = make_video(25, 33, 21, fps=10), make_video(5, 48, 32, fps=7)
        two = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "same colour ?"}]
        answer = [{"type": "text", "text": "yes"}]
        video_user = [{"type": "video"}, {"type": "text", "text": "what colour is the shape ?"}, {"type": "image"}]
        mixed += [
            encoder.encode_conversation(vqa_messages("what happens ?", "red", "video"), [], "v0", [clip]),
            encoder.encode_conversation([{"role": "user", "content": video_user},
                                         {"role": "assistant", "content": answer}],
                                        [Image.fromarray(image_array((30, 40), 9))], "v1", [short]),
            encoder.encode_conversation([{"role": "user", "content": two}, {"role": "assistant", "content": answer}],
                                        [Image.fromarray(image_array((20, 20), 10)),
                                         Image.fromarray(image_array((33, 50), 11))], "m"),
            encoder.encode_conversation([{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], [],
                                        "t"),
        ]
    mixed[3] = image_first(mixed[3], media)
    return {"mixed": mixed, "identical": [mixed[0]] * 6}
