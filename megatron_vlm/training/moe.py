"""Training a mixture-of-experts language model: the load-balancing objective, the positions the routers count, and
the routing numbers a user watches for routing collapse.

**The objective** (``--moe-router-load-balancing-type``, coefficient ``--moe-aux-loss-coeff``: default the HF
config's ``router_aux_loss_coef``, 0 leaves HF LLaVA's plain cross entropy). The trainer's loss is megatron-core's
per-token cross entropy (summed over the global batch's loss tokens, so that every layout equals HF) plus:

- ``hf`` (the default; :class:`HFLoadBalancing`): the term the model's own HF code adds. transformers' Qwen3-MoE and
  Mixtral forward adds ``router_aux_loss_coef x load_balancing_loss_func(router logits, attention_mask)``: ONE loss
  over all MoE layers together, ``E x sum_i f_i P_i``, with ``f_i`` the fraction of the top-k choices that went to
  expert i and ``P_i`` the mean router probability (softmax over all experts) of expert i, both over every (MoE
  layer, position) pair of the batch, padding left out. Balanced routing gives top-k. It is computed as HF's forward
  computes it per batch, per micro batch: the counts, probability sums and positions of the micro batch are summed
  over this rank's MoE layers, over the ranks that hold parts of its sequence (:func:`sequence_group`: the
  tensor-parallel ranks under sequence parallelism; megatron-core's TP x CP group, so context parallelism joins by
  its group) and over the pipeline stages (:class:`_StageExchange`, on a gloo group of each pipeline's ranks),
  and the term is averaged over micro batches and
  data-parallel ranks, as gradient accumulation averages it. Its gradient reaches each router through its
  probabilities only (the counts are not differentiable: ``d/dP_i = E f_i``), so each router's share is exact once
  the micro batch's counts of every layer are known: each stage sends its counts to the other stages when its
  forward of the micro batch ends, and the gradient is formed in the backward, which on every stage starts after
  the micro batch's forward has passed every stage.
- ``aux_loss``, ``seq_aux_loss``, ``global_aux_loss`` (:class:`AuxLossWeight`): megatron-core's own per-layer losses,
  summed over MoE layers (balanced routing gives 1 per layer, so L in all). ``aux_loss``: per micro batch, the
  switch loss ``E / (k T^2) x sum_i (sum of expert i's probabilities) x (tokens routed to i)`` over its T positions;
  ``seq_aux_loss``: the same per sequence, averaged over the micro batch's sequences; ``global_aux_loss``: the
  counts accumulated over the global batch's micro batches and data-parallel ranks. megatron-core's routers would
  multiply each by the micro batch's positions under the per-token loss (10-100x in instruction tuning, where only
  answers carry loss) and megatron-core 0.16 divides it by TP under sequence parallelism: the trainer holds each at
  ``--moe-aux-loss-coeff`` x its mean over micro batches and data-parallel ranks, summed over layers, by routing
  the losses unscaled (the routers' ``calculate_per_token_loss`` off) and multiplying the coefficients, per step,
  by the global batch's loss tokens over its micro batches.
- ``none``: no load-balancing term.

**The positions HF routes.** HF's forward routes every position of its input, the last one included (it predicts
nothing); an MoE model's samples are framed as HF's input (:func:`megatron_vlm.data.task_encoder.whole_sequence`:
the whole kept sequence, the last position's loss mask 0), so the routers here see exactly HF's positions.

**Padding** (:class:`MicroBatchRouting`): every micro batch carries each row's positions that belong to its samples
(``row_tokens``: the image-expanded length; the rest of the row is padding to the batch's longest sample,
``--seq-length`` under pipeline parallelism, or the FP8 / sequence-parallel multiple). Those positions alone enter
the load-balancing statistics (HF's objective, and megatron-core's types through its routers' ``padding_mask``),
the z-loss, the routing numbers and the capacity count: with ``--moe-expert-capacity-factor`` the capacity is
figured on the positions of samples and only they are routed (megatron-core's token dropping applied to them).
Without a capacity, padded positions still run through their top-k experts (their outputs are never read): expert
compute in proportion to the padding (``padding_fraction`` in the log); packing removes it.

**Routing numbers** (:class:`RoutingStats`). Per iteration (a global batch), on every rank, collectively:

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

Activation recomputation re-runs a router's forward inside the backward: the statistics are recorded in the first
forward only, and the recomputed forward takes the micro batch whose backward is running (a hook on the stage's
output marks it).

**Host syncs.** A router's routing and its share of the term's gradient wait for nothing on the host: the positions
of samples are made on the device by the micro batch's first router (:func:`held_positions`) and reused by every
other one, recomputed or not; the statistics, the term's value and its gradient stay on the device, and the values
are read once per step (:meth:`RoutingStats.collect`). Under pipeline parallelism each stage copies a micro batch's
statistics to the host once, when its forward of it ends (gloo sends host memory). With
``--moe-expert-capacity-factor`` the token dropping of the positions of samples (:func:`_install_token_dropping`)
still reads per router whether a row is padded and selects the positions of samples by a mask.

Virtual pipeline stages (several model chunks per rank) call the forward step once per chunk and micro batch:
:meth:`MoETraining.begin` numbers each chunk's calls (each chunk takes the micro batches in order), so the chunks of
a rank add their counts to one record per micro batch, and the record goes to the sequence group and the other
stages once, after the rank's last chunk's forward of it. Every backward of the micro batch comes after its forward
through the last virtual stage, which follows every rank's last chunk: the counts of every stage are out by then.
"""

