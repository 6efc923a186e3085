"""Which transformer layer implementation a run uses, and how checkpoints move between the two.

Owns:
- the choice between Transformer Engine layers and megatron-core's local layers (``--transformer-impl``, named as
  in Megatron-LM): :func:`choose` picks Transformer Engine when it imports on a CUDA device, local layers
  otherwise, and says why;
- the core attention of those layers (``--attention-backend``, Megatron-LM's flag and megatron-core's
  ``AttnBackend`` choices plus ``sdpa``): :func:`choose_attention` (see :data:`ATTENTION_BACKENDS`);
- the checkpoint keys that differ between the two, so that a checkpoint written with either loads into either:

  * norm weights: local layers save their layer norms under the Transformer Engine names
    (:data:`LOCAL_TO_TE_KEYS`, applied to torch_dist checkpoints by the layer specs in :mod:`megatron_vlm.model.build`);
    a legacy ``torch`` state dict is renamed by :func:`adapt_state_dict`;
  * experts: megatron-core's ``SequentialMLP`` (local layers) names an expert's linear
    ``mlp.experts.local_experts.<j>.linear_fc1.weight``, Transformer Engine's ``TEGroupedMLP`` (grouped GEMM)
    ``mlp.experts.linear_fc1.weight<j>``; their torch_dist keys are the same (megatron-core maps both to the global
    expert), and :func:`sequential_expert_name` / :func:`grouped_expert_name` rename plain state dicts;
  * ``_extra_state``: Transformer Engine modules (and megatron's linears, for compatibility) carry an
    ``_extra_state`` entry (FP8 scaling metadata). A checkpoint written with local layers, e.g. one converted from
    HF, lacks some of them (``core_attention._extra_state``). :func:`fill_absent_extra_state` (torch_dist) and
    :func:`adapt_state_dict` (plain state dicts) let such entries keep the module's own current value; every other
    entry must be present, so no real tensor is ever skipped silently. Entries the checkpoint has and the model
    lacks are ignored only when they are ``_extra_state``.
"""

from __future__ import annotations

import logging
import re

IMPLS = ("transformer_engine", "local")
#: ``--attention-backend`` choices: megatron-core's ``AttnBackend`` names (flash, fused, unfused: Transformer Engine's
#: attention kernels; local: megatron-core's ``DotProductAttention``; auto) and ``sdpa``, the core attention on torch's
#: ``scaled_dot_product_attention`` (:mod:`megatron_vlm.model.sdpa_attention`) for local layers
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local", "sdpa")
TE_ATTENTION = ("auto", "flash", "fused", "unfused")
EXTRA_STATE = "_extra_state"

# Local-spec layer norm names -> the Transformer Engine fused names (checkpoint keys).
LOCAL_TO_TE_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}

log = logging.getLogger(__name__)


class CheckpointKeyError(KeyError):
    """A checkpoint lacks tensors the model needs (not only Transformer Engine ``_extra_state``)."""

    def __str__(self):  # KeyError would print the message with quotes
        return str(self.args[0])


def te_status() -> tuple[bool, str]:
    """(importable, reason): whether ``transformer_engine.pytorch`` imports here."""
    try:
        import torch  # noqa: F401  (first: TE's core library needs the NCCL that torch's import loads)
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a broken build raising anything
        return False, f"{type(e).__name__}: {e}"[:300]
    return True, ""


def cp_without_te(cp: int, why: str) -> str:
    """The refusal of context parallelism on CUDA where Transformer Engine does not import and local layers were not
    asked for: they would run the CPU reference attention (:mod:`megatron_vlm.model.cp_attention`) silently."""
    return (f"--cp {cp} on CUDA needs Transformer Engine's attention, and Transformer Engine does not import here "
            f"({why}); install it (bench/GPU.md, or the NGC container in containers/), or pass --transformer-impl "
            "local to run the reference CP attention (the whole sequence's keys and values and an S/CP x S score "
            "matrix per head on every rank: for checks, not for speed)")


