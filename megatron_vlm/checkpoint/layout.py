"""Megatron checkpoint layout and model weight I/O (torch_dist and legacy ``torch``).

Layout (Megatron's)::

    <dir>/latest_checkpointed_iteration.txt      "release" or an integer; written last
    <dir>/release/ or <dir>/iter_0000100/
        vlm_spec.json                             the architecture (megatron_vlm.model.spec)
        ckpt_meta.json                            format, tp, pp, pp_layers, iteration, dtype, and the
                                                  versions that wrote it (megatron-core, torch)
        hf_extra.safetensors                      HF tensors the Megatron model does not hold
        <torch_dist files>  or  mp_rank_XX[_YYY][_EEE]/model_optim_rng.pt   (TP rank, PP rank if pp > 1,
                                                  expert-parallel rank if ep > 1, as Megatron-LM names them)

Model keys follow Megatron-LM's convention: ``model.sharded_state_dict()`` with no prefix (torch_dist) and
``{"model": model.state_dict()}`` per rank file (legacy; with virtual pipeline stages ``model0``, ``model1``, ...,
one per model chunk of the rank, each with its own layer numbers from 0), norms under Transformer Engine names, so
Megatron-LM loads these checkpoints. Checkpoints that megatron-vlm wrote before stored torch_dist keys under a ``model.``
prefix; :func:`dist_key_layout` reads which convention a checkpoint uses from its metadata, so both load.
    <dir>/tokenizer/                              tokenizer + processor files (copied from the HF dir)

An iteration directory is written under a temporary name and renamed when complete; the tracker is
updated after the rename, so a crash never leaves a checkpoint that looks complete but is not. Every function
here also takes an object-store URL (``msc://PROFILE/...``, see :mod:`megatron_vlm.files.storage`); how a checkpoint
is committed there without a rename is described in :mod:`megatron_vlm.training.checkpointing`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megatron_vlm.files import storage
from megatron_vlm.model import layer_impl
from megatron_vlm.runtime import mcore_version
from megatron_vlm.checkpoint.legacy_ranks import (  # noqa: F401 (the legacy layout, exported here)
    CheckpointLayoutError, legacy_layout, legacy_layout_ep, legacy_rank_dir, legacy_rank_file)
from megatron_vlm.model.spec import SPEC_FILE, VLMSpec

TRACKER = "latest_checkpointed_iteration.txt"
META = "ckpt_meta.json"
EXTRA = "hf_extra.safetensors"
TOKENIZER_DIR = "tokenizer"
FORMATS = ("torch_dist", "torch")


@dataclass
class CheckpointMeta:
    format: str
    tp: int
    pp: int
    pp_layers: list[int]
    iteration: int | str = "release"
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)
    #: the software that wrote the checkpoint (megatron_core, torch, python, megatron_vlm); set by save()
    versions: dict = field(default_factory=dict)
    ep: int = 1  # expert-model-parallel size (legacy rank files are per EP rank; torch_dist reshards)
    etp: int | None = None  # expert tensor-parallel size (None: tp)
    vpp: int = 1  # virtual pipeline stages per PP rank (legacy rank files hold model0, model1, ...; torch_dist reshards)

    @property
    def stage_layers(self) -> list[int]:
        """Language layers per virtual pipeline stage, in the model's order (per PP stage without VPP): how legacy
        rank files lay the layers out (:mod:`megatron_vlm.model.pipeline_layout`)."""
        from megatron_vlm.model.pipeline_layout import virtual_stage_layers

        return virtual_stage_layers(self.pp_layers, self.vpp)

    def save(self, iter_dir) -> None:
        self.versions = mcore_version.writer_stamp()
        fields = asdict(self)
        if fields["vpp"] == 1:  # recorded only with virtual pipeline stages: other checkpoints read as before
            del fields["vpp"]
        storage.write_text(storage.join(iter_dir, META), json.dumps(fields, indent=2))

    @classmethod
    def load(cls, iter_dir) -> "CheckpointMeta":
        path = storage.path(iter_dir) / META
        if not path.is_file():
            raise CheckpointLayoutError(f"{iter_dir} has no {META}; it was not written by megatron-vlm")
        return cls(**json.loads(path.read_text()))


def recorded_writer(iter_dir) -> str | None:
    """The megatron-core version recorded in ``iter_dir``'s ``ckpt_meta.json`` (None when it records none)."""
    try:
        meta = json.loads((storage.path(iter_dir) / META).read_text())
    except (OSError, ValueError):
        return None
    return (meta.get("versions") or {}).get("megatron_core")


