"""Which vocabulary columns the training loss is taken over: the one place that decides the objective.

Megatron pads the output layer to a multiple of ``make_vocab_size_divisible_by`` (128) rows, whatever the TP (517 ->
640 on the tiny test models,
151,936 on Qwen2/3 for a 151,669-entry tokenizer). Megatron-LM's loss is a softmax over every one of them, so the
padded rows take part in the normalisation and receive gradient, while the model exported to HF has no such rows.

By default (``--no-loss-over-padded-vocab``) the padded columns are set to the dtype's lowest value before
megatron-core's vocab-parallel cross entropy, on the tensor-parallel rank that holds them: their softmax weight is
exactly zero, they get no gradient, and the loss is HF ``LlavaForConditionalGeneration``'s on the same batch.
``--loss-over-padded-vocab`` keeps Megatron-LM's objective (bit-compatibility with Megatron-LM runs).

A training checkpoint records the objective it was trained with (``ckpt_meta.json`` ``extra``); a resume keeps it
(:func:`resolve`), and asking for the other one on resume is refused; a checkpoint saved before the record resumes
with Megatron-LM's objective, and the log says why.

The mask works on every loss path that goes through ``compute_language_model_loss``: megatron-core's
vocab-parallel cross entropy and its fused versions (``cross_entropy_loss_fusion`` with
``cross_entropy_fusion_impl`` 'native' or 'te'). A fusion that computes the loss elsewhere (a fused linear + cross
entropy, ``'linear'`` in megatron-core's newer releases) would skip it: HF's objective refuses it.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("megatron_vlm.train")

#: the key in a training checkpoint's ``ckpt_meta.json`` ``extra``
META_KEY = "loss_over_padded_vocab"
#: megatron-core's cross-entropy implementations that compute the loss in ``compute_language_model_loss``
LOSS_PATH_IMPLS = ("native", "te")
FLAG = "--loss-over-padded-vocab"
NO_FLAG = "--no-loss-over-padded-vocab"


def describe(over_padded: bool) -> str:
    return ("Megatron-LM's objective: the softmax runs over the padded vocabulary rows too" if over_padded else
            "HF's objective: padded vocabulary rows are masked out of the softmax")


def resolve(requested: bool | None, extra: dict | None, where, notes: list | None = None) -> bool:
    """The objective of a run: ``requested`` (the flag, None when not given) for a new run (``extra`` None),
    else the resumed checkpoint's. A checkpoint saved before the objective was recorded was trained with
    Megatron-LM's (the only one then): ``notes`` (if given) gets the line that says so. Asking a resume for the
    other objective raises ValueError."""
    if extra is None:
        return bool(requested)
    saved = extra.get(META_KEY)
    if saved is None and "trained" in extra:  # a training checkpoint from before the record: Megatron-LM's objective
        saved = True
        if notes is not None and requested is None:
            notes.append(f"{where} predates the record of the loss objective, so it was trained with Megatron-LM's "
                         f"(the only one then): the run keeps it ({FLAG}), padded vocabulary rows in the softmax. "
                         f"For HF's objective start a new run (another --name, with --megatron-load-dir)")
    if saved is None:
        return bool(requested)
    if requested is not None and bool(requested) != bool(saved):
        raise ValueError(
            f"{where} was trained with {describe(bool(saved))} ({FLAG if saved else NO_FLAG}), and this resume asks "
            f"for the other objective ({FLAG if requested else NO_FLAG}): a resumed run keeps its objective. Drop the "
            f"flag to continue as it was trained, or start a new run (another --name, with --megatron-load-dir) to "
            f"train with the other objective")
    return bool(saved)


def _padded_columns(vocab_size: int, padded_vocab_size: int, tp_rank: int, tp: int) -> slice | None:
    """The padded columns of this TP rank's slice of the logits (local indices), or None if it holds none."""
    per_rank = padded_vocab_size // tp
    first_local = vocab_size - tp_rank * per_rank
    if first_local >= per_rank:
        return None
    return slice(max(first_local, 0), per_rank)


def _masked_loss(original, columns: slice, per_rank: int, labels, logits):
    if logits.shape[-1] != per_rank:  # the columns were computed for this width: anything else masks wrong rows
        raise ValueError(f"the output layer gives {logits.shape[-1]} logits per tensor-parallel rank, the padded "
                         f"vocabulary divided over TP gives {per_rank}: the loss mask cannot tell its padded columns")
    mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[columns] = True
    return original(labels, logits.masked_fill(mask, torch.finfo(logits.dtype).min))


def apply(model, vocab_size: int, padded_vocab_size: int, over_padded: bool) -> slice | None:
    """Make ``model``'s (a LLaVAModel chunk) language-model loss skip the padded vocabulary columns unless
    ``over_padded``. Only the last pipeline stage computes a loss. Returns the masked local columns (None: none
    on this rank, or Megatron-LM's objective)."""
    from megatron.core import parallel_state as ps

    lm = getattr(model, "language_model", None)
    if over_padded or lm is None or not getattr(lm, "post_process", False) or padded_vocab_size == vocab_size:
        return None
    config = lm.config
    impl = getattr(config, "cross_entropy_fusion_impl", "native")
    if getattr(config, "cross_entropy_loss_fusion", False) and impl not in LOSS_PATH_IMPLS:
        raise ValueError(f"cross_entropy_fusion_impl={impl!r} computes the loss without compute_language_model_loss, "
                         f"so HF's objective cannot mask the padded vocabulary rows there: use "
                         f"--no-cross-entropy-loss-fusion, or Megatron-LM's objective ({FLAG})")
    tp = ps.get_tensor_model_parallel_world_size()
    if padded_vocab_size % tp:
        raise ValueError(f"the padded vocabulary ({padded_vocab_size} rows) does not divide over --tp {tp}")
    columns = _padded_columns(vocab_size, padded_vocab_size, ps.get_tensor_model_parallel_rank(), tp)
    if columns is not None:
        # an instance attribute shadows GPTModel's method: the vocab-parallel (or fused) cross entropy is
        # megatron-core's own, it only sees -max-float logits in the padded columns
        lm.compute_language_model_loss = functools.partial(_masked_loss, lm.compute_language_model_loss, columns,
                                                           padded_vocab_size // tp)
    return columns
