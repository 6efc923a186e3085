"""This rank's mixture-of-experts parts in training, put together (:class:`MoETraining`): every megatron-core router's
routing wrapped, the micro batches tracked through the schedule, megatron-core's token dropping applied to the
positions of samples (:func:`_install_token_dropping`), and each step's weight of the terms
(:func:`global_loss_tokens`).

Activation recomputation re-runs a router's forward inside the backward: the statistics are recorded in the first
forward only, and the recomputed forward takes the micro batch whose backward is running (a hook on the stage's
output marks it).

Virtual pipeline stages (several model chunks per rank) call the forward step once per chunk and micro batch:
:meth:`MoETraining.begin` numbers each chunk's calls (each chunk takes the micro batches in order; a chunk that is
none of the rank's is refused), so the chunks of a rank add their counts to one record per micro batch, and the
record goes to the sequence group and the other stages once, after the rank's last chunk's forward of it. Every
backward of the micro batch comes after its forward through the last virtual stage, which follows every rank's last
chunk: the counts of every stage are out by then.

With ``--moe-expert-capacity-factor`` the token dropping of the positions of samples still reads, per router,
whether a row is padded, and selects the positions of samples by a mask (two host syncs per router).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_vlm.runtime import mcore_patches
from megatron_vlm.training.moe.hf_objective import HFLoadBalancing
from megatron_vlm.training.moe.mcore_types import AuxLossWeight
from megatron_vlm.training.moe.micro_batch import MicroBatchRouting
from megatron_vlm.training.moe.stats import RoutingStats


#: the positions of samples among the rows a router is routing right now (set around its routing, for the
#: capacity count of :func:`_install_token_dropping`)
_ROUTING = {"valid": None}
#: the registry's entry of the trainer's token dropping (megatron_vlm/runtime/mcore_patches.py)
TOKEN_DROPPING = "moe-token-dropping-positions"


@mcore_patches.implements(TOKEN_DROPPING)
def _install_token_dropping(originals: dict) -> dict:
    """megatron-core's token dropping (``--moe-expert-capacity-factor``) applied to the positions of samples only:
    the capacity is figured on them, and padded positions are routed nowhere. With
    ``--moe-pad-expert-input-to-capacity`` megatron-core's dispatcher figures the capacity over every position
    itself, so dropping stays as megatron-core does it there. The registry installs it on megatron-core's router
    module (the name its routing calls) around one routing call only (:meth:`MoETraining._wrap`)."""
    target = "megatron.core.transformer.moe.router:apply_router_token_dropping"
    original = originals[target]

    def dropping(probs, routing_map, *args, **kwargs):
        valid = _ROUTING["valid"]
        if valid is None or kwargs.get("pad_to_capacity") or bool(valid.all()):
            return original(probs, routing_map, *args, **kwargs)
        kept_probs, kept_map = original(probs[valid], routing_map[valid], *args, **kwargs)
        out_probs, out_map = torch.zeros_like(probs), torch.zeros_like(routing_map)
        out_probs[valid], out_map[valid] = kept_probs, kept_map
        return out_probs, out_map

    return {target: dropping}


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
                with mcore_patches.applied(TOKEN_DROPPING) if router.config.moe_expert_capacity_factor is not None \
                        else contextlib.nullcontext():
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