def check_readable(iter_dir) -> None:
    """:func:`megatron_vlm.runtime.mcore_version.check_readable` with the writer this checkpoint records."""
    if mcore_version.unreadable(iter_dir):
        mcore_version.check_readable(iter_dir, recorded_writer(iter_dir))


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def read_tracker(ckpt_dir) -> int | str | None:
    path = storage.path(ckpt_dir) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise CheckpointLayoutError(f"{path} holds {text!r}; expected an iteration number or 'release'") from None


def write_tracker(ckpt_dir, iteration: int | str) -> None:
    storage.write_text(storage.join(ckpt_dir, TRACKER), str(iteration))


def resolve_iteration_dir(ckpt_dir, iteration: int | str | None = None) -> Path:
    """The iteration directory to read: ``iteration`` if given, else the tracker's (``storage.path`` type)."""
    ckpt_dir = storage.path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointLayoutError(f"--megatron-dir {ckpt_dir} does not exist")
    if is_iteration_dir(ckpt_dir):  # pointed directly at an iteration directory
        from megatron_vlm.checkpoint.checks import check_iteration_matches

        check_iteration_matches(ckpt_dir, iteration)
        check_readable(ckpt_dir)
        return ckpt_dir
    if iteration is None:
        iteration = read_tracker(ckpt_dir)
        if iteration is None:
            found = sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith(("iter_", "release")))
            hint = f"; it has {', '.join(found)}: pass --iteration" if found else ""
            raise CheckpointLayoutError(f"{ckpt_dir} has no {TRACKER}, so it is not a finished checkpoint{hint}")
    path = ckpt_dir / iter_dir_name(iteration)
    if not path.is_dir():
        raise CheckpointLayoutError(f"{path} does not exist (iteration {iteration} of {ckpt_dir})")
    check_readable(path)
    return path


def run_dir(iter_dir):
    """The checkpoint directory (a converted checkpoint, or a training run) that holds ``iter_dir``; it has the
    tracker and ``tokenizer/``."""
    return storage.path(iter_dir).parent


def is_iteration_dir(path) -> bool:
    """An iteration directory of megatron-vlm (``ckpt_meta.json``) or Megatron-LM (torch_dist's
    ``metadata.json``, or legacy ``mp_rank_*`` rank directories)."""
    path = storage.path(path)
    if (path / META).is_file() or (path / "metadata.json").is_file():
        return True
    return not storage.is_remote(path) and path.is_dir() and any(p.name.startswith("mp_rank_") for p in path.iterdir())


def list_iterations(ckpt_dir, complete: bool = True) -> list[int]:
    """Iterations with a directory under ``ckpt_dir``: complete ones (holding ``ckpt_meta.json``, which is
    written last), or with ``complete=False`` those without it (an interrupted save)."""
    ckpt_dir = storage.path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    its = []
    for p in ckpt_dir.iterdir():
        name = p.name or str(p).rstrip("/").rsplit("/", 1)[-1]
        if re.fullmatch(r"iter_\d+", name) and p.is_dir() and (p / META).is_file() == complete:
            its.append(int(name[5:]))
    return sorted(its)


def write_side_files(iter_dir, spec: VLMSpec, extra: dict[str, torch.Tensor] | None) -> None:
    """The spec and the HF-only tensors, which every iteration directory carries."""
    from safetensors.torch import save

    spec.save(iter_dir)
    storage.write_bytes(storage.join(iter_dir, EXTRA), save({k: v.contiguous() for k, v in (extra or {}).items()}))


def read_extra(iter_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    path = storage.path(iter_dir) / EXTRA
    return load(path.read_bytes()) if path.is_file() else {}


def copy_side_files(src_iter_dir, dst_iter_dir) -> None:
    for name in (SPEC_FILE, EXTRA):
        src = storage.path(src_iter_dir) / name
        if src.is_file():
            storage.write_bytes(storage.join(dst_iter_dir, name), src.read_bytes())


def copy_tokenizer(hf_dir, ckpt_dir) -> None:
    """Copy tokenizer / processor / chat template files (not weights) from the local ``hf_dir`` into
    ``<ckpt_dir>/tokenizer`` (a local directory or a URL)."""
    dst = storage.join(ckpt_dir, TOKENIZER_DIR)
    if not storage.is_remote(dst):
        Path(dst).mkdir(parents=True, exist_ok=True)
    for p in Path(hf_dir).iterdir():
        if p.is_file() and not p.name.endswith((".safetensors", ".bin", ".pt")) and p.name != "model.safetensors.index.json":
            storage.copy_file(p, storage.join(dst, p.name))


# ---- legacy `torch` format -----------------------------------------------------------------------
def save_legacy_rank(iter_dir, tp_rank, pp_rank, pp, state: dict, iteration, ep_rank: int = 0, ep: int = 1) -> None:
    path = legacy_rank_file(iter_dir, tp_rank, pp_rank, pp, ep_rank, ep)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"model": state, "checkpoint_version": 3.0, "iteration": iteration}, tmp)
    os.replace(tmp, path)


