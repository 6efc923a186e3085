"""Training a mixture-of-experts language model: the weight of the routers' auxiliary losses in the objective, and
the routing numbers a user watches for routing collapse.

**The auxiliary losses' weight** (:class:`AuxLossWeight`). The trainer's objective is megatron-core's per-token
loss (summed token losses over the global batch's loss tokens, so that every layout equals HF). megatron-core's
routers then multiply each micro batch's load-balancing (and z-) loss by the tokens they routed, and every gradient
is divided by the global batch's loss tokens: in instruction tuning, where only answers carry loss, that weights the
auxiliary losses by positions / loss tokens (10-100x), and megatron-core 0.16 further divides them by the TP size
under sequence parallelism (0.19 does not). The trainer makes the weight what megatron-core's routers intend,
whatever the loss mask, TP or version: ``--moe-aux-loss-coeff`` (``--moe-z-loss-coeff``) times the mean over
micro batches and data-parallel ranks of each MoE layer's loss, summed over layers. It does so by routing the
losses unscaled (the routers' ``calculate_per_token_loss`` off) and, for each step, multiplying the coefficients
by the global batch's loss tokens over its micro batches (the division by loss tokens then leaves exactly the
coefficient); the logged losses are without the coefficient, as Megatron-LM logs them.

**Routing numbers** (:class:`RoutingStats`). Per iteration (a global batch), on every rank, collectively:

- the load-balancing loss (and z-loss) that megatron-core's routers record in its MoE metrics tracker, reduced as
  Megatron-LM reduces them (over pipeline stages, the tensor-parallel group, averaged over data-parallel ranks) and
  averaged over micro batches: per MoE layer, and their mean over MoE layers (Megatron-LM's logged
  ``load_balancing_loss``); values are without the coefficient;
- each MoE layer's expert load: tokens routed to each expert over the whole global batch (every data-parallel rank
  and micro batch, counted once per tensor-parallel group), from the routing map every megatron-core ``TopKRouter``
  returns (a forward hook), and the imbalance ``max / mean`` of those counts (1 is perfectly even, ``num_experts /
  topk``-ish when a few experts take everything).

The numbers go to the console line, ``metrics.jsonl`` and TensorBoard through
:class:`~megatron_vlm.training.metrics.MetricsLogger` (``--moe-per-layer-logging`` adds each layer). megatron-core
0.16 keeps the tracker in a module dict, 0.19 in a ``MoEMetricsTracker``: :func:`_tracker_ops` hides which.
"""

from __future__ import annotations

import contextlib

import torch

#: --moe-router-load-balancing-type -> the name megatron-core's router records its loss under
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


def tracked_names(config) -> list[str]:
    """The losses megatron-core records for this language TransformerConfig (the same list on every rank)."""
    names = []
    kind = config.moe_router_load_balancing_type
    if kind in LOSS_NAMES and config.moe_aux_loss_coeff:
        names.append(LOSS_NAMES[kind])
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def _tracker_ops():
    """(values(name, size, device) -> this rank's per-layer tensor, created if absent; sync(names); clear())."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # megatron-core 0.16
        from megatron.core.transformer.moe import moe_utils

        def values(name, size, device):
            tracker = moe_utils.get_moe_layer_wise_logging_tracker()
            if name not in tracker:
                tracker[name] = {"values": torch.zeros(size, device=device), "reduce_group": None,
                                 "avg_group": None, "reduce_group_has_dp": False}
            return tracker[name]["values"]

        return values, moe_utils.reduce_aux_losses_tracker_across_ranks, moe_utils.clear_aux_losses_tracker
    tracker = get_moe_metrics_tracker()

    def values(name, size, device):
        tracker.ensure_initialized(name, size)
        return tracker.metrics[name].values

    return values, (lambda names: tracker._sync_metrics(names, None)), tracker.clear


class RoutingStats:
    """Collects one iteration's routing numbers of this rank's model chunk (see the module docstring)."""

    def __init__(self, model, spec, config):
        from megatron.core.transformer.moe.router import TopKRouter

        self.spec, self.config = spec, config
        self.names = tracked_names(config)
        self.moe_layers = spec.moe_layers
        self.counts = None
        self._hooks = [m.register_forward_hook(self._count) for m in model.modules() if isinstance(m, TopKRouter)]

    def _count(self, router, inputs, output) -> None:
        routing_map = output[1]
        if self.counts is None:
            self.counts = torch.zeros(self.spec.num_layers, self.spec.num_moe_experts, dtype=torch.float64,
                                      device=routing_map.device)
        self.counts[router.layer_number - 1] += routing_map.detach().sum(dim=0).double()

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()

    def collect(self, num_microbatches: int, device) -> dict:
        """This iteration's numbers (collective over all ranks; call once per training step, after the schedule)."""
        from megatron.core import parallel_state as ps

        out: dict = {}
        values, sync, clear = _tracker_ops()
        if self.names:
            per_layer = {n: values(n, self.spec.num_layers, device) for n in self.names}
            sync(self.names)
            for name, v in per_layer.items():
                layers = [float(v[i]) / num_microbatches for i in self.moe_layers]
                out[f"moe_{name}"] = sum(layers) / len(layers)
                out[f"moe_{name}_per_layer"] = layers
            clear()
        counts = self.counts if self.counts is not None else \
            torch.zeros(self.spec.num_layers, self.spec.num_moe_experts, dtype=torch.float64, device=device)
        if not self.config.sequence_parallel and ps.get_tensor_model_parallel_rank() != 0:
            counts = torch.zeros_like(counts)  # every TP rank routed the same tokens: count them once
        counts = counts.clone()
        torch.distributed.all_reduce(counts, group=ps.get_tensor_model_parallel_group())
        # context-parallel ranks route their own parts of each sequence: summed with the data-parallel ranks'
        torch.distributed.all_reduce(counts, group=ps.get_data_parallel_group(with_context_parallel=True))
        torch.distributed.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
        imbalance = [float(counts[i].max() / counts[i].mean().clamp(min=1e-12)) for i in self.moe_layers]
        out["moe_load_imbalance"] = max(imbalance)
        out["moe_load_imbalance_per_layer"] = imbalance
        out["moe_tokens_per_expert"] = [[int(c) for c in counts[i].tolist()] for i in self.moe_layers]
        self.reset()
        return out


class AuxLossWeight:
    """Holds the routers' auxiliary losses at the weight the module docstring defines (this rank's model chunk)."""

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


def global_loss_tokens(batches: list, device) -> float:
    """The loss tokens of the global batch (what megatron-core's finalize divides gradients by), on every rank:
    counted by tensor-parallel rank 0 of the last pipeline stage of each data-parallel replica, summed over the
    world."""
    from megatron.core import parallel_state as ps

    mine = 0.0  # context-parallel ranks hold the same micro batches: counted on CP rank 0
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_context_parallel_rank() == 0:
        mine = float(sum(float(b.loss_mask.sum()) for b in batches if b is not None and b.loss_mask is not None))
    total = torch.tensor([mine], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total)
    return float(total.item())
