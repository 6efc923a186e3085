"""Training checkpoints: model, optimizer, scheduler, RNG and data position, via megatron dist_checkpointing.

Layout and side files follow :mod:`megatron_vlm.checkpoint.layout` (so ``convert/megatron_to_hf.py`` reads any
iteration). A save is collective: every rank writes its shards with dist_checkpointing, then rank 0 adds the
spec, the HF-only tensors and the metadata, updates the tracker last and prunes old iterations beyond
``save_total_limit``.

How a save becomes visible (a crash at any point leaves the previous checkpoint the one that is resumed):

- local directory: everything goes into ``.iter_XXXXXXX.tmp-<time>-<pid>``, which is renamed to
  ``iter_XXXXXXX`` when complete; the tracker is then replaced atomically (temporary file + rename). A save
  killed part-way leaves its temporary directory, which is never read: the next start reports it
  (:func:`interrupted_saves`) and leaves it for the user to delete.
- integrity: before ``ckpt_meta.json`` a local save records the checksums of every file
  (:mod:`megatron_vlm.checkpoint.manifest`: megatron-core's SHA-256 ``integrity.json`` where it has one, 0.19, and
  ``checksums.json``, crc32 with each rank reading back a share, for the rest); a resume checks them
  (:func:`damaged_files`) before it loads anything. ``--no-verify-integrity`` skips both re-reads (multi-TB
  checkpoints). The commit is durable: every file, the
  directory, the rename and the tracker are flushed to disk in that order (:func:`commit_local`).
- object store (``--save-dir msc://PROFILE/...``): there is no rename, so the shards are written straight
  into ``iter_XXXXXXX/`` (emptied first if an interrupted save left objects there). ``ckpt_meta.json`` is
  the last object of an iteration directory, so a directory without it is known to be incomplete; the
  tracker ``latest_checkpointed_iteration.txt`` is written after it, as one object PUT, which readers see
  whole or not at all. That PUT is the commit point: resume follows only the tracker, so a save interrupted
  before it is never read. Incomplete iteration directories (no ``ckpt_meta.json``) are deleted by rank 0
  after the next successful commit, as are iterations beyond ``save_total_limit`` (the tracker already
  points at the new one when old ones are deleted).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.checkpoint import manifest
from megatron_vlm.files import storage
from megatron_vlm.model import layer_impl
from megatron_vlm.runtime import mcore_patches, mcore_version
from megatron_vlm.model.spec import VLMSpec

log = logging.getLogger(__name__)
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


#: the registry's entry that checks the distributed optimizer's saved state (megatron_vlm/runtime/mcore_patches.py)
OWN_STATE = "optimizer-state-own-values"


@mcore_patches.implements(OWN_STATE)
def _state_at_own_values(originals: dict) -> dict:
    """The distributed optimizer's 'fully_reshardable' save, checked against each parameter's own values (the
    registry installs it on megatron-core's class around a save's ``optimizer.sharded_state_dict`` only).

    megatron-core 0.16 and 0.19 build that state from :meth:`DistributedOptimizer.get_parameter_state_dp_zero`,
    whose tensors hold each bucket's values with the bucket's end padding left out, one bucket after the other, and
    read each parameter at its ``param_index_map`` offset, which counts that padding. With one bucket (no
    ``--overlap-grad-reduce``) the two agree; with more, every parameter past the first bucket was saved with
    another's values and its tail zero-padded ("param range exceeds unpadded buffer"), and a resume trained from
    them (measured: the resumed loss 5.75 where the straight run's was 5.28). NVIDIA/Megatron-LM#5077 fixes the read
    (the gathered tensors keep their layout). Rather than guess which megatron-core runs, the save looks at what it
    produced: :func:`_own_values` compares every saved tensor with the parameter's own values in the gathered
    tensors and replaces the wrong ones, so a megatron-core with the fix passes through unchanged. Loading reads the
    model-space tensors by each parameter's own range and needs nothing."""
    target = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fully_reshardable"
    original = originals[target]

    @functools.wraps(original)
    def checked(self, model_sharded_state_dict, *args, **kwargs):
        is_loading = kwargs.get("is_loading", args[0] if args else False)
        gathered = []
        gather = self.get_parameter_state_dp_zero
        self.get_parameter_state_dp_zero = lambda *a, **k: gathered.append(gather(*a, **k)) or gathered[-1]
        try:
            out = original(self, model_sharded_state_dict, *args, **kwargs)
        finally:
            vars(self).pop("get_parameter_state_dp_zero", None)
        if is_loading or out is None or gathered[-1:] == [None]:
            return out
        if len(gathered) != 1:
            raise RuntimeError(f"megatron-core's {target} gathered the optimizer state {len(gathered)} times, not "
                               f"once: the check of {OWN_STATE} does not know this megatron-core ({mcore_patches.DOC})")
        _own_values(self, gathered[0], model_sharded_state_dict, out)
        return out

    return {target: checked}


def _place(sharded, key: str) -> tuple:
    """Which parameter's tensor a sharded tensor (or factory) of key ``key`` is: megatron-core names the layers of a
    block with one key, told apart by their offset (factories: by their build function)."""
    return key, getattr(sharded, "global_offset", None), getattr(sharded, "build_fn", None)


def _own_values(optimizer, gathered: dict, model_sharded_state_dict, saved: dict) -> int:
    """Give every tensor of ``saved`` (megatron-core's model-space optimizer state: {param index: {state name:
    ShardedTensor}}) its parameter's own values, read from ``gathered`` (the tensors
    ``get_parameter_state_dp_zero`` returned) at the parameter's place: each bucket's values one after the other with
    its end padding left out, or at the buffer's own offsets, whichever layout the tensors have. Returns how many
    tensors were wrong. A wrong tensor of a first-bucket parameter (where both layouts agree) means megatron-core
    saves in a way this check does not know: that raises rather than rewrite what it cannot read."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    place_of = {id(sh.data): _place(sh, sh.key) for sh in nested_values(tensors)}
    own, first_bucket = {}, set()  # (state name, place) -> the parameter's own values
    for index, buffer in enumerate(optimizer.buffers):
        packed, at, size = [], 0, buffer.buckets[-1].offset + buffer.buckets[-1].grad_data.numel()
        for bucket in buffer.buckets:
            packed.append(at)
            at += bucket.numel_unpadded
        for world in gathered[index].values():
            for name, values in world.items():
                if not torch.is_tensor(values) or values.dim() != 1 or name == "step":
                    continue
                if values.numel() == at:  # the buckets' values one after the other (megatron-core 0.16, 0.19)
                    start_of = [b.offset - p for b, p in zip(buffer.buckets, packed)]
                elif values.numel() == size:  # at the buffer's own offsets
                    start_of = [0] * len(buffer.buckets)
                else:
                    raise RuntimeError(f"the distributed optimizer's gathered '{name}' holds {values.numel()} values, "
                                       f"neither the buckets' {at} nor the buffer's {size}: {OWN_STATE} does "
                                       f"not know this megatron-core ({mcore_patches.DOC})")
                for param, (start, end, bucket) in buffer.param_index_map.items():
                    place = place_of.get(id(param))
                    if place is not None:
                        own[name, place] = values[start - start_of[bucket]:end - start_of[bucket]]
                        if bucket == 0:
                            first_bucket.add((name, place))
    wrong = 0
    for state in saved.values():
        for name, t in state.items():
            prefix = f"optimizer.state.{name}."
            place = (name, _place(t, t.key[len(prefix):])) if t.key.startswith(prefix) else None
            right = own.get(place)
            if right is None or torch.equal(t.data.reshape(-1), right):
                continue
            if place in first_bucket:
                raise RuntimeError(f"megatron-core saved {t.key} with values that are not the parameter's own, in its "
                                   f"first bucket: {OWN_STATE} does not know this megatron-core ({mcore_patches.DOC})")
            t.data = right.reshape(t.data.shape)
            wrong += 1
    return wrong


def _rank_objects(loader_state, rng_state, with_rng: bool = True, with_data: bool = True):
    """Per-rank objects as megatron ShardedObjects (RNG: one per rank; loader: one per data-parallel rank).

    Both are laid out by this run's TP/PP/DP ranks (and CP ranks, with context parallelism), so a resume at another
    layout leaves them out. The context-parallel ranks of a DP rank read the same samples: its loader state is
    saved once."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tp, pp, dp = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                  ps.get_data_parallel_world_size())
    tpr, ppr, dpr = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_data_parallel_rank())
    cp, cpr = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    out = {}
    if with_rng:  # CP1 keeps the (pp, tp, dp) layout of checkpoints saved before context parallelism
        shape, at = ((pp, tp, cp, dp), (ppr, tpr, cpr, dpr)) if cp > 1 else ((pp, tp, dp), (ppr, tpr, dpr))
        out["rng_state"] = ShardedObject("rng_state", rng_state, shape, at, replica_id=0)
    if with_data:
        out["loader_state"] = ShardedObject("loader_state", loader_state, (dp,), (dpr,),
                                            replica_id=0 if (tpr == 0 and ppr == 0 and cpr == 0) else 1)
    return out


