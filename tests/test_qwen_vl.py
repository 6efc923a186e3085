"""Qwen2.5-VL (HF ``Qwen2_5_VLForConditionalGeneration``) converted to megatron-core and back, held against HF.

Model: the published Qwen2.5-VL-7B-Instruct config (``../shared/hub``, flat, legacy tensor names ``model.*`` /
``visual.*``), shrunk in size only (:mod:`tests.support.qwen_vl_models`), random weights, around its real tokenizer;
its 152,064-row embedding exceeds the tokenizer's 151,665 tokens.

- **Logits**: fp32 against HF's own model on two samples with images of two sizes (one spanning 2 x 2 windows of the
  ViT's windowed attention, a row of three windows the last partial, and a small one), expanded as the processor
  expands them: ``hf_to_megatron --verify`` at TP1 (in this process), and TP2, PP2 and TP2 x PP2 from that
  torch_dist checkpoint in a 2-process world (TP2 x PP2 in the training world; 1e-4; measured ~7e-6); the same
  config with Qwen2.5-VL-3B's tied embeddings at TP1 and PP2; Qwen3-VL-8B's config shrunk, the same layouts.
- **Training**: the trainer against HF's own model, same batches (loss, grad norms, every tensor's gradient), at the
  layouts of :data:`TRAIN_JOBS` and :data:`QWEN3_TRAIN_JOBS` (TP, PP, VPP, DP, CP, packed), in the same world;
  every global batch holds a video (HF's ``pixel_values_videos``, ``video_grid_thw``; Qwen2.5-VL's
  ``second_per_grid_ts``, Qwen3-VL's timestamps in the text).
- **The real processor** (3.12 lane, which has torchvision): ``AutoProcessor``'s inputs for two images of different
  sizes follow the reference batch's token rule, and Megatron's logits on them equal HF's (measured 6.6e-6).
- **M-RoPE**: megatron-core's ``MultimodalRotaryEmbedding`` equals HF's rotary at the batch's 3-D positions.
- **Controls** (the same world): Megatron fed 1-D positions instead of M-RoPE's 3-D ones, and Megatron's ViT with full
  attention in every layer (no windows), must both differ from HF far beyond the tolerance.
- **Round trips**: HF -> Megatron -> HF byte for byte with dtypes and names: the TP1 torch_dist checkpoint, and legacy
  rank files at TP2 x PP2 (the ViT's fused q/k/v and SwiGLU biases split over TP); a bf16 copy (the hub's dtype)
  through the two commands at TP2.
- **Memory**: the estimate ``--verify`` checks counts the real 7B's 8.29e9 parameters as HF builds them.
- **Names**: transformers 4.5x's layout (``model.language_model.*``, ``model.visual.*``) is read as the hub's.
- **Refusals**: Qwen3-VL-MoE / Qwen2-VL configs, config settings it cannot reproduce, training options it does not
  do yet (``train/run.py``), the LLaVA task encoder on its directory, and image or video tokens without their pixels
  given to the model, in one line naming them, before anything is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.model.spec import VLMSpec
from tests.support.round_trip import assert_same_bytes

from .conftest import not_here, script

TOL = 1e-4  # fp32 logits, as --verify's default
#: (model, tp, pp, control) of the 2-process logits world ("tied": the 7B config with Qwen2.5-VL-3B's tied
#: embeddings; "qwen3": Qwen3-VL-8B's config)
JOBS = [("7B", 2, 1, None), ("7B", 1, 2, None), ("7B", 1, 1, "flat"), ("7B", 1, 1, "no_windows"),
        ("tied", 1, 1, None), ("tied", 1, 2, None),
        ("qwen3", 2, 1, None), ("qwen3", 1, 2, None), ("qwen3", 1, 1, "no_deepstack"),
        ("qwen3", 1, 1, "sectioned"), ("qwen3", 1, 1, "flat")]
#: the logit jobs that need 4 ranks: the first part of the 4-process training world
JOBS4 = [("7B", 2, 2, None), ("qwen3", 2, 2, None)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.support.qwen_vl_models import qwen_vl_hf_model

    return qwen_vl_hf_model(tmp_path_factory.mktemp("qwen_vl") / "hf")


@pytest.fixture(scope="module")
def converted(model, tmp_path_factory):
    """``hf_to_megatron --verify`` at TP1 (torch_dist: it loads at any layout); (checkpoint dir, printed diff)."""
    from megatron_vlm.cli import run_cli

    out = tmp_path_factory.mktemp("qwen_vl_meg") / "tp1"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = run_cli(script("convert/hf_to_megatron.py").main,
                     ["--hf-dir", str(model), "--megatron-dir", str(out), "--verify", "--tolerance", str(TOL)])
    assert rc == 0, buf.getvalue()
    return out, float(re.search(r"verify: max \|logit diff\| .* = (\S+) <=", buf.getvalue()).group(1))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """The 7B config with tied embeddings (Qwen2.5-VL-3B's ``tie_word_embeddings``: no ``lm_head`` on disk), converted
    at TP1; (HF dir, checkpoint dir)."""
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.qwen_vl_models import qwen_vl_hf_model

    root = tmp_path_factory.mktemp("qwen_vl_tied")
    src = qwen_vl_hf_model(root / "hf", seed=3, tie_word_embeddings=True)
    return src, convert_hf_to_megatron(src, root / "meg")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3-VL-8B's config, shrunk, converted by ``hf_to_megatron --verify`` at TP1; (HF dir, checkpoint dir, printed
    diff)."""
    from megatron_vlm.cli import run_cli
    from tests.support.qwen_vl_models import qwen3_vl_hf_model

    root = tmp_path_factory.mktemp("qwen3_vl")
    src, out, buf = qwen3_vl_hf_model(root / "hf", seed=5), root / "meg", io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = run_cli(script("convert/hf_to_megatron.py").main,
                     ["--hf-dir", str(src), "--megatron-dir", str(out), "--verify", "--tolerance", str(TOL)])
    assert rc == 0, buf.getvalue()
    return src, out, float(re.search(r"verify: max \|logit diff\| .* = (\S+) <=", buf.getvalue()).group(1))


@pytest.fixture(scope="module")
def logit_jobs(model, converted, tied, qwen3, tmp_path_factory):
    """{key: job} of :data:`JOBS` and :data:`JOBS4` for :func:`tests.support.qwen_vl_models.logit_diffs`, with HF's
    logits of each model's reference batch."""
    from megatron_vlm.convert.verify import hf_logits, reference_batch

    root = tmp_path_factory.mktemp("qwen_vl_ref")
    sources = {"7B": (model, converted[0]), "tied": tied, "qwen3": qwen3[:2]}
    refs = {}
    for name, (src, _) in sources.items():
        spec = VLMSpec.from_hf_dir(src)
        batch = reference_batch(spec)
        torch.save(hf_logits(src, batch), root / f"{name}.pt")
        refs[name] = (batch, root / f"{name}.pt", spec.vocab_size)
    return {(name, tp, pp, control): dict(megatron_dir=str(sources[name][1]), tp=tp, pp=pp, batch=refs[name][0],
                                          ref_file=str(refs[name][1]), vocab=refs[name][2], control=control)
            for name, tp, pp, control in JOBS + JOBS4}


@pytest.fixture(scope="module")
def world(logit_jobs, one_world):
    """{(model, tp, pp, control): max |logit diff| vs HF}: :data:`JOBS` from one 2-process world, :data:`JOBS4` from
    the training world."""
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import qwen_vl_models

    diffs = run_world(qwen_vl_models.logit_diffs, 2, [logit_jobs[k] for k in JOBS])[0]
    return {**dict(zip(JOBS, diffs)), **dict(zip(JOBS4, one_world[0]))}


def test_spec_of_the_published_config(model):
    """What the spec reads from the hub's flat 7B config (shrunk): the families, M-RoPE sections, the ViT's windows
    and full-attention layers, the image token, and the vocabulary beyond the tokenizer's."""
    from transformers import AutoTokenizer

    s = VLMSpec.from_hf_dir(model)
    assert (s.arch, s.text_family, s.vision_family, s.qkv_bias, s.tie_word_embeddings) == \
        ("qwen2_5_vl", "qwen2", "qwen2_5_vit", True, False)
    assert (s.mrope_section, s.fullatt_block_indexes, s.window_size, s.spatial_merge_size, s.temporal_patch_size) == \
        ([4, 6, 6], [1, 3], 112, 2, 2)
    assert (s.image_token, s.image_token_id, s.pad_token_id, s.vocab_size, s.rotary_base) == \
        ("<|image_pad|>", 151655, 151643, 152064, 1e6)
    assert len(AutoTokenizer.from_pretrained(str(model))) == 151665 < s.vocab_size
    assert s.working_tps() == [1, 2] and s.projector_input_size == 4 * s.vision_hidden_size
    assert "model.layers.0.self_attn.q_proj.bias" in HFReader(model).names()  # the hub's legacy names


@pytest.mark.slow
def test_verify_at_tp1(converted):
    """``hf_to_megatron --verify`` (fp32 logits of HF's own model against megatron-core's, TP1) within 1e-4."""
    print(f"\nQwen2.5-VL: --verify max |logit diff| at TP1 {converted[1]:.2g}")
    assert converted[1] < TOL


@pytest.mark.slow
def test_logits_match_hf_at_tp2_and_pp2(world):
    """TP2, PP2 and TP2 x PP2 of the 7B layout, and TP1 and PP2 with tied embeddings (the last stage's copy of the
    embedding as its output layer), within 1e-4 of HF."""
    diffs = {k[:3]: v for k, v in world.items() if k[3] is None and k[0] != "qwen3"}
    print("\nQwen2.5-VL: max |logit diff| vs HF per (model, TP, PP): " +
          ", ".join(f"{k}: {v:.2g}" for k, v in diffs.items()))
    assert set(diffs) == {("7B", 2, 1), ("7B", 1, 2), ("7B", 2, 2), ("tied", 1, 1), ("tied", 1, 2)}, diffs
    assert max(diffs.values()) < TOL, diffs


def test_qwen3_vl_spec_of_the_published_config(qwen3):
    """What the spec reads from the hub's Qwen3-VL-8B config (shrunk): the Qwen3 LM (q/k norms, no biases), the
    interleaved M-RoPE sections, the ViT's learned position table and DeepStack taps, no windows, the image token."""
    s = VLMSpec.from_hf_dir(qwen3[0])
    assert (s.arch, s.text_family, s.vision_family, s.qkv_bias, s.qk_layernorm, s.tie_word_embeddings) == \
        ("qwen3_vl", "qwen3", "qwen3_vit", False, True, False)
    assert (s.mrope_section, s.mrope_interleaved, s.deepstack_visual_indexes, s.vision_num_position_embeddings) == \
        ([6, 5, 5], True, [0, 1, 2], 2304)
    assert (s.window_size, s.fullatt_block_indexes, s.patch_size, s.vision_activation, s.vision_normalization) == \
        (None, None, 16, "gelu_pytorch_tanh", "LayerNorm")
    assert (s.image_token, s.image_token_id, s.vocab_size, s.rotary_base, s.deepstack_layers) == \
        ("<|image_pad|>", 151655, 151936, 5e6, 3)
    assert "model.visual.deepstack_merger_list.2.norm.bias" in HFReader(qwen3[0]).names()


@pytest.mark.slow
def test_qwen3_vl_logits_match_hf_at_every_layout(qwen3, world):
    """Qwen3-VL: ``hf_to_megatron --verify`` at TP1, and TP2, PP2 and TP2 x PP2 from that checkpoint, within 1e-4 of
    HF's own ``Qwen3VLForConditionalGeneration``; the controls (no DeepStack features, megatron-core's block layout of
    M-RoPE instead of the interleaved one, 1-D positions) differ far beyond it, so the comparison sees each."""
    diffs = {k[1:]: v for k, v in world.items() if k[0] == "qwen3"}
    print(f"\nQwen3-VL: max |logit diff| vs HF: TP1 (--verify) {qwen3[2]:.2g}; " +
          ", ".join(f"{k}: {v:.2g}" for k, v in diffs.items()))
    assert qwen3[2] < TOL
    assert max(diffs[(tp, pp, None)] for tp, pp in ((2, 1), (1, 2), (2, 2))) < TOL, diffs
    assert min(diffs[(1, 1, c)] for c in ("no_deepstack", "sectioned", "flat")) > 100 * TOL, diffs


def test_qwen3_vl_pp_split_without_the_deepstack_layers_first_is_refused(qwen3, tmp_path, capsys):
    """A pipeline split that leaves a DeepStack layer off the first stage is refused by ``hf_to_megatron`` before it
    writes anything; its training and evaluation pass the spec's check."""
    from megatron_vlm.cli import run_cli

    out = tmp_path / "meg"
    rc = run_cli(script("convert/hf_to_megatron.py").main,
                 ["--hf-dir", str(qwen3[0]), "--megatron-dir", str(out), "--pp", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "pp=3 puts 2 language layers on the first stage" in err[0] and \
        "DeepStack" in err[0], err
    assert not out.exists()
    spec = VLMSpec.from_hf_dir(qwen3[0])
    spec.check_supported("training")
    spec.check_supported("evaluation (eval/generate.py, eval/evaluate.py)")


@pytest.mark.slow
def test_qwen3_vl_round_trip_is_byte_identical(qwen3, tmp_path):
    """Qwen3-VL HF -> Megatron -> HF: every tensor byte for byte with its dtype and hub name (the position table,
    each DeepStack merger), from the TP1 torch_dist checkpoint and from legacy rank files at TP2 x PP2."""
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    assert_same_bytes(qwen3[0], convert_megatron_to_hf(qwen3[1], tmp_path / "hf"))
    legacy = convert_hf_to_megatron(qwen3[0], tmp_path / "legacy", ckpt_format="torch", tp=2, pp=2)
    out = convert_megatron_to_hf(legacy, tmp_path / "hf_legacy")
    assert_same_bytes(qwen3[0], out)
    a, b = (json.loads((d / "config.json").read_text()) for d in (qwen3[0], out))
    assert a["vision_config"]["deepstack_visual_indexes"] == b["vision_config"]["deepstack_visual_indexes"]
    back, there = VLMSpec.from_hf_dir(out), VLMSpec.from_hf_dir(qwen3[0])
    assert (back.mrope_section, back.mrope_interleaved) == (there.mrope_section, True)


@pytest.mark.slow
def test_controls_flat_positions_and_no_windows_fail(world):
    """The comparison sees M-RoPE and the windows: 1-D positions, or full attention in every ViT layer, differ from HF
    far beyond the tolerance."""
    flat, full = world[("7B", 1, 1, "flat")], world[("7B", 1, 1, "no_windows")]
    print(f"\nQwen2.5-VL controls: 1-D positions {flat:.2g}, no windows {full:.2g}")
    assert flat > 100 * TOL and full > 100 * TOL


@pytest.mark.slow
def test_round_trip_is_byte_identical(model, converted, tied, tmp_path):
    """HF -> Megatron -> HF: every tensor byte for byte with its dtype, under the hub's names, from the TP1 torch_dist
    checkpoint and from legacy rank files at TP2 x PP2, and the tied model (no ``lm_head`` written back); the config
    keeps the fields that decide the model."""
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    out = convert_megatron_to_hf(converted[0], tmp_path / "hf")
    assert_same_bytes(model, out)
    a, b = (json.loads((d / "config.json").read_text()) for d in (model, out))
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "tie_word_embeddings"):
        assert a[k] == b[k], k
    assert b["vision_config"]["fullatt_block_indexes"] == [1, 3]
    assert VLMSpec.from_hf_dir(out).mrope_section == VLMSpec.from_hf_dir(model).mrope_section
    for f in ("tokenizer_config.json", "preprocessor_config.json", "chat_template.json"):
        assert (out / f).read_bytes() == (model / f).read_bytes(), f
    legacy = convert_hf_to_megatron(model, tmp_path / "legacy", ckpt_format="torch", tp=2, pp=2)
    assert_same_bytes(model, convert_megatron_to_hf(legacy, tmp_path / "hf_legacy"))
    tied_out = convert_megatron_to_hf(tied[1], tmp_path / "hf_tied")
    assert_same_bytes(tied[0], tied_out)
    assert "lm_head.weight" not in HFReader(tied_out).names()
    assert json.loads((tied_out / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("model_type,name", [("qwen3_vl_moe", "Qwen3-VL-MoE"), ("qwen2_vl", "Qwen2-VL")])
def test_other_qwen_vl_families_are_refused_in_one_line(model_type, name, tmp_path, capsys):
    """``hf_to_megatron`` refuses the Qwen-VL families it does not convert yet, naming them, and writes nothing."""
    from megatron_vlm.cli import run_cli

    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": model_type}))
    out = tmp_path / "meg"
    rc = run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(src), "--megatron-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"{name} (model_type '{model_type}') is not supported yet" in err[0], err
    assert not out.exists()


@pytest.mark.slow
def test_what_its_training_does_not_do_yet_is_refused_in_one_line(model, converted, tmp_path, capsys):
    """``train/run.py`` with a Qwen2.5-VL checkpoint and an option its training does not do yet (sequence parallelism,
    recomputation, Transformer Engine layers: CUDA's default) stops before anything is written, with one line naming the
    option and the fix; the LLaVA task encoder refuses the model's directory (its own encoder is the Qwen one)."""
    from megatron_vlm.data.task_encoder import VLMTaskEncoder
    from megatron_vlm.launch import cli
    from megatron_vlm.model.spec import UnsupportedArchitectureError

    from .launch_helpers import REPO, base_args

    for extra, want in ((["-g", "2", "--tp", "2", "--sequence-parallel"], "--sequence-parallel with Qwen2.5-VL is "
                                                                          "not supported yet (" + str(converted[0])),
                        (["--recompute-granularity", "full"], "--recompute-granularity full with Qwen2.5-VL is not "
                                                              "supported yet"),
                        (["--device", "cuda"], "Transformer Engine layers with Qwen2.5-VL")):
        rc = cli.main([*base_args(tmp_path, ids=False), "--megatron-load-dir", str(converted[0]), *extra,
                       "--dry-run"], repo_root=REPO)  # the last --device wins
        err = [line for line in capsys.readouterr().err.strip().splitlines() if "Qwen2.5-VL" in line]
        assert rc == 2 and len(err) == 1 and want in err[0], (extra, err)
        assert not (tmp_path / "out").exists()
    with pytest.raises(UnsupportedArchitectureError) as e:
        VLMTaskEncoder(model, 256)
    assert "\n" not in str(e.value) and "the data pipeline (task encoder: images, videos, chat template) of " \
        "Qwen2.5-VL (model_type 'qwen2_5_vl') is not supported yet" in str(e.value)


@pytest.mark.slow
def test_media_tokens_without_their_pixels_are_refused_by_the_model(converted):
    """Image or video tokens in the tokens but no pixels, or a stray input: refused in one line."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.runtime.session import single_process_world
    from tests.support.worlds import _model_for

    with single_process_world():
        model = _model_for(ckpt.resolve_iteration_dir(converted[0]), 1, 1, 64)
        ids = torch.tensor([[1, 2, 151656, 3]])  # <|video_pad|>
        positions = torch.arange(4)[None, None].expand(3, 1, 4)
        with pytest.raises(ValueError) as e:
            model(input_ids=ids, position_ids=positions)
        assert "\n" not in str(e.value) and "image/video tokens but no images or videos" in str(e.value), str(e.value)
        with pytest.raises(TypeError) as e:
            model(input_ids=ids, position_ids=positions, pixel_values_videos=torch.zeros(4, 8))
        assert "unexpected inputs ['pixel_values_videos']" in str(e.value), str(e.value)


def test_megatron_mrope_equals_hf_rotary(model):
    """megatron-core's ``MultimodalRotaryEmbedding`` (``GPTModel``'s ``mrope``) gives HF's ``Qwen2_5_VLRotaryEmbedding``
    angles at the reference batch's 3-D positions (transformers' ``get_rope_index``), section by section; 1-D positions
    give others."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    from megatron_vlm.convert.verify import reference_batch
    from megatron_vlm.runtime.session import single_process_world

    spec = VLMSpec.from_hf_dir(model)
    batch = reference_batch(spec)
    hf = Qwen2_5_VLRotaryEmbedding(AutoConfig.from_pretrained(str(model)).text_config)
    x = torch.zeros(1, dtype=torch.float32)
    with single_process_world():
        mrope = MultimodalRotaryEmbedding(kv_channels=spec.kv_channels, rotary_percent=1.0,
                                          rotary_base=spec.rotary_base)
        for positions, same in ((batch.position_ids, True), (batch.flat_positions().position_ids, False)):
            emb = mrope(positions, spec.mrope_section).float().cpu()  # [s, b, 1, head dim] angles
            cos, sin = hf(x, batch.position_ids)  # HF's at the 3-D positions, [b, s, head dim]
            mine = (emb.cos()[:, :, 0].transpose(0, 1), emb.sin()[:, :, 0].transpose(0, 1))
            diff = max((a - b).abs().max().item() for a, b in zip(mine, (cos, sin)))
            assert (diff < 1e-6) == same, diff


@pytest.mark.parametrize("edit,expect", [
    (dict(use_sliding_window=True), "use_sliding_window true is not supported"),
    (dict(rope_scaling={"type": "mrope", "mrope_section": [4, 6, 4]}), "mrope_section [4, 6, 4] must give 3 sections"),
    (dict(vision=dict(out_hidden_size=64)), "the vision out_hidden_size 64 differs from the language hidden_size 128"),
    (dict(vision=dict(window_size=14)), "vision window_size 14 is smaller than one merged patch (28 px)"),
    (dict(vision=dict(fullatt_block_indexes=[1, 7])), "fullatt_block_indexes [1, 7] are not layers of the 4-layer"),
])
def test_what_megatron_cannot_build_is_refused_in_one_line(edit, expect):
    """Settings of a Qwen2.5-VL config that this conversion cannot reproduce, one line each naming the setting."""
    from megatron_vlm.model.spec import UnsupportedArchitectureError
    from tests.support.qwen_vl_models import small_config

    cfg = small_config()
    vision = edit.pop("vision", None)
    cfg.update(edit)
    if vision:
        cfg["vision_config"] = dict(cfg["vision_config"], **vision)
    with pytest.raises(UnsupportedArchitectureError) as e:
        VLMSpec.from_hf(cfg)
    assert "\n" not in str(e.value) and expect in str(e.value), str(e.value)
    assert VLMSpec.from_hf(small_config()).arch == "qwen2_5_vl"  # the unedited config builds


def test_transformers_4_names_are_read_as_the_hub_names(model, tmp_path):
    """Checkpoints transformers 4.5x wrote (``model.language_model.*``, ``model.visual.*``) are read under the hub's
    names (``model.*``, ``visual.*``), which the rules use and the export writes."""
    import shutil

    from safetensors.torch import load_file, save_file

    old = tmp_path / "hf"
    shutil.copytree(model, old)
    w = load_file(str(old / "model.safetensors"))
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in w.items()}
    assert any(k.startswith("model.visual.") for k in renamed) and "lm_head.weight" in renamed
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    assert HFReader(old).names() == HFReader(model).names()


def test_weight_estimate_is_the_published_models_size():
    """The memory estimate (what ``--verify`` checks before it writes anything) counts the real Qwen2.5-VL-7B-Instruct
    as HF builds it from the hub's config: 8,292,166,656 parameters, the ViT and merger 676,550,144 of them; and the
    real Qwen3-VL-8B-Instruct (the ViT with its position table, the merger and three DeepStack mergers)."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from megatron_vlm.convert.verify import megatron_weight_bytes
    from megatron_vlm.model import memory
    from tests.support import hub
    from tests.support.qwen_vl_models import QWEN3_VL_8B, QWEN25_VL_7B

    cfg = AutoConfig.from_pretrained(str(hub.hub_model_dir(QWEN25_VL_7B)))
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(cfg)
    spec = VLMSpec.from_hf(cfg)
    total, visual = (sum(p.numel() for p in m.parameters()) for m in (hf, hf.model.visual))
    assert (total, visual) == (8_292_166_656, 676_550_144)
    assert megatron_weight_bytes(spec, 1, 1) == 4 * total
    assert memory.vision_params(spec, 1) + memory.projector_params(spec, 1) == visual

    cfg = AutoConfig.from_pretrained(str(hub.hub_model_dir(QWEN3_VL_8B)))
    with torch.device("meta"):
        hf = Qwen3VLForConditionalGeneration(cfg)
    spec = VLMSpec.from_hf(cfg)
    total, visual = (sum(p.numel() for p in m.parameters()) for m in (hf, hf.model.visual))
    print(f"\nQwen3-VL-8B-Instruct as HF builds it: {total:,} parameters, the ViT and mergers {visual:,}")
    assert megatron_weight_bytes(spec, 1, 1) == 4 * total
    assert memory.vision_params(spec, 1) + memory.projector_params(spec, 1) == visual


@pytest.mark.slow
def test_processor_inputs_match_hf(model, converted):
    """Inputs as Qwen2.5-VL's own ``AutoProcessor`` makes them (the hub's image processor and chat template; two
    images of different sizes in one prompt): the image-pad tokens per image and the token types are the reference
    batch's rule, and Megatron's logits at TP1 (positions from ``mrope_position_ids``) equal HF's (1e-4). The
    processor's video half needs torchvision (the 3.12 lane)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        not_here("Qwen2.5-VL's AutoProcessor needs torchvision (its video processor): the 3.11 lane's CPU torch has "
                 "none (the 3.12 lane runs this check)")
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.verify import load_hf_model
    from megatron_vlm.model.qwen_vl import mrope_position_ids
    from megatron_vlm.runtime.session import single_process_world
    from tests.support.worlds import _model_for

    spec = VLMSpec.from_hf_dir(model)
    processor = AutoProcessor.from_pretrained(str(model))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((150, 230), (90, 60))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"},
                                             {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    ids, grid = inputs["input_ids"], inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 10, 16], [1, 6, 4]]  # two sizes; the first spans 2 x 2 windows
    assert int((ids == spec.image_token_id).sum()) == int(grid.prod(-1).sum()) // spec.spatial_merge_size ** 2
    assert torch.equal((ids == spec.image_token_id).to(torch.int64), inputs["mm_token_type_ids"].to(torch.int64))
    with torch.no_grad():
        ref = load_hf_model(model)(**inputs).logits[0]
    positions = mrope_position_ids(spec.to_hf_config(), ids, grid, spec.image_token_id)
    with single_process_world(), torch.no_grad():
        meg = _model_for(ckpt.resolve_iteration_dir(converted[0]), 1, 1, ids.shape[1])
        out, _ = meg(images=inputs["pixel_values"], image_grid_thw=grid, input_ids=ids, position_ids=positions)
    diff = (ref - out[0, :, :spec.vocab_size]).abs().max().item()
    print(f"\nQwen2.5-VL: processor-made inputs, max |logit diff| at TP1 {diff:.2g}")
    assert diff < TOL


