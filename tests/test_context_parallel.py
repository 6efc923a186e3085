"""Context parallelism's parts that need no world: the positions each CP rank holds against megatron-core's own
split, the local attention's mask against megatron's causal mask in that order, and what megatron-core's LLaVAModel
imports for CP (issue 49). The training proofs (the trainer against HF at CP2, TP2 x CP2, PP2 x CP2, CP2 x DP2,
CP4, CP2 x EP2, packed, a long video, resume) run in the worlds of test_train_reference, test_packing_equivalence,
test_fault_drill and test_memory."""

from __future__ import annotations

import pytest
import torch

from megatron_vlm.model import cp_attention
from megatron_vlm.model.context_parallel import length_multiple
from megatron_vlm.runtime import mcore_patches


def _cp_state() -> dict:
    """What the CP patches replace: LLaVAModel's module names and the sys.modules entries (MISSING: absent)."""
    return {t: mcore_patches.read(t) for name in cp_attention.PATCHES for t in mcore_patches.get(name).replaces}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


@pytest.fixture(scope="module", autouse=True)
def cp_state_at_start():
    return _cp_state()


class _Group:
    """A context-parallel group as megatron-core's split reads it (its size and this rank's place)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def megatron_split(monkeypatch):
    """megatron-core's ``get_batch_on_this_cp_rank`` (the function LLaVAModel calls) for CP rank ``rank`` of ``cp``:
    torch.distributed answers its size and rank questions for a :class:`_Group`."""
    from megatron.core import utils

    real_size, real_rank = torch.distributed.get_world_size, torch.distributed.get_rank
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size",
                        lambda group=None: group.size() if isinstance(group, _Group) else real_size(group))
    monkeypatch.setattr(torch.distributed, "get_rank",
                        lambda group=None: group.rank() if isinstance(group, _Group) else real_rank(group))

    def split(row: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
        group = _Group(cp, rank)
        try:  # megatron-core 0.19: (batch, is_hybrid_cp, cp_group)
            out = utils.get_batch_on_this_cp_rank({"x": row[None]}, False, cp_group=group)
        except TypeError:  # 0.16: (batch, cp_group)
            out = utils.get_batch_on_this_cp_rank({"x": row[None]}, cp_group=group)
        return out["x"][0]

    return split


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_holds_megatron_cores_chunks(megatron_split, cp):
    """rank r: chunks r and 2 x CP - 1 - r of 2 x CP, as megatron-core's split gives them to LLaVAModel and RoPE."""
    n = 8 * cp
    for rank in range(cp):
        assert torch.equal(cp_attention.partition_index([0, n], cp, rank), megatron_split(torch.arange(n), cp, rank))
    with pytest.raises(ValueError, match="does not split into 2 x cp = 4 chunks"):
        cp_attention.partition_index([0, 10], 2, 0)


def test_packed_rows_split_per_sample(megatron_split):
    """A packed 'thd' row: each sample split on its own (as Transformer Engine's thd_get_partitioned_indices), for
    CPU tensors; the stand-in refuses boundaries that do not close the row."""
    cu = torch.tensor([0, 8, 20, 24, 32], dtype=torch.int32)
    for rank in range(2):
        got = cp_attention._TexForCpu(None).thd_get_partitioned_indices(cu, 32, 2, rank)
        want = torch.cat([megatron_split(torch.arange(a, b), 2, rank) for a, b in zip(cu.tolist(), cu[1:].tolist())])
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    with pytest.raises(ValueError, match="cu_seqlens_padded ends at 32, the packed row has 36"):
        cp_attention.thd_partitioned_indices(cu, 36, 2, 0)


def _mask(cu, cp, rank, causal=True):
    attention = cp_attention.ContextParallelAttention.__new__(cp_attention.ContextParallelAttention)
    attention.causal = causal
    return attention.mask(cu, cp, rank, "cpu")[0, 0]


@pytest.mark.parametrize("cp", [2, 4])
def test_mask_is_megatrons_causal_mask_at_the_chunk_positions(megatron_split, cp):
    """This rank's queries against the all-gathered keys (rank 0's positions, then rank 1's, ...): megatron's own
    causal mask of the whole row, rows and columns taken in that order."""
    from megatron.core.transformer.utils import get_default_causal_mask

    if not torch.cuda.is_available():
        from megatron_vlm.runtime import cpu_compat

        cpu_compat.enable()  # megatron makes the mask on "cuda"
    n = 4 * cp
    full = get_default_causal_mask(n).cpu()
    keys = torch.cat([megatron_split(torch.arange(n), cp, r) for r in range(cp)])
    for rank in range(cp):
        queries = megatron_split(torch.arange(n), cp, rank)
        assert torch.equal(_mask([0, n], cp, rank), full[queries][:, keys])
    assert not _mask([0, n], cp, 0, causal=False).any()  # bidirectional: nothing hidden
    # the control: the contiguous order (rank r holding the r-th n/cp positions) is not megatron's
    contiguous = torch.arange(n).view(cp, -1)
    assert not torch.equal(full[contiguous[0]][:, contiguous.reshape(-1)], _mask([0, n], cp, 0))