def rng_state() -> dict:
    import random

    import numpy as np

    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _unwrap(model):
    """The LLaVAModel inside megatron's DDP wrapper (checkpoint keys never carry the wrapper's 'module.')."""
    return getattr(model, "module", model)


def _chunks(model) -> list:
    """This rank's model chunks: ``model`` is one chunk or the list of them (virtual pipeline stages)."""
    return [_unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


def model_keys(n: int) -> list[str]:
    """The state-dict entries of a rank's ``n`` model chunks, as Megatron-LM names them: ``model`` for one,
    ``model0``, ``model1``, ... with virtual pipeline stages (torch_dist keys inside are global: the checkpoint
    loads at any layout)."""
    return ["model"] if n == 1 else [f"model{c}" for c in range(n)]


def trains_here(model) -> bool:
    """Whether this rank's model chunks have a trainable parameter. In stage 1 at PP>1 the later pipeline stages
    (with virtual stages: every chunk but the first rank's first) hold only frozen language-model layers: the
    rank's optimizer has empty parameter groups and no state when none of its chunks trains."""
    return any(p.requires_grad for m in _chunks(model) for p in m.parameters())


def _state_dict(model, optimizer, scheduler, iteration, loader_state, with_optim: bool, loading: bool,
                with_rng: bool = True, with_data: bool = True, layout: ckpt.DistKeyLayout = ckpt.DistKeyLayout()):
    # Megatron-LM's convention: model keys without a prefix (older megatron-vlm checkpoints: "model.")
    chunks = _chunks(model)
    model_sd = {k: ckpt.model_sharded_state_dict(m, layout) for k, m in zip(model_keys(len(chunks)), chunks)}
    sd = {**model_sd, "iteration": iteration,
          **_rank_objects(loader_state, None if loading else rng_state(), with_rng, with_data)}
    if with_optim:
        # A stage without trainable parameters holds no optimizer state, and megatron-core's optimizers cannot
        # describe an empty one (the distributed optimizer asserts on its missing step, the mixed-precision one
        # loads rank 0's main-parameter lists): it leaves the optimizer out. Every rank of such a stage (its TP
        # and DP peers, who share its parameters) does the same, so the collectives of a save still match.
        if trains_here(model):
            # 'fully_reshardable': the distributed optimizer's state resumes at any TP/PP/DP; a save checks it
            with contextlib.nullcontext() if loading else mcore_patches.applied(OWN_STATE):
                sd["optimizer"] = optimizer.sharded_state_dict(model_sd if len(chunks) > 1 else model_sd["model"],
                                                               is_loading=loading, metadata=OPTIM_METADATA)
        sd["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    return sd


class CheckpointWriteError(OSError):
    """A save that the storage refused (a full disk, a read-only directory); the message names the checkpoint."""


def _errno_hint(e: BaseException) -> str | None:
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        return None
    from megatron_vlm.cli import errno_hint

    return errno_hint(e)


def _storage_problem(target, e: BaseException) -> str | None:
    """Why a failed save failed when the error lost it (megatron-core 0.19's async file writer reports a full
    disk as "error: <class 'OSError'>"): write 1 MiB where the save wrote and name the OS error, if any."""
    if storage.is_remote(target) or isinstance(e, (KeyboardInterrupt, SystemExit)):
        return None
    probe = Path(target) / ".space-check"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as oe:
        return _errno_hint(oe)
    finally:
        probe.unlink(missing_ok=True)
    return None


def save(run_dir, iteration: int, model, optimizer, scheduler, loader_state, spec: VLMSpec, meta: ckpt.CheckpointMeta,
         side_src: Path | None, with_optim: bool, total_limit: int | None, config_yaml: str | None = None,
         verify_integrity: bool = True) -> str:
    """Save iteration ``iteration`` under ``run_dir`` (a local directory or an ``msc://`` URL); returns its path.
    ``verify_integrity`` (``--verify-integrity``): record the checksums of every file
    (:mod:`megatron_vlm.checkpoint.manifest`), reading them back once."""
    remote = storage.is_remote(run_dir)
    final = storage.join(run_dir, ckpt.iter_dir_name(iteration))
    rank0 = torch.distributed.get_rank() == 0
    # local: write under a temporary name of this save's own and rename; remote: write in place, commit with the
    # tracker. A save killed part-way leaves its temporary directory: reported at the next start, never read
    # (interrupted_saves), and not reused, so nothing still writing into it can touch a later save.
    name = [None]
    if rank0:
        name[0] = final if remote else storage.join(
            run_dir, f".{ckpt.iter_dir_name(iteration)}{TMP_MARK}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        storage.remove_tree(name[0])
        if not remote:
            Path(name[0]).mkdir(parents=True)
    torch.distributed.broadcast_object_list(name, src=0)
    target = name[0]
    sd = _state_dict(model, optimizer, scheduler, iteration, loader_state, with_optim, loading=False)
    verify = verify_integrity and not remote
    try:
        ckpt.save_sharded(sd, target, verify_integrity=verify)
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        hint = _errno_hint(e) or _storage_problem(target, e)
        if hint is None:
            raise
        raise CheckpointWriteError(f"saving checkpoint {final}: {hint}") from e
    torch.distributed.barrier()
    # megatron-core's integrity manifest (0.19) has the files it wrote; every rank reads back its share of the rest
    listed = manifest.mcore_listed(target) if verify else set()
    shards = _checksum_share(target, skip=listed) if verify else {}
    if rank0:
        if side_src is not None and (storage.path(side_src) / ckpt.EXTRA).is_file():
            ckpt.copy_side_files(side_src, target)
        else:
            ckpt.write_side_files(target, spec, {})
        spec.save(target)
        if config_yaml:
            storage.write_text(storage.join(target, "config.yaml"), config_yaml)
        meta.iteration = iteration
        meta.extra["optimizer"] = with_optim
        if verify:  # the side files (written here, after the shards) are checksummed by rank 0
            side = [n for n in manifest.files_of(target) if n not in shards and n not in listed]
            manifest.write(target, {**shards, **manifest.entries(target, side)})
        meta.save(target)  # last object of the iteration directory: marks it complete
        if not remote:
            commit_local(target, final, run_dir)
        spec.save(run_dir)  # like a converted checkpoint: the run directory itself says what it holds
        ckpt.write_tracker(run_dir, iteration)  # the commit point (a local tracker and its directory flushed)
        # --save-total-limit: the newest iterations up to this one; an iteration after it is one a resume from an
        # earlier iteration (--ckpt-step) left, which the run replaces as it saves that iteration again
        kept = [it for it in ckpt.list_iterations(run_dir) if it <= iteration]
        old = kept[:-total_limit] if total_limit else []
        if remote:
            old += ckpt.list_iterations(run_dir, complete=False)
        for it in old:
            storage.remove_tree(storage.join(run_dir, ckpt.iter_dir_name(it)))
        log.info("saved checkpoint %s", final)
    torch.distributed.barrier()
    return final


def commit_local(target, final, run_dir) -> None:
    """Make the complete save in the temporary directory ``target`` the iteration directory ``final`` of
    ``run_dir``, durably and in order: every file (the shards, ``.metadata``, the side files, ``ckpt_meta.json``) and
    the directory itself flushed to disk, then the rename, flushed in ``run_dir``. An iteration saved again (a resume
    from an earlier one) replaces the old directory only then. The tracker is written after this."""
    from megatron_vlm.files.atomic import fsync_dir, fsync_tree

    fsync_tree(target)
    old_copy = None
    if Path(final).exists():  # the same iteration saved again (a resume from an earlier one)
        old_copy = Path(run_dir) / f".{Path(final).name}.replaced-{os.getpid()}"
        Path(final).rename(old_copy)
    Path(target).rename(final)
    fsync_dir(run_dir)
    if old_copy is not None:
        shutil.rmtree(old_copy)


def _checksum_share(it_dir, skip: set[str] = frozenset()) -> dict[str, dict]:
    """The checksum manifest's entries of every file now in ``it_dir`` (the shards a save just wrote) but those in
    ``skip``, each rank reading its share (:func:`megatron_vlm.checkpoint.manifest.share`); collective, every rank gets
    them all."""
    root = Path(it_dir)
    names = [n for n in manifest.files_of(root) if n not in skip]
    sizes = {n: (root / n).stat().st_size for n in names}
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = manifest.entries(root, manifest.share(names, sizes, world, rank))
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in part.items()}


def damaged_files(iter_dir, verify_integrity: bool = True) -> list[str]:
    """The files of ``iter_dir`` whose bytes differ from its checksum manifests (empty: none, no manifest to compare
    with, or ``verify_integrity`` off: ``--no-verify-integrity``). Collective: megatron-core checks the files of its
    integrity manifest on rank 0 (0.19), each rank a share of the rest; every rank gets the answer."""
    if storage.is_remote(iter_dir) or not verify_integrity:
        return []
    problems: list[str] = []
    try:
        listed = manifest.mcore_listed(iter_dir)
        files = manifest.read(iter_dir)
    except ValueError as e:
        listed, files, problems = set(), None, [str(e)]
    if files is not None:
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        ours = {n: e for n, e in files.items() if n not in listed}
        sizes = {n: e["bytes"] for n, e in ours.items()}
        problems = manifest.checksum_problems(iter_dir, ours, manifest.share(sorted(ours), sizes, world, rank))
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problems)
    problems = sorted({q for part in gathered for q in part})
    if listed and not problems:
        problems = _mcore_integrity_problems(iter_dir)
    return problems


def _mcore_integrity_problems(iter_dir) -> list[str]:
    """megatron-core's own check of its integrity manifest (collective: rank 0 hashes every file it lists and
    broadcasts the verdict), as one line per file."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    if not mcore_version.has_integrity_manifest():
        return []  # a megatron-core without one: the checkpoint's own manifest covered the rest
    try:
        verify_integrity_manifest(str(iter_dir))
        return []
    except CheckpointingException as e:
        out = []
        for line in str(e).splitlines()[1:]:
            name, _, what = line.strip().partition(": ")
            path = Path(iter_dir) / name
            if what.startswith("hash mismatch"):
                detail = what[len("hash mismatch"):].strip().strip("()")
                out.append(f"{path}: its bytes changed after the save (SHA-256 {detail}; its "
                           f"{manifest.MCORE_MANIFEST})")
            elif name:
                out.append(f"{path}: {what or 'failed the check'} (its {manifest.MCORE_MANIFEST} lists it)")
        return out or [f"{iter_dir}: {str(e).splitlines()[0]}"]


#: the mark of a save's temporary directory, ``.iter_XXXXXXX.tmp-<time>-<pid>``
TMP_MARK = ".tmp-"


def interrupted_saves(run_dir) -> list[Path]:
    """Temporary directories of saves that never committed (a rank killed while saving): not checkpoints, never
    loaded, left for the user to delete (local run directories; an object store's are pruned after the next
    commit)."""
    if storage.is_remote(run_dir) or not Path(run_dir).is_dir():
        return []
    return sorted(p for p in Path(run_dir).iterdir()
                  if p.is_dir() and p.name.startswith(".iter_") and (TMP_MARK in p.name or p.name.endswith(".tmp")))


def _dummy_optimizer_state(optimizer) -> list:
    """A distributed optimizer that has not stepped yet has no Adam state; without Apex or Transformer Engine
    megatron-core 0.16 then cannot build its sharded state dict for loading (it reads the step count from that
    state). megatron's own dummy-state initialisation fills it for that moment; returns the optimizers filled,
    whose dummy state is dropped again before the load (megatron allocates the real one there)."""
    filled = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not opt.optimizer.state:
            init()
            filled.append(opt)
    return filled


def _restore_loss_scale(optimizer, common: dict | None) -> None:
    """A stage without trainable parameters still scales the loss when it is the last one (fp16): its grad
    scaler takes the saved one, which every rank's equals (megatron reduces the overflow check over the model
    parallel group, so all scalers step alike). The saved scaler is in the optimizer's common state, written
    by global rank 0 (the first stage, which always trains: it holds the projector)."""
    saved = (common or {}).get("grad_scaler")
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "grad_scaler", None) is not None and saved is not None:
            opt.grad_scaler.load_state_dict(saved)


class OptimizerStateMismatch(ValueError):
    """The checkpoint holds no optimizer state for parameters this run trains."""


def missing_optimizer_state(optimizer_sd: dict, iter_dir) -> list[str]:
    """Keys of the optimizer's sharded state (``optimizer.state.exp_avg.<param>``, ...) that the checkpoint in
    ``iter_dir`` does not hold: it was saved by a run that trained other parameters."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    have = set(dist_checkpointing.load_tensors_metadata(str(iter_dir)))
    wanted = {v.key for v in nested_values(optimizer_sd) if isinstance(v, ShardedTensor)}
    return sorted(wanted - have)


