"""InternVL3 / InternVL3.5 (HF ``InternVLForConditionalGeneration``) through every command, held against HF.

Models: the published ``-HF`` checkpoints' configs shrunk in size only around Qwen's real tokenizer with InternVL's
tokens (:mod:`tests.support.internvl_models`): InternVL3.5-1B (Qwen3, tied), -8B (Qwen3, untied: the
checkpoint's own ``lm_head`` under a config whose top-level ``tie_word_embeddings`` defaults to True), -30B-A3B
(Qwen3-MoE), InternVL3-2B (Qwen2: q/k/v biases, 151,674 rows) and InternVL3.5-38B's InternViT-6B (RMSNorm, q/k
norms over all heads, no q/k/v bias).

- **Logits**: fp32 against HF's own model, ``hf_to_megatron --verify`` at TP1 (1e-5); TP2, PP2 and TP2 x PP2, and
  EP2 and TP2 x EP2 for the MoE model, in one 4-process world (1e-5); a reference whose layer scales are swapped,
  and one whose 6B q/k norms normalise each head alone, must not match (the controls).
- **Data as InternVL's processor makes it**: GotOcr2's dynamic tiles and their pixels equal HF's image processor's
  (PIL backend; both lanes); the expanded input ids of images (both tokenizer layouts) and of a video
  (``FrameN: <img>...</img>``) equal ``AutoProcessor``'s token for token, frame pixels its video processor's (where
  torchvision loads: the 3.12 lane); ``make_wds``'s three formats load packed, and ``stats.py`` counts the tokens the
  encoder makes.
- **The trainer against HF** (one 4-process world, the trainer's ``build_training``/``train_step``, every part
  trained, ViT included): the losses of two AdamW steps, the first gradient norm and every tensor's gradient of the
  first step equal HF's own ``InternVLForConditionalGeneration`` on the same global batches of multi-tile images
  (rel 1e-5; the second step's gradient norm 5e-5): the
  ViT-6B model at TP2 x DP2 and at PP2 x DP2, InternVL3.5-1B at TP2 x DP2 with a video sample in each batch, the MoE
  model at EP2 x DP2 (load-balancing loss off); with the distributed optimizer at TP2 x DP2 (losses and norms), resumed
  bit for bit from its checkpoint.
- **Build**: ``build_llava.py --arch internvl`` takes an InternVL checkpoint's InternViT (and its projector when the
  LM's width matches, else HF's initialisation) and any supported LM; the result converts with ``--verify`` and
  round-trips; stage 1 trains the projector only, stage 2 the LM too, ``--unfreeze-vit`` the ViT too.
- **End to end**: ``build_llava`` -> ``hf_to_megatron --tp 2`` -> ``make_wds`` (llava json, multi-tile images) ->
  ``stats.py`` -> ``train/run.py`` at TP2 in bf16, packed (stage 2) -> ``megatron_to_hf`` -> ``eval/generate.py`` and
  HF ``generate``, whose input ids and greedy tokens equal those of ``AutoProcessor``'s prompt (3.12 lane).
- **Round trips**: HF -> Megatron -> HF byte for byte with dtypes (torch_dist for every model; legacy rank files at
  TP2 x PP2 x EP2 for the MoE model and at TP2 for the 6B ViT, whose q/k norms are split with the heads).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.model.spec import VLMSpec
from tests.support.round_trip import assert_same_bytes

from .conftest import not_here, script
from .data_fixtures import chat_dataset, chat_inputs, llava_dataset, llava_inputs, vqa_dataset, vqa_inputs  # noqa: F401

TOL = 1e-5  # fp32 logits
RTOL = 1e-5  # the trainer's losses, first gradient norm and each tensor's gradient against HF's, relative
NORM_RTOL = 5e-5  # the gradient norm after an AdamW step (clipped at 1.0), relative
#: (tp, pp, ep) of the logits world per model (TP1 is --verify's)
LAYOUTS = {n: [(2, 1, 1), (1, 2, 1)] for n in ("InternVL3_5-1B-HF", "InternVL3_5-8B-HF", "InternVL3-2B-HF",
                                             "InternVL3_5-38B-HF")}
LAYOUTS["InternVL3_5-8B-HF"].append((2, 2, 1))
LAYOUTS["InternVL3_5-30B-A3B-HF"] = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)]
NAMES = ("InternVL3_5-1B-HF", "InternVL3_5-8B-HF", "InternVL3_5-30B-A3B-HF", "InternVL3-2B-HF", "InternVL3_5-38B-HF")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.support.internvl_models import internvl_hf_model

    root = tmp_path_factory.mktemp("internvl")
    return {name: internvl_hf_model(root / name, name, seed=i) for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    """Each model through ``hf_to_megatron --verify --tolerance 1e-5`` (TP1, torch_dist: it loads at any layout);
    {name: (checkpoint dir, the logit difference it printed)}."""
    from megatron_vlm.cli import run_cli

    root = tmp_path_factory.mktemp("internvl_meg")
    out = {}
    for name, src in models.items():
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = run_cli(script("convert/hf_to_megatron.py").main,
                         ["--hf-dir", str(src), "--megatron-dir", str(root / name), "--verify", "--tolerance", str(TOL)])
        assert rc == 0, buf.getvalue()
        diff = float(re.search(r"verify: max \|logit diff\| .* = (\S+) <=", buf.getvalue()).group(1))
        out[name] = (root / name, diff)
    return out


def _config(text=None, **top):
    from transformers import InternVLConfig

    from tests.support.internvl_models import QWEN3_06B, TEXT_SMALL, VIT_300M, VIT_SMALL

    vision = {**VIT_300M, **VIT_SMALL, **top.pop("vision", {})}
    return InternVLConfig(text_config=text or dict(QWEN3_06B, **TEXT_SMALL, head_dim=32), vision_config=vision,
                          image_token_id=151671, image_seq_length=top.pop("image_seq_length", 4), **top)


@pytest.mark.parametrize("edit,expect", [
    (dict(text=dict(model_type="gpt_oss", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, intermediate_size=64)),
     "language model type 'gpt_oss' is not supported; supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral"),
    (dict(downsample_ratio=0.25, image_seq_length=1), "downsample_ratio=0.25 is not supported"),
    (dict(vision_feature_select_strategy="full"), "vision_feature_select_strategy must be 'default'"),
    (dict(vision=dict(use_mean_pooling=False)), "use_mean_pooling=false puts a final LayerNorm on the last layer"),
    (dict(image_seq_length=256), "image_seq_length=256 but 4 x 4 patches pixel-shuffled give 4 tokens per tile"),
    (dict(vision=dict(image_size=[56, 42])), "vision image_size [56, 42] is not square"),
])
def test_what_megatron_cannot_build_is_refused_in_one_line(edit, expect):
    """InternVL3.5's GPT-OSS variant (its LM is not in the rule tables: attention sinks, biased MoE), other pixel
    shuffles, the CLS kept, a final ViT LayerNorm, a wrong token count and non-square tiles: one line each."""
    from megatron_vlm.model.spec import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError) as e:
        VLMSpec.from_hf(_config(**edit))
    assert "\n" not in str(e.value) and expect in str(e.value), str(e.value)
    assert VLMSpec.from_hf(_config()).arch == "internvl"  # the unedited config builds


def test_internvit_6b_at_its_real_size_takes_tp1_only():
    """InternViT-6B's 25 heads (not padded, as Megatron-LM's NVLM pads them to 32) split over 1 or 5 ranks, and an LM
    of 64 heads over neither 5: the published InternVL3.5-38B layout (Qwen3-32B's shape) takes --tp 1 only, and
    every other --tp is refused in one line naming that."""
    from megatron_vlm.model.spec import ParallelismError
    from tests.support.internvl_models import QWEN3_8B, VIT_6B

    qwen3_32b = dict(QWEN3_8B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64)
    spec = VLMSpec.from_hf(_config(text=qwen3_32b, vision={k: VIT_6B[k] for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "norm_type", "use_qk_norm", "attention_bias")}))
    assert (spec.vision_num_attention_heads, spec.num_attention_heads, spec.num_query_groups) == (25, 64, 8)
    assert spec.working_tps() == [1] and spec.check_parallelism(1, 2) == [32, 32]
    for tp, part in ((2, "num_attention_heads=25 of vision model (its 25 heads split over [1, 5, 25] ranks only"),
                     (4, "num_attention_heads=25 of vision model"), (5, "num_attention_heads=64 of language model"),
                     (8, "num_attention_heads=25 of vision model")):
        with pytest.raises(ParallelismError) as e:
            spec.check_parallelism(tp, 1)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"tp={tp} does not divide {part}") and \
            "; choose --tp from [1], the sizes every part of this model splits over" in line, line


@pytest.mark.slow
def test_specs_of_the_published_configs(models):
    """What the spec reads from each config: the InternViT variant, the pixel-shuffled tokens per tile, the image
    token of each tokenizer layout, and the tie that transformers 5 applies."""
    from transformers import AutoTokenizer

    s = {n: VLMSpec.from_hf_dir(models[n]) for n in NAMES}
    one = s["InternVL3_5-1B-HF"]
    assert (one.arch, one.vision_family, one.text_family, one.num_image_tokens, one.downsample_ratio) == \
        ("internvl", "internvit", "qwen3", 4, 0.5)
    assert (one.image_token, one.image_token_id, one.vocab_size, one.tie_word_embeddings) == \
        ("<IMG_CONTEXT>", 151671, 151936, True)
    assert (one.vision_normalization, one.vision_qkv_bias, one.vision_qk_layernorm, one.vision_norm_epsilon) == \
        ("LayerNorm", True, False, 1e-6)
    assert not s["InternVL3_5-8B-HF"].tie_word_embeddings  # top-level default True, text config False
    assert json.loads((models["InternVL3_5-8B-HF"] / "config.json").read_text()).get("tie_word_embeddings") is None
    assert "language_model.lm_head.weight" in HFReader(models["InternVL3_5-8B-HF"]).names()
    moe = s["InternVL3_5-30B-A3B-HF"]
    assert (moe.text_family, moe.num_moe_experts, moe.moe_router_topk, moe.moe_norm_topk_prob) == \
        ("qwen3_moe", 8, 2, True)
    v3 = s["InternVL3-2B-HF"]
    assert (v3.text_family, v3.qkv_bias, v3.image_token_id, v3.vocab_size, v3.tie_word_embeddings) == \
        ("qwen2", True, 151667, 151674, True)
    assert len(AutoTokenizer.from_pretrained(str(models["InternVL3-2B-HF"]))) == 151674
    six = s["InternVL3_5-38B-HF"]
    assert (six.vision_normalization, six.vision_qkv_bias, six.vision_qk_layernorm) == ("RMSNorm", False, True)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_verify_at_tp1(name, converted):
    """``hf_to_megatron --verify`` (fp32 logits of HF's own model against megatron-core's, TP1) within 1e-5."""
    diff = converted[name][1]
    print(f"\n{name}: --verify max |logit diff| at TP1 {diff:.2g}")
    assert diff < TOL


def test_logits_checks_hand_the_model_every_input_on_its_device(models):
    """The logits checks (``--verify``, ``bench/gpu.py``) give megatron-core's model its tile counts on the model's
    device, as the trainer does: megatron-core's LLaVA combines them with the embeddings there, and tile counts left
    on the CPU failed the InternVL row on an H200 ("found at least two devices, cuda:0 and cpu"). The meta device
    stands in for a GPU here."""
    from megatron_vlm.convert.verify import reference_batch

    def devices(b):
        return {k: v.device.type for k, v in b.forward_inputs("meta").items() if isinstance(v, torch.Tensor)}

    batch = reference_batch(VLMSpec.from_hf_dir(models[NAMES[0]]))
    # the whole batch, then each sample alone (as the bounded-memory --verify runs them)
    for where in [devices(batch)] + [devices(batch.sample(b)) for b in range(batch.num_samples)]:
        assert {"images", "input_ids", "num_image_tiles"} <= where.keys()
        assert where == dict.fromkeys(where, "meta")


def _reference_logits(hf_dir, spec, patch=None):
    from megatron_vlm.convert.verify import hf_logits, reference_batch

    batch = reference_batch(spec)
    with patch or _nothing():
        return batch, hf_logits(hf_dir, batch)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.mark.slow
def test_controls_layer_scales_and_cross_head_qk_norm(models, converted, tmp_path, monkeypatch):
    """The comparison sees InternViT's details: the converted 6B-ViT model against HF with lambda_1 and lambda_2
    swapped, and against HF whose q/k norms normalise each head alone (megatron-core's own ``qk_layernorm``), differs
    far beyond the tolerance."""
    from safetensors.torch import load_file, save_file
    from transformers.models.internvl import modeling_internvl

    from megatron_vlm.convert.verify import max_logit_diff, megatron_forward_logits
    from megatron_vlm.runtime.session import single_process_world
    from tests.support.worlds import _model_for

    name = "InternVL3_5-38B-HF"
    src, meg = models[name], converted[name][0]
    spec = VLMSpec.from_hf_dir(src)
    swapped = tmp_path / "swapped"
    shutil.copytree(src, swapped)
    w = load_file(str(swapped / "model.safetensors"))
    for k in [k for k in w if k.endswith("lambda_1")]:
        w[k], w[k.replace("lambda_1", "lambda_2")] = w[k.replace("lambda_1", "lambda_2")], w[k]
    save_file(w, str(swapped / "model.safetensors"), metadata={"format": "pt"})
    batch, ref = _reference_logits(src, spec)
    _, ref_swapped = _reference_logits(swapped, spec)
    real = modeling_internvl.InternVLVisionRMSNorm.forward
    heads = spec.vision_num_attention_heads

    def per_head(self, x):
        if not hasattr(self, "qk"):
            return real(self, x)
        h = x.reshape(*x.shape[:-1], heads, -1).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.reshape(x.shape).to(x.dtype)

    monkeypatch.setattr(modeling_internvl.InternVLVisionRMSNorm, "forward", per_head)
    orig_init = modeling_internvl.InternVLVisionAttention.__init__

    def mark(self, config):
        orig_init(self, config)
        for n in (self.q_norm, self.k_norm):
            n.qk = True

    monkeypatch.setattr(modeling_internvl.InternVLVisionAttention, "__init__", mark)
    _, ref_per_head = _reference_logits(src, spec)
    monkeypatch.undo()
    with single_process_world():
        from megatron_vlm.checkpoint import layout as ckpt

        model = _model_for(ckpt.resolve_iteration_dir(meg), 1, 1, batch.combined_length)
        got = megatron_forward_logits(model, batch)
    diffs = [max_logit_diff(r, got[:, :r.shape[1]], spec.vocab_size, batch) for r in (ref, ref_swapped, ref_per_head)]
    print(f"\n6B ViT: max |logit diff| vs HF {diffs[0]:.2g}; lambdas swapped {diffs[1]:.2g}; per-head q/k norm "
          f"{diffs[2]:.2g}")
    assert diffs[0] < TOL and diffs[1] > 100 * TOL and diffs[2] > 100 * TOL


@pytest.fixture(scope="module")
def world(models, converted, tmp_path_factory):
    """One 4-process world: every model at its :data:`LAYOUTS`; {(name, tp, pp, ep): max |logit diff| vs HF}."""
    from megatron_vlm.convert.verify import hf_logits, reference_batch
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import family_jobs, worlds

    root = tmp_path_factory.mktemp("internvl_refs")
    jobs, keys = [], []
    for name, layouts in LAYOUTS.items():
        spec = VLMSpec.from_hf_dir(models[name])
        batch = reference_batch(spec)
        ref = root / f"{name}.pt"
        torch.save(hf_logits(models[name], batch), ref)
        for tp, pp, ep in layouts:
            jobs.append({"megatron_dir": str(converted[name][0]), "tp": tp, "pp": pp, "ep": ep, "batch": batch,
                         "ref_file": str(ref), "vocab": spec.vocab_size})
            keys.append((name, tp, pp, ep))
    gen_jobs, want = _sharded_generation_jobs(models, converted)
    diffs, generated = run_world(worlds.in_turn, 4, [(family_jobs.logit_diffs, (jobs,)),
                                                     (worlds.sharded_generation, (gen_jobs,))])[0]
    return {"logits": dict(zip(keys, diffs)), "generated": (gen_jobs, generated, want)}


GENERATE = "InternVL3_5-8B-HF"  # the tiny random InternVL whose greedy tokens vary (others repeat one token)


def _sharded_generation_jobs(models, converted):
    """eval/generate.py --engine megatron's jobs for :data:`GENERATE` at TP2, PP2 and TP2 x PP2 (a wide image in
    several tiles + its thumbnail, and text only), and HF's greedy tokens of the same prompts."""
    from PIL import Image

    from megatron_vlm.eval.generate import Generator, Sampling
    from megatron_vlm.eval.model import load
    from megatron_vlm.eval.prompts import user_message

    prompts = [([user_message("what colour is it?", 1)], [Image.new("RGB", (120, 40), (220, 30, 30))]),
               ([user_message("hi", 0)], [])]
    gen = Generator(load(model_dir=models[GENERATE]), Sampling(max_new_tokens=8))
    want = [gen.generate_ids([gen.encode(m, ims)])[0] for m, ims in prompts]
    jobs = [dict(megatron_dir=str(converted[GENERATE][0]), tp=tp, pp=pp, prompts=prompts, max_new_tokens=8)
            for tp, pp in ((2, 1), (1, 2), (2, 2))]
    return jobs, want


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logits_match_hf_at_every_layout(name, world):
    diffs = {k[1:]: v for k, v in world["logits"].items() if k[0] == name}
    print(f"\n{name}: max |logit diff| vs HF per (TP, PP, EP): " + ", ".join(f"{k}: {v:.2g}" for k, v in diffs.items()))
    assert len(diffs) == len(LAYOUTS[name]) and max(diffs.values()) < TOL, diffs


@pytest.mark.slow
def test_sharded_generation_equals_hf(world):
    """megatron-core's inference engine on the sharded InternVL (eval/sharded.py, in the logits' world) gives HF's
    greedy tokens at TP2, PP2 and TP2 x PP2, for a prompt whose image is several tiles and a text-only one."""
    jobs, generated, want = world["generated"]
    assert all(len(set(ids)) > 1 for ids in want) and want[0] != want[1], want  # varied tokens: every step counts
    for job, ids in zip(jobs, generated):
        assert ids == want, (job["tp"], job["pp"])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_byte_identical(name, models, converted, tmp_path):
    """HF -> Megatron (TP1 torch_dist, as converted with --verify) -> HF: every tensor byte for byte and its dtype; the
    config keeps the published fields that decide the model (the tie, the tile, the image token); the processor files
    travel. The MoE model also at TP2 x PP2 x EP2 and the 6B ViT at TP2, in legacy rank files."""
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    src = models[name]
    out = convert_megatron_to_hf(converted[name][0], tmp_path / "hf")
    assert_same_bytes(src, out)
    a, b = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for k in ("image_token_id", "image_seq_length", "downsample_ratio", "vision_feature_layer"):
        assert a[k] == b[k], k
    assert a["text_config"]["tie_word_embeddings"] == b["text_config"]["tie_word_embeddings"]
    assert VLMSpec.from_hf_dir(out).tie_word_embeddings == VLMSpec.from_hf_dir(src).tie_word_embeddings
    for f in ("tokenizer_config.json", "preprocessor_config.json", "processor_config.json", "chat_template.jinja",
              "video_preprocessor_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    layout = {"InternVL3_5-30B-A3B-HF": dict(tp=2, pp=2, ep=2), "InternVL3_5-38B-HF": dict(tp=2)}.get(name)
    if layout:
        meg = convert_hf_to_megatron(src, tmp_path / "legacy", ckpt_format="torch", **layout)
        assert_same_bytes(src, convert_megatron_to_hf(meg, tmp_path / "hf_legacy"))


#: images (h, w) of the data tests: 3 x 4 tiles + thumbnail, 5 x 2 + thumbnail, one tile, 3 x 2 + thumbnail
SIZES = [(40, 30), (20, 52), (64, 64), (12, 18)]
TWO_IMAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in"}, {"type": "image"},
                                            {"type": "text", "text": " these?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "two pictures"}]}]
VIDEO = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "the colours change"}]}]