@pytest.mark.slow
def test_bf16_round_trip_through_the_commands(model, tmp_path):
    """The hub's dtype: a bf16 copy of the model through ``convert/hf_to_megatron.py --tp 2`` (legacy rank files) and
    ``convert/megatron_to_hf.py`` comes back byte for byte, every tensor bf16."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_vlm.cli import run_cli

    src = tmp_path / "bf16"
    shutil.copytree(model, src)
    w = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    meg, out = tmp_path / "meg", tmp_path / "out"
    to_megatron, to_hf = script("convert/hf_to_megatron.py").main, script("convert/megatron_to_hf.py").main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run_cli(to_megatron, ["--hf-dir", str(src), "--megatron-dir", str(meg), "--tp", "2",
                                     "--ckpt-format", "torch"]) == 0
        assert run_cli(to_hf, ["--megatron-dir", str(meg), "--hf-dir", str(out)]) == 0
    assert f"wrote HF Qwen2.5-VL model to {out}" in buf.getvalue()  # the family, not "LLaVA"
    assert_same_bytes(src, out)
    assert {HFReader(out).get(n).dtype for n in HFReader(out).names()} == {torch.bfloat16}


# ---- the trainer against HF --------------------------------------------------------------------------------------
RTOL = 1e-5  # the trainer's losses, first gradient norm and each tensor's gradient against HF's, relative
NORM_RTOL = 5e-5  # the gradient norm after an AdamW step (clipped at 1.0), relative
BF16_RTOL = 2e-2  # bf16 losses against HF's fp32 ones, relative
TRAIN = dict(stage=2, freeze_lm=False, freeze_vit=False)
#: job -> layout of the 4-process training world (the same global batches, the first step's gradients captured); the
#: model has 4 LM layers so that PP4 has middle stages
TRAIN_JOBS = {
    "tp2dp2": dict(tp=2, micro_batch_size=2),
    "pp2dp2": dict(pp=2, micro_batch_size=2),
    "tp2pp2-bf16": dict(tp=2, pp=2, micro_batch_size=2, precision="bf16", freeze_vit=None),  # stage 2's freezing
    "pp4": dict(pp=4, micro_batch_size=2),
    "pp2vpp2": dict(pp=2, num_layers_per_virtual_pipeline_stage=1, micro_batch_size=2),  # two chunks per stage
    # packed: each micro batch one pack of two samples, each with its own M-RoPE positions ('thd', per-sample attention)
    "packed-tp2dp2": dict(tp=2, micro_batch_size=1, pack=2, packing_buffer_size=8, packed_seq_length=128),
    # context parallelism: each row cut into 2 x 2 load-balanced chunks, its positions with it; packed, each sample
    # cut so (every sample padded to a multiple of 4) and the rotary taking the whole row's table (QwenMRoPE)
    "cp2dp2": dict(cp=2, micro_batch_size=2),
    "packed-tp2cp2": dict(tp=2, cp=2, micro_batch_size=1, pack=2, packing_buffer_size=8, packed_seq_length=128),
}
#: Qwen3-VL's jobs in the same world (its own model: DeepStack on the first three LM layers, the first stage of PP2)
QWEN3_TRAIN_JOBS = {
    "qwen3-tp2dp2": dict(tp=2, micro_batch_size=2),
    "qwen3-pp2dp2": dict(pp=2, micro_batch_size=2),
    "qwen3-tp2pp2-bf16": dict(tp=2, pp=2, micro_batch_size=2, precision="bf16", freeze_vit=None),  # stage 2's own
    # packed at TP2 x CP2: two samples a pack, each cut over the CP ranks, the DeepStack features added at the image
    # tokens of this rank's chunks
    "qwen3-packed-tp2cp2": dict(tp=2, cp=2, micro_batch_size=1, pack=2, packing_buffer_size=8, packed_seq_length=192),
}
#: jobs that run two steps (the second after an AdamW update; TP2 x DP2 saves after its first); the others run one
STEPS = {"tp2dp2": 2, "qwen3-tp2dp2": 2, "packed-tp2cp2": 2, "qwen3-packed-tp2cp2": 2}


@pytest.fixture(scope="module")
def train_model(tmp_path_factory):
    """The shrunk 7B config with 4 LM layers, converted at TP1; (HF dir, checkpoint dir)."""
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.qwen_vl_models import qwen_vl_hf_model

    root = tmp_path_factory.mktemp("qwen_vl_train")
    src = qwen_vl_hf_model(root / "hf", seed=5, num_hidden_layers=4)
    return src, convert_hf_to_megatron(src, root / "meg")


@pytest.fixture(scope="module")
def train_model3(tmp_path_factory):
    """The shrunk Qwen3-VL-8B config, converted at TP1; (HF dir, checkpoint dir)."""
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.qwen_vl_models import qwen3_vl_hf_model

    root = tmp_path_factory.mktemp("qwen3_vl_train")
    src = qwen3_vl_hf_model(root / "hf", seed=7)
    return src, convert_hf_to_megatron(src, root / "meg")


@pytest.fixture(scope="module")
def one_world(logit_jobs, train_model, train_model3):
    """The module's 4-process world: the logit jobs of :data:`JOBS4`, then every :data:`TRAIN_JOBS` job, stage 1's
    freezing, a save at TP2 x DP2 with its resume, and Qwen3-VL's :data:`QWEN3_TRAIN_JOBS`; (logit diffs, the
    training runs, the global batches of each model)."""
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import qwen_vl_models, worlds
    from tests.support.train_jobs import train_jobs, variable_length_batches

    src, meg = train_model
    src3, meg3 = train_model3
    # Qwen2.5-VL's global batches hold a video each (4 frames of a 7 fps and of a 10 fps clip: two temporal patches,
    # their M-RoPE time steps from each one's seconds per grid step): every job below trains on the first, whose
    # 0.36 s a step puts its second step at the first's time (HF's default of 1 s a step would put it 2 later)
    batches = variable_length_batches(src, 2, videos=1, first_clip=1)
    batches3 = variable_length_batches(src3, 2, videos=1)  # a video each too, its timestamps in the text
    saved = meg.parent / "saved"
    # TP2 x DP2 also saves after its first step, and the last job resumes from there
    jobs = [dict(name=job, steps=STEPS.get(job, 1), grads=True, **{**TRAIN, **layout}, **(
        dict(save=str(saved), save_after=1) if job == "tp2dp2" else {})) for job, layout in TRAIN_JOBS.items()]
    jobs += [dict(name="stage1", stage=1, freeze_vit=None, freeze_lm=None, steps=1, grads=True, micro_batch_size=2)]
    jobs += [dict(name="resume", start=1, steps=1, tp=2, resume=str(saved / "iter_0000001"), reset_data_position=True,
                  micro_batch_size=2, **TRAIN)]
    jobs += [dict(name=job, steps=STEPS.get(job, 1), grads=True, megatron_dir=str(meg3), hf_dir=str(src3),
                  batches=(str(src3), 2, False, 1, 1), **{**TRAIN, **layout})  # the ranks make batches3
             for job, layout in QWEN3_TRAIN_JOBS.items()]
    logits, runs = run_world(worlds.in_turn, 4, [(qwen_vl_models.logit_diffs, ([logit_jobs[k] for k in JOBS4],)),
                                                 (train_jobs, (jobs, str(meg), str(src), batches))])[0]
    return logits, runs, batches, batches3


@pytest.fixture(scope="module")
def trained(one_world, train_model, train_model3):
    """The training runs of :func:`one_world` by name, and HF's own numbers on the same batches (``"hf"``, Qwen3-VL's
    ``"hf3"``; ``"hf-1d"``: the 1-D positions control)."""
    from tests.support import hf_reference
    from tests.support.train_jobs import job_config

    (src, _), (src3, _) = train_model, train_model3
    _, runs, batches, batches3 = one_world
    out = {r["name"]: r for r in runs}
    cfg = job_config(TRAIN, 2, len(batches[0]))
    out["hf"] = hf_reference.train(src, batches, cfg, grads=True)
    out["hf3"] = hf_reference.train(src3, batches3, job_config(TRAIN, 2, len(batches3[0])), grads=True)
    # the control: HF without mm_token_type_ids falls back to 1-D positions (plain RoPE), silently
    with pytest.MonkeyPatch.context() as patch:
        full = hf_reference.qwen_vl_inputs
        patch.setattr(hf_reference, "qwen_vl_inputs", lambda sample, spec: {
            k: v for k, v in full(sample, spec).items() if k != "mm_token_type_ids"})
        out["hf-1d"] = hf_reference.train(src, batches, cfg, steps=1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("job", list(TRAIN_JOBS))
def test_trainer_equals_hf(job, trained, train_model):
    """Losses and gradient norms of each job's steps (two AdamW steps where :data:`STEPS` says so), and every trained
    tensor's gradient (ViT, patch merger, LM) of the first, against HF's own ``Qwen2_5_VLForConditionalGeneration``
    on the same batches (images of four sizes, HF computing its own M-RoPE positions); bf16 losses (stage 2's own
    freezing) within 2e-2 of HF's fp32 ones."""
    from tests.support import grad_reference

    r, ref = trained[job], trained["hf"]
    ref = dict(ref, loss=ref["loss"][:len(r["loss"])], grad_norm=ref["grad_norm"][:len(r["loss"])])  # its steps
    if TRAIN_JOBS[job].get("precision") == "bf16":
        rel = [grad_reference.relative(a, b) for a, b in zip(r["loss"], ref["loss"], strict=True)]
        print(f"\nQwen2.5-VL {job}: losses {r['loss']} (HF fp32 {ref['loss']})")
        assert max(rel) <= BF16_RTOL, (r["loss"], ref["loss"])
        return
    spec = VLMSpec.from_hf_dir(train_model[0])
    mine = grad_reference.assemble(r["grads"], spec, **r["layout"])
    diffs = grad_reference.compare(mine, ref["grads"])
    worst = max(diffs.items(), key=lambda kv: kv[1])
    print(f"\nQwen2.5-VL {job}: losses {r['loss']} (HF {ref['loss']}), grad norms {r['grad_norm']} "
          f"(HF {ref['grad_norm']}); {len(diffs)} gradients, worst {worst[0]}: {worst[1]:.2g}")
    assert any("visual.merger" in n for n in diffs) and any("visual.blocks.0." in n for n in diffs)
    grad_reference.assert_steps_match(r, ref, RTOL, NORM_RTOL)
    assert worst[1] <= RTOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("job", list(QWEN3_TRAIN_JOBS))
