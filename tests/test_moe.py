"""Mixture-of-experts language models in every LLaVA architecture, with expert parallelism, held against HF.

Models: Qwen3-30B-A3B-Instruct-2507's config shrunk in size only, around Qwen3's real tokenizer (151,936 rows),
as OneVision (SigLIP; one dense layer among three MoE layers, ``mlp_only_layers``) and as LLaVA (CLIP; every layer
MoE); a tiny Qwen3-MoE LLaVA-NeXT without top-k renormalisation (``norm_topk_prob=false``); a tiny Mixtral LLaVA.

- **Logits**: fp32, megatron-core's model of every converted checkpoint against HF's own model, at TP1, TP2, PP2,
  EP2 and TP2 x EP2 (and TP2 x EP2 with experts unsplit, ETP1), in one 4-process world; a checkpoint whose spec
  claims the other top-k normalisation fails (the control).
- **Round trips**: HF -> Megatron -> HF byte for byte, dtypes kept, experts one by one as HF writes them (torch_dist,
  and legacy rank files per expert-parallel rank).
- **The trainer against HF** (one 4-process world, the trainer's ``build_training``/``train_step``): with the
  load-balancing loss off, every step's loss and gradient norm and every tensor's gradient equal HF's
  (``LlavaForConditionalGeneration``/``LlavaOnevisionForConditionalGeneration`` on the same batches) at EP2 x DP2,
  TP2 x EP2 (sequence parallel) and PP2 x EP2; with it on, the difference from HF's cross entropy is exactly the
  logged load-balancing term (computed independently from HF's router logits), gradients included; bf16 at
  TP2 x EP2 starts at HF's loss within bf16's rounding and falls; a checkpoint saved at PP2 x EP2 resumes bit-exactly
  at its layout and, resharded by torch_dist, continues as HF does at EP4 and at TP2 x EP2; at EP1, where
  megatron-core keeps the experts' optimizer state with the other parameters', it is refused naming the fix.
- **The user's commands**: build -> ``hf_to_megatron --tp 2 --ep 2 --verify`` -> ``train/run.py`` at TP2 x EP2
  (experts unsplit, the all-to-all dispatcher: gloo cannot all-gather the uneven expert inputs of ETP2 with it),
  bf16, packed -> ``megatron_to_hf`` -> HF ``generate``, for the OneVision (stage 2) and the LLaVA (stage 1: the
  language model, experts and routers frozen).
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import hf_logits, reference_batch
from megatron_vlm.runtime.spawn import run_world
from megatron_vlm.spec import VLMSpec

pytestmark = pytest.mark.slow

TOL = 1e-5  # fp32 logits (measured 2.7e-7 to 4.5e-7)
RTOL = 1e-5  # losses, gradient norms, each tensor's gradient relative to its norm (measured <= 1.1e-6)
BF16_LOSS_RTOL = 0.005  # tests/test_train_reference.py's bound for bf16 against fp32
AUX = 0.1  # a load-balancing coefficient large enough to move every gradient
#: (tp, pp, ep, etp) of the logits world
LAYOUTS = [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, None), (2, 1, 2, None)]


def _build(root, text_dir, vision: str, arch: str):
    from megatron_vlm.convert.build import build_llava
    from megatron_vlm.testing import hub_models
    from megatron_vlm.testing.tiny import make_vision_model

    if vision == "siglip":
        vit, kw = hub_models.siglip_vision_model(root / "vit", image_size=20, patch_size=6), dict(vision_feature_layer=-1)
    else:
        vit, kw = make_vision_model(root / "vit", "clip"), {}
    return build_llava(text_dir, vit, root / "hf", arch=arch, max_grid=3, vision_aspect_ratio="anyres_max_2", **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_vlm.testing import hub_models
    from megatron_vlm.testing.tiny import make_tiny_llava, make_tiny_onevision

    root = tmp_path_factory.mktemp("moe")
    out = {
        "qwen3moe_onevision": _build(root / "ov", hub_models.qwen3_moe_text_model(root / "ov_lm", mlp_only_layers=[1]),
                                     "siglip", "llava_onevision"),
        "qwen3moe_llava": _build(root / "llava", hub_models.qwen3_moe_text_model(root / "llava_lm"), "clip", "llava"),
        "qwen3moe_next": make_tiny_onevision(root / "next", "qwen3_moe", "clip", arch="llava_next",
                                             text_overrides=dict(norm_topk_prob=False)),
        "mixtral_llava": make_tiny_llava(root / "mixtral", "mixtral", "clip"),
    }
    return out


def test_specs_hold_the_published_routing(models):
    ov, llava = VLMSpec.from_hf_dir(models["qwen3moe_onevision"]), VLMSpec.from_hf_dir(models["qwen3moe_llava"])
    assert ov.moe_layers == [0, 2, 3] and llava.moe_layers == [0, 1, 2, 3]
    for s in (ov, llava):
        assert (s.num_moe_experts, s.moe_router_topk, s.moe_norm_topk_prob, s.moe_aux_loss_coeff) == (8, 2, True, 0.001)
        assert s.vocab_size == 151936 and s.rotary_base == 1e7 and not s.tie_word_embeddings and s.qk_layernorm
    assert VLMSpec.from_hf_dir(models["qwen3moe_next"]).moe_norm_topk_prob is False


@pytest.fixture(scope="module")
def logits(models, tmp_path_factory):
    """{(model, tp, pp, ep, etp): max |logit diff| vs HF}: one 4-process world over every model and layout."""
    from megatron_vlm.testing import family_jobs

    root = tmp_path_factory.mktemp("moe_logits")
    jobs, keys = [], []
    for name, hf in models.items():
        spec = VLMSpec.from_hf_dir(hf)
        meg = convert_hf_to_megatron(hf, root / name, tp=1)
        batch = reference_batch(spec)
        ref = root / f"{name}.pt"
        torch.save(hf_logits(hf, batch), ref)
        layouts = LAYOUTS + ([(2, 1, 2, 1)] if name == "qwen3moe_llava" else [])
        for tp, pp, ep, etp in layouts:
            jobs.append(dict(megatron_dir=str(meg), tp=tp, pp=pp, ep=ep, etp=etp, batch=batch, ref_file=str(ref),
                             vocab=spec.vocab_size))
            keys.append((name, tp, pp, ep, etp))
        if name == "qwen3moe_next":  # the control: the spec claims renormalised top-k probabilities
            wrong = root / "next_wrong"
            shutil.copytree(meg, wrong)
            f = wrong / "release" / "vlm_spec.json"
            f.write_text(f.read_text().replace('"moe_norm_topk_prob": false', '"moe_norm_topk_prob": true'))
            assert VLMSpec.load(wrong / "release").moe_norm_topk_prob
            jobs.append(dict(jobs[-1], megatron_dir=str(wrong)))
            keys.append(("next_wrong_normalisation", 2, 1, 2, None))
    diffs = dict(zip(keys, run_world(family_jobs.logit_diffs, 4, jobs)[0]))
    print("moe logits:", diffs)  # the closing note's numbers (pytest -s)
    return diffs


@pytest.mark.parametrize("name", ["qwen3moe_onevision", "qwen3moe_llava", "qwen3moe_next", "mixtral_llava"])
def test_logits_match_hf_at_every_layout(name, logits):
    mine = {k: v for k, v in logits.items() if k[0] == name}
    assert len(mine) >= len(LAYOUTS)
    assert all(v <= TOL for v in mine.values()), mine


def test_wrong_top_k_normalisation_fails_the_comparison(logits):
    assert logits[("next_wrong_normalisation", 2, 1, 2, None)] > 1e-3


@pytest.mark.parametrize("name,fmt,layout", [
    ("qwen3moe_onevision", "torch_dist", dict(tp=2, ep=2)),
    ("qwen3moe_onevision", "torch", dict(tp=2, ep=2)),
    ("mixtral_llava", "torch", dict(tp=2, pp=2, ep=2, etp=1)),
])
def test_round_trip_is_byte_identical(name, fmt, layout, models, tmp_path):
    from megatron_vlm import checkpoint as ckpt

    src = models[name]
    meg = convert_hf_to_megatron(src, tmp_path / "meg", ckpt_format=fmt, **layout)
    if fmt == "torch":  # Megatron-LM's rank files: one per (TP, PP, EP) rank, experts under their local index
        ranks = sorted(p.name for p in (meg / "release").glob("mp_rank_*"))
        assert len(ranks) == layout["tp"] * layout.get("pp", 1) * layout["ep"], ranks
        f = ckpt.load_legacy_rank(meg / "release", 0, 0, layout.get("pp", 1), ep_rank=1, ep=layout["ep"])["model"]
        experts = {int(k.split("local_experts.")[1].split(".")[0]) for k in f if "local_experts." in k}
        assert experts == set(range(VLMSpec.from_hf_dir(src).num_moe_experts // layout["ep"])), experts
    out = convert_megatron_to_hf(meg, tmp_path / "hf")
    a, b = HFReader(src), HFReader(out)
    assert a.names() == b.names() and any(".mlp.experts.7.down_proj." in n for n in a.names()) == \
        (name != "mixtral_llava")
    for n in a.names():
        assert a.get(n).dtype == b.get(n).dtype and torch.equal(a.get(n), b.get(n)), n


# ---- the trainer against HF --------------------------------------------------------------------------------------
S2 = dict(stage=2, freeze_lm=False, freeze_vit=True)
TRAIN_LAYOUTS = {
    "ep2dp2": dict(ep=2, micro_batch_size=2),
    "tp2ep2": dict(tp=2, ep=2, sequence_parallel=True, micro_batch_size=2),
    "pp2ep2": dict(pp=2, ep=2, micro_batch_size=2),
}


#: virtual pipeline stages with expert parallelism (issue 51): one layer per model chunk, the load-balancing loss off
VPP_EP = dict(pp=2, num_virtual_stages_per_pipeline_rank=2, ep=2, micro_batch_size=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny Qwen3-MoE LLaVA and OneVision (3 MoE layers and a dense one), trained in one 4-process world, and HF's
    numbers for the same batches."""
    from megatron_vlm.testing import grad_reference, hf_reference
    from megatron_vlm.testing.tiny import make_tiny_llava, make_tiny_onevision
    from megatron_vlm.testing.train_jobs import job_config, train_jobs, variable_length_batches

    root = tmp_path_factory.mktemp("moe_train")
    text = dict(num_hidden_layers=4, mlp_only_layers=[1])
    hf = {"llava": make_tiny_llava(root / "llava", "qwen3_moe", "clip", text_overrides=text),
          "onevision": make_tiny_onevision(root / "ov", "qwen3_moe", "siglip", text_overrides=text)}
    meg = {m: convert_hf_to_megatron(d, root / f"{m}_meg", tp=1) for m, d in hf.items()}
    batches = {m: variable_length_batches(d, 3) for m, d in hf.items()}
    uniform = variable_length_batches(hf["llava"], 1, uniform=True)  # one length: HF routes the trainer's tokens
    spec = VLMSpec.from_hf_dir(hf["llava"])
    length = uniform[0][0].tokens.numel() + spec.num_image_tokens - 1  # the image-expanded length, no padding
    saved = root / "pp2ep2-run"
    jobs = []
    for m in hf:
        own = dict(megatron_dir=str(meg[m]), hf_dir=str(hf[m]), batches=m, moe_aux_loss_coeff=0.0, **S2)
        jobs += [dict(name=f"{m}-{lay}", steps=3, grads=True, **kw, **own) for lay, kw in TRAIN_LAYOUTS.items()]
        jobs.append(dict(name=f"{m}-ep2dp2-distopt", steps=3, dist_optim=True, **TRAIN_LAYOUTS["ep2dp2"], **own))
    llava = dict(megatron_dir=str(meg["llava"]), hf_dir=str(hf["llava"]), **S2)
    jobs.append(dict(name="llava-pp2vpp2ep2", steps=2, grads=True, batches="llava", moe_aux_loss_coeff=0.0, **VPP_EP,
                     **llava))  # virtual pipeline stages (issue 51)
    jobs += [dict(name=f"aux-{lay}", steps=1, grads=True, batches="uniform", moe_aux_loss_coeff=AUX,
                  seq_length=length, **kw, **llava) for lay, kw in TRAIN_LAYOUTS.items()]
    jobs.append(dict(name="bf16-tp2ep2", steps=9, precision="bf16", batches="llava-long", **TRAIN_LAYOUTS["tp2ep2"],
                     **llava))
    plain = dict(batches="llava", moe_aux_loss_coeff=0.0, **llava)
    jobs.append(dict(name="save-pp2ep2", steps=1, save=str(saved), **TRAIN_LAYOUTS["pp2ep2"], **plain))
    for name, kw in (("pp2ep2", TRAIN_LAYOUTS["pp2ep2"]), ("ep4", dict(ep=4, micro_batch_size=2)),
                     ("tp2ep2", TRAIN_LAYOUTS["tp2ep2"])):
        jobs.append(dict(name=f"resume-{name}", start=1, steps=2, resume=str(saved / "iter_0000001"),
                         reset_data_position=True, **kw, **plain))
    sets = {"llava": (str(hf["llava"]), 3, False, 1), "onevision": (str(hf["onevision"]), 3, False, 1),
            "uniform": (str(hf["llava"]), 1, True, 1), "llava-long": (str(hf["llava"]), 3, False, 3)}
    out = {r["name"]: r for r in run_world(train_jobs, 4, jobs, None, None, sets)[0]}
    for m in hf:
        cfg = job_config(dict(S2, moe_aux_loss_coeff=0.0), 3, 8)
        out[f"{m}-hf"] = hf_reference.train(hf[m], batches[m], cfg)
        out[f"{m}-hf-grads"] = grad_reference.hf_gradients(hf[m], batches[m][0], cfg)
    out["aux-hf"] = grad_reference.hf_gradients(hf["llava"], uniform[0], job_config(S2, 1, 8), aux_coeff=AUX,
                                                micro_batch_size=2)
    out["spec"], out["specs"] = spec, {m: VLMSpec.from_hf_dir(d) for m, d in hf.items()}
    out.update(saved=saved, sets=sets, **{"llava-meg": str(meg["llava"]), "llava-hf-dir": str(hf["llava"])})
    for name, r in sorted(out.items()):
        if isinstance(r, dict) and "loss" in r:
            print(f"{name}: loss {r['loss']} grad norm {r.get('grad_norm')}")
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _gradients(run, spec, job):
    from megatron_vlm.testing import grad_reference

    return grad_reference.assemble(run["grads"], spec, job.get("tp", 1), job.get("pp", 1), run["layers"],
                                   job.get("ep", 1), job.get("etp"))


