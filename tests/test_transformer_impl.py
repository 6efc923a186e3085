"""Layer implementation choice, checkpoints across local / Transformer Engine layers, FP8 recipes and padding.

Transformer Engine cannot run here (no CUDA), so the CPU tests check what it changes: the choice and its
messages, the checkpoint keys a TE model adds (``core_attention._extra_state``, TE norm names) through real
dist_checkpointing and load_state_dict, the recipe table against megatron-core's, and the padding arithmetic on
real batches. The tests marked ``gpu`` build real TE models (skipped without CUDA).
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from megatron_vlm.model import fp8, layer_impl
from megatron_vlm.data.task_encoder import VLMTaskEncoder, padded_text_length
from tests.data_fixtures import tiny_llava


# ---- the choice ----------------------------------------------------------------------------------------
def test_choose_implementation(monkeypatch):
    assert layer_impl.choose(None, "cpu")[0] == "local"
    assert layer_impl.choose("local", "cuda")[0] == "local"
    with pytest.raises(ValueError, match="needs a CUDA GPU; on --device cpu use --transformer-impl local"):
        layer_impl.choose("transformer_engine", "cpu")
    with pytest.raises(ValueError, match="--fp8 needs --transformer-impl transformer_engine"):
        layer_impl.choose("local", "cuda", fp8=True)
    monkeypatch.setattr(layer_impl, "te_status", lambda: (False, "ImportError: no TE"))
    impl, why = layer_impl.choose(None, "cuda")
    assert impl == "local" and "does not import (ImportError: no TE)" in why
    with pytest.raises(ValueError, match="--fp8 needs Transformer Engine, which does not import here"):
        layer_impl.choose(None, "cuda", fp8=True)
    # CP on a GPU without TE: refused rather than the CPU reference attention silently; local layers asked for run it
    with pytest.raises(ValueError, match="--cp 2 on CUDA needs Transformer Engine's attention, and Transformer "
                                         "Engine does not import here \\(ImportError: no TE\\).*"
                                         "--transformer-impl local"):
        layer_impl.choose(None, "cuda", cp=2)
    assert layer_impl.choose("local", "cuda", cp=2)[0] == "local"
    monkeypatch.setattr(layer_impl, "te_status", lambda: (True, ""))
    assert layer_impl.choose(None, "cuda") == ("transformer_engine", "automatic: Transformer Engine imports on CUDA")
    assert layer_impl.choose(None, "cuda", cp=2)[0] == "transformer_engine"


def test_planned_attention_and_its_score_matrices():
    """The layers and attention the launcher plans for the memory estimate are the ones the ranks choose: score
    matrices are kept by megatron's local attention only (CPU, and CP's reference attention), not by TE's or sdpa."""
    plan = layer_impl.planned
    assert plan(None, None, "cuda", 1, True) == ("transformer_engine", "auto")
    assert plan(None, None, "cuda", 1, None) == ("transformer_engine", "auto")  # not asked: the GPU path
    assert plan(None, None, "cuda", 1, False) == ("local", "sdpa")
    assert plan("local", None, "cuda", 2, True) == ("local", "local")
    assert plan(None, None, "cpu", 1, None) == ("local", "local")
    assert plan(None, "sdpa", "cpu", 1, None) == ("local", "sdpa")
    no_scores = {args: layer_impl.keeps_no_scores(*plan(*args)) for args in [
        (None, None, "cuda", 1, True), (None, None, "cuda", 1, False), ("local", None, "cuda", 2, True),
        (None, None, "cpu", 1, None), (None, "sdpa", "cpu", 1, None)]}
    assert list(no_scores.values()) == [True, True, False, False, True], no_scores


