"""Megatron checkpoint (converted or from training; any iteration, either format, any TP/PP) -> HF LLaVA dir.

torch_dist is read through megatron's ``dist_checkpointing`` into a TP=1/PP=1 model (resharding on load);
legacy rank files are memory-mapped and merged tensor by tensor. Weights stream into safetensors shards, each
in the checkpoint's dtype; the HF-only tensors carried by the checkpoint are added back, so HF -> Megatron ->
HF is lossless. A checkpoint Megatron-LM wrote (no ``vlm_spec.json``) is described by
:mod:`megatron_vlm.convert.megatron_lm` from an HF config and read the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_vlm import checkpoint as ckpt
from megatron_vlm.atomic import atomic_dir
from megatron_vlm.convert import mapping
from megatron_vlm.convert.hf_io import HFShardWriter
from megatron_vlm.spec import VLMSpec

log = logging.getLogger(__name__)


def read_full_megatron_state(iter_dir, spec: VLMSpec, meta: ckpt.CheckpointMeta) -> dict[str, torch.Tensor]:
    """Full (TP=1/PP=1, global layer numbers) Megatron tensors of an iteration directory."""
    rules = mapping.rules(spec)
    if meta.format == "torch":
        files = {}
        state = {}
        ep, etp = meta.ep, meta.etp or meta.tp
        per_rank = spec.num_moe_experts // ep if spec.is_moe else None
        for rule in rules:
            stage = mapping.stages_of(rule, spec, meta.pp_layers)[0]
            e = mapping.ep_rank_of(rule, spec, ep) or 0
            shards = []
            for t in range(mapping.split_size(rule, meta.tp, etp)):
                key = (t, stage, e)
                if key not in files:
                    rank_file = ckpt.load_legacy_rank(iter_dir, t, stage, meta.pp, ep_rank=e, ep=ep)
                    files[key] = ckpt.normalize_legacy_names(rank_file["model"])  # TE names, _extra_state
                name = mapping.local_name(rule, stage, meta.pp_layers, per_rank)
                if name not in files[key]:
                    raise ckpt.CheckpointLayoutError(f"{name} is missing from rank file tp={t} pp={stage}"
                                                     f"{f' ep={e}' if ep > 1 else ''} of {iter_dir}")
                shards.append(files[key][name])
            state[rule.mcore] = mapping.tp_merge(rule, shards)
        return state
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from megatron_vlm.model import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world

    dtype = getattr(torch, meta.dtype)
    _check_dist_vocab(iter_dir, spec)
    layout = ckpt.dist_key_layout(iter_dir)
    with single_process_world():
        model = build_model(spec, ModelOptions(params_dtype=dtype, perform_initialization=False, seq_length=64))
        sharded = ckpt.model_sharded_state_dict(model, layout)
        # With the factories applied here, split tensors (the SwiGLU halves of linear_fc1) are views of the
        # parameters, so everything loads in place: no merged copies next to the model.
        apply_factories(sharded)
        dist_checkpointing.load(sharded, str(iter_dir))
        del sharded
        names = {r.mcore for r in rules}
        state = {k: v.detach() for k, v in model.state_dict().items() if k in names}
        del model
    return state


def _check_dist_vocab(iter_dir, spec: VLMSpec) -> None:
    """dist_checkpointing would load embeddings of another padded size without error: check it here."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(iter_dir))
    for key, sh in meta.items():
        if key.endswith(("word_embeddings.weight", "output_layer.weight")):
            rows = sh.global_shape[0]
            if rows != spec.padded_vocab_size:
                raise ckpt.CheckpointLayoutError(
                    f"{key} in {iter_dir} has {rows} rows but its spec says padded vocab {spec.padded_vocab_size}; "
                    "the checkpoint and its vlm_spec.json do not belong together"
                )


