"""The default CUDA path (Transformer Engine layers) run on the CPU, with the real TE modules of the 3.12 lane.

TE's kernels need a GPU, so no forward runs here; everything before it does: building TE models for every
architecture at TP=1, TP=2 (with sequence parallelism) and PP=2, loading converted checkpoints into them
(compared with the local layers through megatron's sharded keys), saving from them and exporting that to HF,
the FP8 recipes, and the trainer's set-up (mixed precision, DDP, distributed optimizer). One 2-process world
(tests.support.te_jobs) runs every check; the tests below read its results.

Marked ``te``: skipped in the 3.11 lane (no TE there), failing in the 3.12 lane when TE does not import.
"""

from __future__ import annotations

import filecmp

import pytest
import torch

from tests.conftest import not_here, require_te

pytestmark = [pytest.mark.te, pytest.mark.slow]

ARCHS = ("llama_clip", "qwen2_siglip", "mistral_clip_full", "llava_next", "llava_onevision")
RECIPES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling", "blockwise": "Float8BlockScaling",
           "mxfp8": "MXFP8BlockScaling"}
# The TE classes of each role (megatron-core's TE spec for LLaVA): fused norm + QKV / FC1, TE attention.
TE_ROLES = {
    "linear_qkv": "megatron.TELayerNormColumnParallelLinear", "core_attention": "megatron.TEDotProductAttention",
    "linear_proj": "megatron.TERowParallelLinear", "linear_fc1": "megatron.TELayerNormColumnParallelLinear",
    "linear_fc2": "megatron.TERowParallelLinear", "input_layernorm": "megatron.IdentityOp",
    "pre_mlp_layernorm": "megatron.IdentityOp",
}
# What a TE model holds that a converted (local-layout) checkpoint lacks: the FP8 metadata of TE's norms, which
# are not fused into a linear (the language model's final norm, CLIP's ln_pre).
FINAL_NORM_STATE = "language_model.decoder.final_layernorm._extra_state"
LN_PRE_STATE = "vision_model.ln_pre._extra_state"


def te_only_objects(name: str, pp_rank: int) -> list[str]:
    """TE-only _extra_state of job ``name`` on pipeline stage ``pp_rank`` (the first holds the ViT, the last the
    final norm)."""
    clip = not any(a in name for a in ("qwen2_siglip", "llava_onevision"))
    pp = "pp2" in name
    return sorted(([FINAL_NORM_STATE] if not pp or pp_rank == 1 else []) +
                  ([LN_PRE_STATE] if clip and (not pp or pp_rank == 0) else []))


