"""The ``hf`` load-balancing objective (the default; :class:`HFLoadBalancing`): the term the model's own HF code adds.

transformers' Qwen3-MoE and Mixtral forward adds ``router_aux_loss_coef x load_balancing_loss_func(router logits,
attention_mask)``: ONE loss over all MoE layers together, ``E x sum_i f_i P_i``, with ``f_i`` the fraction of the
top-k choices that went to expert i and ``P_i`` the mean router probability (softmax over all experts) of expert i,
both over every (MoE layer, position) pair of the batch, padding left out. Balanced routing gives top-k. It is
computed as HF's forward computes it per batch, per micro batch: the counts, probability sums and positions of the
micro batch are summed over this rank's MoE layers, over the ranks that hold parts of its sequence
(:func:`sequence_group`: the tensor-parallel ranks under sequence parallelism; megatron-core's TP x CP group, so
context parallelism joins by its group) and over the pipeline stages (:class:`_StageExchange`, on a gloo group of
each pipeline's ranks, :func:`pipeline_gloo_group`), and the term is averaged over micro batches and data-parallel
ranks, as gradient accumulation averages it. Its gradient reaches each router through its probabilities only (the
counts are not differentiable: ``d/dP_i = E f_i``), so each router's share is exact once the micro batch's counts of
every layer are known: each stage sends its counts to the other stages when its forward of the micro batch ends, and
the gradient is formed in the backward, which on every stage starts after the micro batch's forward has passed every
stage.

**Host syncs.** A router's share of the term and of its gradient waits for nothing on the host: the statistics, the
term's value and its gradient stay on the device, and the values are read once per step
(:meth:`megatron_vlm.training.moe.stats.RoutingStats.collect`). Under pipeline parallelism each stage copies a micro
batch's statistics to the host once, when its forward of it ends (gloo sends host memory).
"""

from __future__ import annotations

import torch

from megatron_vlm.training.moe.micro_batch import MicroBatchRouting


def sequence_group(config):
    """The ranks that hold parts of one micro batch's sequence, whose routers see one batch between them: the
    tensor-parallel ranks under sequence parallelism (without it every TP rank routes every position) and the
    context-parallel ranks (megatron-core's groups; of size 1 where unused)."""
    from megatron.core import parallel_state as ps

    if config.sequence_parallel:
        return ps.get_tensor_and_context_parallel_group()
    return ps.get_context_parallel_group()


def pipeline_gloo_group():
    """A gloo group of this rank's pipeline (megatron-core's pipeline group's ranks, which may be NCCL and carry
    the schedule's own traffic): each pipeline's group is made by every rank, in the same order (collective over
    the world, once), from every rank's pipeline gathered once. gloo connects the members of a group as a full
    mesh: a group of the world would connect every rank to every rank."""
    from megatron.core import parallel_state as ps

    ranks = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
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