def normalize_legacy_names(state: dict) -> dict:
    """A rank file's model state under the local layer spec's names: Transformer Engine's fused norm names
    (``linear_qkv.layer_norm_weight``) become ``input_layernorm.weight`` etc., ``TEGroupedMLP``'s experts
    (``experts.linear_fc1.weight3``) ``SequentialMLP``'s (``experts.local_experts.3.linear_fc1.weight``), and TE's
    ``_extra_state`` entries (FP8 scaling state, which no weight depends on) are dropped."""
    from megatron_vlm.model.layer_impl import sequential_expert_name

    return {sequential_expert_name(local_norm_name(k)): v for k, v in state.items() if not k.endswith("_extra_state")}


def local_norm_name(key: str) -> str:
    """``key`` with Transformer Engine's fused norm names replaced by the local layer spec's."""
    from megatron_vlm.model.build import LOCAL_TO_TE_KEYS

    for local, te in LOCAL_TO_TE_KEYS.items():
        key = key.replace("." + te, "." + local)
    return key


def load_legacy_rank(iter_dir, tp_rank, pp_rank, pp, mmap: bool = True, ep_rank: int = 0, ep: int = 1) -> dict:
    path = legacy_rank_file(iter_dir, tp_rank, pp_rank, pp, ep_rank, ep)
    if not path.is_file():
        raise CheckpointLayoutError(f"{path} is missing; the checkpoint is incomplete")
    import megatron.core  # noqa: F401  (registers the safe globals of Megatron-LM's files: args, RNG state)

    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


# ---- torch_dist key convention ----------------------------------------------------------------------------
OLD_PREFIX = "model."  # megatron-vlm checkpoints written before it followed Megatron-LM's convention


@dataclass(frozen=True)
class DistKeyLayout:
    """How a torch_dist checkpoint names the model's tensors.

    ``prefix``: ``""`` (Megatron-LM's convention) or ``"model."`` (older megatron-vlm checkpoints).
    ``te_norms``: layer norms under Transformer Engine's fused names (``linear_qkv.layer_norm_weight``) rather
    than the local spec's (``input_layernorm.weight``); megatron-vlm always writes TE names, Megatron-LM's
    local spec writes local ones.
    """

    prefix: str = ""
    te_norms: bool = True


def dist_key_layout(iter_dir) -> DistKeyLayout:
    """Read the key convention of the torch_dist checkpoint in ``iter_dir`` from its tensor metadata."""
    from megatron.core import dist_checkpointing

    check_readable(iter_dir)  # every torch_dist load asks this first
    keys = list(dist_checkpointing.load_tensors_metadata(str(iter_dir)))
    prefix = OLD_PREFIX if any(k.startswith(OLD_PREFIX + "language_model.") for k in keys) else ""
    te = any(".linear_qkv.layer_norm_weight" in k for k in keys) or not any(".input_layernorm." in k for k in keys)
    return DistKeyLayout(prefix, te)


def model_sharded_state_dict(model, layout: DistKeyLayout = DistKeyLayout()) -> dict:
    """``model``'s sharded state dict with the checkpoint keys of ``layout`` (the dict's own keys are the
    parameter names with ``layout.prefix``)."""
    sharded = model.sharded_state_dict(prefix=layout.prefix)
    if not layout.te_norms:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        from megatron_vlm.model.build import LOCAL_TO_TE_KEYS

        for sh in nested_values(sharded):
            if isinstance(sh, ShardedBase):
                for local, te in LOCAL_TO_TE_KEYS.items():
                    sh.key = sh.key.replace("." + te, "." + local)
    return sharded


# ---- model weights in a running world --------------------------------------------------------------
def check_meta(meta: CheckpointMeta, spec: VLMSpec, tp: int, pp: int, where, ep: int = 1,
               etp: int | None = None, vpp: int = 1) -> None:
    have = (meta.tp, meta.pp, meta.ep, meta.etp or meta.tp, meta.vpp)
    if meta.format == "torch" and have != (tp, pp, ep, etp or tp, vpp):
        ep_text = lambda e, x, t: f" ep={e} etp={x or t}" if spec.is_moe else ""  # noqa: E731
        vpp_text = lambda v: f" vpp={v}" if v > 1 or vpp != meta.vpp else ""  # noqa: E731
        flags = f"--tp {meta.tp} --pp {meta.pp}" + (f" --ep {meta.ep} --etp {meta.etp or meta.tp}" if spec.is_moe else "")
        if meta.vpp > 1:
            flags += f" --num-virtual-stages-per-pipeline-rank {meta.vpp}"
        raise CheckpointLayoutError(
            f"{where} is a legacy 'torch' checkpoint written at tp={meta.tp} pp={meta.pp}"
            f"{ep_text(meta.ep, meta.etp, meta.tp)}{vpp_text(meta.vpp)}, which cannot be loaded at tp={tp} pp={pp}"
            f"{ep_text(ep, etp, tp)}{vpp_text(vpp)}; use {flags}, or convert it to torch_dist (which reshards on load)"
        )