@pytest.fixture(scope="module")
def world(hf_models, tmp_path_factory):
    """Converted checkpoints (local layout) of every architecture, then one 2-process world that runs every job
    of tests.support.te_jobs; returns the models, checkpoints, saved TE checkpoints and results."""
    require_te()
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import te_jobs
    from tests.support.tiny import make_tiny_onevision

    root = tmp_path_factory.mktemp("te")
    hf = {name: hf_models[name] for name in ARCHS[:3]}
    hf["llava_onevision"] = make_tiny_onevision(root / "hf_ov")
    hf["llava_next"] = make_tiny_onevision(root / "hf_next", "llama", "clip", arch="llava_next",
                                           vision_feature_layer=-2)
    # llama_clip converted at TP=2 (loaded at TP=1, TP=2, PP=2: torch_dist reshards), the others at TP=1
    meg = {name: convert_hf_to_megatron(hf[name], root / f"meg_{name}", tp=2 if name == "llama_clip" else 1)
           for name in ARCHS}
    saved = {(layout, fmt): root / f"te_{layout}_{fmt}" for layout in ("tp1", "tp2") for fmt in ("torch_dist", "torch")}

    def job(name, arch, tp=1, pp=1, **kw):
        return dict(name=name, megatron_dir=str(meg[arch]), tp=tp, pp=pp, **kw)

    layouts = [job(f"tp1_{arch}", arch) for arch in ARCHS]
    layouts[0]["save"] = {fmt: str(saved["tp1", fmt]) for fmt in ("torch_dist", "torch")}
    layouts += [
        job("tp2_llama_clip", "llama_clip", tp=2, save={fmt: str(saved["tp2", fmt]) for fmt in ("torch_dist", "torch")}),
        job("tp2_qwen2_siglip", "qwen2_siglip", tp=2),
        job("tp2_sp_llava_next", "llava_next", tp=2, sequence_parallel=True),
        job("pp2_llama_clip", "llama_clip", pp=2),
        job("pp2_llava_onevision", "llava_onevision", pp=2),
        job("fp8_delayed_tp2_sp", "llama_clip", tp=2, sequence_parallel=True, fp8_recipe="delayed"),
        *[job(f"fp8_{r}", "llama_clip", fp8_recipe=r, fp8_format="e4m3" if r == "tensorwise" else "hybrid")
          for r in ("tensorwise", "blockwise", "mxfp8")],
    ]
    te = dict(device="cuda", transformer_impl="transformer_engine")  # a GPU user's config; the world is CPU
    local = dict(device="cpu", transformer_impl="local")
    trainer = [
        dict(name="s1_local", stage=1, step=True, **local), dict(name="s1_te", stage=1, **te),
        dict(name="s2_local", stage=2, step=True, **local), dict(name="s2_te", stage=2, **te),
        dict(name="tp2_s2_local", stage=2, tp=2, **local),
        dict(name="tp2_s2_te_sp", stage=2, tp=2, sequence_parallel=True, **te),
        dict(name="tp2_packing_te", stage=2, tp=2, packing_buffer_size=4, packed_seq_length=288, packing_samples=3,
             **te),
    ]
    results = run_world(te_jobs.run, 2, layouts, trainer, str(meg["llama_clip"]), str(hf["llama_clip"]))[0]
    return dict(hf=hf, meg=meg, saved=saved, **results)


def _all_ranks(world, name):
    return world["layouts"][name]


def test_te_modules_for_every_architecture(world):
    from megatron_vlm.model.spec import VLMSpec

    for arch in ARCHS:
        spec = VLMSpec.load(world["meg"][arch] / "release")
        mods = _all_ranks(world, f"tp1_{arch}")[0]["modules"]
        for part, norm, eps in (("language", "RMSNorm", spec.norm_epsilon),
                                ("vision", "LayerNorm", spec.vision_norm_epsilon)):
            for role, cls in TE_ROLES.items():
                assert mods[f"{part}.{role}"]["class"] == cls, (arch, part, role)
            for role in ("linear_qkv", "linear_fc1"):  # the fused norm: the family's type and epsilon
                assert mods[f"{part}.{role}"]["normalization"] == norm, (arch, part, role)
                assert mods[f"{part}.{role}"]["eps"] == pytest.approx(eps, rel=1e-6), (arch, part, role)
        # causal LM attention, bidirectional ViT attention (CLIP/SigLIP), GQA groups as in the spec
        assert mods["language.core_attention"]["attn_mask_type"] == "causal", arch
        assert mods["vision.core_attention"]["attn_mask_type"] == "no_mask", arch
        assert mods["language.core_attention"]["num_gqa_groups"] == spec.num_query_groups, arch
        assert mods["language.final_layernorm"]["class"] == "transformer_engine.RMSNorm", arch
        assert mods["language.final_layernorm"]["eps"] == pytest.approx(spec.norm_epsilon, rel=1e-6), arch
        assert mods["projector.linear_fc1"]["class"] == "megatron.TEColumnParallelLinear", arch
        assert mods["projector.linear_fc2"]["class"] == "megatron.TERowParallelLinear", arch
        if spec.vision_family == "clip":
            assert mods["vision.ln_pre"] == {"class": "transformer_engine.LayerNorm"}, arch
        else:  # SigLIP: no ln_pre; its post_layernorm is unused by LLaVA
            assert mods["vision.ln_pre"] is None and mods["vision.ln_post"] is None, arch


