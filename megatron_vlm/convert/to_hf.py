"""Megatron checkpoint (converted or from training; any iteration, either format, any TP/PP) -> HF LLaVA dir.

One task per Megatron tensor (:class:`~megatron_vlm.convert.mapping.Rule`) writes its HF tensors in place in the
planned safetensors shards (:class:`~megatron_vlm.convert.hf_io.SafetensorsWriter`). Where they are whole stored
rows (the tensors of a converted torch_dist checkpoint, the TP shards of legacy rank files, row-parallel ones
too), their bytes go file to file in the kernel (:mod:`megatron_vlm.convert.copyplan`), located in the
``.distcp`` items through torch.distributed.checkpoint's index and torch's own archive reader, or in the
memory-mapped rank files. Otherwise the full tensor is read (torch_dist through torch.distributed.checkpoint,
resharding blocks saved at any TP/PP; legacy rank files memory-mapped and merged over TP), split by
``mapping.to_hf``, cast and written. A few tensors are in memory at a time (:mod:`megatron_vlm.convert.streaming`).
Every tensor comes out in one dtype (the checkpoint's by default); the HF-only tensors the checkpoint carries are
added back, so HF -> Megatron -> HF is lossless. A checkpoint Megatron-LM wrote (no ``vlm_spec.json``) is
described by :mod:`megatron_vlm.convert.megatron_lm` from an HF config and read the same way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from pathlib import Path

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.files.atomic import atomic_dir
from megatron_vlm.convert import copyplan, mapping, mcore_io
from megatron_vlm.convert import streaming as st
from megatron_vlm.convert.file_tensors import write_tensor
from megatron_vlm.convert.hf_io import SafetensorsFile, SafetensorsWriter
from megatron_vlm.runtime.gc_freeze import preload
from megatron_vlm.model.spec import VLMSpec

log = logging.getLogger(__name__)


@contextlib.contextmanager
def open_source(iter_dir, spec: VLMSpec, meta: ckpt.CheckpointMeta):
    """The reader of ``iter_dir``'s full (TP=1/PP=1, global layer numbers) Megatron tensors, one at a time, in the
    dtypes stored: :class:`~megatron_vlm.convert.mcore_io.LegacyReader` for rank files,
    :class:`~megatron_vlm.convert.mcore_io.DistReader` for torch_dist (inside a one-process world, whose
    megatron-core model on the meta device gives the keys). The export reads through it, and so does a model built
    in memory from a checkpoint (:mod:`megatron_vlm.eval.model`)."""
    if meta.format == "torch":
        yield mcore_io.LegacyReader(iter_dir, spec, meta)
        return
    from megatron_vlm.runtime.session import single_process_world

    _check_dist_vocab(iter_dir, spec)
    layout = ckpt.dist_key_layout(iter_dir)
    with single_process_world():
        model = mcore_io.meta_model(spec, getattr(torch, meta.dtype))
        _, pieces = mcore_io.dist_pieces(model, {r.mcore for r in mapping.rules(spec)}, layout)
        del model
        yield mcore_io.DistReader(iter_dir, pieces)


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
    max_memory: int | None = None,
    workers: int | None = None,
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
        extra = {n: (t.dtype, tuple(t.shape), (lambda t=t: t), None) for n, t in extra.items()}
        return _export(iter_dir, spec, meta, extra, hf_dir, megatron_lm.tokenizer_dir(hf_config, tokenizer_dir),
                       overwrite, max_shard_bytes, tp, pp, dtype, max_memory, workers)
    meta = ckpt.CheckpointMeta.load(iter_dir)
    spec = VLMSpec.load(iter_dir)
    if hf_config is not None:
        from megatron_vlm.convert import megatron_lm

        megatron_lm.check_spec_against_hf_config(spec, hf_config, iter_dir)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else ckpt.run_dir(iter_dir) / ckpt.TOKENIZER_DIR
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"no tokenizer at {tok_dir}; pass --tokenizer-dir HF_DIR")
    extra_file = SafetensorsFile(Path(iter_dir) / ckpt.EXTRA) if (Path(iter_dir) / ckpt.EXTRA).is_file() else None
    try:
        extra = {} if extra_file is None else {
            n: (extra_file.info(n).dtype, extra_file.info(n).shape, None, extra_file.located(n))
            for n in extra_file.names()}
        return _export(iter_dir, spec, meta, extra, hf_dir, tok_dir, overwrite, max_shard_bytes, tp, pp, dtype,
                       max_memory, workers)
    finally:
        if extra_file is not None:
            extra_file.close()


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _export(iter_dir, spec: VLMSpec, meta: ckpt.CheckpointMeta, extra, hf_dir, tok_dir: Path | None,
            overwrite: bool, max_shard_bytes: int, tp: int | None, pp: int | None, out_dtype: str | None,
            max_memory: int | None = None, workers: int | None = None) -> Path:
    for flag, given, have in (("--tp", tp, meta.tp), ("--pp", pp, meta.pp)):
        if given is not None and given != have:
            raise ckpt.CheckpointLayoutError(
                f"{flag} {given} does not match the checkpoint {iter_dir} (written at tp={meta.tp} pp={meta.pp}); "
                f"drop {flag} or pass {flag} {have}"
            )
    log.info("reading %s (%s, tp=%d pp=%d)", iter_dir, meta.format, meta.tp, meta.pp)
    # Every tensor in one dtype (default the checkpoint's): megatron holds local norms and the ViT's conv1 in fp32
    # whatever the model's dtype, which would otherwise reach the HF files.
    dtype_name = DTYPES[out_dtype] if out_dtype else meta.dtype
    dtype = getattr(torch, dtype_name)
    workers = workers or st.default_workers()
    preload(["megatron.core"])  # both readers use it (its keys; its types in rank files): imported collector-paused
    with open_source(iter_dir, spec, meta) as source:
        _export_tensors(source, mapping.rules(spec), spec, extra, hf_dir, dtype, dtype_name, tok_dir, overwrite,
                        max_shard_bytes, max_memory, workers)
    return Path(hf_dir)


def meta_full(source, rule) -> torch.Tensor:
    """The full tensor of ``rule`` on the meta device (its shape and stored dtype, nothing read)."""
    if isinstance(source, mcore_io.DistReader):
        return torch.empty(source.shape(rule.mcore), dtype=source.dtype(rule.mcore), device="meta")
    shards = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in source.shards(rule)]
    return mapping.tp_merge(rule, shards)


def _export_tensors(source, rules, spec: VLMSpec, extra, hf_dir, dtype: torch.dtype, dtype_name: str,
                    tok_dir: Path | None, overwrite: bool, max_shard_bytes: int, max_memory: int | None,
                    workers: int) -> None:
    """One task per Megatron tensor: its HF tensors, each written to its place in the planned shards; the rows
    that are unchanged stored rows go file to file in the kernel, the rest is computed from the tensor read
    (merged over TP). The HF-only tensors the checkpoint carries follow."""
    files = copyplan.Files()
    entries, tasks, makers, plans_made = [], [], [], {}
    for rule in rules:
        full = meta_full(source, rule)
        outs = mapping.to_hf(rule, full, spec)
        out_dtypes = [_out_dtype(o.dtype, dtype) for o in outs]
        entries += [(n, d, tuple(o.shape)) for n, d, o in zip(rule.hf, out_dtypes, outs)]
        nbytes = sum(o.numel() * torch.empty((), dtype=d).element_size() for o, d in zip(outs, out_dtypes))
        runs = _copy_plan(source, rule, spec, outs, out_dtypes, plans_made)
        if runs is not None:
            tasks.append(st.Task(rule.mcore, cost=0, nbytes=nbytes, run=None, reads=tuple(s.span for s in runs[0])))
            makers.append(functools.partial(_copy_run, files, rule, runs))
            continue
        stored = full.numel() * full.element_size()
        merged = stored if isinstance(source, mcore_io.DistReader) or rule.split != "replicated" else 0
        # the merged tensor (or the loaded one and the chunk it is read from), the split copies, the cast
        cost = 2 * merged + (stored if rule.kind in ("qkv", "qkv_packed") else 0) \
            + (nbytes if dtype != full.dtype else 0)
        tasks.append(st.Task(rule.mcore, cost=cost, nbytes=nbytes, run=None))
        makers.append(functools.partial(_rule_run, source, rule, spec, dtype))
    for name, (edtype, shape, get, located) in extra.items():
        out = _out_dtype(edtype, dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=out).element_size()
        entries.append((name, out, tuple(shape)))
        tasks.append(st.Task(name, cost=nbytes if out != edtype else 0, nbytes=nbytes, run=None,
                             reads=(located.span,) if located is not None else ()))
        makers.append(functools.partial(_extra_run, files, name, get, located, dtype))
    budget = st.memory_budget(tasks, max_memory, workers)
    try:
        with atomic_dir(hf_dir, overwrite=overwrite, what="--hf-dir", flush=True) as tmp:
            writer = SafetensorsWriter(tmp, entries, max_shard_bytes)
            try:
                for task, make in zip(tasks, makers):
                    task.run = make(writer)
                progress = st.Progress(sum(t.nbytes for t in tasks), "megatron_to_hf")
                try:
                    with st.Runner(workers, st.Budget(budget), progress) as runner:
                        runner.run(tasks)
                finally:
                    progress.close()
                writer.close()
            finally:
                writer.abort()
            _write_configs(spec, tmp, dtype_name, tok_dir)
    finally:
        files.close()
    log.debug("wrote HF LLaVA (%s) to %s", dtype_name, hf_dir)


def _out_dtype(have: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if have.is_floating_point else have


def _copy_plan(source, rule, spec: VLMSpec, outs, out_dtypes, plans_made: dict):
    """``(sources, [(hf name, runs)])`` when every HF tensor of ``rule`` is whole stored rows, else None. A plan
    holds byte offsets relative to its sources and outputs, so tensors of one shape stored alike (each layer's
    ``linear_qkv``, say) share it: ``plans_made`` keeps them, and a model's depth costs no planning."""
    if any(o.numel() * o.element_size() < copyplan.MIN_COPY_BYTES for o in outs):
        return None
    located = source.located(rule)
    if located is None:
        return None
    sources, assemble, layout = located
    key = (layout, rule.kind, rule.split, rule.heads, rule.groups, rule.head_dim,
           tuple((tuple(s.shape), s.dtype) for s in sources),
           tuple((tuple(o.shape), d) for o, d in zip(outs, out_dtypes)))
    if key not in plans_made:
        rows = copyplan.RowPlan(sources, assemble)
        made = [rows.runs(functools.partial(_hf_part, rule, spec, k), tuple(o.shape), d)
                for k, (o, d) in enumerate(zip(outs, out_dtypes))]
        plans_made[key] = None if any(r is None for r in made) else made
    if plans_made[key] is None:
        return None
    return sources, list(zip(rule.hf, plans_made[key]))


def _hf_part(rule, spec: VLMSpec, k: int, full):
    return mapping.to_hf(rule, full, spec)[k]


def _copy_run(files, rule, runs, writer: SafetensorsWriter):
    sources, plans = runs

    def run():
        for name, r in plans:
            copyplan.fill(writer.target(name), None, sources, files, runs=r)

    return run


def _rule_run(source, rule, spec: VLMSpec, dtype: torch.dtype, writer: SafetensorsWriter):
    def run():
        full = source.read(rule)
        for name, t in zip(rule.hf, mapping.to_hf(rule, full, spec)):
            writer.write(name, _cast(t, dtype))

    return run


def _extra_run(files, name: str, get, located, dtype: torch.dtype, writer: SafetensorsWriter):
    def run():
        target = writer.target(name)
        if located is not None:
            copyplan.fill(target, lambda xs: _cast(xs[0], dtype), [located], files)
        else:
            write_tensor(target, _cast(get(), dtype))

    return run


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
