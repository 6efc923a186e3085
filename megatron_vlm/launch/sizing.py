"""The memory estimate the launcher prints with ``--dry-run`` and checks before a launch.

:mod:`megatron_vlm.model.memory` does the arithmetic (no torch); this module picks its inputs -- the spec
the run will build (``preflight.load_spec``), the resolved config, whether its attention keeps score matrices (the
layers and attention its ranks will choose, :func:`megatron_vlm.model.layer_impl.planned`, with whether Transformer
Engine imports in the runtime that will train, as the probe found) -- and the limit to compare with:
``--gpu-memory-gb``, else the smallest visible GPU's memory as the probe reported it (none on CPU).
"""

from __future__ import annotations

from megatron_vlm.model import memory

GIB = memory.GIB


def device_limit_gib(cfg, facts: dict) -> tuple[float | None, str]:
    """The memory one rank may use, in GiB, and where that number came from."""
    if getattr(cfg, "gpu_memory_gb", None):
        return float(cfg.gpu_memory_gb), "--gpu-memory-gb"
    sizes = facts.get("memory") or []
    if cfg.device == "cuda" and sizes:
        return min(sizes) / GIB, "the visible GPU's memory"
    return None, ""


def fused_attention(cfg, facts: dict) -> bool:
    """Whether the run's core attention keeps no score matrices, from the probe's facts (``transformer_engine``:
    whether it imports there; absent: not asked, and taken as importing on CUDA)."""
    return memory.attention_keeps_no_scores(cfg, facts.get("transformer_engine"))


def estimate_lines(cfg, spec, facts: dict) -> tuple[list[str], str | None]:
    """The estimate's lines and, when it exceeds the limit, a warning."""
    layout = memory.Layout.of_config(cfg, fused_attention=fused_attention(cfg, facts), spec=spec)
    stages = memory.estimate(spec, layout)
    limit, source = device_limit_gib(cfg, facts)
    lines = memory.format_estimate(stages, layout, limit, source)
    warning = None
    if memory.over_limit(stages, limit):
        worst = max(stages, key=lambda s: s.total)
        warning = (f"the memory estimate per GPU, {worst.total / GIB:.1f} GiB (pipeline stage {worst.stage}), exceeds "
                   f"{limit:g} GiB ({source}); raise --tp/--pp (or --cp for long sequences), pass --dist-optim, lower "
                   "--micro-batch-size or "
                   "--seq-length, or use --recompute-granularity (train/run.py --dry-run prints the parts)")
    return lines, warning
