"""HF LLaVA directory -> Megatron checkpoint (torch_dist or legacy ``torch``) at a chosen TP/PP.

torch_dist: one process builds the TP=1/PP=1 megatron model (no random init, so its empty parameters are
never touched), gives each parameter the tensor converted from the HF files and saves it with megatron's ``dist_checkpointing`` (which reshards on load to any
TP/PP). legacy ``torch``: no model is built; each rank's file is assembled from the HF files and written
one at a time, so memory stays near one rank's share.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_vlm import checkpoint as ckpt
from megatron_vlm.atomic import atomic_dir
from megatron_vlm.convert import mapping
from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.spec import VLMSpec

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _full_tensor(rule, reader: HFReader, spec: VLMSpec, dtype) -> torch.Tensor:
    return _cast(mapping.to_mcore(rule, [reader.get(h) for h in rule.hf], spec), dtype)


def convert_hf_to_megatron(
    hf_dir,
    megatron_dir,
    tp: int = 1,
    pp: int = 1,
    pp_layers: list[int] | None = None,
    ckpt_format: str = "torch_dist",
    dtype: str = "auto",
    overwrite: bool = False,
    check=None,
    ep: int = 1,
    etp: int | None = None,
) -> Path:
    """Write ``megatron_dir``. ``check(tmp_dir)``, if given, runs on the complete checkpoint under its temporary
    name before the rename (``--verify``): when it raises, the new checkpoint is deleted and ``megatron_dir`` is
    left as it was (absent, or the previous checkpoint with ``overwrite``). ``ep``/``etp``: the expert-parallel
    layout of a mixture-of-experts model (legacy rank files are written per EP rank; torch_dist reshards to any)."""
    if ckpt_format not in ckpt.FORMATS:
        raise ValueError(f"--ckpt-format {ckpt_format!r} is not one of {ckpt.FORMATS}")
    spec = VLMSpec.from_hf_dir(hf_dir)
    layers = spec.check_parallelism(tp, pp, pp_layers, ep, etp)
    if ckpt_format == "torch" and (etp or tp) not in (1, tp):
        raise ValueError(f"--etp {etp} with --tp {tp}: legacy rank files hold experts whole (--etp 1) or split as the "
                         "attention (--etp equal to --tp); use --ckpt-format torch_dist, which reshards to any --etp")
    reader = HFReader(hf_dir)
    torch_dtype = reader.dtype() if dtype == "auto" else DTYPES[dtype]
    rules = mapping.rules(spec)
    missing = [h for r in rules for h in r.hf if h not in reader]
    if missing:
        raise ValueError(f"{hf_dir} lacks {len(missing)} tensors the spec needs, e.g. {missing[0]}")
    extra = {n: _cast(reader.get(n), torch_dtype) for n in mapping.extra_hf_names(spec, reader.names())}
    meta = ckpt.CheckpointMeta(ckpt_format, tp, pp, layers, "release", str(torch_dtype).replace("torch.", ""),
                               ep=ep, etp=etp)
    with atomic_dir(megatron_dir, overwrite=overwrite, what="--megatron-dir") as tmp:
        iter_dir = tmp / "release"
        iter_dir.mkdir()
        if ckpt_format == "torch":
            _write_legacy(reader, spec, rules, iter_dir, tp, pp, layers, torch_dtype, ep, etp)
        else:
            _write_dist(reader, spec, rules, iter_dir, torch_dtype)
        ckpt.write_side_files(iter_dir, spec, extra)
        meta.save(iter_dir)
        spec.save(tmp)
        ckpt.copy_tokenizer(hf_dir, tmp)
        ckpt.write_tracker(tmp, "release")
        if check is not None:
            check(tmp)
    log.debug("wrote %s checkpoint (tp=%d pp=%d, %s) to %s", ckpt_format, tp, pp, meta.dtype, megatron_dir)
    return Path(megatron_dir)


def _write_legacy(reader, spec, rules, iter_dir, tp, pp, layers, dtype, ep: int = 1, etp: int | None = None) -> None:
    """One rank file per (PP stage, EP rank, TP rank), as Megatron-LM writes them: an EP rank's file holds its own
    experts (under their local indices) and the stage's other tensors; experts split over ``etp`` (1 or ``tp``)."""
    ranks = [(p, e, t) for p in range(pp) for e in range(ep) for t in range(tp)]
    per_rank = spec.num_moe_experts // ep if spec.is_moe else None
    for p, e, t in tqdm(ranks, desc="writing rank files", unit="rank", disable=None):
        state = {}
        for rule in rules:
            if p not in mapping.stages_of(rule, spec, layers) or mapping.ep_rank_of(rule, spec, ep) not in (None, e):
                continue
            full = _full_tensor(rule, reader, spec, dtype)
            split = mapping.split_size(rule, tp, etp)
            state[mapping.local_name(rule, p, layers, per_rank)] = mapping.tp_shard(rule, full, split, t % split).clone()
            del full
        ckpt.save_legacy_rank(iter_dir, t, p, pp, state, "release", ep_rank=e, ep=ep)
        del state


def _write_dist(reader, spec, rules, iter_dir, dtype) -> None:
    from megatron_vlm.model import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world

    with single_process_world():
        model = build_model(spec, ModelOptions(params_dtype=dtype, perform_initialization=False, seq_length=64))
        params = dict(model.state_dict(keep_vars=True))
        with torch.no_grad():
            for rule in tqdm(rules, desc="filling megatron model", unit="tensor", disable=None):
                target = params[rule.mcore]
                src = _full_tensor(rule, reader, spec, dtype)
                if tuple(src.shape) != tuple(target.shape):
                    raise ValueError(f"{rule.hf} -> {rule.mcore}: shape {tuple(src.shape)} != {tuple(target.shape)}")
                # A fresh tensor, adopted rather than copied, in the checkpoint's dtype: megatron creates
                # local norms and the ViT's conv1 in fp32 whatever params_dtype says, and casting to the
                # parameter's dtype would store them (and export them) in fp32.
                target.data = src.contiguous()
        sharded = ckpt.model_sharded_state_dict(model)  # Megatron-LM's key convention (no prefix)
        del params
        _detach_views(sharded, model)
        ckpt.save_sharded(sharded, iter_dir)
        del model, sharded


def _detach_views(sharded: dict, model) -> None:
    """Give every sharded tensor that is a view (e.g. the gate and up halves of a SwiGLU ``linear_fc1``) its
    own storage, one parameter at a time, and drop the parameter it came from.

    dist_checkpointing's writer clones such views before it writes anything, so it would hold all of them
    at once next to the model (~1/3 of an LLM's bytes). Cloning here, releasing each source parameter as
    soon as its views are copied, keeps the peak near the model's size. The model is unusable afterwards;
    the converter only saves it.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    owners = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    views: dict[int, list] = {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor) and sh.data.untyped_storage().nbytes() != sh.data.numel() * sh.data.itemsize:
            views.setdefault(sh.data.untyped_storage().data_ptr(), []).append(sh)
    for ptr, group in views.items():
        for sh in group:
            sh.data = sh.data.clone()
        if ptr in owners:
            owners[ptr].data = torch.empty(0, dtype=owners[ptr].dtype)
