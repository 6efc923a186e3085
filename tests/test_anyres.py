"""Anyres geometry and packing (megatron_vlm/model/anyres.py) against HF's own ``pack_image_features``, in fp32.

HF's method is called on its model class with only the config it reads, so the reference is HF's code
itself; sizes sweep wide, tall, square, tiny (one grid tile) and huge images (OneVision downsamples the
grid when it exceeds the ``anyres_max_N`` budget), plus single-tile images (OneVision's multi-image case).
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.model.anyres import AnyresConfigError, AnyresGeometry, parse_vision_aspect_ratio

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="anyres geometry against HF's own pack_image_features: torch and transformers, pinned alike in both "
           "lanes")

SIZES = [(384, 384), (300, 1200), (1200, 300), (500, 700), (20, 30), (2000, 2300), (4000, 1000), (77, 1999),
         (768, 1152), (1000, 1000), (3000, 3000), (2000, 3600)]


def _onevision_config(tile, patch, grid_max, aspect):
    from transformers import LlavaOnevisionConfig

    pins = [[tile * i, tile * j] for i in range(1, grid_max + 1) for j in range(1, grid_max + 1)]
    return LlavaOnevisionConfig(vision_config=dict(model_type="siglip_vision_model", image_size=tile,
                                                   patch_size=patch, hidden_size=8),
                                text_config=dict(model_type="qwen2", hidden_size=8),
                                image_grid_pinpoints=pins, vision_aspect_ratio=aspect)


def _next_config(tile, patch):
    from transformers import LlavaNextConfig

    pins = [[tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile], [3 * tile, tile], [tile, 3 * tile]]
    return LlavaNextConfig(vision_config=dict(model_type="clip_vision_model", image_size=tile, patch_size=patch),
                           text_config=dict(model_type="llama"), image_grid_pinpoints=pins)


def _features(geo, size, channels, g):
    n = geo.num_tiles(*size)
    return torch.randn(n, geo.side**2, channels, generator=g)


@pytest.mark.parametrize("tile,patch,grid_max,aspect", [(384, 14, 6, "anyres_max_9"), (20, 6, 4, "anyres_max_2")])
def test_onevision_packing_equals_hf(tile, patch, grid_max, aspect):
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    cfg = _onevision_config(tile, patch, grid_max, aspect)
    geo = AnyresGeometry.from_hf(cfg)
    assert geo.max_tiles == int(aspect.rsplit("_", 1)[1]) and geo.side == tile // patch
    g = torch.Generator().manual_seed(0)
    channels = 4
    newline = torch.randn(channels, generator=g)
    feats = [_features(geo, s, channels, g) for s in SIZES]
    feats.append(torch.randn(1, geo.side**2, channels, generator=g))  # a single-tile image
    sizes = torch.tensor(SIZES + [(640, 480)])
    ref, ref_lens = LlavaOnevisionModel.pack_image_features(SimpleNamespace(config=cfg), feats, sizes,
                                                            image_newline=newline, vision_aspect_ratio=aspect)
    downsampled = 0
    for f, size, r, n in zip(feats, sizes.tolist(), ref, ref_lens.tolist()):
        got = geo.pack(f, size, newline)
        assert torch.equal(got, r), size
        tiled = f.shape[0] > 1
        assert geo.num_tokens(*size, tiled=tiled) == n == got.shape[0], size
        downsampled += tiled and geo.downsampled_size(*geo.unpadded_grid(*size)) is not None
    assert downsampled >= 2  # the sweep reaches OneVision's downsampling
    batch = geo.pack_batch(torch.cat(feats), sizes, [f.shape[0] for f in feats], newline)
    assert torch.equal(batch, torch.cat(ref))


def test_next_packing_equals_hf():
    from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

    cfg = _next_config(24, 8)
    geo = AnyresGeometry.from_hf(cfg)
    assert geo.max_tiles is None
    g = torch.Generator().manual_seed(1)
    newline = torch.randn(6, generator=g)
    feats = [_features(geo, s, 6, g) for s in SIZES]
    sizes = torch.tensor(SIZES)
    ref, lens = LlavaNextModel.pack_image_features(SimpleNamespace(config=cfg), feats, sizes, "default",
                                                   image_newline=newline)
    for f, size, r, n in zip(feats, SIZES, ref, lens.tolist()):
        assert torch.equal(geo.pack(f, size, newline), r)
        assert geo.num_tokens(*size) == n


def test_tile_counts_equal_hf_and_bad_configs():
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    cfg = _onevision_config(384, 14, 6, "anyres_max_9")
    geo = AnyresGeometry.from_hf(cfg)
    for s in SIZES:
        assert geo.num_tiles(*s) == image_size_to_num_patches(s, cfg.image_grid_pinpoints, 384)
    assert geo.num_tokens(384, 384) == 729 + 27 * 28
    with pytest.raises(AnyresConfigError, match="anyres_max_N"):
        parse_vision_aspect_ratio("anyres")
    with pytest.raises(AnyresConfigError, match="multiple of the tile size"):
        AnyresGeometry(384, 14, ((384, 500),))