def _exact(report, where, bf16=False):
    c = report["compare"]
    assert c["tensors"] > 0, where
    if bf16:  # megatron's local norms stay fp32 in a bf16 model; TE's norms are bf16 (Float16Module casts both)
        assert c["dtypes_differ"] and all((te, local) == ("torch.bfloat16", "torch.float32") and
                                          ("norm" in key or ".ln_pre." in key) for key, te, local in
                                          c["dtypes_differ"]), (where, c["dtypes_differ"])
    else:
        assert c["dtypes_differ"] == [], (where, c["dtypes_differ"])
    assert (c["te_only_tensors"], c["local_only_tensors"], c["local_only_objects"]) == ([], [], []), (where, c)
    assert c["different"] == [], (where, c["different"])
    assert c["uncovered_params"] == [], (where, c["uncovered_params"])


def test_converted_checkpoint_loads_into_te_layers_exactly(world):
    """Strict keys: the TE model needs nothing from the checkpoint beyond TE's own _extra_state objects, and loads
    every tensor the checkpoint has; then every TE tensor equals the local model's under the same sharded key."""
    names = [f"tp1_{a}" for a in ARCHS] + ["tp2_llama_clip", "tp2_qwen2_siglip", "tp2_sp_llava_next",
                                           "pp2_llama_clip", "pp2_llava_onevision"]
    for name in names:
        every_stage = set()
        for r in _all_ranks(world, name):
            where = f"{name} rank {r['rank']}"
            assert r["checkpoint_keys_not_loaded"] == [], where
            assert r["te_modules_in_local_model"] == [], where  # local layers stay local with TE installed
            _exact(r, where)
            assert r["compare"]["te_only_objects"] == te_only_objects(name, r["pp_rank"]), where
            every_stage |= set(te_only_objects(name, r["pp_rank"]))
        for r in _all_ranks(world, name):  # keys of all stages
            assert r["keys_absent_from_checkpoint"] == sorted(every_stage), name
    tp2 = _all_ranks(world, "tp2_llama_clip")
    assert [r["tp_rank"] for r in tp2] == [0, 1]
    pp2 = _all_ranks(world, "pp2_llama_clip")
    assert [r["pp_rank"] for r in pp2] == [0, 1]
    assert "vision.linear_qkv" in pp2[0]["modules"] and "vision.linear_qkv" not in pp2[1]["modules"]
    assert "language.final_layernorm" in pp2[1]["modules"]


def test_sequence_parallel_reaches_te_linears_of_the_language_model(world):
    for name in ("tp2_sp_llava_next", "fp8_delayed_tp2_sp"):
        for r in _all_ranks(world, name):
            mods = r["modules"]
            for role in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
                assert mods[f"language.{role}"]["sequence_parallel"] is True, (name, role)
                assert mods[f"vision.{role}"]["sequence_parallel"] is False, (name, role)
    for r in _all_ranks(world, "tp2_llama_clip"):
        assert r["modules"]["language.linear_qkv"]["sequence_parallel"] is False


def test_fp8_settings_reach_te_recipes(world):
    """The FP8 context megatron enters before the first layer: TE's recipe with the trainer's settings on the
    language model; none on the ViT (its token count is no multiple of 16)."""
    for recipe, cls in RECIPES.items():
        name = "fp8_delayed_tp2_sp" if recipe == "delayed" else f"fp8_{recipe}"
        for r in _all_ranks(world, name):
            lm, vit = r["fp8"]["language_model"], r["fp8"]["vision_model"]
            assert lm["config"]["fp8"] == ("e4m3" if recipe == "tensorwise" else "hybrid"), name
            assert lm["config"]["fp8_recipe"] == recipe and cls in lm["recipe"], name  # TE's class, or a subclass
            assert lm["fp8_format"] == ("Format.E4M3" if recipe == "tensorwise" else "Format.HYBRID"), name
            assert vit["config"]["fp8"] is None and vit["context"] == "nullcontext", name
            if recipe == "delayed":
                assert (lm["amax_history_len"], lm["amax_compute_algo"]) == (1024, "max")
                assert (lm["config"]["amax_history_len"], lm["config"]["amax_compute_algo"]) == (1024, "max")
            _exact(r, name, bf16=True)


