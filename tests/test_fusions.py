"""Kernel fusions (megatron_vlm.model.fusions): the defaults resolved per device and layer implementation, the
Megatron-LM flags, and the values the TransformerConfigs built by megatron_vlm.model.build receive. The kernels run on
CUDA only; bench/gpu.py measures them on a GPU (fusions on vs off)."""

from __future__ import annotations

import pytest

from megatron_vlm.model import fusions
from megatron_vlm.training.config import ConfigError, TrainConfig

AUTO = {f.name: None for f in fusions.FUSIONS}
EVERYTHING = dict(te=True, fused_weight_gradient_mlp_cuda=True, scaled_upper_triang_masked_softmax_cuda=True)
NOTHING = dict(te=False, fused_weight_gradient_mlp_cuda=False, scaled_upper_triang_masked_softmax_cuda=False)
REQ = ["--data-path", "/d", "--tokenizer-load-dir", "/t", "--init", "--train-iters", "2"]


def test_defaults_per_device_and_layers():
    te = fusions.resolve(AUTO, "cuda", "transformer_engine", EVERYTHING)
    assert all(te.values.values()), te.summary()  # CUDA + Transformer Engine: all on, as Megatron-LM
    cpu = fusions.resolve(AUTO, "cpu", "local")
    assert not any(cpu.values.values()) and all("CUDA only" in why for why in cpu.reasons.values())
    local = fusions.resolve(AUTO, "cuda", "local", NOTHING)  # CUDA, local layers, no apex / TE
    assert local.values == dict(gradient_accumulation_fusion=False, bias_activation_fusion=True,
                                bias_dropout_fusion=True, apply_rope_fusion=False, masked_softmax_fusion=False,
                                persist_layer_norm=False, cross_entropy_loss_fusion=True)
    assert "apex's fused_weight_gradient_mlp_cuda" in local.reasons["gradient_accumulation_fusion"]
    with_apex = fusions.resolve(AUTO, "cuda", "local", {**NOTHING, "fused_weight_gradient_mlp_cuda": True})
    assert with_apex.values["gradient_accumulation_fusion"] is True
    # an explicit switch wins where it can run; where it cannot, the error names the flag and the fix
    off = fusions.resolve({**AUTO, "gradient_accumulation_fusion": False}, "cuda", "transformer_engine", EVERYTHING)
    assert off.values["gradient_accumulation_fusion"] is False
    assert off.reasons["gradient_accumulation_fusion"] == "--no-gradient-accumulation-fusion"
    with pytest.raises(ValueError, match="--gradient-accumulation-fusion cannot run here: megatron's own linears .*"
                                         "need apex's fused_weight_gradient_mlp_cuda.*install apex"):
        fusions.resolve({**AUTO, "gradient_accumulation_fusion": True}, "cuda", "local", NOTHING)
    # with TE layers but without apex: TE's linears fuse it; the language model's output layer, megatron's
    # ColumnParallelLinear, refuses to build with it, so the TransformerConfigs get False (issue 63)
    no_apex = {**EVERYTHING, "fused_weight_gradient_mlp_cuda": False}
    for req in (AUTO, {**AUTO, "gradient_accumulation_fusion": True}):
        te_only = fusions.resolve(req, "cuda", "transformer_engine", no_apex)
        assert te_only.values["gradient_accumulation_fusion"] is True and te_only.te_linears_only
        assert "output layer" in te_only.reasons["gradient_accumulation_fusion"]
        assert not any(te_only.config_kwargs(p)["gradient_accumulation_fusion"] for p in fusions.PARTS)
    assert not te.te_linears_only and te.config_kwargs("language")["gradient_accumulation_fusion"]  # apex: all
    assert not fusions.resolve(AUTO, "cuda", "local", NOTHING).te_linears_only
    with pytest.raises(ValueError, match="--rope-fusion cannot run here: device cpu.*run on --device cuda"):
        fusions.resolve({**AUTO, "apply_rope_fusion": True}, "cpu", "local")
    assert "gradient_accumulation_fusion=on (automatic: apex fused_weight_gradient_mlp_cuda)" in te.summary()