def _images(sizes):
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array

    return [Image.fromarray(image_array((h, w), i)) for i, (h, w) in enumerate(sizes)]


def _expanded(sample: dict, spec) -> list[int]:
    """The encoder's ids with each image token expanded to its tiles' tokens (HF's processor's ids)."""
    x = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
    tiles, out = iter(sample["num_image_tiles"].tolist()), []
    for t in x:
        out += [t] * (next(tiles) * spec.num_image_tokens) if t == spec.image_token_id else [t]
    return out


@pytest.mark.slow
def test_tiles_and_pixels_are_hf_image_processors(models):
    """Tiles per image as GotOcr2 chooses them (closest grid of 1..12 tiles, then a thumbnail) and their pixels equal
    HF's image processor's with ``crop_to_patches`` (PIL backend), in token order; frame pixels equal its resize of
    the decoded frames to one tile."""
    from transformers import GotOcr2ImageProcessorPil

    from megatron_vlm.data import videos as vid
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from tests.support.videos import make_video

    src = models["InternVL3_5-1B-HF"]
    spec = VLMSpec.from_hf_dir(src)
    enc = task_encoder_for(spec, src, 4096)
    ip = GotOcr2ImageProcessorPil.from_pretrained(str(src))
    images = _images(SIZES[:2])
    out = enc.encode_conversation(TWO_IMAGES, images)
    ref = ip(images=images, crop_to_patches=True, return_tensors="pt")
    assert out["num_image_tiles"].tolist() == ref["num_patches"].tolist() == [13, 11]
    assert torch.equal(out["images"], ref["pixel_values"])
    assert out["num_tokens"] == len(_expanded(out, spec)) - 1
    assert [enc.image_tiles(h, w) for h, w in SIZES] == [13, 11, 1, 7]
    video = make_video(12, 48, 32, fps=4)
    got = enc.encode_conversation(VIDEO, [], "v", [video])
    frames = vid.decode_frames(video, enc.frame_indices(video))
    assert got["num_image_tiles"].tolist() == [1] * frames.shape[0] == [1, 1, 1]
    want = torch.stack([ip(images=[f.permute(1, 2, 0).numpy()], return_tensors="pt")["pixel_values"][0]
                        for f in frames])
    assert torch.equal(got["images"], want)