def test_te_checkpoint_loads_into_local_layers_and_exports_byte_identical(world, tmp_path):
    """Saved from the TE model at TP=1 and TP=2, torch_dist and legacy: TE's _extra_state is in the checkpoint,
    local layers load it to the same tensors, and the HF export is the original HF directory, byte for byte."""
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf

    src = world["hf"]["llama_clip"]
    names = sorted(p.name for p in src.iterdir())
    for (layout, fmt), run_dir in world["saved"].items():
        where = f"{layout} {fmt}"
        for r in _all_ranks(world, f"{layout}_llama_clip"):
            saved = r["saved"][fmt]
            # TE's _extra_state went into the checkpoint (one object per TE module of each stacked layer kind)
            assert {FINAL_NORM_STATE, LN_PRE_STATE} <= set(saved["extra_state_keys"]), where
            assert any(k.endswith("linear_qkv._extra_state") for k in saved["extra_state_keys"]), where
            c = saved["compare"]  # local layers loaded from it == local layers loaded from the converted one
            assert (c["te_only_tensors"], c["local_only_tensors"], c["different"]) == ([], [], []), (where, c)
        out = convert_megatron_to_hf(run_dir, tmp_path / f"hf_{layout}_{fmt}")
        assert sorted(p.name for p in out.iterdir()) == names, where
        _, mismatch, errors = filecmp.cmpfiles(src, out, names, shallow=False)
        assert (mismatch, errors) == ([], []), (where, mismatch, errors)


def test_trainer_setup_with_te_matches_local_layers(world):
    """--transformer-impl transformer_engine: model, Float16Module, DDP and the distributed optimizer are built;
    the optimizer's parameter groups and the frozen parameters are those of the local layers (by checkpoint
    key), for stage 1 and stage 2, at TP=1 (DP=2) and TP=2 with sequence parallelism."""
    t = world["trainer"]
    for te, local in (("s1_te", "s1_local"), ("s2_te", "s2_local"), ("tp2_s2_te_sp", "tp2_s2_local")):
        for a, b in zip(t[te], t[local]):
            assert a["impl"] == "transformer_engine" and b["impl"] == "local"
            assert a["wrappers"] == b["wrappers"] == ["DistributedDataParallel", "Float16Module"]
            assert a["optimizer"] == b["optimizer"] == ["DistributedOptimizer"]
            assert a["attention"] == ["megatron.TEDotProductAttention"], te
            assert a["deterministic_attention"] == [True], te  # --deterministic reaches TE's attention
            assert a["params_without_key"] == b["params_without_key"] == []
            assert a["dtypes"] == b["dtypes"] == ["torch.bfloat16"], (a["dtypes"], b["dtypes"])
            assert a["groups"] == b["groups"], te
            assert a["frozen"] == b["frozen"] and a["trainable"] == b["trainable"], te
            assert sorted(k for g, _ in a["groups"] for k in g) == a["trainable"], te
    s1, s2 = t["s1_te"][0], t["s2_te"][0]
    assert s1["trainable"] and all(k.startswith("vision_projection.") for k in s1["trainable"])  # stage 1
    assert any(k.startswith("language_model.") for k in s2["trainable"])  # stage 2: LM and projector
    assert all(k.startswith("vision_model.") for k in s2["frozen"]) and s2["frozen"]
    assert [dict(settings)["wd_mult"] for _, settings in s2["groups"]] == [0.0, 1.0]  # norms and biases: no decay
    assert [r["sequence_parallel"] for r in t["tp2_s2_te_sp"]] == [True, True]