from __future__ import annotations

import contextlib

import torch

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


def sequence_group(config):
    """The ranks that hold parts of one micro batch's sequence, whose routers see one batch between them: the
    tensor-parallel ranks under sequence parallelism (without it every TP rank routes every position) and the
    context-parallel ranks (megatron-core's groups; of size 1 where unused)."""
    from megatron.core import parallel_state as ps

    if config.sequence_parallel:
        return ps.get_tensor_and_context_parallel_group()
    return ps.get_context_parallel_group()


def held_positions(s_local: int, config, device) -> torch.Tensor:
    """The positions of the micro batch's rows that this rank's routers see, of ``s_local`` per row, made on
    ``device`` (no host copy): all of them; under context parallelism this CP rank's two chunks of the row's
    ``2 x CP`` (megatron-core's load-balanced order, as :func:`megatron_vlm.model.cp_attention.partition_index` lists
    them); under sequence parallelism this TP rank's contiguous slice of those (megatron-core scatters the CP rank's
    sequence in TP chunks)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    cp = ps.get_context_parallel_world_size()
    i = torch.arange(s_local, device=device)  # the index among the CP rank's positions
    if tp > 1:
        i = i + ps.get_tensor_model_parallel_rank() * s_local
    if cp == 1:
        return i
    c, r = s_local * tp // 2, ps.get_context_parallel_rank()  # the CP rank holds chunks r and 2 x CP - 1 - r of c
    return torch.where(i < c, r * c + i, (2 * cp - 1 - r) * c + (i - c))


class MicroBatchRouting:
    """One micro batch on this rank: its rows' positions of samples, and (HF objective) its statistics."""

    def __init__(self, index: int, row_tokens, config, experts: int, device):
        self.index, self.config = index, config
        #: this rank's MoE layers: counts of top-k choices per expert, probability sums per expert, positions
        self.stats = torch.zeros(2 * experts + 1, dtype=torch.float64, device=device)
        self.total = None  # the same over the sequence group and every pipeline stage
        self.exchange = None  # (sends, receives) with the other stages
        self.value = None  # load_balancing_loss_func of the micro batch (a tensor: read once per step)
        self.set_rows(row_tokens)

    def set_rows(self, row_tokens) -> None:
        """Each row's positions of samples (None: not known, every position counts)."""
        self.row_tokens = None if row_tokens is None else row_tokens.to(device=self.stats.device, dtype=torch.int64)
        self._valid = None  # (positions per row, rows, mask): made by the micro batch's first router

    def valid(self, s_local: int, rows: int):
        """[s_local, rows] bool, True where the position holds a sample (None: no information, every position).
        Made once per micro batch, on the device; every router of the micro batch (on every model chunk of this
        rank, recomputed or not) sees the same rows."""
        if self.row_tokens is None:
            return None
        if self.row_tokens.numel() != rows:
            raise ValueError(f"micro batch {self.index}: a router routes {rows} rows of {s_local} positions, but the "
                             f"batch gives the positions of samples of {self.row_tokens.numel()} rows (row_tokens): "
                             "the model routes another micro batch than the forward step was given")
        if self._valid is None:
            positions = held_positions(s_local, self.config, self.row_tokens.device)
            self._valid = (s_local, rows, positions[:, None] < self.row_tokens[None, :])
        elif self._valid[0] != s_local:
            raise ValueError(f"micro batch {self.index}: a router routes {s_local} positions per row, an earlier "
                             f"router of the same micro batch {self._valid[0]}: the positions of samples are "
                             "this rank's part of one sequence for every router")
        return self._valid[2]