def _expert_optimizer_split_differs(missing: list[str], iter_dir) -> bool:
    """Whether the missing keys are only named apart: megatron-core keeps expert and dense parameters in two
    optimizers (keys ``chained_<i>.optimizer...``) at some layouts and in one (no prefix) at others, by a rule that
    changed between versions (:func:`megatron_vlm.runtime.mcore_version.experts_optimizer_apart`)."""
    import re

    from megatron.core import dist_checkpointing

    have = set(dist_checkpointing.load_tensors_metadata(str(iter_dir)))
    bare = {re.sub(r"^chained_\d+\.", "", k) for k in have}
    return all(re.sub(r"^chained_\d+\.", "", k) in bare for k in missing)


def _check_optimizer_state(optimizer_sd: dict, iter_dir) -> None:
    missing = missing_optimizer_state(optimizer_sd, iter_dir)
    if missing and _expert_optimizer_split_differs(missing, iter_dir):
        from megatron.core import parallel_state as ps

        meta = ckpt.CheckpointMeta.load(iter_dir)
        writer = (meta.versions or {}).get("megatron_core")
        saved_apart = not any(k.startswith("chained_") for k in missing)  # this run asks for unprefixed keys
        ep, etp, tp = (ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
                       ps.get_tensor_model_parallel_world_size())
        fix = f"--ep {meta.ep} --etp {meta.etp or meta.tp}" if saved_apart else "--ep 1 with --etp equal to --tp"
        raise OptimizerStateMismatch(
            f"{iter_dir} was saved at --ep {meta.ep} --etp {meta.etp or meta.tp} --tp {meta.tp}"
            + (f" by megatron-core {writer}" if writer else "")
            + (f" ({mcore_version.expert_optimizer_rule(writer)})" if writer and writer != mcore_version.installed()
               else "")
            + f", where the optimizer state of the experts is kept {'apart from' if saved_apart else 'together with'}"
            f" the other parameters; this run at --ep {ep} --etp {etp} --tp {tp} keeps it "
            f"{'together' if saved_apart else 'apart'} ({mcore_version.expert_optimizer_rule()}): the optimizer "
            f"state cannot move between the two. Resume at a layout that keeps them as the checkpoint does ({fix}), "
            "or pass --no-load-optim to continue from its weights with a fresh optimizer")
    if missing:
        params = sorted({k.split(".", 3)[-1] for k in missing if k.startswith("optimizer.state.")} or set(missing))
        raise OptimizerStateMismatch(
            f"{iter_dir} holds no optimizer state for {len(params)} parameter(s) this run trains (e.g. {params[0]}): "
            "it was saved by a run that trained other parts of the model (another --stage or --freeze-*/--unfreeze-* "
            "setting). Resume it with the settings it was saved with; to start a new stage from its weights, give "
            "the new run another --name (with --megatron-load-dir); to continue in this run directory with a fresh "
            "optimizer, pass --no-load-optim")