def test_qwen3_vl_trainer_equals_hf(job, trained, train_model3):
    """Qwen3-VL: losses and gradient norms (two AdamW steps at TP2 x DP2) and every tensor's gradient of the first
    step (ViT with its position table, the merger, each DeepStack merger, LM) against HF's own
    ``Qwen3VLForConditionalGeneration`` on the same batches; at PP2 the DeepStack layers are the first stage's; bf16
    losses at TP2 x PP2 (stage 2's own freezing) within 2e-2 of HF's fp32 ones."""
    from tests.support import grad_reference

    r, ref = trained[job], trained["hf3"]
    ref = dict(ref, loss=ref["loss"][:len(r["loss"])], grad_norm=ref["grad_norm"][:len(r["loss"])])
    if QWEN3_TRAIN_JOBS[job].get("precision") == "bf16":
        rel = [grad_reference.relative(a, b) for a, b in zip(r["loss"], ref["loss"], strict=True)]
        print(f"\nQwen3-VL {job}: losses {r['loss']} (HF fp32 {ref['loss']})")
        assert max(rel) <= BF16_RTOL, (r["loss"], ref["loss"])
        return
    mine = grad_reference.assemble(r["grads"], VLMSpec.from_hf_dir(train_model3[0]), **r["layout"])
    diffs = grad_reference.compare(mine, ref["grads"])
    worst = max(diffs.items(), key=lambda kv: kv[1])
    print(f"\nQwen3-VL {job}: losses {r['loss']} (HF {ref['loss']}), grad norms {r['grad_norm']} "
          f"(HF {ref['grad_norm']}); {len(diffs)} gradients, worst {worst[0]}: {worst[1]:.2g}")
    for part in ("visual.pos_embed", "visual.deepstack_merger_list.2.", "visual.merger", "visual.blocks.0."):
        assert any(n.startswith("model." + part) for n in diffs), part
    grad_reference.assert_steps_match(r, ref, RTOL, NORM_RTOL)
    assert worst[1] <= RTOL, worst