def test_choose_attention_backend():
    """--attention-backend: megatron-core's AttnBackend names plus sdpa; auto by device and layers; every refusal
    one line naming the flag and the fix."""
    from megatron.core.transformer.enums import AttnBackend

    assert set(layer_impl.ATTENTION_BACKENDS) == {b.name for b in AttnBackend} | {"sdpa"}
    choose = layer_impl.choose_attention
    assert choose(None, "local", "cuda")[0] == "sdpa"  # the GPU path without Transformer Engine
    assert choose(None, "local", "cpu")[0] == "local"
    assert choose(None, "local", "cuda", cp=2)[0] == "local"  # CP's reference attention
    assert choose(None, "transformer_engine", "cuda")[0] == "auto"
    for b in ("flash", "fused", "unfused"):
        assert choose(b, "transformer_engine", "cuda")[0] == b
    assert choose("sdpa", "local", "cpu") == ("sdpa", "--attention-backend sdpa")
    for args, msg in [(("sdpa", "transformer_engine", "cuda"), "pass --transformer-impl local for sdpa"),
                      (("local", "transformer_engine", "cuda"), "use auto, flash, fused or unfused"),
                      (("flash", "local", "cuda"), "use --transformer-impl transformer_engine"),
                      (("sdpa", "local", "cuda", 2), "does not run context parallelism \\(--cp 2\\)"),
                      (("math", "local", "cuda"), "must be one of auto, flash")]:
        with pytest.raises(ValueError, match=msg) as e:
            choose(*args)
        assert "\n" not in str(e.value)


def test_sdpa_attention_in_the_layer_specs():
    """sdpa puts megatron_vlm's SDPAttention (megatron-core's DotProductAttention subclass) into the language and
    vision layer specs of local layers; local keeps megatron's DotProductAttention; CP keeps its own attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_vlm.model.build import layer_specs
    from megatron_vlm.model.cp_attention import ContextParallelAttention
    from megatron_vlm.model.sdpa_attention import SDPAttention

    def cores(specs):
        return [s.submodules.self_attention.submodules.core_attention for s in specs[:2]]

    assert issubclass(SDPAttention, DotProductAttention)
    assert cores(layer_specs(False, attention="sdpa")) == [SDPAttention, SDPAttention]
    assert cores(layer_specs(False, attention="local")) == [DotProductAttention, DotProductAttention]
    assert cores(layer_specs(False, cp=2, attention="local"))[0] is ContextParallelAttention


def test_te_attention_kernel_reaches_the_transformer_configs(hf_models):
    """With TE layers an explicit flash / fused / unfused goes to every TransformerConfig's attention_backend (megatron-
    core's language model sets TE's NVTE_*_ATTN switches from it); auto, and local layers, keep megatron's default."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_vlm.model.build import ModelOptions, language_config, vision_config
    from megatron_vlm.model.spec import VLMSpec

    spec = VLMSpec.from_hf_dir(hf_models["llama_clip"])
    for backend in ("flash", "fused", "unfused"):
        opts = ModelOptions(use_te=True, attention_backend=backend)
        assert language_config(spec, opts).attention_backend == vision_config(spec, opts).attention_backend == \
            AttnBackend[backend]
    for opts in (ModelOptions(use_te=True), ModelOptions(attention_backend="sdpa")):
        assert language_config(spec, opts).attention_backend == AttnBackend.auto


def test_config_flags():
    from megatron_vlm.training.config import ConfigError, TrainConfig

    req = ["--data-path", "/d", "--tokenizer-load-dir", "/t", "--init", "--train-iters", "2"]
    c = TrainConfig.from_args([*req, "--device", "cuda", "--fp8", "--fp8-recipe", "tensorwise", "--fp8-format", "e4m3"])
    assert (c.fp8_recipe, c.fp8_format, c.transformer_impl) == ("tensorwise", "e4m3", None)
    assert TrainConfig.from_args([*req, "--device", "cpu", "--attention-backend", "sdpa"]).attention_backend == "sdpa"
    for argv, msg in [
        (["--device", "cuda", "--fp8", "--seq-length", "1000"], "must be a multiple of 16, the token alignment of "
                                                                  "FP8 GEMMs; use --seq-length 1008"),
        (["--device", "cuda", "--fp8", "--fp8-recipe", "mxfp8", "--seq-length", "1040"], "multiple of 32"),
        (["--device", "cuda", "--fp8", "--transformer-impl", "local"], "--fp8 needs --transformer-impl "
                                                                        "transformer_engine"),
        (["--device", "cpu", "--transformer-impl", "transformer_engine"], "needs a CUDA GPU"),
        (["--device", "cpu", "--attention-backend", "flash"], "--attention-backend flash is a Transformer Engine"),
        (["--device", "cuda", "--transformer-impl", "transformer_engine", "--attention-backend", "sdpa"],
         "--attention-backend sdpa is the core attention of local layers"),
        (["--device", "cpu", "--attention-backend", "sdpa", "--cp", "2", "--seq-length", "64"],
         "--attention-backend sdpa does not run context parallelism"),
    ]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
            TrainConfig.from_args([*req, *argv])