@pytest.mark.slow
@pytest.mark.parametrize("name,video_token,takes_videos", [("InternVL3_5-1B-HF", "<video>", True),
                                                           ("InternVL3-2B-HF", "<|video_pad|>", False)])
def test_input_ids_equal_autoprocessors(name, video_token, takes_videos, models):
    """The encoder's ids, each image (frame) token expanded to its tokens, equal ``AutoProcessor``'s for two tiled
    images (the PIL pixels of its image processor equal too; its default torchvision backend within a level), and
    for a video: ``Frame1: <img>...</img>`` per frame, pixels within 1e-6 of its video processor's. InternVL3's
    tokenizer names Qwen2.5's ``<|video_pad|>`` as its video token, which its chat template does not write (it writes
    ``<video>``): HF's processor refuses such a video, and the encoder skips the sample saying why."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        not_here("HF's InternVLProcessor loads its video processor, which needs torchvision: the 3.11 lane's CPU "
                 "torch has none (tiles and pixels are checked in both lanes)")
    from megatron.energon import SkipSample
    from transformers import AutoProcessor, GotOcr2ImageProcessorPil

    from megatron_vlm.data import videos as vid
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from tests.support.videos import make_video

    src = models[name]
    spec = VLMSpec.from_hf_dir(src)
    enc = task_encoder_for(spec, src, 4096)
    proc = AutoProcessor.from_pretrained(str(src))
    images = _images(SIZES[:2])
    text = proc.apply_chat_template(TWO_IMAGES, tokenize=False)
    auto = proc(images=images, text=text, return_tensors="pt")
    proc.image_processor = GotOcr2ImageProcessorPil.from_pretrained(str(src))
    pil = proc(images=images, text=text, return_tensors="pt")
    out = enc.encode_conversation(TWO_IMAGES, images)
    assert _expanded(out, spec) == pil["input_ids"][0].tolist() == auto["input_ids"][0].tolist()
    assert torch.equal(out["images"], pil["pixel_values"])
    assert (out["images"] - auto["pixel_values"]).abs().max() < 0.05  # torchvision's resize: a level or so
    assert enc.chat.video == proc.video_token == video_token
    video = make_video(12, 48, 32, fps=4)
    frames = vid.decode_frames(video, enc.frame_indices(video)).permute(0, 2, 3, 1).numpy()
    text = proc.apply_chat_template(VIDEO, tokenize=False)
    assert (video_token in text) == takes_videos, text
    if takes_videos:
        got = enc.encode_conversation(VIDEO, [], "v", [video])
        hf = proc(videos=[frames], text=text, return_tensors="pt")
        assert _expanded(got, spec) == hf["input_ids"][0].tolist()
        assert proc.decode(hf["input_ids"][0]).count("Frame") == 3
        assert (got["images"] - hf["pixel_values"]).abs().max() < 1e-6
    else:  # InternVL3: HF refuses the video, and the encoder skips the sample
        with pytest.raises(ValueError, match=re.escape(f"Found total 0 {video_token} tokens and 1 videos")):
            proc(videos=[frames], text=text, return_tensors="pt")
        with pytest.raises(SkipSample):
            enc.encode_conversation(VIDEO, [], "v", [video])
        assert list(enc.skips.total) == ["0 image and 0 video parts but 0 images and 1 videos"], enc.skips.total


@pytest.mark.slow
def test_make_wds_formats_load_packed_and_stats_count_the_encoders_tokens(models, vqa_dataset, llava_dataset,
                                                                          chat_dataset):  # noqa: F811
    """Datasets written by ``make_wds`` in its three formats load through energon with InternVL's packing encoder
    (tiles in token order, ``cu_seqlens`` at the image-expanded sample boundaries), and ``stats.py``'s token count of
    each equals what the encoder makes of its samples."""
    from megatron_vlm.data.loader import build_eval_loader
    from megatron_vlm.data.packing import packing_task_encoder_for
    from megatron_vlm.data.sample import conversation_of
    from megatron_vlm.data.stats import dataset_stats

    src = models["InternVL3_5-1B-HF"]
    spec = VLMSpec.from_hf_dir(src)
    for ds in (vqa_dataset, llava_dataset, chat_dataset):
        enc = packing_task_encoder_for(spec, src, 512, 1024)
        stats = dataset_stats(ds.output, enc)["train"]
        packs = list(build_eval_loader(ds.output, enc, 1, 0, 1, 0, split="train", packing_buffer_size=8))
        samples = sum(int(b.num_samples) for b in packs)
        tokens = sum(int(b.num_tokens) for b in packs)
        for b in packs:
            assert b.images.shape[0] == int(b.num_image_tiles.sum())
            assert int(b.cu_seqlens[-1]) == 1024 and b.tokens.shape[1] - int((b.tokens == spec.image_token_id).sum()) \
                + int(b.num_image_tiles.sum()) * spec.num_image_tokens == 1024
        assert samples == stats["samples"] > 0, (ds.output, samples, stats)
        assert tokens + samples == stats["tokens"], (ds.output, tokens, stats)  # stats count each last token too
        assert stats["image_tokens"] % spec.num_image_tokens == 0 and stats["images"] > 0


@pytest.mark.te
@pytest.mark.slow
def test_transformer_engine_layers_load_the_converted_checkpoints(converted):
    """The GPU path's layers (Transformer Engine, built on CPU through the construction shim; no forward) at TP2:
    InternViT (300M and 6B: its q/k norm weights on the attention) and the projector's fused LayerNorm + linear load
    every tensor from the converted checkpoint, equal to the local layers' under the same sharded key."""
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import te_jobs

    from .conftest import require_te

    require_te()
    jobs = [{"name": n, "megatron_dir": str(converted[n][0]), "tp": 2, "pp": 1}
            for n in ("InternVL3_5-1B-HF", "InternVL3_5-38B-HF")]
    one = converted["InternVL3_5-1B-HF"][0]
    reports = run_world(te_jobs.run, 2, jobs, [], str(one), str(one))[0]
    for name in reports["layouts"]:
        for r in reports["layouts"][name]:
            c = r["compare"]
            assert c["tensors"] > 0 and (c["te_only_tensors"], c["local_only_tensors"], c["different"],
                                         c["dtypes_differ"], c["uncovered_params"]) == ([], [], [], [], []), (name, c)
            assert all(k.endswith("_extra_state") for k in r["keys_absent_from_checkpoint"]), (name, r)


