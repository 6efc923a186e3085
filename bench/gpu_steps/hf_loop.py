"""The ``hf`` step of bench/gpu.py: the reference, HF's ``LlavaForConditionalGeneration`` with SDPA attention trained
by a plain PyTorch loop on the same batches and parts as our training rows; its row (:data:`HF_ROW`) is what
the results' ``vs_hf`` ratios divide by."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .common import mfu, train_bench


HF_ROW = "HF + SDPA loop"


def hf_loop(a, hf: Path, data: Path, profile: tuple[int, int] | None = None) -> dict:
    """Train HF's LLaVA (SDPA attention) in a plain PyTorch loop on our batches; bench/train.py's summary of it.

    Same data (energon loader, ``VLMTaskEncoder``, seed; each image token expanded as the HF processor writes it),
    same trained parts (stage 2: LM + projector; the ViT frozen), AdamW with the trainer's defaults (3% linear
    warm-up, cosine decay, gradient clipping 1.0), gradient accumulation to ``--gbs``. bf16 as HF's Trainer runs
    it: fp32 weights and optimizer, matmuls under bf16 autocast. Each iteration ends with a device sync, so its
    time stamp is the step's end.

    ``profile=(start, end)``: iterations ``start + 1`` to ``end`` run under torch.profiler (CPU, and CUDA on a GPU);
    the summary then holds its Chrome trace (``trace``, bytes) and its top-ops table (``table``)."""
    import math

    import torch
    import torch.nn.functional as F
    from transformers import LlavaForConditionalGeneration

    from megatron_vlm.data.loader import build_train_loader
    from megatron_vlm.data.task_encoder import VLMTaskEncoder

    tb = train_bench()
    dev = torch.device(a.device)
    t0 = time.time()
    torch.manual_seed(a.seed)
    model = LlavaForConditionalGeneration.from_pretrained(str(hf), dtype=torch.float32,
                                                          attn_implementation="sdpa").to(dev).train()
    model.model.vision_tower.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    warm = int(0.03 * a.iters)

    def lr_factor(step):
        if step < warm:
            return step / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, a.iters - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    enc = VLMTaskEncoder(hf, a.seq_length)
    data_iter = iter(build_train_loader(data, enc, a.mbs, 0, 1, a.num_workers, a.seed))
    rows = []
    prof = None
    for it in range(1, a.iters + 1):
        if profile and it == profile[0] + 1:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                            if dev.type == "cuda" else [])
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        batches = [tb.hf_batch(next(data_iter), enc.image_token_id, enc.tokens_per_image, enc.pad_token_id)
                   for _ in range(a.gbs // a.mbs)]
        n_loss = sum(int((b["labels"] != -100).sum()) for b in batches)
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=dev)
        for b in batches:
            with autocast:
                logits = model(input_ids=b["input_ids"].to(dev, non_blocking=True),
                               pixel_values=b["pixel_values"].to(dev, non_blocking=True)).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].to(dev).flatten(), ignore_index=-100,
                                   reduction="sum")
            (loss / n_loss).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_value = loss_sum.item() / n_loss  # synchronises: the time stamp is the step's end
        rows.append({"iteration": it, "loss": loss_value, "samples": a.gbs, "time": time.time(),
                     "tokens": sum(b["num_tokens"] for b in batches),
                     "images": sum(b["pixel_values"].shape[0] for b in batches)})
        if prof is not None and it == profile[1]:
            prof.__exit__(None, None, None)
        if it % max(1, a.iters // 5) == 0:
            print(f"HF + SDPA iteration {it}/{a.iters}: loss {loss_value:.4f}", flush=True)
    out = tb.summarize(rows, t0, a.warmup, tb.step_flops(argparse.Namespace(stage=2), hf))
    out["name"] = HF_ROW
    if prof is not None:
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            out["trace"] = Path(f.name).read_bytes()
        out["table"] = prof.key_averages().table(sort_by="self_cuda_time_total" if dev.type == "cuda" else
                                                 "self_cpu_time_total", row_limit=30)
    return out


def check_hf_loop(a, hf: Path, data: Path) -> list[dict]:
    """The reference loop's row (part ``train``, impl :data:`HF_ROW`); an error is reported, not raised."""
    try:
        r = hf_loop(a, hf, data)
    except Exception as e:  # report and go on
        return [dict(part="train", impl=HF_ROW, dtype=a.precision, ok=False, note=f"{type(e).__name__}: {e}"[:300])]
    return [dict(part="train", impl=HF_ROW, dtype=a.precision, loss_first=r["losses"][0], loss_last=r["losses"][-1],
                 tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], s_per_iter=r["s_per_iter"], losses=r["losses"],
                 mfu=mfu(r), ok=None, note="reference: HF LlavaForConditionalGeneration, sdpa attention, "
                 + ("bf16 autocast, fp32 weights" if a.precision == "bf16" else a.precision))]