# ---- FP8 recipes ------------------------------------------------------------------------------------------
def test_fp8_recipes_against_gpus():
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    for name in fp8.RECIPES:  # the names and alignments are megatron-core's own
        assert fp8.align_size(name) == get_fp8_align_size(Fp8Recipe(name))
    assert fp8.runnable((9, 0), "13.0") == ["delayed", "tensorwise", "blockwise"]  # H100 / H200
    assert fp8.runnable((9, 0), "12.8") == ["delayed", "tensorwise"]  # blockwise needs CUDA 12.9
    assert fp8.runnable((8, 9)) == ["delayed", "tensorwise"]  # Ada
    assert fp8.runnable((10, 0)) == list(fp8.RECIPES)  # B200
    assert fp8.runnable((12, 0)) == ["delayed", "tensorwise", "blockwise"]  # RTX 50: no MXFP8 GEMMs yet
    assert fp8.runnable((8, 0)) == []  # A100
    msg = fp8.recipe_problem("mxfp8", (9, 0), "13.0", gpu="GPU 0 (H100)")
    assert msg == ("--fp8-recipe mxfp8 needs compute capability 10.x or 11.x (Blackwell data-centre GPUs); GPU 0 "
                   "(H100) is sm_90, CUDA 13.0: use --fp8-recipe delayed or tensorwise or blockwise")
    assert fp8.recipe_problem("delayed", (8, 0)).endswith("is sm_80: drop --fp8")


# ---- padding for FP8 --------------------------------------------------------------------------------------
def test_padded_text_length_arithmetic():
    # LLaVA expands row b to columns + extra_b positions and pads to the longest row.
    assert padded_text_length([10, 7], [575, 0], None) == 10
    assert padded_text_length([10, 7], [575, 0], 16) == 17  # 10 + 575 = 585 -> 592 = 17 + 575
    assert padded_text_length([10, 30], [575, 0], 32) == 33  # 30 + 575 = 605 -> 608 = 33 + 575
    assert padded_text_length([10, 7], [0, 0], 16) == 16
    assert padded_text_length([32, 5], [0, 0], 16) == 32  # aligned already


def test_batch_pads_image_expanded_length(tmp_path_factory):
    from tests.conversation_helpers import CONVERSATIONS, pil

    hf = tiny_llava(tmp_path_factory, "llama", "clip")
    plain = VLMTaskEncoder(hf, seq_length=256)
    padded = VLMTaskEncoder(hf, seq_length=256, pad_to_multiple_of=16)
    k = plain.tokens_per_image
    samples = []
    for i, name in enumerate(("vqa", "two_images", "text_only")):
        messages, n = CONVERSATIONS[name]
        samples.append(plain.encode_conversation(messages, [pil(i + j) for j in range(n)]))
    extra = max(s["num_tokens"] - len(s["tokens"]) for s in samples)
    assert extra == 2 * (k - 1)  # the two-image sample

    def batch(enc):
        from megatron_vlm.data.task_encoder import VLMSample

        objs = [VLMSample(__key__=f"s{i}", __restore_key__=(), __subflavors__={}, **s) for i, s in enumerate(samples)]
        return enc.batch(objs)

    a, b = batch(plain), batch(padded)
    longest = max(len(s["tokens"]) for s in samples)
    assert a.tokens.shape[1] == longest
    combined = b.tokens.shape[1] + extra  # what LLaVAModel hands the language model
    assert combined % 16 == 0 and longest + extra <= combined < longest + extra + 16
    assert torch.equal(b.tokens[:, :longest], a.tokens) and torch.equal(b.labels[:, :longest], a.labels)
    assert (b.tokens[:, longest:] == padded.pad_token_id).all() and (b.loss_mask[:, longest:] == 0).all()
    assert b.num_tokens == a.num_tokens and torch.equal(b.images, a.images)


