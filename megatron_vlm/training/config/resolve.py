"""Resolution: fill what the user left open (environment defaults, stage defaults, ``--smoke-test``
shrinking, tensorboard dir, precision), make paths absolute, and validate (:mod:`.checks`); once the model and the
GPUs are known (the launcher), stage 2's micro batch on CUDA sized from the memory estimate
(:func:`size_micro_batch`).

Precedence of a value: command line > YAML > environment (``env_defaults``) > ``--smoke-test`` shrinking > stage
default > field default; ``--smoke-test`` forces its sizes whatever was asked and says so in ``resolution_notes``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from megatron_vlm.training.config import checks
from megatron_vlm.training.config.fields import SMOKE_TEST_TRAIN_ITERS, STAGE_DEFAULTS, ConfigError, ConfigFields


def absolute_path(p: str) -> str:
    """``p`` made absolute (``~`` expanded); URLs such as ``s3://`` or ``msc://`` are returned as given."""
    if "://" in p:
        return p
    return str(Path(os.path.expanduser(p)).absolute())



def resolve(config: ConfigFields, env_defaults: dict[str, Any] | None = None) -> ConfigFields:
    """A copy of ``config`` with open values filled in, paths absolute, and everything validated (``ConfigError``)."""
    cfg = dataclasses.replace(config)
    notes: list[str] = []
    for key, value in (env_defaults or {}).items():
        if key == "gpus" and cfg.gpu_ids:  # explicit --gpu-ids decide the count
            continue
        if getattr(cfg, key) is None and value is not None:
            setattr(cfg, key, value)
    problems = checks.check_types_and_ranges(cfg)
    if problems:
        raise ConfigError(checks.join(problems))

    if cfg.gpus is None:
        cfg.gpus = len(cfg.gpu_ids) if cfg.gpu_ids else (cfg.gpus_per_node or 1)
    cfg.nodes = cfg.nodes or 1
    cfg.node_rank = cfg.node_rank or 0
    cfg.device = cfg.device or "cuda"
    cfg.precision = cfg.precision or ("bf16" if cfg.device == "cuda" else "fp32")
    if cfg.nodes == 1 and cfg.master_addr is None:
        cfg.master_addr = "127.0.0.1"
    cfg.name = cfg.name or f"llava-stage{cfg.stage}"
    if cfg.sbatch and cfg.gpus_per_node is None:
        cfg.gpus_per_node = cfg.gpus

    if cfg.packing:  # a micro batch is one packed sequence
        if cfg.micro_batch_size is None:
            cfg.micro_batch_size = 1
        if cfg.packed_seq_length is None:
            cfg.packed_seq_length = cfg.seq_length
    for key, value in STAGE_DEFAULTS[cfg.stage].items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    if cfg.smoke_test:
        forced = dict(tp=1, pp=1, cp=1, pp_layers=None, micro_batch_size=1, log_interval=1,
                      num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None)
        changed = {k: v for k, v in forced.items() if getattr(cfg, k) != v}
        for k, v in forced.items():
            setattr(cfg, k, v)
        if cfg.global_batch_size != cfg.dp:
            changed["global_batch_size"] = cfg.dp
            cfg.global_batch_size = cfg.dp
        if cfg.train_iters is None:
            cfg.train_iters = changed["train_iters"] = SMOKE_TEST_TRAIN_ITERS
        if changed:
            notes.append("--smoke-test set " + ", ".join(f"{k}={v}" for k, v in changed.items()))

    for f in dataclasses.fields(cfg):
        if f.metadata["kind"] == "path" and getattr(cfg, f.name):
            setattr(cfg, f.name, absolute_path(getattr(cfg, f.name)))
    if cfg.log_dir is None and "://" in cfg.save_dir:
        cfg.log_dir = absolute_path(str(Path("outputs") / cfg.name))
        notes.append(f"--save-dir is remote: checkpoints go to {cfg.checkpoint_dir}, config and logs to "
                     f"{cfg.log_dir} (set --log-dir to change)")
    if cfg.tensorboard_dir is None:
        cfg.tensorboard_dir = str(cfg.run_dir / "tensorboard")

    problems = checks.check_consistency(cfg)
    if problems:
        raise ConfigError(checks.join(problems))
    object.__setattr__(cfg, "resolution_notes", notes)
    return cfg


