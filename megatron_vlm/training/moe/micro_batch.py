"""One micro batch on this rank, as its routers see it (:class:`MicroBatchRouting`): its rows' positions of samples
and its record of the HF objective's statistics.

**The positions HF routes.** HF's forward routes every position of its input, the last one included (it predicts
nothing); an MoE model's samples are framed as HF's input (:func:`megatron_vlm.data.task_encoder.whole_sequence`:
the whole kept sequence, the last position's loss mask 0), so the routers here see exactly HF's positions.

**Padding.** Every micro batch carries each row's positions that belong to its samples (``row_tokens``: the
image-expanded length; the rest of the row is padding to the batch's longest sample, ``--seq-length`` under pipeline
parallelism, or the FP8 / sequence-parallel multiple). Those positions alone enter the load-balancing statistics
(HF's objective, and megatron-core's types through its routers' ``padding_mask``), the z-loss, the routing numbers
and the capacity count: with ``--moe-expert-capacity-factor`` the capacity is figured on the positions of samples and
only they are routed (megatron-core's token dropping applied to them,
:func:`megatron_vlm.training.moe.orchestration._install_token_dropping`). Without a capacity, padded positions still
run through their top-k experts (their outputs are never read): expert compute in proportion to the padding
(``padding_fraction`` in the log); packing removes it.

Which positions of a row a rank's routers see (:func:`held_positions`: this CP rank's chunks, this TP rank's slice
under sequence parallelism) is made on the device by the micro batch's first router and reused by every other one,
on every model chunk of the rank, recomputed or not: no host sync per router. A router that routes other rows than
the batch's is refused.
"""

from __future__ import annotations

import torch


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