def test_megatron_lm_flags():
    c = TrainConfig.from_args([*REQ, "--device", "cuda", "--no-bias-gelu-fusion", "--no-rope-fusion",
                               "--cross-entropy-loss-fusion", "--no-persist-layer-norm"])
    assert fusions.requested(c) == dict(AUTO, bias_activation_fusion=False, apply_rope_fusion=False,
                                        cross_entropy_loss_fusion=True, persist_layer_norm=False)
    c = TrainConfig.from_args([*REQ, "--device", "cuda", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
                               "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion"])
    assert [k for k, v in fusions.requested(c).items() if v is False] == [
        "gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion"]
    assert TrainConfig.from_dict({"apply_rope_fusion": "off"}).apply_rope_fusion is False  # YAML: field names
    with pytest.raises(ConfigError, match="--gradient-accumulation-fusion needs a CUDA GPU .* drop it for --device "
                                          "cpu"):
        TrainConfig.from_args([*REQ, "--device", "cpu", "--gradient-accumulation-fusion"])
    TrainConfig.from_args([*REQ, "--device", "cpu", "--no-gradient-accumulation-fusion"])  # off is always fine


def test_transformer_configs_receive_the_resolved_values(hf_models):
    from megatron_vlm.model.build import ModelOptions, language_config, projection_config, vision_config
    from megatron_vlm.model.spec import VLMSpec

    spec = VLMSpec.from_hf_dir(hf_models["llama_clip"])
    resolved = fusions.resolve(AUTO, "cuda", "local", {**EVERYTHING, "te": False})  # all but the rope fusion
    opts = ModelOptions(fusions=resolved)
    lang, vis, proj = language_config(spec, opts), vision_config(spec, opts), projection_config(spec, opts)
    for f in fusions.FUSIONS:
        assert getattr(lang, f.name) is resolved.values[f.name], f.name
    assert lang.gradient_accumulation_fusion and lang.bias_activation_fusion and lang.cross_entropy_loss_fusion
    for cfg in (vis, proj):  # GELU / quick-GELU are not fused; no RoPE; no loss
        assert cfg.gradient_accumulation_fusion and cfg.bias_dropout_fusion and cfg.masked_softmax_fusion
        assert not cfg.bias_activation_fusion and not cfg.apply_rope_fusion and not cfg.cross_entropy_loss_fusion
    # CPU defaults: nothing fused
    cpu = language_config(spec, ModelOptions(fusions=fusions.resolve(AUTO, "cpu", "local")))
    assert not any(getattr(cpu, f.name) for f in fusions.FUSIONS)
    # the CUDA + Transformer Engine resolution carries apply_rope_fusion into the language config: megatron-core
    # itself then asks for Transformer Engine (installed in the 3.12 lane only)
    from megatron_vlm.model.layer_impl import te_status

    te = fusions.resolve(AUTO, "cuda", "transformer_engine", EVERYTHING)
    if te_status()[0]:
        assert language_config(spec, ModelOptions(fusions=te)).apply_rope_fusion is True
    else:
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            language_config(spec, ModelOptions(fusions=te))
    assert vision_config(spec, ModelOptions(fusions=te)).persist_layer_norm is True


def test_startup_line_gives_each_reason_once():
    cpu = fusions.resolve(AUTO, "cpu", "local")
    assert cpu.summary() == "all off (automatic: device cpu: fused kernels run on CUDA only)"
    te = fusions.resolve({**AUTO, "persist_layer_norm": False}, "cuda", "transformer_engine", EVERYTHING)
    line = te.summary()
    assert line.count("(automatic: CUDA)") == 1 and "persist_layer_norm=off (--no-persist-layer-norm)" in line
    assert "bias_activation_fusion, bias_dropout_fusion, cross_entropy_loss_fusion=on (automatic: CUDA)" in line
