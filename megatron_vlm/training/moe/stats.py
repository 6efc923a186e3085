"""The routing numbers a user watches for routing collapse (:class:`RoutingStats`). Per iteration (a global batch), on
every rank, collectively:

- the load-balancing loss without its coefficient: HF's term, averaged over micro batches and data-parallel ranks;
  or megatron-core's, which its routers record in its metrics tracker, reduced as Megatron-LM reduces them (over
  pipeline stages, the tensor-parallel group, averaged over data-parallel ranks) and averaged over micro batches:
  per MoE layer, and their mean (Megatron-LM's logged ``load_balancing_loss``);
- each MoE layer's expert load: the positions of samples routed to each expert over the whole global batch (every
  data-parallel rank and micro batch, counted once per tensor-parallel group), and the imbalance ``max / mean`` of
  those counts (1 is perfectly even, ``num_experts / topk``-ish when a few experts take everything).

The numbers go to the console line, ``metrics.jsonl`` and TensorBoard through
:class:`~megatron_vlm.training.metrics.MetricsLogger` (``--moe-per-layer-logging`` adds each layer). megatron-core
0.16 keeps the tracker in a module dict, 0.19 in a ``MoEMetricsTracker``: :func:`_tracker_ops` hides which.
"""

from __future__ import annotations

import torch

from megatron_vlm.training.moe.objectives import LOSS_NAMES


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
    """One iteration's routing numbers of this rank's model chunk (see the module docstring): each MoE layer's
    positions of samples routed to each expert, counted by the router wrapper of
    :class:`~megatron_vlm.training.moe.orchestration.MoETraining`."""

    def __init__(self, spec, config):
        self.spec, self.config = spec, config
        self.names = tracked_names(config)
        self.moe_layers = spec.moe_layers
        self.counts = None

    def count(self, layer_number: int, routing_map, valid) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.spec.num_layers, self.spec.num_moe_experts, dtype=torch.float64,
                                      device=routing_map.device)
        routed = routing_map.detach() if valid is None else routing_map.detach() & valid[:, None]
        self.counts[layer_number - 1] += routed.sum(dim=0).double()

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()

    def collect(self, num_microbatches: int, device, hf_values: list | None = None) -> dict:
        """This iteration's numbers (collective over all ranks; call once per training step, after the schedule).
        ``hf_values``: this rank's micro batches' values of HF's term (the ``hf`` objective)."""
        from megatron.core import parallel_state as ps

        out: dict = {}
        if hf_values is not None:
            mean = torch.zeros(2, dtype=torch.float64, device=device)
            if hf_values:
                mean[0] = torch.stack([v.to(device) for v in hf_values]).sum()
            mean[1] = len(hf_values)
            torch.distributed.all_reduce(mean, group=ps.get_data_parallel_group())
            out["moe_load_balancing_loss"] = float(mean[0] / mean[1].clamp(min=1))
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
