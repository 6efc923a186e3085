"""Numerical verification: HF LLaVA logits vs the Megatron model loaded from a checkpoint, in fp32.

The reference batch holds images at different positions of the text. HF takes the image token expanded
to ``num_image_tokens`` copies; Megatron's LLaVAModel takes one image token per image and expands it
itself. The Megatron side runs in a world of TP*PP processes, through megatron-core's pipeline schedule
(forward only), and gathers the vocab-parallel logits; logits are compared on the true vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_vlm.spec import VLMSpec

log = logging.getLogger(__name__)
DEFAULT_TOLERANCE = 1e-4


@dataclass
class ReferenceBatch:
    tokens: torch.Tensor  # [B, L] Megatron input: one image token per image
    hf_input_ids: torch.Tensor  # [B, L - 1 + N] HF input: image token expanded
    images: torch.Tensor  # [B, 3, H, W]

    @property
    def combined_length(self) -> int:
        return self.hf_input_ids.shape[1]


def reference_batch(spec: VLMSpec, text_len: int = 12, positions=(1, 7), seed: int = 0) -> ReferenceBatch:
    """A fixed batch: one image per sample at ``positions[b]`` among random text tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = spec.vocab_size
    rows, hf_rows = [], []
    for pos in positions:
        ids = torch.randint(0, vocab, (text_len,), generator=g)
        ids[ids == spec.image_token_id] = (spec.image_token_id + 1) % vocab
        ids[pos] = spec.image_token_id
        rows.append(ids)
        hf_rows.append(torch.cat([ids[:pos], ids.new_full((spec.num_image_tokens,), spec.image_token_id), ids[pos + 1:]]))
    images = torch.randn(len(positions), 3, spec.image_size, spec.image_size, generator=g)
    return ReferenceBatch(torch.stack(rows), torch.stack(hf_rows), images)


def hf_logits(hf_dir, batch: ReferenceBatch) -> torch.Tensor:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch.hf_input_ids, pixel_values=batch.images)
    return out.logits


def megatron_forward_logits(model, batch: ReferenceBatch) -> torch.Tensor | None:
    """Full-vocab logits [B, S, padded_vocab] on the last PP stage (None elsewhere). Collective."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device

    def step(data_iterator, chunk):
        b = next(data_iterator)
        out, _ = chunk(images=b.images.to(device), input_ids=b.tokens.to(device), position_ids=None, attention_mask=None)

        def loss_func(output, non_loss_data=False):
            return tensor_parallel.gather_from_tensor_model_parallel_region(output)

        return out, loss_func

    with torch.no_grad():
        result = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=batch.combined_length,
            micro_batch_size=batch.tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        return result[0].float().cpu()
    return None


def _verify_worker(megatron_dir, iteration, tp: int, pp: int, batch: ReferenceBatch, device=None):
    from megatron.core import parallel_state as ps

    from megatron_vlm import checkpoint as ckpt
    from megatron_vlm.model import ModelOptions, build_model
    from megatron_vlm.runtime import distributed

    distributed.setup(tp, pp, device=device)
    iter_dir = ckpt.resolve_iteration_dir(megatron_dir, iteration)
    spec = VLMSpec.load(iter_dir)
    meta = ckpt.CheckpointMeta.load(iter_dir)
    pp_layers = meta.pp_layers if meta.pp == pp else None
    opts = ModelOptions(tp=tp, pp=pp, pp_layers=pp_layers, seq_length=batch.combined_length, perform_initialization=False)
    model = build_model(spec, opts)
    if torch.cuda.is_available():
        model.cuda()
    ckpt.load_model_weights(model, iter_dir)
    model.eval()
    logits = megatron_forward_logits(model, batch)
    return logits if ps.get_tensor_model_parallel_rank() == 0 else None


def megatron_checkpoint_logits(megatron_dir, batch: ReferenceBatch, tp: int = 1, pp: int = 1, iteration=None):
    """Logits of the checkpoint loaded into a TP x PP Megatron model (spawns TP*PP processes)."""
    from megatron_vlm.runtime.spawn import run_world

    results = run_world(_verify_worker, tp * pp, megatron_dir, iteration, tp, pp, batch)
    return next(r for r in results if r is not None)


def max_logit_diff(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    return (a[..., :vocab].float() - b[..., :vocab].float()).abs().max().item()


def verify_checkpoint(hf_dir, megatron_dir, tp: int = 1, pp: int = 1, iteration=None,
                      tolerance: float = DEFAULT_TOLERANCE) -> float:
    """Max |logit difference| between HF and the Megatron checkpoint; raises above ``tolerance``."""
    from megatron_vlm import checkpoint as ckpt

    spec = VLMSpec.load(ckpt.resolve_iteration_dir(megatron_dir, iteration))
    batch = reference_batch(spec)
    ref = hf_logits(hf_dir, batch)
    got = megatron_checkpoint_logits(megatron_dir, batch, tp, pp, iteration)
    diff = max_logit_diff(ref, got[:, : ref.shape[1]], spec.vocab_size)
    log.info("max |logit diff| HF vs Megatron (tp=%d pp=%d, fp32): %.3g (tolerance %.1g)", tp, pp, diff, tolerance)
    if not diff <= tolerance:
        raise VerificationError(f"logits differ by {diff:.3g} > {tolerance:g} between HF and Megatron (tp={tp} pp={pp})")
    return diff


class VerificationError(RuntimeError):
    pass