# ---- checkpoints across implementations ------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_world(tmp_path_factory):
    """A one-process world, a checkpoint converted from HF (torch_dist, local layers) and a model loaded from it."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.model.spec import VLMSpec

    hf = tiny_llava(tmp_path_factory, "llama", "clip")
    meg = convert_hf_to_megatron(hf, tmp_path_factory.mktemp("impl") / "local")
    iter_dir = meg / "release"
    spec = VLMSpec.load(iter_dir)
    with single_process_world("cpu"):
        def build():
            return build_model(spec, ModelOptions(seq_length=64, perform_initialization=False))

        model = build()
        ckpt.load_model_weights(model, iter_dir)
        yield dict(iter_dir=iter_dir, build=build, model=model)


TE_ONLY = ("core_attention._extra_state",)  # what TE layers add over the local ones


def _with_te_entries(sharded: dict) -> tuple[dict, dict[str, str]]:
    """``sharded`` plus the ``core_attention._extra_state`` objects a TE model has (one per layer); returns
    them as {state dict name: checkpoint key}."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    added = {}
    for name, sh in list(sharded.items()):
        if isinstance(sh, ShardedObject) and sh.key.endswith("self_attention.linear_proj._extra_state"):
            new = name.replace("linear_proj._extra_state", TE_ONLY[0])
            key = sh.key.replace("linear_proj._extra_state", TE_ONLY[0])
            sharded[new] = dataclasses.replace(sh, key=key, data=io.BytesIO(b"fresh TE state"))
            added[new] = key
    return sharded, added


def test_local_checkpoint_loads_into_te_layout(local_world):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    iter_dir = local_world["iter_dir"]
    sharded, added = _with_te_entries(local_world["build"]().sharded_state_dict())
    assert len(added) == 4 and len(set(added.values())) == 2  # one object per layer, of the LM and the ViT
    assert sorted(layer_impl.prepare_dist_load(sharded, iter_dir)) == sorted(added.values())
    loaded = dist_checkpointing.load(sharded, str(iter_dir))
    for name in added:  # absent from the checkpoint: the module keeps its own state
        assert loaded[name].getvalue() == b"fresh TE state"
    want = local_world["model"].state_dict()
    tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    assert len(tensors) == sum(isinstance(v, torch.Tensor) for v in want.values())
    for k, v in tensors.items():
        assert torch.equal(v, want[k]), k
    # A real tensor that the checkpoint lacks is never skipped.
    sharded = local_world["build"]().sharded_state_dict()
    qkv = next(k for k, v in sharded.items() if isinstance(v, ShardedTensor) and k.endswith("linear_qkv.weight"))
    sharded["te_only.weight"] = dataclasses.replace(sharded[qkv], key="language_model.te_only.weight")
    with pytest.raises(layer_impl.CheckpointKeyError, match="lacks 1 tensor.*language_model.te_only.weight"):
        layer_impl.prepare_dist_load(sharded, iter_dir)


def test_te_checkpoint_loads_into_local_layers(local_world, tmp_path, caplog):
    from megatron.core import dist_checkpointing

    from megatron_vlm.checkpoint import layout as ckpt

    src = local_world["model"]
    te_dir = tmp_path / "release"
    te_dir.mkdir()
    sharded, added = _with_te_entries(src.sharded_state_dict())
    dist_checkpointing.save(sharded, str(te_dir))
    ckpt.copy_side_files(local_world["iter_dir"], te_dir)
    ckpt.CheckpointMeta.load(local_world["iter_dir"]).save(te_dir)
    assert set(added.values()) <= layer_impl.checkpoint_keys(te_dir)
    model = local_world["build"]()
    with caplog.at_level("WARNING"):
        ckpt.load_model_weights(model, te_dir)
    assert "does not load" not in caplog.text  # only _extra_state was left out
    got, want = model.state_dict(), src.state_dict()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k


def test_legacy_state_dict_between_layouts(local_world):
    model = local_world["build"]()
    local = {k: v for k, v in local_world["model"].state_dict().items()}
    te = {}
    for k, v in local.items():
        for old, new in layer_impl.LOCAL_TO_TE_KEYS.items():
            k = k.replace("." + old, "." + new)
        te[k] = v
    for k in [k for k in te if k.endswith("self_attention.linear_proj._extra_state")]:
        te[k.replace("linear_proj._extra_state", TE_ONLY[0])] = io.BytesIO(b"TE")
    assert any("linear_qkv.layer_norm_weight" in k for k in te) and set(te) != set(local)
    adapted = layer_impl.adapt_state_dict(te, model.state_dict())  # TE-written -> local model
    assert set(adapted) == set(local)
    model.load_state_dict(adapted, strict=True)
    for k, v in local.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(model.state_dict()[k], v), k
    back = layer_impl.adapt_state_dict(local, te)  # local-written -> TE layout: absent _extra_state kept
    assert set(back) == set(te) and back[next(k for k in te if TE_ONLY[0] in k)].getvalue() == b"TE"
    del te[next(k for k in te if k.endswith("linear_qkv.weight"))]  # a real tensor missing stays missing
    with pytest.raises(RuntimeError, match="Missing key.*linear_qkv.weight"):
        model.load_state_dict(layer_impl.adapt_state_dict(te, model.state_dict()), strict=True)