# ---- the trainer against HF --------------------------------------------------------------------------------------
TRAIN = dict(stage=2, freeze_lm=False, freeze_vit=False, moe_aux_loss_coeff=0.0)
#: job -> (model, layout, batches with a video sample)
TRAIN_JOBS = {
    "6b-tp2dp2": ("InternVL3_5-38B-HF", dict(tp=2, micro_batch_size=2), False),
    "6b-pp2dp2": ("InternVL3_5-38B-HF", dict(pp=2, micro_batch_size=2), False),
    "1b-video-tp2dp2": ("InternVL3_5-1B-HF", dict(tp=2, micro_batch_size=2), True),
    # context parallelism (issue 49): each sequence, tiles and video frames expanded, split over two ranks
    # and the vision encoder's tiles shared out over the two CP ranks (--vision-cp-split, the default; issue 65)
    "1b-video-cp2dp2": ("InternVL3_5-1B-HF", dict(cp=2, micro_batch_size=2, count_vision_tiles=True), True),
    "moe-ep2dp2": ("InternVL3_5-30B-A3B-HF", dict(ep=2, micro_batch_size=2), False),
}


@pytest.fixture(scope="module")
def trained(models, converted):
    """Every :data:`TRAIN_JOBS` job in one 4-process world (two steps, the first step's gradients captured), and HF's
    numbers on the same batches."""
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import internvl_jobs
    from tests.support.train_jobs import job_config, train_jobs

    sets = {(m, video): internvl_jobs.global_batches(models[m], 2, video=video) for m, _, video in TRAIN_JOBS.values()}
    names = {key: f"{key[0]}{'-video' if key[1] else ''}" for key in sets}
    jobs = [dict(name=job, steps=2, grads=True, megatron_dir=str(converted[m][0]), hf_dir=str(models[m]),
                 batches=names[(m, video)], **TRAIN, **layout) for job, (m, layout, video) in TRAIN_JOBS.items()]
    one = "InternVL3_5-1B-HF"
    own = dict(megatron_dir=str(converted[one][0]), hf_dir=str(models[one]), batches=names[(one, True)],
               micro_batch_size=2)
    jobs += [dict(name=f"stage{st}", stage=st, freeze_vit=None, freeze_lm=None, steps=1, grads=True, **own)
             for st in (1, 2)]  # each stage's own freezing
    saved = converted[one][0].parent / "ivl-saved"
    jobs += [dict(name="distopt-save", steps=2, dist_optim=True, tp=2, save=str(saved), save_after=1, **TRAIN, **own),
             dict(name="distopt-resume", start=1, steps=1, dist_optim=True, tp=2, resume=str(saved / "iter_0000001"),
                  reset_data_position=True, **TRAIN, **own)]
    out = {r["name"]: r for r in run_world(train_jobs, 4, jobs, None, None,
                                           {names[k]: v for k, v in sets.items()})[0]}
    for key, batches in sets.items():
        out[names[key]] = internvl_jobs.hf_numbers(models[key[0]], batches, job_config(TRAIN, 2, len(batches[0])))
    out["names"] = names
    return out