def pipeline_gloo_group():
    """A gloo group of this rank's pipeline (megatron-core's pipeline group's ranks, which may be NCCL and carry
    the schedule's own traffic): each pipeline's group is made by every rank, in the same order (collective over
    the world, once), from every rank's pipeline gathered once. gloo connects the members of a group as a full
    mesh: a group of the world would connect every rank to every rank."""
    from megatron.core import parallel_state as ps

    ranks = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    device = _device() if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(ranks, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(every, mine)
    group = None
    for pipeline in sorted({tuple(t.tolist()) for t in every}):
        made = torch.distributed.new_group(list(pipeline), backend="gloo")
        if pipeline == tuple(ranks):
            group = made
    return group


class _StageExchange:
    """Each micro batch's statistics of this pipeline stage to the other stages of its pipeline, and theirs to it:
    point to point on a gloo group of the pipeline's ranks (:func:`pipeline_gloo_group`; CPU tensors, tagged by the
    micro batch), so the schedule's own pipeline traffic is untouched. Sent when a stage's forward of the micro batch
    ends; received when its backward needs them, which every stage reaches only after the micro batch's forward
    passed every stage."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        ranks = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        me = torch.distributed.get_rank()
        self.peers = [r for r in ranks if r != me]
        self.group = pipeline_gloo_group()  # collective: every rank makes every pipeline's

    def post(self, index: int, stats: torch.Tensor):
        """The micro batch's statistics out (one device-to-host copy: gloo sends host memory) and the other stages'
        posted to be received (into pinned memory on a GPU, copied to the device without a wait)."""
        cpu = stats.detach().to("cpu", copy=True)
        sends = [(cpu, torch.distributed.isend(cpu, dst=p, group=self.group, tag=index)) for p in self.peers]
        recvs = []
        for p in self.peers:
            buf = torch.empty(cpu.shape, dtype=cpu.dtype, pin_memory=stats.is_cuda)
            recvs.append((buf, torch.distributed.irecv(buf, src=p, group=self.group, tag=index)))
        return sends, recvs


class _LoadBalancingGradient(torch.autograd.Function):
    """Identity on a router's probabilities (which the experts' outputs are weighted by, so its backward runs with
    the micro batch's); the backward adds the HF term's gradient to the router's softmax scores: the same vector
    for every position (the scores are masked to the positions of samples), formed only then, when every stage's
    counts are in (:meth:`HFLoadBalancing.gradient`)."""

    @staticmethod
    def forward(ctx, probs, scores, micro, objective):
        ctx.micro, ctx.objective, ctx.rows = micro, objective, scores.shape[0]
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        w = ctx.objective.gradient(ctx.micro).to(grad_probs.device)
        return grad_probs, w[None, :].expand(ctx.rows, -1).contiguous(), None, None


class HFLoadBalancing:
    """The ``hf`` objective's term on this rank (see the module docstring)."""

    def __init__(self, config, coeff: float, pipeline: int):
        self.config, self.coeff = config, float(coeff)
        self.experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.exchange = _StageExchange() if pipeline > 1 else None
        self.factor = 1.0

    def routed(self, logits, probs, valid, micro: MicroBatchRouting, record: bool):
        """A router's output with the term attached: record its counts and probability sums (``record``: the first
        forward, not a recomputation)."""
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        flat = logits.reshape(-1, self.experts)
        routing_map, scores = compute_routing_scores_for_aux_loss(
            flat, self.topk, "softmax", padding_mask=None if valid is None else ~valid)
        if record:
            n = torch.full((1,), flat.shape[0], dtype=torch.float64, device=flat.device) if valid is None else \
                valid.sum().double().reshape(1)
            micro.stats += torch.cat([routing_map.sum(0).double(), scores.detach().sum(0).double(), n])
        if torch.is_grad_enabled() and scores.requires_grad:
            probs = _LoadBalancingGradient.apply(probs, scores, micro, self)
        return probs

    def forward_done(self, micro: MicroBatchRouting) -> None:
        """This stage's forward of ``micro`` is over: sum its statistics over the sequence group and send them to
        the other stages (collective over the sequence group)."""
        group = sequence_group(self.config)
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(micro.stats, group=group)
        if self.exchange is not None:
            micro.exchange = self.exchange.post(micro.index, micro.stats)

    def resolve(self, micro: MicroBatchRouting) -> torch.Tensor:
        """The micro batch's statistics over every stage (waits for the other stages' if they are still out)."""
        if micro.total is None:
            total = micro.stats.clone()
            if micro.exchange is not None:
                for buf, work in micro.exchange[1]:
                    work.wait()
                    total += buf.to(total.device, non_blocking=True)
            e = self.experts
            f, p, n = total[:e], total[e:2 * e], total[2 * e].clamp(min=1.0)
            micro.value = e * ((f / n) * (p / n)).sum()  # left on the device: read once per step (finish)
            micro.total = total
        return micro.total

    def gradient(self, micro: MicroBatchRouting) -> torch.Tensor:
        """d(objective)/d(score of expert i at a position of a sample), for every i: coefficient x the step's weight
        x E f_i / N, times the loss scale megatron-core's schedule set for the auxiliary losses (fp16)."""
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        total = self.resolve(micro)
        e = self.experts
        n = total[2 * e].clamp(min=1.0)
        w = self.coeff * self.factor * e * total[:e] / (n * n)
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is not None:
            w = w * scale.double().to(w.device)
        return w.float()

    def finish(self, micros: list) -> list:
        """After the step's schedule: every micro batch's value as a device tensor (waits for what no backward
        needed), and the sends completed."""
        values = []
        for m in micros:
            self.resolve(m)
            if m.exchange is not None:
                for _, work in m.exchange[0]:
                    work.wait()
                m.exchange = None
            values.append(m.value)
        return values


class RoutingStats:
    """One iteration's routing numbers of this rank's model chunk (see the module docstring): each MoE layer's
    positions of samples routed to each expert, counted by :class:`MoETraining`'s router wrapper."""

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


#: the positions of samples among the rows a router is routing right now (set around its routing, for the
#: capacity count of :func:`_install_token_dropping`)
_ROUTING = {"valid": None}


def _install_token_dropping() -> None:
    """megatron-core's token dropping (``--moe-expert-capacity-factor``) applied to the positions of samples only:
    the capacity is figured on them, and padded positions are routed nowhere. With
    ``--moe-pad-expert-input-to-capacity`` megatron-core's dispatcher figures the capacity over every position
    itself, so dropping stays as megatron-core does it there. Installed once per process on megatron-core's router
    module (the name its routing calls)."""
    from megatron.core.transformer.moe import router as module

    original = module.apply_router_token_dropping
    if getattr(original, "positions_of_samples", False):
        return

    def dropping(probs, routing_map, *args, **kwargs):
        valid = _ROUTING["valid"]
        if valid is None or kwargs.get("pad_to_capacity") or bool(valid.all()):
            return original(probs, routing_map, *args, **kwargs)
        kept_probs, kept_map = original(probs[valid], routing_map[valid], *args, **kwargs)
        out_probs, out_map = torch.zeros_like(probs), torch.zeros_like(routing_map)
        out_probs[valid], out_map[valid] = kept_probs, kept_map
        return out_probs, out_map

    dropping.positions_of_samples = True
    module.apply_router_token_dropping = dropping


class MoETraining:
    """This rank's mixture-of-experts parts in training (:func:`megatron_vlm.training.build.build_training` makes
    it for an MoE model): every megatron-core ``TopKRouter``'s routing wrapped to know the positions of samples
    (:class:`MicroBatchRouting`), to attach the ``hf`` objective's term (:class:`HFLoadBalancing`) and to count the
    routing numbers (:class:`RoutingStats`); megatron-core's own types and its z-loss weighted by
    :class:`AuxLossWeight`.

    Per step: :meth:`step` around the schedule; the forward step calls :meth:`begin` with each micro batch before
    the model and :meth:`forward_done` with the model's output after it; :meth:`collect` gives the numbers."""

    def __init__(self, models, spec, config, objective: str, coeff: float, wrapped=None):
        """``models``: this rank's model chunks (a list; one module also); ``wrapped``: the same chunks as the
        schedule passes them to the forward step (DDP), in chunk order."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        chunks = list(models) if isinstance(models, (list, tuple)) else [models]
        model = torch.nn.ModuleList(chunks)  # the routers of every chunk
        self.wrapped = list(wrapped) if wrapped is not None else chunks
        self.spec, self.config, self.objective, self.coeff = spec, config, objective, coeff
        self.stats = RoutingStats(spec, config)
        self.hf = HFLoadBalancing(config, coeff, ps.get_pipeline_model_parallel_world_size()) \
            if objective == "hf" and coeff else None
        self.aux_weight = AuxLossWeight(model, config)  # megatron-core's types and its z-loss
        self.micros: list = []
        self._calls = [0] * len(chunks)  # forward steps of each chunk in this step
        self._done: dict[int, int] = {}  # micro batch -> chunks whose forward of it ended
        self._forward = self._backward = None
        for m in model.modules():
            if isinstance(m, TopKRouter):
                self._wrap(m)
        _install_token_dropping()

    def _current(self):
        """The micro batch being routed: the one in its forward, or, inside a backward (activation recomputation
        re-running a layer's forward), the one whose backward runs."""
        return self._backward if torch._C._current_graph_task_id() != -1 else self._forward

    def _wrap(self, router) -> None:
        original = router.routing

        def routing(logits, padding_mask=None):
            micro = self._current()
            valid = micro.valid(logits.shape[0], logits.shape[1]) if micro is not None else None
            flat = None if valid is None else valid.reshape(-1)
            if valid is not None and padding_mask is None:
                padding_mask = ~valid
            _ROUTING["valid"] = flat
            try:
                probs, routing_map = original(logits, padding_mask=padding_mask)
            finally:
                _ROUTING["valid"] = None
            if micro is not None and router.training:
                record = torch._C._current_graph_task_id() == -1  # not a recomputation
                if record:
                    self.stats.count(router.layer_number, routing_map, flat)
                if self.hf is not None:
                    probs = self.hf.routed(logits, probs, flat, micro, record)
            return probs, routing_map

        router.routing = routing

    @contextlib.contextmanager
    def step(self, loss_tokens: float, micro_batches: int):
        """One step of ``micro_batches`` micro batches (over all data-parallel ranks) whose gradients are divided by
        ``loss_tokens`` (megatron-core's per-token loss): the terms' weight for that step."""
        self.micros, self._forward, self._backward = [], None, None
        self._calls, self._done = [0] * len(self.wrapped), {}
        self.stats.reset()
        if self.hf is not None:
            self.hf.factor = float(loss_tokens) / micro_batches
        with self.aux_weight.step(loss_tokens, micro_batches):
            yield

    def begin(self, batch, chunk=None) -> MicroBatchRouting:
        """A micro batch's forward starts on this rank (``batch``: what the forward step got, or None; ``chunk``:
        the model chunk it runs through, as the schedule passed it)."""
        if getattr(batch, "cu_seqlens", None) is not None and self.config.context_parallel_size > 1:
            # a pack's samples are each padded to 2 x CP inside their segments: its samples' positions are no longer
            # the row's first row_tokens (refused before launch too, launch/preflight.py)
            raise NotImplementedError("sequence packing with context parallelism for a mixture-of-experts model: the "
                                      "routed padding cannot be told apart; train it unpacked, or at --cp 1")
        c = self._chunk(chunk)
        index = self._calls[c]
        self._calls[c] += 1
        if index == len(self.micros):
            self.micros.append(MicroBatchRouting(index, getattr(batch, "row_tokens", None), self.config,
                                                 self.spec.num_moe_experts, _device()))
        micro = self.micros[index]
        if micro.row_tokens is None and getattr(batch, "row_tokens", None) is not None:
            micro.set_rows(batch.row_tokens)
        self._forward = micro
        return micro

    def _chunk(self, chunk) -> int:
        """Which of this rank's model chunks ``chunk`` (what the schedule passed the forward step) is."""
        if chunk is None:
            if len(self.wrapped) == 1:
                return 0
            raise ValueError(f"the forward step named no model chunk, and this rank has {len(self.wrapped)} (virtual "
                             "pipeline stages): each chunk numbers its own micro batches; pass the chunk the "
                             "schedule gave the forward step")
        for i, w in enumerate(self.wrapped):
            if w is chunk:
                return i
        raise ValueError(f"the forward step ran a {type(chunk).__name__} that is none of this rank's "
                         f"{len(self.wrapped)} model chunks (the ones the schedule passes): its micro batches cannot "
                         "be numbered; build MoETraining with wrapped= the chunks as the schedule passes them")

    def forward_done(self, micro: MicroBatchRouting, output) -> None:
        """This stage's forward of ``micro`` ended with ``output``: the statistics go out, and the output's
        gradient marks the start of the micro batch's backward (collective over the sequence group)."""
        self._forward = None
        self._done[micro.index] = self._done.get(micro.index, 0) + 1
        if self.hf is not None and self._done[micro.index] == len(self.wrapped):  # the rank's last chunk
            self.hf.forward_done(micro)
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda grad: self._enter_backward(micro))

    def _enter_backward(self, micro) -> None:
        self._backward = micro

    def collect(self, num_microbatches: int, device) -> dict:
        """The step's routing numbers (collective over all ranks; after the schedule)."""
        values = self.hf.finish(self.micros) if self.hf is not None else None
        self.micros, self._backward = [], None
        return self.stats.collect(num_microbatches, device, values)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