def test_packed_mask_keeps_each_sample_to_itself():
    cu = [0, 8, 16]
    keys = torch.cat([cp_attention.partition_index(cu, 2, r) for r in range(2)])
    for rank in range(2):
        queries = cp_attention.partition_index(cu, 2, rank)
        same = (queries[:, None] // 8) == (keys[None, :] // 8)
        assert torch.equal(~_mask(cu, 2, rank), same & (keys[None, :] <= queries[:, None]))


def test_mask_is_built_once_per_micro_batch(monkeypatch):
    """Every layer of a micro batch asks for the same mask: it is built (and its cu_seqlens read to the host) once,
    and again for a new micro batch's boundaries, a changed tensor, another rank or causality."""
    built = []
    real = cp_attention.partition_index
    monkeypatch.setattr(cp_attention, "partition_index", lambda *a: built.append(a) or real(*a))
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    first = cp_attention.attention_mask(cu, 2, 0, True, "cpu")
    n = len(built)
    assert all(cp_attention.attention_mask(cu, 2, 0, True, "cpu") is first for _ in range(3)) and len(built) == n
    fresh = cp_attention.attention_mask(cu.clone(), 2, 0, True, "cpu")  # the next micro batch: built again
    assert fresh is not first and torch.equal(fresh, first) and len(built) == 2 * n
    row = cp_attention.attention_mask([0, 16], 2, 1, True, "cpu")  # an unpacked row: by its length
    assert cp_attention.attention_mask([0, 16], 2, 1, True, "cpu") is row
    for other in ([0, 16], 2, 0, True), ([0, 16], 2, 1, False), ([0, 32], 2, 1, True):
        assert cp_attention.attention_mask(*other, "cpu") is not row
    same = cp_attention.attention_mask(cu, 2, 0, True, "cpu")
    cu[1] = 4  # changed in place: not the mask of the old boundaries
    changed = cp_attention.attention_mask(cu, 2, 0, True, "cpu")
    assert changed is not same and not torch.equal(changed, same)


def test_length_rule():
    assert [length_multiple(1), length_multiple(2), length_multiple(4), length_multiple(2, 2, True),
            length_multiple(1, 2, True), length_multiple(2, 2, False)] == [1, 4, 8, 8, 2, 4]


def test_llava_model_finds_what_it_imports_for_context_parallelism():
    """megatron-core 0.16's LLaVAModel imports get_batch_on_this_cp_rank from Megatron-LM's megatron.training,
    which the megatron-core package lacks: while cp_attention.patched() is on (a CP model's build and each forward)
    the name is megatron-core's own function (0.19 imports it from megatron.core.utils); the partition kernel takes
    CPU tensors; without TE the TE version checks pass. After the block megatron-core has its own names back."""
    import importlib

    from megatron.core import utils
    from megatron.core.models.multimodal import llava_model

    before = _cp_state()
    imports = cp_attention.compiled_names(llava_model.LLaVAModel)  # what its compiled code imports
    with cp_attention.patched():
        if "megatron.training.utils" in imports:
            assert importlib.import_module("megatron.training.utils").get_batch_on_this_cp_rank is \
                utils.get_batch_on_this_cp_rank
        else:
            assert "megatron.core.utils" in imports and "get_batch_on_this_cp_rank" in imports
        index = llava_model.tex.thd_get_partitioned_indices(torch.tensor([0, 8], dtype=torch.int32), 8, 2, 1)
        assert index.tolist() == [2, 3, 4, 5] and llava_model.HAVE_TEX
        if not llava_model.HAVE_TE:
            assert llava_model.is_te_min_version("1.10.0")
        assert set(cp_attention.needed()) <= set(mcore_patches.active())
    assert _same(_cp_state(), before)


def test_nothing_of_the_cp_patches_is_left_installed(cp_state_at_start):
    """The last test of the module (issue 62, finding 9): after every test above, none of the CP patches is
    installed (the registry lists none) and megatron-core's LLaVAModel module and sys.modules hold what they held
    before the module's first test."""
    assert set(cp_attention.PATCHES).isdisjoint(mcore_patches.active()), mcore_patches.active()
    assert _same(_cp_state(), cp_state_at_start)