def save_sharded(sharded_state_dict: dict, iter_dir, verify_integrity: bool = False) -> None:
    """``dist_checkpointing.save`` (collective over all ranks): every torch_dist save of megatron-vlm goes
    through here. ``verify_integrity``: megatron-core writes its integrity manifest too, where it has one
    (:func:`megatron_vlm.runtime.mcore_version.has_integrity_manifest`).

    megatron-core's torch_dist writer collects its results through a ``multiprocessing`` Manager queue whose server
    process it starts once per process (:func:`_start_write_results_queue` starts it instead, so that the server
    ends with the rank on every device path).
    """
    from megatron.core import dist_checkpointing

    _start_write_results_queue()
    extra = {"verify_integrity": True} if verify_integrity and mcore_version.has_integrity_manifest() else {}
    dist_checkpointing.save(sharded_state_dict, str(iter_dir), **extra)


def _start_write_results_queue() -> None:
    """Start megatron-core's write-results queue (see :func:`save_sharded`), if not started yet: both megatron-core
    0.16 and 0.19 keep it in the module global ``_results_queue``, which their getter fills only when empty.

    Its server process ends with the rank that started it, even when the rank is killed with SIGKILL
    (:func:`megatron_vlm.runtime.with_parent.end_with_parent`): megatron-core's own server outlived a rank killed in
    the middle of a save. With CUDA the server is spawned, as megatron-core does (a forked CUDA process is unsafe);
    without CUDA it is forked from this process, which has torch and torch.distributed.checkpoint imported already
    (a spawned interpreter imports them again to unpickle the results: ~3 s of CPU, measured on a 2-core machine, in
    every rank's first save and every converter run)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_vlm.runtime.with_parent import end_with_parent

    if getattr(filesystem_async, "_results_queue", None) is not None or not hasattr(filesystem_async,
                                                                                    "_results_queue"):
        return  # started, or a megatron-core whose queue lives elsewhere: its own choice stands
    method = "spawn" if torch.cuda.is_available() else "fork"
    manager = SyncManager(ctx=multiprocessing.get_context(method))
    manager.start(end_with_parent, (os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager (and its server) alive


def save_model_weights(model, iter_dir) -> None:
    """Save this rank's chunk with dist_checkpointing (collective over all ranks)."""
    Path(iter_dir).mkdir(parents=True, exist_ok=True)
    save_sharded(model_sharded_state_dict(model), iter_dir)


def load_model_weights(model, iter_dir, strict: bool = True) -> CheckpointMeta:
    """Load this rank's chunk ``model``, or its list of chunks (virtual pipeline stages), from ``iter_dir`` (torch_dist
    reshards to the current TP/PP/VPP; a legacy checkpoint must have this layout, its chunk ``c`` under ``model<c>``)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    keys = ["model"] if len(chunks) == 1 else [f"model{c}" for c in range(len(chunks))]
    meta = CheckpointMeta.load(iter_dir)
    spec = VLMSpec.load(iter_dir)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    check_meta(meta, spec, tp, pp, iter_dir, ep, etp, len(chunks))
    if meta.format == "torch_dist":
        layout = dist_key_layout(iter_dir)
        sharded = {k: model_sharded_state_dict(m, layout) for k, m in zip(keys, chunks)}
        for part in sharded.values():
            layer_impl.prepare_dist_load(part, iter_dir)  # TE _extra_state may be absent; nothing else
        loaded = dist_checkpointing.load(sharded, str(iter_dir))
        # (the result also holds the checkpoint's common entries: iteration, optimizer, ...)
        states = [{k[len(layout.prefix):]: v for k, v in loaded[key].items() if k in sharded[key]} for key in keys]
    else:
        f = load_legacy_rank(iter_dir, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), pp,
                             ep_rank=ps.get_expert_model_parallel_rank(), ep=ep)
        states = [layer_impl.adapt_state_dict(f[key], m.state_dict(), where=str(iter_dir)) for key, m in zip(keys, chunks)]
    for state, m in zip(states, chunks):
        _check_vocab(state, spec)
        m.load_state_dict(state, strict=strict)
    return meta


def _check_vocab(state: dict, spec: VLMSpec) -> None:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    for key in ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"):
        t = state.get(key)
        if t is not None and t.shape[0] * tp != spec.padded_vocab_size:
            raise CheckpointLayoutError(
                f"{key} has {t.shape[0] * tp} rows but the spec's padded vocab is {spec.padded_vocab_size}"
            )
