"""The per-rank gradient references at virtual pipeline stages: a rank's model chunks seen as the ranks of a plain
pipeline of ``pp * vpp`` stages.

With virtual pipeline parallelism a rank holds one model chunk per virtual stage
(:mod:`megatron_vlm.model.pipeline_layout`), each with its own layer numbers. Chunk ``c`` of pipeline rank ``p`` holds
exactly what pipeline rank ``c * pp + p`` of a ``pp * vpp``-stage pipeline would, under the same local names; so the
reference that compares a rank's gradients with HF's (:mod:`tests.support.grad_reference`) runs unchanged on each
chunk's :class:`ChunkView`, a one-chunk ``Training``, runtime and config of that wider pipeline. This module is that
thin wrapper and knows nothing of how they compare.
"""

from __future__ import annotations

import dataclasses

from megatron_vlm.model.pipeline_layout import virtual_stage, virtual_stage_layers


@dataclasses.dataclass
class ChunkView:
    training: object  # a Training of one chunk (the rank's optimizer and schedule, shared)
    rt: object  # the runtime with pp = pp * vpp and this chunk's virtual stage as its pp_rank
    cfg: object  # the config with pp = pp * vpp and the layers per virtual stage as its pp_layers
    stage: int  # the chunk's virtual stage


def views(training, rt, cfg, spec) -> list[ChunkView]:
    """One view per model chunk of this rank (one view of the rank itself without virtual stages)."""
    vpp = len(training.models)
    if vpp == 1:
        return [ChunkView(training, rt, cfg, rt.pp_rank)]
    layers = virtual_stage_layers(spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers), vpp)
    wide = dataclasses.replace(cfg, pp=rt.pp * vpp, pp_layers=layers, num_layers_per_virtual_pipeline_stage=None,
                               num_virtual_stages_per_pipeline_rank=None)
    out = []
    for c, (m, d) in enumerate(zip(training.models, training.ddps)):
        stage = virtual_stage(rt.pp_rank, c, rt.pp)
        out.append(ChunkView(dataclasses.replace(training, models=[m], ddps=[d]),
                             dataclasses.replace(rt, pp=rt.pp * vpp, pp_rank=stage, vpp=1), wide, stage))
    return out


def stage_layers(training, cfg, spec) -> list[int]:
    """Language layers per stage of the pipeline the views form (per virtual stage with several chunks)."""
    return virtual_stage_layers(spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers), len(training.models))
