"""Legacy (``torch`` format) rank files: their names, which exist, and which file holds each shard.

Megatron-LM names a rank's file ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` (TP rank, PP rank when PP > 1,
expert-parallel rank when EP > 1), and each file holds that rank's whole model state: its TP shard of every dense
tensor of its pipeline stage and its EP rank's experts, split over the expert tensor-parallel size ETP. The expert
TP rank of the rank that wrote file ``TT`` is ``TT % ETP`` (megatron-core orders ranks TP-fastest, ETP dividing TP).

Not every (TP, PP, EP) file need exist. Megatron-LM writes a legacy checkpoint only on the ranks of expert
data-parallel rank 0 (and, since NVIDIA/Megatron-LM#4678 of May 2026, also on those of data-parallel rank 0), so at
ETP < TP the TP and EP ranks of the written files go together: at TP2 x EP2 with ETP1 only ``mp_rank_00_000`` and
``mp_rank_01_001`` exist, which hold between them every shard. :class:`Sources` says which file each shard is read
from, and refuses, naming the shard, a checkpoint where none holds it (Megatron-LM before that fix, at
TP > EP x ETP, never wrote the other TP ranks' dense shards).

Pure Python (no torch): the command-line checks use it before any heavy import.
"""

from __future__ import annotations

import re
from pathlib import Path

RANK_FILE = "model_optim_rng.pt"
_NAME = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


class CheckpointLayoutError(ValueError):
    """A checkpoint's files do not make the layout its metadata names (or that the command was given)."""


def legacy_rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's rank directory: ``mp_rank_TT``, ``_PPP`` with pipeline parallelism, ``_EEE`` with expert
    parallelism."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep > 1 else "")


def legacy_rank_file(iter_dir, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> Path:
    return Path(iter_dir) / legacy_rank_dir(tp_rank, pp_rank, pp, ep_rank, ep) / RANK_FILE


def present(iter_dir, expert_parallel: bool = False, files: bool = True) -> set[tuple[int, int, int]]:
    """The (TP, PP, EP) ranks whose rank file exists (``files=False``: whose rank directory exists). Megatron-LM's
    names do not say whether a second number is a PP or an EP rank: ``expert_parallel`` reads the last number of
    ``mp_rank_TT[_PPP]_EEE`` as the EP rank."""
    ranks = set()
    d = Path(iter_dir)
    for p in d.iterdir() if d.is_dir() else ():
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir() and (not files or (p / RANK_FILE).is_file()):
            nums = [int(g) for g in m.groups()[1:] if g is not None]
            e = nums.pop() if expert_parallel and nums else 0
            ranks.add((int(m.group(1)), nums[0] if nums else 0, e))
    return ranks


def legacy_layout_ep(iter_dir, expert_parallel: bool = False) -> tuple[int, int, int]:
    """(tp, pp, ep) that the rank files' names span (the largest rank + 1 of each); whether the files hold every
    shard is :class:`Sources`' question."""
    ranks = present(iter_dir, expert_parallel)
    if not ranks:
        raise CheckpointLayoutError(f"{iter_dir} has no mp_rank_XX[_YYY]/{RANK_FILE} files")
    tp, pp, ep = (max(r[i] for r in ranks) + 1 for i in range(3))
    return tp, pp, ep


def legacy_layout(iter_dir, expert_parallel: bool = False) -> tuple[int, int]:
    """(tp, pp) of a legacy checkpoint (see :func:`legacy_layout_ep`)."""
    tp, pp, _ = legacy_layout_ep(iter_dir, expert_parallel)
    return tp, pp


class Sources:
    """Which rank file each shard of a legacy checkpoint is read from, given the files ``have`` (:func:`present`)
    and the layout ``tp``/``pp``/``ep``/``etp`` (``etp`` None: ``tp``): :meth:`dense` for a TP shard of a dense
    tensor, :meth:`experts` for an EP rank's experts at an expert TP rank (``experts``: the model has any). The
    lowest-numbered file that holds a shard is chosen, so a complete checkpoint reads as it always did. Raises
    :class:`CheckpointLayoutError` naming the first shard no file holds."""

    def __init__(self, iter_dir, have: set[tuple[int, int, int]], tp: int, pp: int, ep: int = 1,
                 etp: int | None = None, experts: bool = False, fix: str = "the checkpoint is incomplete"):
        etp = tp if etp is None else etp
        self.tp, self.pp, self.ep, self.etp = tp, pp, ep, etp
        self._dense: dict[tuple[int, int], int] = {}
        self._experts: dict[tuple[int, int, int], int] = {}
        for p in range(pp):
            for t in range(tp):
                e = min((e for e in range(ep) if (t, p, e) in have), default=None)
                if e is None:
                    raise CheckpointLayoutError(self._missing(iter_dir, [(t, p, e) for e in range(ep)],
                                                              f"tensor-parallel rank {t}'s shards of the dense "
                                                              "tensors", p, fix))
                self._dense[(t, p)] = e
            for e in range(ep if experts else 0):
                for x in range(etp):
                    t = min((t for t in range(x, tp, etp) if (t, p, e) in have), default=None)
                    if t is None:
                        raise CheckpointLayoutError(self._missing(
                            iter_dir, [(t, p, e) for t in range(x, tp, etp)], f"expert-parallel rank {e}'s experts "
                            f"at expert tensor-parallel rank {x}", p, fix))
                    self._experts[(x, p, e)] = t

    def _missing(self, iter_dir, ranks: list[tuple[int, int, int]], what: str, p: int, fix: str) -> str:
        layout = f"tp={self.tp} pp={self.pp}" + (f" ep={self.ep} etp={self.etp}" if self.ep > 1 or self.etp != self.tp
                                                  else "")
        why = ("; Megatron-LM before NVIDIA/Megatron-LM#4678 (May 2026) wrote legacy rank files only on expert "
               "data-parallel rank 0, which at TP > EP x ETP leaves TP ranks unwritten: save the run again with "
               "--ckpt-format torch_dist or a newer Megatron-LM" if self.tp > self.ep * self.etp else "")
        names = " or ".join(legacy_rank_dir(t, q, self.pp, e, self.ep) for t, q, e in ranks)
        t, q, e = ranks[0]
        return (f"{legacy_rank_file(iter_dir, t, q, self.pp, e, self.ep)}: missing rank file (no rank file holds "
                f"{what}{f' of pipeline stage {p}' if self.pp > 1 else ''}: {names}; the checkpoint spans {layout}); "
                f"{fix}{why}")

    def dense(self, tp_rank: int, pp_rank: int) -> int:
        """The EP rank of the file that holds TP rank ``tp_rank``'s dense shards of stage ``pp_rank``."""
        return self._dense[(tp_rank, pp_rank)]

    def experts(self, etp_rank: int, pp_rank: int, ep_rank: int) -> int:
        """The TP rank of the file that holds EP rank ``ep_rank``'s experts at expert TP rank ``etp_rank``."""
        return self._experts[(etp_rank, pp_rank, ep_rank)]