@pytest.mark.parametrize("layout", [*TRAIN_LAYOUTS, "ep2dp2-distopt"])
@pytest.mark.parametrize("model", ["llava", "onevision"])
def test_losses_and_grad_norms_equal_hf_for_three_adamw_steps(trained, model, layout):
    r, ref = trained[f"{model}-{layout}"], trained[f"{model}-hf"]
    assert all(rel(a, b) <= RTOL for a, b in zip(r["loss"], ref["loss"], strict=True)), (r["loss"], ref["loss"])
    assert all(rel(a, b) <= RTOL for a, b in zip(r["grad_norm"], ref["grad_norm"], strict=True)), \
        (r["grad_norm"], ref["grad_norm"])


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
@pytest.mark.parametrize("model", ["llava", "onevision"])
def test_every_gradient_equals_hf(trained, model, layout):
    from megatron_vlm.testing import grad_reference

    spec = trained["specs"][model]
    mine = _gradients(trained[f"{model}-{layout}"], spec, TRAIN_LAYOUTS[layout])
    diffs = grad_reference.compare(mine, trained[f"{model}-hf-grads"]["grads"])
    experts = [n for n in diffs if ".mlp.experts." in n]
    assert len(experts) == 3 * spec.num_moe_experts * 3 and any(".mlp.gate." in n for n in diffs)
    worst = max(diffs.items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst


def test_virtual_pipeline_stages_with_expert_parallelism_equal_hf(trained):
    """The Qwen3-MoE LLaVA at PP2 x VPP2 x EP2 (each rank's two model chunks one layer each, the experts of every
    chunk dealt out over EP2; the load-balancing loss off): two AdamW steps give HF's losses and grad norms, and the
    first step's gradient of every tensor (routers, every expert, the dense layers) HF's."""
    from megatron_vlm.testing import grad_reference

    r, ref, spec = trained["llava-pp2vpp2ep2"], trained["llava-hf"], trained["specs"]["llava"]
    assert all(rel(a, b) <= RTOL for a, b in zip(r["loss"] + r["grad_norm"], ref["loss"][:2] + ref["grad_norm"][:2]))
    assert len(r["layers"]) == 4  # the four virtual stages, as a PP4 world's stages
    diffs = grad_reference.compare(_gradients(r, spec, VPP_EP), trained["llava-hf-grads"]["grads"])
    assert len([n for n in diffs if ".mlp.experts." in n]) == 3 * spec.num_moe_experts * len(spec.moe_layers)
    worst = max(diffs.items(), key=lambda kv: kv[1])
    print(f"\nPP2 x VPP2 x EP2 vs HF: losses {r['loss']}, worst tensor {worst}")
    assert worst[1] <= RTOL, worst


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
def test_load_balancing_loss_is_exactly_the_logged_term(trained, layout):
    """The objective with --moe-aux-loss-coeff: HF's cross entropy plus the coefficient times the logged
    load-balancing loss (mean over micro batches, summed over MoE layers); HF computes it from its own router
    logits with megatron-core's formula, and every gradient of the sum is the trainer's."""
    from megatron_vlm.testing import grad_reference

    r, ref, spec = trained[f"aux-{layout}"], trained["aux-hf"], trained["spec"]
    logged = AUX * r["moe"][0]["moe_load_balancing_loss"] * len(spec.moe_layers)
    assert rel(r["loss"][0], ref["loss"]) <= RTOL and rel(logged, ref["aux"]) <= RTOL, (r["loss"], logged, ref)
    diffs = grad_reference.compare(_gradients(r, spec, TRAIN_LAYOUTS[layout]), ref["grads"])
    assert max(diffs.values()) <= RTOL, max(diffs.items(), key=lambda kv: kv[1])
    assert r["moe"][0]["moe_load_imbalance"] >= 1.0 and len(r["moe"][0]["moe_tokens_per_expert"]) == 3


def test_bf16_at_tp2_ep2_starts_at_hf_and_falls(trained):
    r = trained["bf16-tp2ep2"]
    assert rel(r["loss"][0], trained["llava-hf"]["loss"][0]) <= BF16_LOSS_RTOL, r["loss"]
    assert sum(r["loss"][-3:]) / 3 < 0.9 * sum(r["loss"][:3]) / 3, r["loss"]


def test_resume_at_ep1_explains_the_optimizer_layout(trained, tmp_path):
    """megatron-core keeps the experts' optimizer state apart (a second optimizer) whenever EP x ETP differs from
    TP: a resume at EP1 TP1 cannot take the state saved at EP2; the refusal says so, before anything loads."""
    from megatron_vlm.training.checkpointing import OptimizerStateMismatch
    from megatron_vlm.testing.train_jobs import train_jobs

    with pytest.raises(Exception) as e:
        run_world(train_jobs, 4, [dict(name="ep1", start=1, steps=1, resume=str(trained["saved"] / "iter_0000001"),
                                       reset_data_position=True, micro_batch_size=2, batches="llava",
                                       moe_aux_loss_coeff=0.0, megatron_dir=trained["llava-meg"],
                                       hf_dir=trained["llava-hf-dir"], **S2)], None, None, trained["sets"])
    assert "megatron-core keeps the optimizer state of the experts apart from the other parameters" in str(e.value)
    assert "--no-load-optim" in str(e.value) and OptimizerStateMismatch.__name__


def test_resume_is_exact_at_its_layout_and_reshards_across_expert_parallelism(trained):
    full, hf = trained["llava-pp2ep2"], trained["llava-hf"]
    same = trained["resume-pp2ep2"]
    assert same["loss"] == full["loss"][1:3] and same["grad_norm"] == full["grad_norm"][1:3]
    for other in ("resume-ep4", "resume-tp2ep2"):
        r = trained[other]
        assert all(rel(a, b) <= RTOL for a, b in zip(r["loss"], hf["loss"][1:3], strict=True)), (other, r["loss"])
        assert all(rel(a, b) <= RTOL for a, b in zip(r["grad_norm"], hf["grad_norm"][1:3], strict=True)), other


# ---- the user's commands -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coloured_data(tmp_path_factory):
    from PIL import Image

    from megatron_vlm.testing import forked_cli

    from .conftest import ROOT

    root = tmp_path_factory.mktemp("moe_data")
    (root / "img").mkdir()
    colours = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
    rows = []
    for i in range(48):
        c = list(colours)[i % 4]
        Image.new("RGB", (24 + 4 * (i % 3), 20), colours[c]).save(root / "img" / f"{i}.png")
        rows.append({"image": f"{i}.png", "question": "what colour is the shape ?", "answer": c, "id": str(i)})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    forked_cli.run([sys.executable, "data_prep/make_wds.py", "--format", "vqa", "--input", str(root / "qa.jsonl"),
                    "--image-root", str(root / "img"), "--output", str(root / "data"), "--shard-size", "12",
                    "--no-progress"], check=True, cwd=ROOT, capture_output=True)
    return root / "data"


@pytest.mark.parametrize("name,stage", [("qwen3moe_onevision", "2"), ("qwen3moe_llava", "1")])
def test_build_convert_train_export_generate(name, stage, models, coloured_data, tmp_path):
    from megatron_vlm.convert.verify import load_hf_model
    from megatron_vlm.testing import forked_cli

    from .conftest import ROOT, script

    hf = models[name]
    meg = tmp_path / "meg"
    script("convert/hf_to_megatron.py").main(["--hf-dir", str(hf), "--megatron-dir", str(meg), "--tp", "2", "--ep", "2",
                                              "--verify"])
    argv = ["--device", "cpu", "-g", "4", "--tp", "2", "--ep", "2", "--etp", "1", "--sequence-parallel", "--precision",
            "bf16",
            "--stage", stage, "--megatron-load-dir", str(meg), "--tokenizer-load-dir", str(hf), "--data-path",
            str(coloured_data), "--save-dir", str(tmp_path / "runs"), "--name", "moe", "--seq-length", "96",
            "--packing-buffer-size", "8", "--packed-seq-length", "192", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1", "--num-workers", "1",
            "--lr", "2e-3", "--moe-token-dispatcher-type", "alltoall"]
    p = forked_cli.run([sys.executable, "train/run.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    out = p.stdout + p.stderr
    assert "mixture of experts: 8 experts of 32, top 2 per token (renormalised)" in out and "ep=2 etp=1" in out
    assert "coefficient 0.001 (the HF config's router_aux_loss_coef)" in out and "alltoall dispatcher" in out
    records = [json.loads(x) for x in (tmp_path / "runs" / "moe" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4 and all(r["moe_load_imbalance"] >= 1 and r["padding_fraction"] < 1 for r in steps)
    assert all(len(r["moe_tokens_per_expert"]) == len(VLMSpec.from_hf_dir(hf).moe_layers) for r in steps)
    export = convert_megatron_to_hf(tmp_path / "runs" / "moe", tmp_path / "export")
    model = load_hf_model(export)
    batch = reference_batch(VLMSpec.from_hf_dir(export)).hf_inputs(0)
    gen = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == batch["input_ids"].shape[1] + 3


@pytest.mark.te
def test_transformer_engine_grouped_experts_load_and_save_the_converted_checkpoint(models, tmp_path):
    """The GPU path's MoE layers (Transformer Engine, built on CPU through the construction shim; no forward): at
    EP2 the TE model's experts are one TEGroupedMLP per layer with its own pre-MLP norm, every tensor loads from the
    converted checkpoint and equals the local SequentialMLP's under the same sharded key, and what the TE model
    saves (torch_dist, and legacy rank files with TEGroupedMLP's ``linear_fc1.weightN`` names) loads back into the
    local layers unchanged."""
    from .conftest import require_te

    require_te()
    from megatron_vlm.testing import te_jobs

    meg = convert_hf_to_megatron(models["mixtral_llava"], tmp_path / "meg")
    job = {"name": "moe", "megatron_dir": str(meg), "tp": 1, "pp": 1, "ep": 2,
           "save": {"torch_dist": str(tmp_path / "te_dist"), "torch": str(tmp_path / "te_legacy")}}
    reports = run_world(te_jobs.run, 2, [job], [], str(meg), str(models["mixtral_llava"]))[0]["layouts"]["moe"]
    for r in reports:
        assert r["modules"]["language.experts"]["class"] == "megatron.TEGroupedMLP", r["modules"]
        assert r["modules"]["language.pre_mlp_layernorm"]["class"].startswith("transformer_engine."), r["modules"]
        c = r["compare"]
        assert c["tensors"] > 0 and (c["te_only_tensors"], c["local_only_tensors"], c["different"],
                                     c["uncovered_params"]) == ([], [], [], []), c
        for fmt, saved in r["saved"].items():
            s = saved["compare"]
            assert (s["te_only_tensors"], s["local_only_tensors"], s["different"]) == ([], [], []), (fmt, s)
        assert r["saved"]["torch"]["grouped_expert_keys"], r["saved"]["torch"]
