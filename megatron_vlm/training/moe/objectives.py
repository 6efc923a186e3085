"""The load-balancing objective of a mixture-of-experts run: ``--moe-router-load-balancing-type``'s choices and the
start-up line's words for the term (coefficient ``--moe-aux-loss-coeff``: default the HF config's
``router_aux_loss_coef``, 0 leaves HF LLaVA's plain cross entropy).

The trainer's loss is megatron-core's per-token cross entropy (summed over the global batch's loss tokens, so that
every layout equals HF) plus ``hf`` (the default: the term the model's own HF code adds,
:mod:`megatron_vlm.training.moe.hf_objective`), one of megatron-core's own types
(:mod:`megatron_vlm.training.moe.mcore_types`), or nothing (``none``).
"""

from __future__ import annotations


#: megatron-core's load-balancing types -> the name its router records the loss under
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


#: --moe-router-load-balancing-type's choices, the default first
OBJECTIVES = ("hf", *LOSS_NAMES, "none")


def describe_objective(kind: str, coeff: float, source: str, moe_layers: int) -> str:
    """The start-up line's words for the load-balancing term."""
    if kind == "none" or not coeff:
        return "no load-balancing loss (cross entropy only)"
    if kind == "hf":
        return (f"HF's load_balancing_loss_func over all {moe_layers} MoE layers together, per micro batch, padding "
                f"excluded, coefficient {coeff:g} ({source})")
    return f"megatron-core's {kind} per MoE layer, summed over {moe_layers} layers, coefficient {coeff:g} ({source})"
