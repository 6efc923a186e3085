"""Context parallelism without Transformer Engine (CPU, or ``--transformer-impl local``): what megatron-core lacks
for it (the rules and megatron-core's own parts are described in :mod:`megatron_vlm.model.context_parallel`).

- :class:`ContextParallelAttention`, the language model's core attention under CP with local layers: megatron's
  own local ``DotProductAttention`` (scaling, softmax, dropout) on this rank's queries against the keys and values
  of the whole sequence, all-gathered over the CP group with megatron-core's differentiable
  ``gather_from_sequence_parallel_region`` (backward: a reduce-scatter of their gradients; gloo does both), and a
  causal mask at each position's place in the sequence (:func:`partition_index`), per packed sample for 'thd'.
  It holds the whole sequence's keys and values and an ``S/N x S`` score matrix per head on every rank: a
  reference path that makes CP run and be checked on the CPU as the other parallelisms are, not a fast one.
- :func:`patched`: the pieces megatron-core's ``LLaVAModel`` imports for CP that a CPU (or a lane without them)
  does not have, for the time of a build or a forward only (:func:`under_patches` gives the model class whose
  forward runs under them; :func:`megatron_vlm.model.build.build_model` builds a CP model so). Each is an entry of
  :mod:`megatron_vlm.runtime.mcore_patches` (:data:`PATCHES`), applied where it is needed:
  megatron-core 0.16 imports ``get_batch_on_this_cp_rank`` from Megatron-LM's ``megatron.training.utils``, which the
  megatron-core package does not ship: that name is given megatron-core's own
  ``megatron.core.utils.get_batch_on_this_cp_rank`` (the same function; ``cp-batch-split-import``). Transformer
  Engine's ``thd_get_partitioned_indices`` is a CUDA kernel: CPU tensors (and a machine without TE) get
  :func:`thd_partitioned_indices`, the same indices (``cp-partition-kernel``). Without TE, ``LLaVAModel``'s TE
  version checks, which guard TE's CP attention and that kernel, pass: neither runs (``cp-te-version-checks``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import types

import torch

from megatron_vlm.runtime import mcore_patches

_LLAVA = "megatron.core.models.multimodal.llava_model"
#: the registry's entries of context parallelism without Transformer Engine
PATCHES = ("cp-batch-split-import", "cp-partition-kernel", "cp-te-version-checks")


def partition_index(cu_seqlens, cp: int, rank: int) -> torch.Tensor:
    """Positions of the whole row (int64) that CP rank ``rank`` of ``cp`` holds, in its order: for each segment
    ``[cu[i], cu[i+1])`` (one segment: a row of one sequence; packed 'thd' rows: one per sample) split into
    ``2 x cp`` chunks, chunk ``rank`` then chunk ``2 x cp - 1 - rank`` (megatron-core's load-balanced order)."""
    cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    parts = []
    for a, b in zip(cu, cu[1:]):
        n = b - a
        if n % (2 * cp):
            raise ValueError(f"a sequence segment of {n} positions does not split into 2 x cp = {2 * cp} chunks; "
                             f"context parallelism needs every segment padded to a multiple of {2 * cp}")
        c = n // (2 * cp)
        parts += [torch.arange(a + rank * c, a + (rank + 1) * c),
                  torch.arange(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, world_size: int,
                            rank: int) -> torch.Tensor:
    """Transformer Engine's ``thd_get_partitioned_indices`` for tensors its CUDA kernel cannot take: the positions
    of a packed row of ``total_tokens`` that CP rank ``rank`` holds (:func:`partition_index` per sample)."""
    cu = cu_seqlens_padded.reshape(-1).tolist()
    if cu[-1] != int(total_tokens):
        raise ValueError(f"cu_seqlens_padded ends at {cu[-1]}, the packed row has {total_tokens} positions")
    return partition_index(cu, world_size, rank).to(device=cu_seqlens_padded.device, dtype=torch.int32)


class _TexForCpu:
    """Transformer Engine's ``transformer_engine_torch`` as megatron-core's ``LLaVAModel`` uses it under CP: CUDA
    tensors go to TE's kernel (where TE is installed), others to :func:`thd_partitioned_indices`."""

    def __init__(self, real):
        self.real = real

    def thd_get_partitioned_indices(self, cu_seqlens, total_tokens, world_size, rank):
        if self.real is not None and cu_seqlens.is_cuda:
            return self.real.thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank)
        return thd_partitioned_indices(cu_seqlens, total_tokens, world_size, rank)


def _te_version_checks_pass(version, check_equality=True) -> bool:
    """Stands for megatron-core's ``is_te_min_version`` in ``LLaVAModel`` where Transformer Engine is absent: its
    checks guard TE's CP attention and TE's partition kernel, and neither runs without TE."""
    return True


def compiled_names(cls) -> set[str]:
    """The names the compiled code of ``cls``'s own functions uses (modules they import included): what megatron-core
    runs, read without its source."""
    names, codes = set(), [v.__code__ for v in vars(cls).values() if isinstance(v, types.FunctionType)]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def needed() -> list[str]:
    """The entries of :data:`PATCHES` this process needs for a CP ``LLaVAModel`` (see the module docstring)."""
    from megatron.core.models.multimodal import llava_model

    wanted = {"cp-batch-split-import": mcore_patches.is_active("cp-batch-split-import")
              or _imports_missing_megatron_lm(llava_model.LLaVAModel),
              "cp-partition-kernel": not (getattr(llava_model, "HAVE_TEX", False) and torch.cuda.is_available()),
              "cp-te-version-checks": not getattr(llava_model, "HAVE_TE", False)}
    return [name for name in PATCHES if wanted[name] or mcore_patches.is_active(name)]


@functools.lru_cache(maxsize=None)
def _imports_missing_megatron_lm(cls) -> bool:
    """Whether ``cls`` imports Megatron-LM's ``megatron.training.utils`` (megatron-core 0.16's LLaVAModel) and no
    Megatron-LM is installed (read once per process: every forward of a CP model asks)."""
    if "megatron.training.utils" not in compiled_names(cls):
        return False
    try:
        return importlib.util.find_spec("megatron.training") is None
    except ValueError:  # a megatron.training module without a spec is there already: not ours to replace
        return False


@contextlib.contextmanager
def patched():
    """megatron-core's ``LLaVAModel`` runs context parallelism here for the time of the ``with`` block (a build, a
    forward): the registry's entries :func:`needed` names, undone at its end."""
    with contextlib.ExitStack() as stack:
        for name in needed():
            stack.enter_context(mcore_patches.applied(name))
        yield


@functools.lru_cache(maxsize=None)
def under_patches(cls):
    """``cls`` (megatron-core's ``LLaVAModel`` or a subclass) whose forward runs under :func:`patched`."""

    class ContextParallel(cls):
        def forward(self, *args, **kwargs):
            with patched():
                return super().forward(*args, **kwargs)

    ContextParallel.__name__ = ContextParallel.__qualname__ = f"ContextParallel{cls.__name__}"
    ContextParallel.__doc__ = f"megatron-core's {cls.__name__} whose forward runs under cp_attention.patched()."
    return ContextParallel


@mcore_patches.implements("cp-batch-split-import")
def _batch_split_import(originals: dict) -> dict:
    from megatron.core.utils import get_batch_on_this_cp_rank

    utils = types.ModuleType("megatron.training.utils")
    utils.__doc__ = "megatron-core's get_batch_on_this_cp_rank under the name megatron-core 0.16 imports it by"
    utils.get_batch_on_this_cp_rank = get_batch_on_this_cp_rank
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    package.utils = utils
    return {"sys.modules:megatron.training": package, "sys.modules:megatron.training.utils": utils}


@mcore_patches.implements("cp-partition-kernel")
def _partition_kernel(originals: dict) -> dict:
    real = originals[f"{_LLAVA}:tex"] if originals[f"{_LLAVA}:HAVE_TEX"] is True else None
    return {f"{_LLAVA}:tex": _TexForCpu(real), f"{_LLAVA}:HAVE_TEX": True}


@mcore_patches.implements("cp-te-version-checks")
def _te_version_checks(originals: dict) -> dict:
    return {f"{_LLAVA}:is_te_min_version": _te_version_checks_pass}


def _core_attention_base():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class ContextParallelAttention(_core_attention_base()):
    """megatron-core's local ``DotProductAttention`` under context parallelism (see the module docstring).

    Built like megatron's core attention (its layer spec's ``core_attention``); ``cp_comm_type`` is accepted and
    not used (this attention always all-gathers keys and values). Queries ``[s/cp, b, heads, dim]`` (packed:
    ``[t/cp, heads, dim]``) are this rank's positions in megatron-core's order; the output has their shape
    ``[s/cp, b, hidden]`` (packed: ``[t/cp, 1, hidden]``, as megatron's local packed attention)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType

        plain = copy.copy(config)
        plain.context_parallel_size = 1  # megatron's local attention refuses CP only because it cannot gather
        # the explicit mask goes through megatron's softmax as given (a causal type would rebuild a square one)
        super().__init__(plain, layer_number, AttnMaskType.arbitrary, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, pg_collection=pg_collection)
        self.causal = attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        self.cp_group = getattr(pg_collection, "cp", None) or ps.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if attention_mask is not None:
            raise ValueError("context-parallel local attention takes no attention mask: it masks by each "
                             "position's place in the sequence (causal, per packed sample)")
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:  # [t/cp, heads, dim] -> one row of the batch
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        total = query.shape[0] * cp
        if not packed:
            cu = [0, total]
        mask = self.mask(cu, cp, rank, query.device)
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=self.cp_group)
        return super().forward(query, key, value, mask, attention_bias=attention_bias, **kwargs)

    def mask(self, cu_seqlens, cp: int, rank: int, device) -> torch.Tensor:
        """:func:`attention_mask` for this attention's causality (built once per micro batch, not per layer)."""
        return attention_mask(cu_seqlens, cp, rank, self.causal, device)


#: the last mask :func:`attention_mask` built, and what it was built for: every layer of a micro batch asks for
#: the same one (the same ``cu_seqlens`` tensor of its packed parameters, or the same row length)
_LAST_MASK: list = []


def attention_mask(cu_seqlens, cp: int, rank: int, causal: bool, device) -> torch.Tensor:
    """``[1, 1, this rank's positions, all positions]``, True where a query may not see a key (megatron's mask
    convention): a key of another packed sample, or (causal) a later position. Keys are in the order of the
    all-gather: rank 0's positions, then rank 1's, ...

    Built on the host and copied to ``device`` once per micro batch: the layers after the first get the same mask
    back (a ``cu_seqlens`` tensor is recognised as the same object, unchanged since, which also skips reading it to
    the host again; a list of boundaries by its values)."""
    tensor = torch.is_tensor(cu_seqlens)
    key = (cu_seqlens if tensor else tuple(int(x) for x in cu_seqlens), cu_seqlens._version if tensor else 0, cp,
           rank, causal, torch.device(device))
    if _LAST_MASK:
        last, mask = _LAST_MASK
        if (last[0] is key[0] if tensor else last[0] == key[0]) and last[1:] == key[1:]:
            return mask
    cu = torch.as_tensor([int(x) for x in (cu_seqlens.tolist() if tensor else cu_seqlens)])
    q = partition_index(cu, cp, rank)
    k = torch.cat([partition_index(cu, cp, r) for r in range(cp)])
    seg_q, seg_k = (torch.bucketize(x, cu[1:], right=True) for x in (q, k))
    hidden = seg_q[:, None] != seg_k[None, :]
    if causal:
        hidden |= k[None, :] > q[:, None]
    mask = hidden[None, None].to(device)
    _LAST_MASK[:] = [key, mask]
    return mask