def convert_megatron_to_hf(
    megatron_dir,
    hf_dir,
    iteration: int | str | None = None,
    tokenizer_dir=None,
    tp: int | None = None,
    pp: int | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    hf_config=None,
    dtype: str | None = None,
) -> Path:
    """Export ``megatron_dir`` (a checkpoint directory or one of its iteration directories) to ``hf_dir``.

    ``hf_config`` (an HF LLaVA dir or its config.json) describes a checkpoint that Megatron-LM wrote; a
    megatron-vlm checkpoint carries its own spec and needs none. ``dtype`` (``fp32``/``bf16``/``fp16``): the
    weights' dtype in ``hf_dir``; default the checkpoint's (``ckpt_meta.json``: a training run's precision, or
    the dtype a converted checkpoint was written in). The tokenizer comes from ``tokenizer_dir`` or the
    checkpoint directory's ``tokenizer/``."""
    iter_dir = ckpt.resolve_iteration_dir(megatron_dir, iteration)
    if not (Path(iter_dir) / ckpt.META).is_file():
        from megatron_vlm.convert import megatron_lm

        if hf_config is None:
            raise ckpt.CheckpointLayoutError(
                f"{iter_dir} has no {ckpt.META}: it was not written by megatron-vlm (a Megatron-LM checkpoint?); "
                "pass --hf-config HF_DIR_OR_CONFIG_JSON of the LLaVA model it holds"
            )
        spec, meta, extra = megatron_lm.describe(iter_dir, hf_config)
        return _export(iter_dir, spec, meta, extra, hf_dir, megatron_lm.tokenizer_dir(hf_config, tokenizer_dir),
                       overwrite, max_shard_bytes, tp, pp, dtype)
    meta = ckpt.CheckpointMeta.load(iter_dir)
    spec = VLMSpec.load(iter_dir)
    if hf_config is not None:
        from megatron_vlm.convert import megatron_lm

        megatron_lm.check_spec_against_hf_config(spec, hf_config, iter_dir)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else ckpt.run_dir(iter_dir) / ckpt.TOKENIZER_DIR
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"no tokenizer at {tok_dir}; pass --tokenizer-dir HF_DIR")
    return _export(iter_dir, spec, meta, ckpt.read_extra(iter_dir), hf_dir, tok_dir, overwrite, max_shard_bytes,
                   tp, pp, dtype)


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _export(iter_dir, spec: VLMSpec, meta: ckpt.CheckpointMeta, extra: dict, hf_dir, tok_dir: Path | None,
            overwrite: bool, max_shard_bytes: int, tp: int | None, pp: int | None, out_dtype: str | None) -> Path:
    for flag, given, have in (("--tp", tp, meta.tp), ("--pp", pp, meta.pp)):
        if given is not None and given != have:
            raise ckpt.CheckpointLayoutError(
                f"{flag} {given} does not match the checkpoint {iter_dir} (written at tp={meta.tp} pp={meta.pp}); "
                f"drop {flag} or pass {flag} {have}"
            )
    log.info("reading %s (%s, tp=%d pp=%d)", iter_dir, meta.format, meta.tp, meta.pp)
    state = read_full_megatron_state(iter_dir, spec, meta)
    # Every tensor in one dtype (default the checkpoint's): megatron holds local norms and the ViT's conv1 in fp32
    # whatever the model's dtype, which would otherwise reach the HF files.
    dtype_name = DTYPES[out_dtype] if out_dtype else meta.dtype
    dtype = getattr(torch, dtype_name)
    with atomic_dir(hf_dir, overwrite=overwrite, what="--hf-dir") as tmp:
        writer = HFShardWriter(tmp, max_shard_bytes)
        for rule in tqdm(mapping.rules(spec), desc="writing HF tensors", unit="tensor", disable=None):
            full = state.pop(rule.mcore)
            for name, t in zip(rule.hf, mapping.to_hf(rule, full, spec)):
                writer.add(name, _cast(t, dtype))
        for name, t in extra.items():
            writer.add(name, _cast(t, dtype))
        writer.close()
        _write_configs(spec, tmp, dtype_name, tok_dir)
    log.debug("wrote HF LLaVA (%s) to %s", dtype_name, hf_dir)
    return Path(hf_dir)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _write_configs(spec: VLMSpec, out_dir: Path, dtype: str, tok_dir: Path | None) -> None:
    import shutil

    from transformers import GenerationConfig

    config = spec.to_hf_config()
    config.dtype = dtype
    config.save_pretrained(str(out_dir))
    if tok_dir is None:
        return
    gen_src = tok_dir / "generation_config.json"
    if gen_src.is_file():
        GenerationConfig.from_pretrained(str(tok_dir)).save_pretrained(str(out_dir))
    for p in tok_dir.iterdir():
        if p.is_file() and p.name not in ("config.json", "generation_config.json") and not _is_weights(p.name):
            shutil.copy2(p, out_dir / p.name)


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name.endswith(".index.json")