@pytest.mark.slow
@pytest.mark.parametrize("job", list(TRAIN_JOBS))
def test_trainer_equals_hf(job, trained, models):
    """Losses and gradient norms of two AdamW steps, and every trained tensor's gradient (ViT, projector, LM; the
    layer scales, the 6B's q/k norms, the experts) of the first, against HF's on the same batches."""
    from tests.support import internvl_jobs

    name, layout, video = TRAIN_JOBS[job]
    r, ref = trained[job], trained[trained["names"][(name, video)]]
    spec = VLMSpec.from_hf_dir(models[name])
    mine = internvl_jobs.trainer_gradients(r, spec, layout)
    diffs = internvl_jobs.compare(mine, ref["grads"])
    # the key bias's gradient is zero in exact arithmetic (softmax ignores what it adds to every score of a query):
    # both sides' are rounding noise, held to be negligible instead of compared with each other
    total = sum(float(g.double().pow(2).sum()) for g in ref["grads"].values()) ** 0.5
    zero = [n for n in diffs if n.endswith("attention.k_proj.bias")]
    assert all(float(mine[n].norm()) < 1e-6 * total and float(ref["grads"][n].norm()) < 1e-6 * total for n in zero)
    worst = max(((n, d) for n, d in diffs.items() if n not in zero), key=lambda kv: kv[1])
    print(f"\n{job}: losses {r['loss']} (HF {ref['loss']}), grad norms {r['grad_norm']} (HF {ref['grad_norm']}); "
          f"{len(diffs)} gradients, worst {worst[0]}: {worst[1]:.2g}")
    # megatron-core sums the norm in fp32 per tensor (the 151,936-row output layer's): its first norm is within
    # 1e-5 of HF's double sum, later ones also carry that through the clipped updates (test_qwen3_train's bounds)
    internvl_jobs.assert_steps_match(r, ref, RTOL, NORM_RTOL)
    assert worst[1] <= RTOL, worst
    assert any(n.endswith("lambda_1") for n in diffs) and any("multi_modal_projector.layer_norm" in n for n in diffs)
    # every tensor HF trains is compared: grad_reference.compare fails naming any the trainer's side lacks
    live = [n for n in diffs if "vision_tower" in n and n not in zero]  # the ViT's gradients are no rounding noise
    assert min(float(ref["grads"][n].norm()) for n in live) > 1e-6 * total, \
        min((float(ref["grads"][n].norm()), n) for n in live)
    if spec.vision_qk_layernorm:
        assert any(n.endswith("attention.q_norm.weight") for n in diffs)
    if spec.is_moe:
        assert any(".mlp.experts.7.down_proj." in n for n in diffs)