def test_local_layers_avoid_apex_layernorm_for_rmsnorm(local_world, monkeypatch):
    """With apex importable megatron-core's local spec and block pick FusedLayerNorm, which refuses RMSNorm."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.multimodal import llava_spec
    from megatron.core.transformer import transformer_block

    monkeypatch.setattr(llava_spec, "LNImpl", FusedLayerNorm)
    monkeypatch.setattr(transformer_block, "LayerNormImpl", FusedLayerNorm)
    lm = local_world["build"]().language_model
    norms = [m for m in lm.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert not any(isinstance(m, FusedLayerNorm) for m in lm.modules())
    assert len(norms) == 2 * lm.config.num_layers + 1  # input + pre-MLP per layer, and the final norm
    assert isinstance(lm.decoder.final_layernorm, torch.nn.RMSNorm)


# ---- on a GPU with Transformer Engine --------------------------------------------------------------------
@pytest.mark.gpu
def test_te_and_local_layers_agree_with_hf(tmp_path_factory):
    """Both implementations load the converted (local, no TE _extra_state) checkpoint and match HF in fp32."""
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.convert.verify import reference_batch
    from megatron_vlm.model.spec import VLMSpec

    from tests.conftest import script

    bench = script("bench/gpu.py")
    hf = tiny_llava(tmp_path_factory, "llama", "clip")
    meg = convert_hf_to_megatron(hf, tmp_path_factory.mktemp("gpu") / "m")
    bench._no_tf32()
    batch = reference_batch(VLMSpec.from_hf_dir(hf))
    ref = bench.hf_reference(hf, batch, torch.float32, "cuda")
    for impl in ("local", "transformer_engine"):
        got = bench.megatron_logits(meg, batch, impl, torch.float32, "cuda")
        assert (got - ref[..., : got.shape[-1]]).abs().max().item() <= bench.FP32_TOLERANCE, impl


@pytest.mark.gpu
def test_unsupported_recipe_is_refused_on_this_gpu():
    cap = torch.cuda.get_device_capability()
    bad = [r for r in fp8.RECIPES if fp8.recipe_problem(r, cap, torch.version.cuda)]
    for r in bad:
        with pytest.raises(ValueError, match=f"--fp8-recipe {r}"):
            fp8.check_recipe_runs(r)
    for r in fp8.runnable(cap, torch.version.cuda):
        fp8.check_recipe_runs(r)  # Transformer Engine agrees with the table


@pytest.mark.gpu
def test_te_written_checkpoint_loads_into_local_layers(tmp_path_factory, tmp_path):
    """Converted (local) -> TE model -> saved with TE's _extra_state -> local model: the same weights."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.model.spec import VLMSpec

    hf = tiny_llava(tmp_path_factory, "llama", "clip")
    src = convert_hf_to_megatron(hf, tmp_path / "local") / "release"
    spec = VLMSpec.load(src)
    with single_process_world("cuda"):
        def build(te):
            return build_model(spec, ModelOptions(seq_length=64, use_te=te, perform_initialization=False)).cuda()

        te = build(True)
        ckpt.load_model_weights(te, src)
        out = tmp_path / "te" / "release"
        ckpt.save_model_weights(te, out)
        ckpt.copy_side_files(src, out)
        ckpt.CheckpointMeta.load(src).save(out)
        assert any(k.endswith(TE_ONLY[0]) for k in layer_impl.checkpoint_keys(out))
        a, b = build(False), build(False)
        ckpt.load_model_weights(a, src)
        ckpt.load_model_weights(b, out)
        sa, sb = a.state_dict(), b.state_dict()
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(sb[k], v), k
