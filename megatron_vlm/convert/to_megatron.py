"""HF LLaVA directory -> Megatron checkpoint (torch_dist or legacy ``torch``) at a chosen TP/PP.

Each checkpoint is written in two passes. First its structure, by the libraries that own the format, with every
tensor's bytes left out (``torch.serialization.skip_data``): torch_dist through megatron-core's
``dist_checkpointing.save`` and torch.distributed.checkpoint (:func:`megatron_vlm.convert.mcore_io.save_dist`, the
TP=1/PP=1 layout, whose keys and blocks come from megatron-core's own ``sharded_state_dict`` of a model built on
the meta device; dist_checkpointing reshards it on load to any TP/PP), legacy rank files by ``torch.save``
(:class:`megatron_vlm.convert.mcore_io.LegacyWriter`). Then one task per Megatron tensor
(:class:`~megatron_vlm.convert.mapping.Rule`) writes its bytes in place: the rows that are unchanged HF rows (a
copy, the fused QKV, the SwiGLU halves, the TP shards along rows) go file to file in the kernel
(:mod:`megatron_vlm.convert.copyplan`); the rest is made by ``mapping.to_mcore`` from the memory-mapped HF tensors
and written. Each HF byte is read once and each output byte written once.

Tasks run on worker threads under a memory budget (:mod:`megatron_vlm.convert.streaming`): the converter holds a
few tensors at a time, never a pipeline stage or the model, and refuses at the start when the largest tensor does
not fit under ``max_memory``.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.files.atomic import atomic_dir
from megatron_vlm.convert import copyplan, mapping
from megatron_vlm.convert import streaming as st
from megatron_vlm.convert.file_tensors import Target, itemsize, write_tensor
from megatron_vlm.convert.hf_io import HFReader, SafetensorsWriter
from megatron_vlm.runtime.gc_freeze import preload
from megatron_vlm.model.spec import VLMSpec

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


class _Plan:
    """What the conversion makes: each full Megatron tensor (shape and dtype from the HF headers alone) and how."""

    def __init__(self, reader: HFReader, spec: VLMSpec, rules, dtype: torch.dtype):
        self.reader, self.spec, self.dtype, self.rules = reader, spec, dtype, rules
        self.plans_made: dict = {}
        self.shape = {}
        for rule in rules:
            metas = [torch.empty(reader.info(h).shape, dtype=reader.info(h).dtype, device="meta") for h in rule.hf]
            self.shape[rule.mcore] = tuple(mapping.to_mcore(rule, metas, spec).shape)

    def out_dtype(self, rule) -> torch.dtype:
        src = self.reader.info(rule.hf[0]).dtype
        return self.dtype if src.is_floating_point else src

    def nbytes(self, rule) -> int:
        return math.prod(self.shape[rule.mcore]) * itemsize(self.out_dtype(rule))

    def made_bytes(self, rule) -> int:
        """Anonymous bytes the full tensor takes when computed (0 when it is the memory-mapped HF tensor)."""
        numel = math.prod(self.shape[rule.mcore])
        src = self.reader.info(rule.hf[0]).dtype
        made = numel * itemsize(src) if rule.kind in ("qkv", "qkv_packed", "gated", "vocab") else 0
        cast = numel * itemsize(self.out_dtype(rule)) if self.out_dtype(rule) != src else 0
        return made + cast

    def make_full(self, rule) -> torch.Tensor:
        """The full Megatron tensor of ``rule`` in the checkpoint's dtype (a view of the mapped HF file when
        nothing changes)."""
        return _cast(mapping.to_mcore(rule, [self.reader.view(h) for h in rule.hf], self.spec), self.dtype)

    def task(self, rule, outs: list, files: copyplan.Files) -> st.Task:
        """The task writing ``rule``'s outputs: ``outs`` is ``[(part, part_key, shape, target)]``, ``part(full)``
        the output's block of the full tensor (a TP shard, a ShardedTensor's block), ``part_key`` what that block is
        (the same for the same block of every layer) and ``target()`` where it goes. All in the kernel when every
        output is whole HF rows, else from the computed full tensor. A copy plan holds offsets relative to its
        sources and outputs, so tensors of one shape made alike share it (:attr:`plans_made`): a model's depth
        costs no planning."""
        sources = [self.reader.located(h) for h in rule.hf]
        dtype = self.out_dtype(rule)
        key = (rule.kind, rule.split, rule.heads, rule.groups, rule.head_dim, dtype,
               tuple((tuple(s.shape), s.dtype) for s in sources), tuple((k, tuple(shape)) for _, k, shape, _ in outs))
        if key not in self.plans_made:
            def made(xs):
                return _cast(mapping.to_mcore(rule, xs, self.spec), self.dtype)

            rows = copyplan.RowPlan(sources, made)
            self.plans_made[key] = [
                rows.runs(part, shape, dtype) if math.prod(shape) * itemsize(dtype) >= copyplan.MIN_COPY_BYTES
                else None for part, _, shape, _ in outs]
        runs = self.plans_made[key]
        nbytes = sum(math.prod(shape) for _, _, shape, _ in outs) * itemsize(dtype)
        reads = tuple(s.span for s in sources)  # copied, or computed from their mapped views
        if all(r is not None for r in runs):
            def copy():
                for (_, _, _, target), r in zip(outs, runs):
                    copyplan.fill(target(), None, sources, files, runs=r)

            return st.Task(rule.mcore, cost=0, nbytes=nbytes, run=copy, after=lambda: self.release(rule),
                           reads=reads)

        def compute():
            full = self.make_full(rule)
            for part, _, _, target in outs:
                write_tensor(target(), part(full))

        largest = max(math.prod(shape) for _, _, shape, _ in outs) * itemsize(dtype)  # a block made contiguous
        return st.Task(rule.mcore, cost=self.made_bytes(rule) + largest, nbytes=nbytes, run=compute,
                       after=lambda: self.release(rule), reads=reads)

    def release(self, rule) -> None:
        for h in rule.hf:
            self.reader.release(h)


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
    max_memory: int | None = None,
    workers: int | None = None,
    before_write=None,
    ep: int = 1,
    etp: int | None = None,
    vpp: int = 1,
    layers_per_virtual_stage: int | None = None,
) -> Path:
    """Write ``megatron_dir``. ``check(tmp_dir)``, if given, runs on the complete checkpoint under its temporary
    name before the rename (``--verify``): when it raises, the new checkpoint is deleted and ``megatron_dir`` is
    left as it was (absent, or the previous checkpoint with ``overwrite``). ``max_memory``: the cap in bytes on the
    process's memory (None: from the memory available); ``before_write(spec)`` runs once the plan is checked,
    before anything is written (``--verify``'s own memory check). ``ep``/``etp``: the expert-parallel layout of a
    mixture-of-experts model (legacy rank files are written per EP rank; torch_dist reshards to any). ``vpp``:
    virtual pipeline stages per PP rank (legacy rank files hold one ``model<c>`` entry per model chunk, as Megatron-LM
    writes them; a torch_dist checkpoint is the same at any layout and records it only), or
    ``layers_per_virtual_stage`` layers per model chunk (Megatron-LM's two flags)."""
    if ckpt_format not in ckpt.FORMATS:
        raise ValueError(f"--ckpt-format {ckpt_format!r} is not one of {ckpt.FORMATS}")
    spec = VLMSpec.from_hf_dir(hf_dir)
    layers = spec.check_parallelism(tp, pp, pp_layers, ep, etp)
    if vpp > 1 or layers_per_virtual_stage is not None:
        from megatron_vlm.model.pipeline_layout import vpp_size

        vpp = vpp_size(layers, layers_per_virtual_stage, vpp if vpp > 1 else None, uneven=pp_layers is not None)
    if ckpt_format == "torch" and (etp or tp) not in (1, tp):
        raise ValueError(f"--etp {etp} with --tp {tp}: legacy rank files hold experts whole (--etp 1) or split as the "
                         "attention (--etp equal to --tp); use --ckpt-format torch_dist, which reshards to any --etp")
    reader = HFReader(hf_dir)
    files = copyplan.Files()
    try:
        torch_dtype = reader.dtype() if dtype == "auto" else DTYPES[dtype]
        rules = mapping.rules(spec)
        missing = [h for r in rules for h in r.hf if h not in reader]
        if missing:
            raise ValueError(f"{hf_dir} lacks {len(missing)} tensors the spec needs, e.g. {missing[0]}")
        plan = _Plan(reader, spec, rules, torch_dtype)
        workers = workers or st.default_workers()
        meta = ckpt.CheckpointMeta(ckpt_format, tp, pp, layers, "release", str(torch_dtype).replace("torch.", ""),
                                   ep=ep, etp=etp, vpp=vpp)
        if ckpt_format == "torch":
            _convert(plan, files, hf_dir, megatron_dir, overwrite, check, max_memory, workers, before_write, meta,
                     _LegacyOutput(plan, files, tp, pp, meta.stage_layers, ep, etp, vpp))
        else:
            from megatron_vlm.runtime.session import single_process_world

            preload(["megatron.core"])  # megatron-core writes torch_dist: imported with the collector paused
            with single_process_world():
                _convert(plan, files, hf_dir, megatron_dir, overwrite, check, max_memory, workers, before_write,
                         meta, _DistOutput(plan, files))
    finally:
        files.close()
        reader.close()
    log.debug("wrote %s checkpoint (tp=%d pp=%d vpp=%d) to %s", ckpt_format, tp, pp, vpp, megatron_dir)
    return Path(megatron_dir)


def _convert(plan: _Plan, files, hf_dir, megatron_dir, overwrite, check, max_memory, workers, before_write, meta,
             output) -> None:
    extra = _Extra(plan.reader, mapping.extra_hf_names(plan.spec, plan.reader.names()), plan.dtype, files)
    tasks = output.tasks + extra.tasks
    budget = st.memory_budget(tasks, max_memory, workers)
    if before_write is not None:
        before_write(plan.spec)
    with atomic_dir(megatron_dir, overwrite=overwrite, what="--megatron-dir", flush=True) as tmp:
        iter_dir = tmp / "release"
        iter_dir.mkdir()
        progress = st.Progress(sum(t.nbytes for t in tasks), "hf_to_megatron")
        try:
            with st.Runner(workers, st.Budget(budget), progress) as runner:
                output.write(iter_dir, runner)
                extra.write(iter_dir, runner)
        finally:
            progress.close()
        plan.spec.save(iter_dir)
        meta.save(iter_dir)
        plan.spec.save(tmp)
        ckpt.copy_tokenizer(hf_dir, tmp)
        ckpt.write_tracker(tmp, "release")
        if check is not None:
            check(tmp)


class _DistOutput:
    """torch_dist: megatron-core's blocks of the TP=1/PP=1 model (a one-process world must be up)."""

    def __init__(self, plan: _Plan, files):
        from megatron_vlm.convert import mcore_io

        self.plan = plan
        model = mcore_io.meta_model(plan.spec, plan.dtype)
        self.sharded, self.pieces = mcore_io.dist_pieces(model, {r.mcore for r in plan.rules})
        del model
        self.offsets: dict = {}
        self.tasks = []
        for rule in plan.rules:
            ps = self.pieces[rule.mcore]
            want = plan.out_dtype(rule)
            if any(pc.sh.dtype != want for pc in ps) or ps[0].full_shape != plan.shape[rule.mcore]:
                raise ValueError(f"{rule.mcore}: megatron-core's model holds {ps[0].sh.dtype} {ps[0].full_shape}, the "
                                 f"conversion makes {want} {plan.shape[rule.mcore]}")
            outs = [(pc.of, ("block", pc.start), pc.shape, self._target(pc)) for pc in ps]
            self.tasks.append(plan.task(rule, outs, files))

    def _target(self, pc):
        def target():
            fd, offset = self.offsets[pc.key]
            return Target(fd, offset, pc.sh.dtype, pc.shape, f"{pc.name} (its block at {pc.start})")

        return target

    def write(self, iter_dir: Path, runner: st.Runner) -> None:
        from megatron_vlm.convert import mcore_io

        def write_data(offsets: dict) -> None:
            fds = {}
            try:
                for key, (path, offset) in offsets.items():
                    if path not in fds:
                        fds[path] = os.open(path, os.O_WRONLY)
                    self.offsets[key] = (fds[path], offset)
                runner.run(self.tasks)
            finally:
                for fd in fds.values():
                    os.close(fd)

        mcore_io.save_dist(self.sharded, iter_dir, write_data)


class _LegacyOutput:
    """Legacy rank files: every TP shard of every stage that holds the tensor, one file per (TP rank, PP stage, EP
    rank) as Megatron-LM writes them. An EP rank's file holds its own experts (under their local indices) and the
    stage's other tensors; an expert's linears are split over ``etp`` (1 or ``tp``). ``layers``: the language layers
    per virtual stage (per PP stage without virtual stages); with ``vpp`` > 1 a file holds one ``model<c>`` entry
    per model chunk ``c`` of its rank, each numbering its layers from 0 (Megatron-LM's layout)."""

    def __init__(self, plan: _Plan, files, tp: int, pp: int, layers: list[int], ep: int = 1, etp: int | None = None,
                 vpp: int = 1):
        from megatron_vlm.model.pipeline_layout import rank_and_chunk

        self.plan, self.tp, self.pp, self.ep = plan, tp, pp, ep
        spec = plan.spec
        per_rank = spec.num_moe_experts // ep if spec.is_moe else None
        self.layout: dict[tuple[int, int, int], list] = {(t, p, e): [] for p in range(pp) for e in range(ep)
                                                         for t in range(tp)}
        self.writer = None
        self.tasks = []
        for rule in plan.rules:
            full = torch.empty(plan.shape[rule.mcore], dtype=plan.out_dtype(rule), device="meta")
            owner = mapping.ep_rank_of(rule, spec, ep)
            split = mapping.split_size(rule, tp, etp)
            outs = []
            for s in mapping.stages_of(rule, spec, layers):
                name = mapping.local_name(rule, s, layers, per_rank)
                p, c = rank_and_chunk(s, pp)
                entry = "model" if vpp == 1 else f"model{c}"
                for e in (range(ep) if owner is None else [owner]):
                    for t in range(tp):
                        shape = tuple(mapping.tp_shard(rule, full, split, t % split).shape)
                        self.layout[(t, p, e)].append((name, full.dtype, shape, entry))
                        outs.append((self._part(rule, split, t % split), ("tp", split, t % split), shape,
                                     self._target(t, p, name, e, entry)))
            self.tasks.append(plan.task(rule, outs, files))

    @staticmethod
    def _part(rule, split: int, t: int):
        return lambda full: mapping.tp_shard(rule, full, split, t)

    def _target(self, t: int, p: int, name: str, e: int, entry: str):
        return lambda: self.writer.target(t, p, name, e, entry)

    def write(self, iter_dir: Path, runner: st.Runner) -> None:
        from megatron_vlm.convert import mcore_io

        self.writer = mcore_io.LegacyWriter(iter_dir, self.pp, self.layout, "release", self.ep)
        try:
            runner.run(self.tasks)
            self.writer.close(runner.workers)
        finally:
            self.writer.abort()


class _Extra:
    """``hf_extra.safetensors``: the HF tensors the Megatron model does not hold, in the checkpoint's dtype."""

    def __init__(self, reader: HFReader, names: list[str], dtype, files):
        self.reader, self.names, self.dtype, self.files = reader, names, dtype, files
        self.entries, self.tasks, self.writer = [], [], None
        for n in names:
            info = reader.info(n)
            out = dtype if info.dtype.is_floating_point else info.dtype
            self.entries.append((n, out, info.shape))
            nbytes = math.prod(info.shape) * itemsize(out)
            self.tasks.append(st.Task(n, cost=nbytes if out != info.dtype else 0, nbytes=nbytes, run=self._run(n),
                                      after=lambda n=n: reader.release(n), reads=(reader.located(n).span,)))

    def _run(self, name: str):
        def run():
            target = self.writer.target(name)
            copyplan.fill(target, lambda xs: _cast(xs[0], self.dtype), [self.reader.located(name)], self.files)

        return run

    def write(self, iter_dir: Path, runner: st.Runner) -> None:
        self.writer = SafetensorsWriter(iter_dir, self.entries, single_name=ckpt.EXTRA)
        try:
            runner.run(self.tasks)
            self.writer.close()
        finally:
            self.writer.abort()