@pytest.mark.slow
def test_one_dimensional_positions_fail_the_comparison(trained):
    """The comparison sees M-RoPE: HF's own model given 1-D positions (no ``mm_token_type_ids``: plain RoPE) is far
    from the trainer's loss, which equals HF's with its 3-D positions within 1e-5."""
    from tests.support.grad_reference import relative

    mine, flat = trained["tp2dp2"]["loss"][0], trained["hf-1d"]["loss"][0]
    print(f"\nQwen2.5-VL control: the trainer's loss {mine}, HF's with 1-D positions {flat} "
          f"(rel {relative(mine, flat):.2g}), with M-RoPE {trained['hf']['loss'][0]}")
    assert relative(mine, flat) > 100 * RTOL


@pytest.mark.slow
def test_stages_train_what_they_say_and_a_save_resumes_bit_exactly(trained, train_model):
    """Stage 1 trains the patch merger only, stage 2 also the language model, ``--unfreeze-vit`` (the jobs above) also
    the ViT: the tensors with gradients of each. A resume from the iteration-1 checkpoint of a TP2 x DP2 run continues
    bit for bit: the same loss, gradient norm and weights."""
    from tests.support import grad_reference

    spec = VLMSpec.from_hf_dir(train_model[0])

    def parts(run):  # the parts of the HF tensors the run's gradients assemble into
        names = grad_reference.assemble(run["grads"], spec, **run["layout"])
        return {"merger" if n.startswith("visual.merger") else "vit" if n.startswith("visual.") else "lm"
                for n in names}

    assert parts(trained["stage1"]) == {"merger"} and parts(trained["tp2pp2-bf16"]) == {"merger", "lm"}
    assert parts(trained["tp2dp2"]) == {"merger", "vit", "lm"}
    r, resumed = trained["tp2dp2"], trained["resume"]
    assert resumed["loss"] == r["loss"][1:] and resumed["grad_norm"] == r["grad_norm"][1:], (resumed, r)
    assert resumed["weights"] == r["weights"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["Qwen2.5-VL", "Qwen3-VL"])
