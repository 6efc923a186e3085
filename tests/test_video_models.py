"""LLaVA-OneVision videos on the model side, against HF's own code: token counts, pooling, the packed video
features, the ``<video>`` token through build_llava, HF -> Megatron -> HF, and the exported video processor.

The logits of a mixed image + video batch at TP=1, TP=2 and PP=2 and training on videos are asserted in
tests/test_anyres_models.py's world (its reference batch and micro batches hold videos); train/run.py on a
make_wds set with videos in tests/test_video_run.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.model.anyres import AnyresGeometry
from megatron_vlm.model.spec import VLMSpec


@pytest.fixture(scope="module")
def ov(tmp_path_factory):
    from tests.support.tiny import make_tiny_onevision

    return make_tiny_onevision(tmp_path_factory.mktemp("video_models") / "ov")


def _hf_config(tile, patch):
    return SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(image_size=tile, patch_size=patch)),
                           num_image_tokens=(tile // patch) ** 2)


@pytest.mark.parametrize("tile,patch", [(384, 14), (336, 14), (20, 6), (24, 6)])
def test_video_tokens_and_pooling_equal_hf(tile, patch):
    """HF's processor count and HF's apply_pooling (the functions themselves), at OneVision's 384/14 too."""
    from transformers import LlavaOnevisionProcessor
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    geo = AnyresGeometry(tile, patch, ((tile, tile),), 9)
    hf = _hf_config(tile, patch)
    frames = [1, 2, 3, 32]
    got = LlavaOnevisionProcessor._get_num_multimodal_tokens(hf, video_sizes=[(f, tile, tile) for f in frames])
    assert got.num_video_tokens == [geo.video_tokens(f) for f in frames]
    if (tile, patch) == (384, 14):
        assert geo.video_tokens(32) == 6273 == 32 * 196 + 1
    g = torch.Generator().manual_seed(tile)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, geo.side**2, 16, generator=g).to(dtype)
        want = LlavaOnevisionModel.apply_pooling(hf, x)
        assert torch.equal(geo.pool_frames(x), want)
        strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # as the projector's output reaches it
        assert torch.equal(geo.pool_frames(strided), want)


def test_packed_video_equals_hf_video_features(ov):
    """HF's get_video_features (ViT, projector, pooling, one image_newline) equals our packing of the same
    projector output, bit for bit, for videos of 1, 2 and 3 frames."""
    from megatron_vlm.convert.verify import load_hf_model

    model = load_hf_model(ov)
    geo = VLMSpec.from_hf_dir(ov).anyres
    g = torch.Generator().manual_seed(0)
    for frames in (1, 2, 3):
        pixels = torch.randn(1, frames, 3, geo.tile_size, geo.tile_size, generator=g)
        with torch.no_grad():
            hf = model.model.get_video_features(pixels, vision_feature_layer=-1,
                                                vision_feature_select_strategy="full").pooler_output[0]
            feats = model.model.vision_tower(pixels[0], output_hidden_states=True).hidden_states[-1]
            ours = geo.pack_video(model.model.multi_modal_projector(feats), model.model.image_newline)
        assert ours.shape == (geo.video_tokens(frames), model.config.text_config.hidden_size)
        assert torch.equal(ours, hf)


def test_build_adds_the_video_token_template_and_video_processor(ov):
    from huggingface_hub.dataclasses import validate_typed_dict
    from transformers import AutoTokenizer
    from transformers.processing_utils import VideosKwargs

    cfg = json.loads((ov / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(ov)
    assert tok.convert_tokens_to_ids("<video>") == cfg["video_token_index"] == cfg["image_token_index"] + 1
    spec = VLMSpec.from_hf_dir(ov)
    assert (spec.video_token, spec.video_token_id) == ("<video>", cfg["video_token_index"])
    assert spec.media_token_ids == (cfg["image_token_index"], cfg["video_token_index"])
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}],
                                   tokenize=False)
    assert text.startswith("USER: <video>\nhi")
    vp = json.loads((ov / "video_preprocessor_config.json").read_text())
    ip = json.loads((ov / "preprocessor_config.json").read_text())
    assert vp.pop("video_processor_type") == "LlavaOnevisionVideoProcessor"
    validate_typed_dict(VideosKwargs, vp)  # HF's own check of a video processor's settings
    assert vp["size"] == {"height": 20, "width": 20} == ip["size"] and vp["resample"] == ip["resample"] == 3
    assert (vp["image_mean"], vp["image_std"], vp["rescale_factor"]) == (ip["image_mean"], ip["image_std"],
                                                                       ip["rescale_factor"])
    assert (vp["do_resize"], vp["do_rescale"], vp["do_normalize"], vp["do_center_crop"]) == (True, True, True, None)


def test_video_token_template_and_processor_survive_conversion_and_export(ov, tmp_path):
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    meg = convert_hf_to_megatron(ov, tmp_path / "meg", tp=2)
    assert VLMSpec.load(meg / "release").video_token_id == VLMSpec.from_hf_dir(ov).video_token_id
    out = convert_megatron_to_hf(meg, tmp_path / "hf", tokenizer_dir=ov)
    a, b = json.loads((ov / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert b["video_token_index"] == a["video_token_index"] and b["image_token_index"] == a["image_token_index"]
    for name in ("video_preprocessor_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (ov / name).read_bytes(), name
    assert VLMSpec.from_hf_dir(out).to_json() == VLMSpec.from_hf_dir(ov).to_json()


def test_a_onevision_built_without_video_token_takes_no_videos(ov, tmp_path):
    """A OneVision config from before videos (HF's default video_token_index, beyond its vocabulary) gets no
    video token: its reference batch takes images only; a tokenizer whose <video> differs is refused."""
    import shutil

    from megatron_vlm.convert.verify import reference_batch

    cfg = json.loads((ov / "config.json").read_text())
    cfg["video_token_index"] = 151647
    spec = VLMSpec.from_hf(cfg)
    assert spec.video_token_id is None and spec.media_token_ids == (spec.image_token_id,)
    assert reference_batch(spec).tokens.shape[0] == 4 and reference_batch(VLMSpec.from_hf_dir(ov)).tokens.shape[0] == 6
    old = tmp_path / "old"
    shutil.copytree(ov, old)
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        VLMSpec.from_hf_dir(old)
    assert str(e.value) == ("tokenizer's '<video>' id 301 != config video_token_index 151647; rebuild the model "
                            "with convert/build_llava.py --arch llava_onevision")