@pytest.mark.slow
def test_context_parallel_ranks_share_the_tiles(trained):
    """At CP2 x DP2 (whose gradients, the trained InternViT's included, equal HF's above) each CP rank encodes half of
    each micro batch's tiles and video frames (one more on one rank where they are odd in number), not all of them."""
    seen = trained["1b-video-cp2dp2"]["vision_tiles"]  # every rank's tiles per encoder forward
    for a, b in ((0, 1), (2, 3)):  # the CP groups (megatron-core's tp-cp-ep-dp-pp order, TP 1)
        assert len(seen[a]) == len(seen[b]) > 0, seen
        assert all(abs(x - y) <= 1 and x + y > 2 for x, y in zip(seen[a], seen[b])), seen


@pytest.mark.slow
def test_distributed_optimizer_equals_hf_and_resumes_bit_exactly(trained):
    """InternVL3.5-1B at TP2 x DP2 with the distributed optimizer: the losses and gradient norms of HF's AdamW steps on
    the same batches, and a resume from its iteration-1 checkpoint continues bit for bit."""
    from tests.support import internvl_jobs

    r, ref = trained["distopt-save"], trained[trained["names"][("InternVL3_5-1B-HF", True)]]
    internvl_jobs.assert_steps_match(r, ref, RTOL, NORM_RTOL)
    resumed = trained["distopt-resume"]
    assert resumed["loss"] == r["loss"][1:] and resumed["grad_norm"] == r["grad_norm"][1:], (resumed, r)
    assert resumed["weights"] == r["weights"]