def settle_with_spec(cfg: ConfigFields, spec) -> list[str]:
    """Settings that follow from the model the run trains, once its spec is read (the launcher, and every rank at
    start-up): a mixture-of-experts language model at --tp > 1 trains with sequence parallelism, which
    megatron-core's MoE layers need with tensor parallelism. Changes ``cfg`` in place and returns notes for the
    start-up output; raises ConfigError when the settled config fails a check that sequence parallelism takes part
    in (--packed-seq-length, or --seq-length under context or pipeline parallelism, not a multiple of the chunks
    the sequence splits into)."""
    notes: list[str] = []
    if getattr(spec, "is_moe", False) and cfg.tp > 1 and not cfg.sequence_parallel:
        cfg.sequence_parallel = True
        notes.append(f"sequence parallelism on: the mixture-of-experts language model trains at --tp {cfg.tp} "
                     "on a sequence-parallel split (megatron-core's MoE layers need it with tensor parallelism)")
        origin = f", which the mixture-of-experts language model turns on at --tp {cfg.tp}"
        problems = checks._check_packing(cfg) + checks.check_sequence_length(cfg, origin)
        if problems:
            raise ConfigError(checks.join(problems))
    return notes


#: the micro batch sizes stage 2 on CUDA may default to, largest first (stage 1's default is 16)
SIZED_MICRO_BATCHES = (16, 8, 4, 2)
#: the share of a GPU's memory the sized micro batch's estimate may take: the estimate leaves out the CUDA context,
#: NCCL/cuBLAS workspaces and fragmentation (1-3 GB), and its activations are a formula's
SIZING_HEADROOM = 0.8


def size_micro_batch(cfg: ConfigFields, spec, limit_gib: float | None, fused_attention: bool) -> str | None:
    """Stage 2 on CUDA without --micro-batch-size: the largest of :data:`SIZED_MICRO_BATCHES` whose memory estimate
    (:mod:`megatron_vlm.model.memory`) fits :data:`SIZING_HEADROOM` of ``limit_gib``, that divides --global-batch-size
    per data-parallel rank and leaves the pipeline at least --pp micro batches; in place of micro batch 1, whose
    step launches every layer once per sample (the host-bound configuration: docs/training.md, "Stages"). Sets
    ``cfg.micro_batch_size`` and returns the note for the start-up output, or None (left at 1). The launcher calls it
    once, where the GPUs' memory is known, and writes the result into the run's config, so every rank reads the
    same. ``fused_attention``: whether the attention keeps no score matrices (Transformer Engine)."""
    from megatron_vlm.model import memory

    if cfg.stage != 2 or cfg.device != "cuda" or cfg.packing or cfg.smoke_test or cfg.micro_batch_size != 1 \
            or not limit_gib:
        return None
    per_rank = cfg.global_batch_size // max(cfg.dp, 1)
    for mbs in SIZED_MICRO_BATCHES:
        if per_rank % mbs or per_rank // mbs < cfg.pp:
            continue
        trial = dataclasses.replace(cfg, micro_batch_size=mbs)
        stages = memory.estimate(spec, memory.Layout.of_config(trial, fused_attention=fused_attention, spec=spec))
        need = max(st.total for st in stages) / memory.GIB
        if need <= SIZING_HEADROOM * limit_gib:
            cfg.micro_batch_size = mbs
            return (f"--micro-batch-size {mbs}: stage 2 on CUDA sizes its micro batch from the memory estimate "
                    f"({need:.1f} GiB of {limit_gib:g} GiB per GPU; at most {SIZING_HEADROOM:.0%}) instead of 1; pass "
                    "--micro-batch-size to choose")
    return None