def choose(requested: str | None, device: str, fp8: bool = False, cp: int = 1) -> tuple[str, str]:
    """(implementation, why) for ``--transformer-impl`` ``requested`` (None: automatic) on ``device`` with context
    parallelism ``cp``.

    Automatic: Transformer Engine when it imports on CUDA, local layers otherwise; but not context parallelism on
    CUDA without it (:func:`cp_without_te`: only an explicit ``--transformer-impl local`` runs the reference CP
    attention there). Transformer Engine asked for where it cannot run, or FP8 without it, is an error naming the
    fix.
    """
    if requested not in (None, *IMPLS):
        raise ValueError(f"--transformer-impl {requested}: must be one of {', '.join(IMPLS)}")
    if requested == "local":
        if fp8:
            raise ValueError("--fp8 needs --transformer-impl transformer_engine (FP8 GEMMs are Transformer "
                             "Engine's); drop --fp8 or --transformer-impl local")
        return "local", "--transformer-impl local"
    if device != "cuda":
        if requested == "transformer_engine" or fp8:
            what = "--fp8" if fp8 else "--transformer-impl transformer_engine"
            raise ValueError(f"{what} needs a CUDA GPU; on --device {device} use --transformer-impl local")
        return "local", f"automatic: device {device} (Transformer Engine runs on CUDA only)"
    ok, why = te_status()
    if requested == "transformer_engine" or fp8:
        if not ok:
            what = "--fp8" if fp8 and requested is None else "--transformer-impl transformer_engine"
            raise ValueError(f"{what} needs Transformer Engine, which does not import here ({why}); install it "
                             "(bench/GPU.md, or the NGC container in containers/) or use --transformer-impl local")
        return "transformer_engine", "--transformer-impl transformer_engine" if requested else \
            "automatic: --fp8 needs Transformer Engine"
    if ok:
        return "transformer_engine", "automatic: Transformer Engine imports on CUDA"
    if cp > 1:
        raise ValueError(cp_without_te(cp, why))
    return "local", f"automatic: Transformer Engine does not import ({why})"


def planned(requested: str | None, backend: str | None, device: str | None, cp: int,
            te_imports: bool | None) -> tuple[str, str]:
    """(implementation, core attention) that a run's ranks will choose (:func:`choose`, :func:`choose_attention`),
    decided before they start (the launcher's memory estimate): ``te_imports`` says whether Transformer Engine
    imports in the runtime that will train (None: not asked, taken as importing on CUDA). A choice the ranks would
    refuse gives what the request names, or local layers (the launcher's checks report the refusal)."""
    device = device or "cuda"
    if requested in IMPLS:
        impl = requested
    else:
        impl = "transformer_engine" if device == "cuda" and te_imports is not False else "local"
    try:
        attention = choose_attention(backend, impl, device, cp)[0]
    except ValueError:
        attention = backend or "local"
    return impl, attention


def keeps_no_scores(impl: str, attention: str) -> bool:
    """Whether the core attention keeps no ``S x S`` score matrices for its backward (the memory estimate's
    ``fused_attention``): Transformer Engine's attention and torch's ``scaled_dot_product_attention`` (``sdpa``,
    flash / memory-efficient kernels) keep none; megatron-core's local attention keeps scores and probabilities."""
    return impl == "transformer_engine" or attention == "sdpa"