def test_eval_generate_equals_hf_generate(family, request):
    """``eval/generate.py``'s generator (the prompt encoded as training encodes samples, two prompts left-padded into
    one batch) gives, greedy, the tokens HF's own ``generate`` gives each prompt alone from the processor's inputs
    (``mm_token_type_ids`` included: M-RoPE); from the HF directory and from the Megatron checkpoint read in memory.
    Without ``mm_token_type_ids`` (the control) HF's model answers otherwise."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    from megatron_vlm.eval.generate import Generator, Sampling
    from megatron_vlm.eval.model import load
    from megatron_vlm.eval.prompts import user_message

    hf_dir, meg = request.getfixturevalue(E2E[family][0])
    images = [Image.new("RGB", size, colour) for size, colour in (((40, 30), (200, 30, 30)),
                                                                   ((400, 120), (20, 90, 200)))]  # 2 lengths
    question = "what colour is it ?"
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(hf_dir))
    template = json.loads((hf_dir / "chat_template.json").read_text())["chat_template"]
    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])

    def answer(row):  # the new tokens up to the first end token, as the generator cuts them
        return row[:next((i for i, t in enumerate(row) if t in stops), len(row))]

    want, flat = [], []
    for im in images:
        pixels = processor(images=[im], return_tensors="pt")
        text = tok.apply_chat_template([user_message(question, 1)], add_generation_prompt=True, tokenize=False,
                                       chat_template=template)
        ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * (int(pixels["image_grid_thw"].prod()) // 4)),
                  return_tensors="pt")["input_ids"]
        with torch.no_grad():
            for row, extra in ((want, dict(mm_token_type_ids=(ids == model.config.image_token_id).int())),
                               (flat, {})):
                if family == "Qwen3-VL" and not extra:
                    continue  # Qwen3-VL raises without them instead of falling back
                out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **extra, **pixels)
                row.append(answer(out[0, ids.shape[1]:].tolist()))
    for source in (dict(model_dir=hf_dir), dict(megatron_dir=meg)):
        gen = Generator(load(**source), Sampling(max_new_tokens=4))
        prompts = [gen.encode([user_message(question, 1)], [im]) for im in images]
        assert len(prompts[0].input_ids) != len(prompts[1].input_ids)  # left padding in the batch
        got = gen.generate_ids(prompts)
        print(f"\n{family} eval/generate ({next(iter(source))}): {got}; HF generate {want}; HF without "
              f"mm_token_type_ids {flat}")
        assert got == want, (got, want)
    assert all(want) and (family == "Qwen3-VL" or flat != want)


#: family -> (its training fixture, the export's class, tensors that train in stage 2 / that stay frozen)
E2E = {
    "Qwen2.5-VL": ("train_model", "Qwen2_5_VLForConditionalGeneration",
                   ("visual.merger.mlp.0.weight", "model.layers.0.mlp.up_proj.weight"),
                   "visual.blocks.0.attn.qkv.weight"),
    "Qwen3-VL": ("train_model3", "Qwen3VLForConditionalGeneration",
                 ("model.visual.deepstack_merger_list.0.linear_fc1.weight",
                  "model.language_model.layers.0.mlp.up_proj.weight"), "model.visual.blocks.0.attn.qkv.weight"),
}

#: the end-to-end training: TP2 x CP2 on 4 ranks, bf16, packs of up to 192 positions (each sample padded to 2 x CP)
E2E_TRAIN = ("-g", "4", "--tp", "2", "--cp", "2", "--precision", "bf16", "--seq-length", "96", "--micro-batch-size",
             "1", "--global-batch-size", "2", "--packing-buffer-size", "8", "--packed-seq-length", "192")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(E2E))
def test_convert_train_export_generate(family, request, tmp_path):
    """The user's commands on the shrunk 7B / 8B config: ``hf_to_megatron --tp 2``, ``make_wds`` and ``stats.py`` (whose
    image tokens are the image processor's merged patches of each image's size; the dataset holds two videos, their
    tokens those of the frames its video processor takes), ``train/run.py`` at TP2 x CP2, packed,
    in bf16 (:data:`E2E_TRAIN`; the loss logged every step falls below its start), ``megatron_to_hf`` (every tensor of
    the source, in bf16; the trained ones changed, the frozen ViT not), HF's ``AutoModelForImageTextToText`` generates
    from the export, and ``eval/evaluate.py`` scores it on the dataset's first samples."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    from megatron_vlm.cli import run_cli
    from tests.support import user_commands
    from tests.support.train_jobs import IMAGE_SIZES

    fixture, cls, trains, frozen = E2E[family]
    hf, meg, runs = request.getfixturevalue(fixture)[0], tmp_path / "meg", tmp_path / "runs"
    assert run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(hf), "--megatron-dir", str(meg),
                                                              "--tp", "2"]) == 0
    data, stats = user_commands.colour_dataset(tmp_path, IMAGE_SIZES, hf, videos=2)  # samples 7 and 15
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(hf))
    grids = [processor(images=[Image.open(tmp_path / "img" / f"{i}.png")], return_tensors="pt")["image_grid_thw"]
             for i in range(4)]
    # a clip's 8 frames over 2 s at --video-fps 1: 4 frames (the least), 2 temporal patches; its tokens (Qwen2.5-VL:
    # 2 x 4 x 6 patches merged 2 x 2, 12; Qwen3-VL: theirs and the timestamps' text), counted from the stored video's
    # size and frame rate, are those the trainer's encoder gives the video
    from megatron_vlm.data.anyres_encoder import task_encoder_for

    spec = VLMSpec.from_hf_dir(hf)
    plan = task_encoder_for(spec, hf, 96).video_plan((tmp_path / "img" / "7.mp4").read_bytes())
    assert len(plan["indices"]) == 4 and (family != "Qwen2.5-VL" or len(plan["ids"]) == 12), plan
    assert stats["images"] == 14 and stats["videos"] == 2 and stats["video_tokens"] == 2 * len(plan["ids"]), stats
    assert stats["image_tokens"] == sum(int(grids[i % 4].prod()) // 4 for i in range(16) if i % 8 != 7), stats
    losses = user_commands.train_losses(meg, hf, data, runs, "qwen", *E2E_TRAIN)
    print(f"\n{family} TP2 x CP2 bf16, packed: losses {losses}")
    assert len(losses) == 4 and min(losses[1:]) < losses[0], losses
    export = tmp_path / "export"
    assert run_cli(script("convert/megatron_to_hf.py").main, ["--megatron-dir", str(runs / "qwen"), "--hf-dir",
                                                              str(export)]) == 0
    a, b = HFReader(hf), HFReader(export)
    assert a.names() == b.names() and all(b.get(n).dtype == torch.bfloat16 for n in b.names())
    for name, changed in [(n, True) for n in trains] + [(frozen, False)]:
        assert torch.equal(a.get(name).to(torch.bfloat16), b.get(name)) is not changed, name
    model = AutoModelForImageTextToText.from_pretrained(str(export)).eval()
    tok = AutoTokenizer.from_pretrained(str(export))
    pixels = processor(images=[Image.open(tmp_path / "img" / "0.png").convert("RGB")], return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // 4
    template = json.loads((export / "chat_template.json").read_text())["chat_template"]
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it ?"}]}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False, chat_template=template)
    ids = tok(prompt.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                         max_new_tokens=4, do_sample=False, **pixels)
    print(f"{family} export ({type(model).__name__}) answers {tok.decode(out[0, ids.shape[1]:])!r}")
    assert type(model).__name__ == cls
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 4
    preds = tmp_path / "preds.jsonl"  # eval/evaluate.py scores the export on the dataset's first samples
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_cli(script("eval/evaluate.py").main, ["--model", str(export), "--data-path", str(data), "--split",
                                                         "train", "--limit", "4", "--batch-size", "2",
                                                         "--max-new-tokens", "4", "--output", str(preds),
                                                         "--no-progress"]) == 0
    lines = [json.loads(x) for x in preds.read_text().splitlines()]
    assert len(lines) == 4 and {x["reference"] for x in lines} <= set(user_commands.COLOURS), lines