def test_gradient_accumulation_fusion_in_te_linears_only(world):
    """A GPU user's config with TE layers and no apex (this lane): every TE linear accumulates its weight gradient
    into main_grad inside the GEMM (TE's fuse_wgrad_accumulation), megatron's own output layer does not (it cannot
    build with the fusion without apex's fused_weight_gradient_mlp_cuda); local layers on CPU fuse nothing."""
    for name in ("s2_te", "tp2_s2_te_sp"):
        for r in world["trainer"][name]:
            off = {cls for cls, on in r["wgrad_fusion"] if not on}
            fused = {cls for cls, on in r["wgrad_fusion"] if on}
            assert off == {"megatron.ColumnParallelLinear"}, (name, r["wgrad_fusion"])  # the output layer
            assert {"megatron.TELayerNormColumnParallelLinear", "megatron.TERowParallelLinear",
                    "megatron.TEColumnParallelLinear"} <= fused, (name, fused)
    for r in world["trainer"]["s2_local"]:
        assert not any(on for _, on in r["wgrad_fusion"]), r["wgrad_fusion"]


def test_local_layers_train_on_cpu_with_te_installed(world):
    """With TE installed megatron-core binds TE's CUDA kernels (FusedAdam, multi-tensor norms) and TE's norm for
    the ViT's ln_pre; on CPU the local layers still train: one bf16 step of each stage."""
    for name in ("s1_local", "s2_local"):
        for r in world["trainer"][name]:
            step = r["step"]
            assert step["finite"] and step["loss"] > 0 and step["grad_norm"] > 0, (name, step)
            assert step["optimizer"] == ["AdamW"], step  # torch's, as megatron uses without TE/Apex
            assert step["trainable_changed"] == step["trainable"] and step["frozen_changed"] == 0, (name, step)


def test_packing_builds_packed_seq_params_for_te_attention(world):
    reports = world["trainer"]["tp2_packing_te"]
    assert [r["attention"] for r in reports] == [["megatron.TEDotProductAttention"]] * 2
    p0, p1 = (r["packing"] for r in reports)
    assert p0 == p1  # TP rank 1 received the pack's boundaries from rank 0
    cu = p0["cu_seqlens_q"]
    assert p0["qkv_format"] == "thd" and p0["dtype"] == "torch.int32" and p0["cu_seqlens_kv"] == cu
    assert len(cu) == 5 and cu[0] == 0 and cu[-1] == 288 and cu == sorted(cu)  # 3 samples + padding
    assert cu[3] == p0["num_tokens"] and p0["max_seqlen_q"] == p0["max_seqlen_kv"] == max(
        b - a for a, b in zip(cu, cu[1:]))
    assert {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"} <= set(
        p0["attention_kept_params"])


def test_deterministic_te_attention_needs_its_environment(monkeypatch):
    from megatron_vlm.model import build as model

    monkeypatch.delenv(model.NONDETERMINISTIC_ENV, raising=False)
    model.te_deterministic_env()
    import os

    assert os.environ[model.NONDETERMINISTIC_ENV] == "0"
    monkeypatch.setenv(model.NONDETERMINISTIC_ENV, "1")
    with pytest.raises(ValueError, match="needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 .*sets "
                                         "NVTE_ALLOW_NONDETERMINISTIC_ALGO=1: unset it, or drop --deterministic"):
        model.te_deterministic_env()


def test_cpu_shim_answers_only_te_construction(monkeypatch):
    """The shim's narrowness: while it is on (around a TE model's build), TE's module constructor runs on CPU, and
    CUDA is still absent for every other caller; without it TE refuses to construct; after it torch has its own
    is_available back; on a machine with CUDA it refuses."""
    require_te()
    from megatron_vlm.runtime import cpu_compat

    if torch.cuda.is_available():
        not_here("the CPU shim is for machines without CUDA")
    cpu_compat.enable()
    import transformer_engine.pytorch as te

    real = torch.cuda.is_available
    with cpu_compat.te_construction():
        lin = te.Linear(8, 4, params_dtype=torch.float32)  # TE's default device "cuda" is mapped to the CPU
        assert torch.cuda.is_available() is False
    assert lin.weight.device.type == "cpu" and tuple(lin.weight.shape) == (4, 8) and lin.weight.abs().sum() > 0
    assert torch.cuda.is_available is real
    with pytest.raises(Exception):  # the control: TE's constructor itself refuses without the shim
        te.Linear(8, 4, params_dtype=torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be used on a machine with CUDA"):
        with cpu_compat.te_construction():
            pass