def choose_attention(requested: str | None, impl: str, device: str, cp: int = 1) -> tuple[str, str]:
    """(backend, why) of ``--attention-backend`` ``requested`` (None: auto) for layer implementation ``impl`` on
    ``device`` with context parallelism ``cp``. The backend is one of :data:`ATTENTION_BACKENDS` but ``auto`` only
    with Transformer Engine layers (TE's attention picks its kernel); local layers get ``local`` or ``sdpa``.

    ``auto``: Transformer Engine layers run TE's attention, which picks flash, fused or unfused itself (as in
    Megatron-LM). Local layers run ``sdpa`` on CUDA (a fused flash / memory-efficient kernel: the GPU path without
    TE, e.g. a plain PyPI install or ROCm) and megatron-core's ``local`` attention on CPU; under context
    parallelism (``cp`` > 1) local layers run megatron-vlm's CP reference attention, which is ``local``. Asked for
    where it cannot run: a ``ValueError`` naming the flag and the fix."""
    requested = requested or "auto"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {requested}: must be one of {', '.join(ATTENTION_BACKENDS)}")
    if impl == "transformer_engine":
        if requested not in TE_ATTENTION:
            raise ValueError(f"--attention-backend {requested} is the core attention of local layers; with "
                             "--transformer-impl transformer_engine use auto, flash, fused or unfused (Transformer "
                             f"Engine's attention), or pass --transformer-impl local for {requested}")
        return requested, ("automatic: Transformer Engine's attention picks its kernel" if requested == "auto"
                           else f"--attention-backend {requested} (Transformer Engine's attention)")
    if requested in ("flash", "fused", "unfused"):
        raise ValueError(f"--attention-backend {requested} is a Transformer Engine attention kernel; use "
                         "--transformer-impl transformer_engine, or --attention-backend sdpa / local with local layers")
    if requested == "sdpa" and cp > 1:
        raise ValueError(f"--attention-backend sdpa does not run context parallelism (--cp {cp}); use "
                         "--attention-backend local (megatron's attention on all-gathered keys and values) or "
                         "Transformer Engine layers")
    if requested != "auto":
        return requested, f"--attention-backend {requested}"
    if cp > 1:
        return "local", f"automatic: context parallelism (--cp {cp}) with local layers runs megatron's local attention"
    if device == "cuda":
        return "sdpa", "automatic: local layers on CUDA run torch's scaled_dot_product_attention"
    return "local", f"automatic: local layers on {device} run megatron-core's local attention"


def is_extra_state(key: str) -> bool:
    return key == EXTRA_STATE or key.endswith("." + EXTRA_STATE)


def _examples(keys, n: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def fill_absent_extra_state(sharded_state_dict: dict, checkpoint_keys: set[str], where="checkpoint") -> list[str]:
    """Prepare a model's flat sharded state dict for ``dist_checkpointing.load`` from a checkpoint holding
    ``checkpoint_keys`` (from :func:`checkpoint_keys`).

    Each ``_extra_state`` ShardedObject the checkpoint lacks becomes a LocalNonpersistentObject of the module's
    current value, so loading keeps it; returns those keys. Any other ShardedTensor/ShardedObject the checkpoint
    lacks raises :class:`CheckpointKeyError` naming them. Entries only in the checkpoint are left to
    dist_checkpointing, which ignores them; see :func:`unexpected_keys`.
    """
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor

    filled, missing = [], []
    for name, sh in list(sharded_state_dict.items()):
        if not isinstance(sh, (ShardedTensor, ShardedObject)) or sh.key in checkpoint_keys:
            continue
        if isinstance(sh, ShardedObject) and is_extra_state(sh.key):
            sharded_state_dict[name] = LocalNonpersistentObject(sh.data)
            filled.append(sh.key)
        else:
            missing.append(sh.key)
    if missing:
        raise CheckpointKeyError(
            f"{where} lacks {len(missing)} tensor(s) the model needs: {_examples(missing)}. It was written for a "
            "different architecture or megatron-vlm version; convert it again with convert/hf_to_megatron.py")
    if filled:
        log.info("%s has no Transformer Engine _extra_state for %d module(s) (written with local layers); they "
                 "keep their fresh state", where, len(filled))
    return filled


def unexpected_keys(requested: set[str], checkpoint_keys: set[str], roots: set[str]) -> list[str]:
    """Checkpoint entries under the model's top-level ``roots`` that nobody requested, other than
    ``_extra_state`` (``requested``: the keys of every rank, so pipeline stages see the whole model)."""
    return sorted(k for k in checkpoint_keys - requested
                  if k.split(".", 1)[0] in roots and not is_extra_state(k))


def prepare_dist_load(sharded_state_dict: dict, iter_dir) -> list[str]:
    """What the torch_dist load paths call before ``dist_checkpointing.load``: :func:`fill_absent_extra_state`
    against ``iter_dir``'s keys, and a warning naming checkpoint tensors the model does not load (collective:
    the keys of all ranks are gathered, since each pipeline stage holds a part of the model)."""
    import torch

    keys = checkpoint_keys(iter_dir)
    filled = fill_absent_extra_state(sharded_state_dict, keys, where=str(iter_dir))
    requested = {getattr(v, "key", None) for v in sharded_state_dict.values()} - {None}
    requested |= set(filled)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, requested)
        requested = set().union(*everyone)
    roots = {k.split(".", 1)[0] for k in requested}
    extra = unexpected_keys(requested, keys, roots)
    if extra and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        log.warning("%s holds %d tensor(s) this model does not load: %s", iter_dir, len(extra), _examples(extra))
    return filled


