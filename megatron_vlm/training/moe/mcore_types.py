"""megatron-core's own load-balancing types and its z-loss, at the weight the trainer gives them
(:class:`AuxLossWeight`).

``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``: megatron-core's per-layer losses, summed over MoE layers
(balanced routing gives 1 per layer, so L in all). ``aux_loss``: per micro batch, the switch loss
``E / (k T^2) x sum_i (sum of expert i's probabilities) x (tokens routed to i)`` over its T positions;
``seq_aux_loss``: the same per sequence, averaged over the micro batch's sequences; ``global_aux_loss``: the counts
accumulated over the global batch's micro batches and data-parallel ranks. megatron-core's routers would multiply
each by the micro batch's positions under the per-token loss (10-100x in instruction tuning, where only answers
carry loss) and megatron-core 0.16 divides it by TP under sequence parallelism: the trainer holds each at
``--moe-aux-loss-coeff`` x its mean over micro batches and data-parallel ranks, summed over layers, by routing the
losses unscaled (the routers' ``calculate_per_token_loss`` off) and multiplying the coefficients, per step, by the
global batch's loss tokens over its micro batches.
"""

from __future__ import annotations

import contextlib


class AuxLossWeight:
    """Holds megatron-core's auxiliary losses (its load-balancing types, the z-loss) at the weight the module
    docstring defines (this rank's model chunk)."""

    def __init__(self, model, config):
        from megatron.core.transformer.moe.router import Router

        self.config = config
        self.aux, self.z = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        for m in model.modules():
            if isinstance(m, Router):
                m.calculate_per_token_loss = False  # the losses attach unscaled; step() sets their weight

    @contextlib.contextmanager
    def step(self, loss_tokens: float, micro_batches: int):
        """The coefficients for one step of ``micro_batches`` micro batches (over all data-parallel ranks) whose
        gradients are divided by ``loss_tokens``."""
        factor = float(loss_tokens) / micro_batches
        scale = (lambda c: [x * factor for x in c]) if isinstance(self.aux, list) else (lambda c: c * factor)
        self.config.moe_aux_loss_coeff = scale(self.aux)
        if self.z is not None:
            self.config.moe_z_loss_coeff = self.z * factor
        try:
            yield
        finally:
            self.config.moe_aux_loss_coeff, self.config.moe_z_loss_coeff = self.aux, self.z
