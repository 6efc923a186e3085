"""The pipeline layout of virtual pipeline parallelism (issue 51), held to megatron-core's own placement.

:mod:`megatron_vlm.model.pipeline_layout` says which language layers each model chunk of each pipeline rank holds; the
converters' legacy rank files, the gradient references and the start-up line read it. Here megatron-core decides:
for even and uneven splits (``--pp-layers``, which megatron-core expresses as the first and last stage's counts),
at PP2 and PP4 with 2 and 3 chunks per rank, the TransformerConfig the model builds with (``model.language_config``)
gives each chunk the layers (megatron-core's ``get_transformer_layer_offset`` and ``get_num_layers_to_build``) the
layout module says. The refusals name the flag and the fix.
"""

from __future__ import annotations

import pytest

from megatron_vlm.model import pipeline_layout as pl
from megatron_vlm.model.spec import ParallelismError

from .launch_helpers import tiny_spec


@pytest.mark.parametrize("layers,pp,pp_layers,vpp", [
    (8, 2, None, 2), (8, 2, None, 4), (12, 2, None, 3), (8, 4, None, 2),
    (22, 2, [12, 10], 2), (6, 2, [4, 2], 2), (16, 4, [2, 6, 6, 2], 2), (20, 4, [6, 4, 4, 6], 2),
])
def test_chunks_hold_the_layers_megatron_core_builds(layers, pp, pp_layers, vpp):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_vlm.model.build import ModelOptions, language_config

    spec = tiny_spec(num_layers=layers)
    cfg = language_config(spec, ModelOptions(pp=pp, pp_layers=pp_layers, vpp=vpp, perform_initialization=False))
    assert cfg.virtual_pipeline_model_parallel_size == vpp and cfg.overlap_p2p_comm and not cfg.batch_p2p_comm
    ranges = pl.chunk_layer_ranges(spec.check_parallelism(1, pp, pp_layers), vpp)
    for rank in range(pp):
        for chunk in range(vpp):
            start = get_transformer_layer_offset(cfg, vp_stage=chunk, pp_rank=rank)
            n = get_num_layers_to_build(cfg, vp_stage=chunk, pp_rank=rank)
            assert (start, start + n) == ranges[rank][chunk], (rank, chunk, ranges)
    covered = sorted(i for rank in ranges for a, b in rank for i in range(a, b))
    assert covered == list(range(layers))  # every layer once


def test_virtual_stages_and_the_start_up_line():
    assert pl.virtual_stage_layers([2, 2], 2) == [1, 1, 1, 1] and pl.virtual_stage_layers([3, 1]) == [3, 1]
    assert [pl.rank_and_chunk(s, 2) for s in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(pl.virtual_stage(*pl.rank_and_chunk(s, 4), 4) == s for s in range(12))
    assert pl.describe([4, 4], 2) == ("rank 0: [vision encoder, projector, embedding, layers 0-1] [layers 4-5]; "
                                      "rank 1: [layers 2-3] [layers 6-7, output layer]")
    assert pl.describe([1, 1]) == "rank 0: [vision encoder, projector, embedding, layer 0]; rank 1: [layer 1, output layer]"


@pytest.mark.parametrize("args,message", [
    (([4, 4], 3, None), "--num-layers-per-virtual-pipeline-stage 3 does not divide the 4 language layers of each "
                        "pipeline rank (--pp 2); choose one of [1, 2, 4]"),
    (([4, 4], None, 3), "--num-virtual-stages-per-pipeline-rank 3: pipeline rank 0 holds 4 language layers (--pp 2), "
                        "which do not split into 3 model chunks of equal size"),
    (([8], 1, None), "--num-layers-per-virtual-pipeline-stage needs pipeline parallelism"),
    (([4, 4], 1, 4), "give one of them"),
    (([4, 4], None, 0), "--num-virtual-stages-per-pipeline-rank 0: must be at least 1"),
])
def test_impossible_layouts_are_refused_naming_the_fix(args, message):
    with pytest.raises(ParallelismError) as e:
        pl.vpp_size(*args)
    assert message in str(e.value)
    with pytest.raises(ParallelismError, match="with --pp-layers 6,2: with an explicit split, give the chunks per "
                                               "rank with --num-virtual-stages-per-pipeline-rank instead"):
        pl.vpp_size([6, 2], 2, None, uneven=True)
    with pytest.raises(ParallelismError, match=r"rank 0 holds 5 language layers \(--pp-layers 5,3\).*; give every "
                                               "stage a multiple of 2 layers with --pp-layers"):
        pl.vpp_size([5, 3], None, 2, uneven=True)
    with pytest.raises(ParallelismError, match=r"; choose --num-virtual-stages-per-pipeline-rank from \[2, 3, 6\] or "
                                               "change --pp"):
        pl.vpp_size([6, 6], None, 4)


def test_flags_give_the_number_of_chunks():
    assert pl.vpp_size([4, 4]) == 1
    assert pl.vpp_size([4, 4], 1) == 4 and pl.vpp_size([4, 4], 2) == 2 and pl.vpp_size([4, 4], 4) == 1
    assert pl.vpp_size([6, 2], None, 2, uneven=True) == 2 and pl.vpp_size([4, 4], None, 1) == 1