@pytest.mark.slow
def test_stages_train_what_they_say(trained):
    """Stage 1 trains the projector only (its LayerNorm included), stage 2 also the language model, and
    ``--unfreeze-vit`` (the jobs above) also InternViT: the parameters with gradients of each."""
    def parts(run):
        names = {n for _, g in run["grads"] for n in g}
        return {n.split(".")[0] for n in names}, names

    one, names = parts(trained["stage1"])
    assert one == {"vision_projection"} and any("layer_norm_weight" in n for n in names), one
    assert parts(trained["stage2"])[0] == {"vision_projection", "language_model"}
    assert parts(trained["1b-video-tp2dp2"])[0] == {"vision_projection", "language_model", "vision_model"}


@pytest.mark.slow
def test_build_llava_arch_internvl(models, tmp_path, capsys):
    """``build_llava.py --arch internvl`` with InternVL3.5-1B's vision side: a Qwen3 LM of its width gets its
    InternViT and projector as they are; a wider one (hidden 96) its InternViT and a projector initialised as HF
    initialises it; InternVL's tokens are the tokenizer's named ones and the chat template renders them as
    InternVL's does. The wider one converts with ``--verify`` (1e-5) and round-trips byte for byte."""
    from transformers import AutoTokenizer

    from megatron_vlm.cli import run_cli
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf
    from tests.support import hub_models

    src = models["InternVL3_5-1B-HF"]
    a = HFReader(src)
    for name, lm in (("same", hub_models.qwen3_text_model(tmp_path / "lm", tie_word_embeddings=False)),
                     ("wide", hub_models.qwen3_text_model(tmp_path / "lm96", hidden_size=96))):
        out = tmp_path / name
        assert run_cli(script("convert/build_llava.py").main, ["--arch", "internvl", "--text-model", str(lm),
                                                               "--vision-model", str(src), "--save-dir", str(out)]) == 0
        b, spec = HFReader(out), VLMSpec.from_hf_dir(out)
        assert (spec.arch, spec.image_token, spec.image_token_id, spec.num_image_tokens, spec.vision_feature_layer) \
            == ("internvl", "<IMG_CONTEXT>", 151671, 4, -1)
        assert all(torch.equal(a.get(n), b.get(n)) for n in a.names() if n.startswith("vision_tower."))
        proj = [n for n in a.names() if n.startswith("multi_modal_projector.")]
        tok = AutoTokenizer.from_pretrained(str(out))
        assert (tok.context_image_token, tok.start_image_token, tok.end_image_token, tok.video_token) == \
            ("<IMG_CONTEXT>", "<img>", "</img>", "<video>")
        text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                                     {"type": "text", "text": "hi"}]}], tokenize=False)
        assert "<IMG_CONTEXT>\n<video>\nhi" in text, text
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] == cfg["text_config"]["tie_word_embeddings"] == (name == "wide")
        if name == "same":
            assert all(torch.equal(a.get(n), b.get(n)) for n in proj)
            continue
        assert b.get("multi_modal_projector.linear_1.weight").shape == (96, 128)
        assert torch.equal(b.get("multi_modal_projector.layer_norm.weight"), torch.ones(128))  # HF's initialisation
        assert run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(out), "--megatron-dir",
                                                                  str(tmp_path / "meg"), "--verify", "--tolerance",
                                                                  str(TOL)]) == 0
        assert "verify: max |logit diff|" in capsys.readouterr().out
        assert_same_bytes(out, convert_megatron_to_hf(tmp_path / "meg", tmp_path / "back"))
    rc = run_cli(script("convert/build_llava.py").main, ["--arch", "internvl", "--text-model", str(lm),
                                                         "--vision-model", str(lm), "--save-dir", str(tmp_path / "bad")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "--arch internvl takes its vision side from an InternVL checkpoint" in line, line
    assert not (tmp_path / "bad").exists()


# ---- the user's commands -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_build_convert_train_export_generate(models, tmp_path, capsys):
    """An InternVL3.5 built from the 1B checkpoint's vision side and a Qwen3 LM goes through the user's commands: the
    loss of a packed bf16 TP2 run is logged and falls below its start, the export holds every tensor of the build
    (trained ones changed), and generation from it with the project's prompt equals HF's ``AutoProcessor`` prompt."""
    from PIL import Image

    from megatron_vlm.cli import run_cli
    from megatron_vlm.convert.verify import load_hf_model
    from tests.support import hub_models, user_commands

    lm = hub_models.qwen3_text_model(tmp_path / "lm", tie_word_embeddings=False)
    hf, meg, runs = tmp_path / "hf", tmp_path / "meg", tmp_path / "runs"
    assert run_cli(script("convert/build_llava.py").main, ["--arch", "internvl", "--text-model", str(lm),
                                                           "--vision-model", str(models["InternVL3_5-1B-HF"]),
                                                           "--save-dir", str(hf)]) == 0
    assert run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(hf), "--megatron-dir", str(meg),
                                                              "--tp", "2"]) == 0
    data, stats = user_commands.colour_dataset(tmp_path, SIZES, hf)
    assert stats["images"] == 16 and stats["image_tokens"] == 4 * 4 * (13 + 11 + 1 + 7), stats
    losses = user_commands.train_losses(meg, hf, data, runs, "ivl", "--tp", "2", "--precision", "bf16", "--seq-length",
                                        "96", "--packing-buffer-size", "8", "--packed-seq-length", "192",
                                        "--micro-batch-size", "1", "--global-batch-size", "2")
    print(f"\nInternVL TP2 bf16 packed: losses {losses}")
    assert len(losses) == 4 and min(losses[1:]) < losses[0], losses
    export = tmp_path / "export"
    assert run_cli(script("convert/megatron_to_hf.py").main, ["--megatron-dir", str(runs / "ivl"), "--hf-dir",
                                                              str(export)]) == 0
    a, b = HFReader(hf), HFReader(export)
    assert a.names() == b.names() and not torch.equal(a.get("multi_modal_projector.linear_1.weight").float(),
                                                      b.get("multi_modal_projector.linear_1.weight").float())
    frozen = b.get("vision_tower.encoder.layer.0.lambda_1")  # stage 2: the ViT stays as built (in the run's dtype)
    assert torch.equal(a.get("vision_tower.encoder.layer.0.lambda_1").to(frozen.dtype), frozen)
    image = tmp_path / "img" / "0.png"
    answers = []
    for source in (["--model", str(export)], ["--megatron-dir", str(runs / "ivl")]):  # the export; the run, in memory
        capsys.readouterr()
        assert run_cli(script("eval/generate.py").main, [*source, "--prompt", "what colour is it ?", "--image",
                                                         str(image), "--max-new-tokens", "4"]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1], answers
    from megatron_vlm.eval.prompts import PromptEncoder, collate, user_message

    spec = VLMSpec.from_hf_dir(export)
    enc = PromptEncoder(export, spec)
    messages = [user_message("what colour is it ?", images=1)]
    ours = collate([enc.encode(messages, [Image.open(image).convert("RGB")])], enc.pad_token_id, spec.arch)
    model = load_hf_model(export)
    gen = model.generate(**ours, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == ours["input_ids"].shape[1] + 4
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return  # HF's InternVL processor needs torchvision (the 3.12 lane compares with it)
    from transformers import AutoProcessor, GotOcr2ImageProcessorPil

    proc = AutoProcessor.from_pretrained(str(export))
    proc.image_processor = GotOcr2ImageProcessorPil.from_pretrained(str(export))
    theirs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    theirs = proc(images=[Image.open(image).convert("RGB")], text=theirs, return_tensors="pt")
    assert torch.equal(theirs["input_ids"], ours["input_ids"]) and torch.equal(theirs["pixel_values"],
                                                                              ours["pixel_values"])
    assert torch.equal(model.generate(**theirs, max_new_tokens=4, do_sample=False), gen)