def load(iter_dir, model, optimizer, scheduler, with_optim: bool, with_rng: bool = True,
         with_data: bool = True, schedule_check=None) -> dict:
    """Restore model (+ optimizer, scheduler) and return {'iteration', 'loader_state', 'rng_state'} (the last two
    None where not asked for). Without the optimizer, the caller must refresh the optimizer's main parameters
    from the loaded weights (:func:`megatron_vlm.training.build.weights_changed`).

    With the optimizer, the checkpoint must hold its state for every trained parameter
    (:class:`OptimizerStateMismatch` otherwise, before anything is read), and ``schedule_check(state)`` (if given)
    sees the saved scheduler state before it is loaded."""
    from megatron.core import dist_checkpointing

    here = trains_here(model)
    dummy = _dummy_optimizer_state(optimizer) if with_optim and here else []
    layout = ckpt.dist_key_layout(iter_dir)
    sd = _state_dict(model, optimizer, scheduler, 0, None, with_optim, loading=True, with_rng=with_rng,
                     with_data=with_data, layout=layout)
    for opt in dummy:
        opt.optimizer.state.clear()
    if with_optim and here:
        _check_optimizer_state(sd["optimizer"], iter_dir)
    for key in model_keys(len(_chunks(model))):
        layer_impl.prepare_dist_load(sd[key], iter_dir)  # TE _extra_state may be absent; nothing else
    loaded = dist_checkpointing.load(sd, str(iter_dir))  # a local path or an msc:// URL
    for key, chunk in zip(model_keys(len(_chunks(model))), _chunks(model)):
        chunk.load_state_dict({k[len(layout.prefix):]: v for k, v in loaded[key].items()}, strict=True)
    if with_optim:
        if scheduler is not None and loaded.get("scheduler") and schedule_check is not None:
            schedule_check(loaded["scheduler"])
        if here:
            optimizer.load_state_dict(loaded["optimizer"])
        else:
            _restore_loss_scale(optimizer, loaded.get("optimizer"))
        if scheduler is not None and loaded.get("scheduler"):
            scheduler.load_state_dict(loaded["scheduler"])
    return {"iteration": loaded["iteration"], "loader_state": loaded.get("loader_state"),
            "rng_state": loaded.get("rng_state")}