def checkpoint_keys(iter_dir) -> set[str]:
    """Keys of the ShardedTensors and ShardedObjects of a torch_dist checkpoint (a local path or a URL)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {v.key for v in load_sharded_metadata(str(iter_dir)).values() if hasattr(v, "key")}


_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_SEQUENTIAL = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def sequential_expert_name(key: str) -> str:
    """A ``TEGroupedMLP`` expert key (``...mlp.experts.linear_fc1.weight3``) under ``SequentialMLP``'s name
    (``...mlp.experts.local_experts.3.linear_fc1.weight``); other keys unchanged."""
    return _GROUPED.sub(lambda m: f".mlp.experts.local_experts.{m.group(3)}.{m.group(1)}.{m.group(2)}", key)


def grouped_expert_name(key: str) -> str:
    """The inverse of :func:`sequential_expert_name`."""
    return _SEQUENTIAL.sub(lambda m: f".mlp.experts.{m.group(2)}.{m.group(3)}{m.group(1)}", key)


def _renamed(key: str, table: dict[str, str]) -> str | None:
    for old, new in table.items():
        marker = "." + old
        if marker in key:
            return key.replace(marker, "." + new, 1)
    return None


def adapt_state_dict(state: dict, model_state: dict, where="checkpoint") -> dict:
    """A plain (legacy ``torch``) ``state`` made loadable with ``strict=True`` into a model whose own state dict
    is ``model_state``: norm names renamed between the local and Transformer Engine layouts, experts between
    ``SequentialMLP`` and ``TEGroupedMLP``, ``_extra_state``
    the checkpoint lacks taken from the model, ``_extra_state`` the model lacks dropped. Real tensors are never
    dropped or invented: what still differs makes ``load_state_dict(strict=True)`` fail."""
    te_to_local = {v: k for k, v in LOCAL_TO_TE_KEYS.items()}
    out = {}
    for key, value in state.items():
        if key not in model_state:
            alt = _renamed(key, LOCAL_TO_TE_KEYS) or _renamed(key, te_to_local)
            experts = [n for n in (sequential_expert_name(key), grouped_expert_name(key)) if n != key]
            if alt is not None and alt in model_state:
                key = alt
            elif experts and experts[0] in model_state:
                key = experts[0]
            elif is_extra_state(key):
                continue
        out[key] = value
    absent = [k for k in model_state if k not in out and is_extra_state(k)]
    for k in absent:
        out[k] = model_state[k]
    if absent:
        log.info("%s has no _extra_state for %d module(s); they keep their fresh state", where, len(absent))
    return out
