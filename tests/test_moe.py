"""Mixture-of-experts language models in every LLaVA architecture, with expert parallelism, held against HF.

Models: tiny Qwen3-MoE LLaVA and OneVision (4 experts, top 2; one dense layer among three MoE layers,
``mlp_only_layers``), a tiny Qwen3-MoE LLaVA-NeXT without top-k renormalisation (``norm_topk_prob=false``) and a
tiny Mixtral LLaVA. The published routing of Qwen3-30B-A3B (and its config shrunk in size only) is
tests/test_moe_spec.py's; no check here needs its 151,936-row vocabulary.

One 4-process world (``world``) runs every multi-rank check, the logits jobs and the trainer's jobs in turn:

- **Logits**: fp32, megatron-core's model of every tiny converted checkpoint against HF's own model, at TP1, TP2,
  PP2, EP2 and TP2 x EP2 (and TP2 x EP2 with experts unsplit, ETP1); a checkpoint whose spec claims the other top-k
  normalisation fails (the control).
- **The trainer's objective is HF's** (the trainer's ``build_training``/``train_step``): with a load-balancing
  coefficient of 1 (the term dominates every router's gradient: checked on HF's side), on variable-length samples
  padded to ``--seq-length`` 160 (expert parallelism pads every micro batch to it), every tensor's gradient equals
  HF's ``Qwen3MoeForCausalLM`` objective through ``LlavaForConditionalGeneration`` / ``LlavaOnevision...``: HF's cross
  entropy plus the coefficient times transformers' own ``load_balancing_loss_func`` on HF's routers' logits, per micro
  batch (``tests.support.hf_reference``), at EP2 x DP2 (distributed optimizer), TP2 x EP2 (sequence parallel,
  turned on by the trainer) and PP2 x EP2; losses, the logged load-balancing loss and gradient norms equal HF's over
  three AdamW steps; every gradient also at PP4 (two middle stages) and with full activation recomputation; the
  routing numbers count the samples' positions only (once, recomputed or not). HF's term is over every position of
  HF's input, the last one too (the trainer's MoE samples are HF's whole sequences). megatron-core's own
  ``aux_loss`` at the same coefficient fails the comparison (the control); coefficient 0 gives HF LLaVA's plain
  cross entropy; stage 1 (only the projector trains) gets the term's gradient through the routers' inputs, as HF
  does. bf16 at TP2 x EP2 starts at HF's loss within bf16's rounding and falls. In the first step of four layouts
  no router waits on a host sync, each micro batch's positions of samples are made once per rank, and the stages
  exchange on their pipeline's ranks only.
- **Resume** with the distributed optimizer: a checkpoint saved at EP2 x DP2 continues bit-exactly at its layout and,
  resharded by torch_dist, as HF does at PP2 x EP2 and at EP4; at EP1, where megatron-core keeps the experts'
  optimizer state with the other parameters', it is refused naming the version's rule and the fix. At EP1 with the
  experts unsplit at TP2 (ETP1): megatron-core 0.16 sums the experts' gradients over the data-parallel ranks only
  there, so the trainer refuses that layout; 0.19 trains it as HF does, and refuses the optimizer state of a
  checkpoint 0.16 wrote there (``tests/fixtures/mcore-0.16-moe``), naming both versions' rules.
- **Round trips**: HF -> Megatron -> HF byte for byte, dtypes kept, experts one by one as HF writes them (torch_dist,
  and legacy rank files per expert-parallel rank).
- **The user's commands** on the tiny OneVision: ``hf_to_megatron --tp 2 --ep 2 --verify`` ->
  ``train/run.py`` at TP2 x EP2 (sequence parallelism turned on and said so; experts unsplit, the all-to-all
  dispatcher: gloo cannot all-gather the uneven expert inputs of ETP2 with it), bf16, packed -> ``megatron_to_hf``
  -> HF ``generate``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_vlm.runtime import mcore_version
from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import hf_logits, reference_batch
from megatron_vlm.runtime.spawn import run_world
from megatron_vlm.model.spec import VLMSpec

pytestmark = pytest.mark.slow

TOL = 1e-5  # fp32 logits (measured 2.7e-7 to 5.4e-7)
RTOL = 1e-5  # losses, gradient norms, each tensor's gradient relative to its norm (measured <= 1.1e-6)
BF16_LOSS_RTOL = 0.005  # tests/test_train_reference.py's bound for bf16 against fp32
AUX = 1.0  # a load-balancing coefficient that makes the term dominate every router's gradient
SEQ = 160  # --seq-length: every sample (at most 96 positions) is padded beyond its end
FIXTURE = Path(__file__).parent / "fixtures" / "mcore-0.16-moe"
#: (tp, pp, ep, etp) of the logits jobs
LOGIT_LAYOUTS = [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, None), (2, 1, 2, None)]
S2 = dict(stage=2, freeze_lm=False, freeze_vit=True, seq_length=SEQ, moe_aux_loss_coeff=AUX)
TRAIN_LAYOUTS = {
    "ep2dp2": dict(ep=2, micro_batch_size=2, dist_optim=True),
    "tp2ep2": dict(tp=2, ep=2, micro_batch_size=2),  # sequence parallelism: turned on by the trainer
    "pp2ep2": dict(pp=2, ep=2, micro_batch_size=2),
}
AT_019 = not mcore_version.writes_common_file()  # megatron-core 0.19's lane


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def close(a: list, b: list, rtol: float = RTOL) -> bool:
    return all(rel(x, y) <= rtol for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{name: (HF dir, converted Megatron dir)} of the tiny models."""
    from tests.support.tiny import make_tiny_llava, make_tiny_onevision

    root = tmp_path_factory.mktemp("moe_tiny")
    text = dict(num_hidden_layers=4, mlp_only_layers=[1])
    hf = {"llava": make_tiny_llava(root / "llava", "qwen3_moe", "clip", text_overrides=text),
          "onevision": make_tiny_onevision(root / "ov", "qwen3_moe", "siglip", text_overrides=text),
          "next": make_tiny_onevision(root / "next", "qwen3_moe", "clip", arch="llava_next",
                                      text_overrides=dict(norm_topk_prob=False)),
          "mixtral": make_tiny_llava(root / "mixtral", "mixtral", "clip")}
    return {m: (d, convert_hf_to_megatron(d, root / f"{m}_meg", tp=1)) for m, d in hf.items()}


def _logit_jobs(tiny, root) -> tuple[list, list]:
    jobs, keys = [], []
    for name, (hf, meg) in tiny.items():
        spec = VLMSpec.from_hf_dir(hf)
        batch = reference_batch(spec)
        ref = root / f"{name}.pt"
        torch.save(hf_logits(hf, batch), ref)
        for tp, pp, ep, etp in LOGIT_LAYOUTS + ([(2, 1, 2, 1)] if name == "llava" else []):
            jobs.append(dict(megatron_dir=str(meg), tp=tp, pp=pp, ep=ep, etp=etp, batch=batch, ref_file=str(ref),
                             vocab=spec.vocab_size))
            keys.append((name, tp, pp, ep, etp))
        if name == "next":  # the control: the spec claims renormalised top-k probabilities
            wrong = root / "next_wrong"
            shutil.copytree(meg, wrong)
            f = wrong / "release" / "vlm_spec.json"
            f.write_text(f.read_text().replace('"moe_norm_topk_prob": false', '"moe_norm_topk_prob": true'))
            assert VLMSpec.load(wrong / "release").moe_norm_topk_prob
            jobs.append(dict(jobs[-1], megatron_dir=str(wrong)))
            keys.append(("next_wrong_normalisation", 2, 1, 2, None))
    return jobs, keys


def _train_jobs(tiny, root) -> list[dict]:
    saved = root / "ep2dp2-run"
    own = {m: dict(megatron_dir=str(tiny[m][1]), hf_dir=str(tiny[m][0]), batches=m) for m in ("llava", "onevision")}
    jobs = []
    for m in own:
        for lay, kw in TRAIN_LAYOUTS.items():
            save = dict(save=str(saved), save_after=1) if (m, lay) == ("llava", "ep2dp2") else {}
            probe = dict(count_syncs=True) if (m, lay) == ("llava", "tp2ep2") else {}
            jobs.append(dict(name=f"{m}-{lay}", steps=3, grads=True, **kw, **S2, **own[m], **save, **probe))
    llava = own["llava"]
    jobs += [
        dict(name="plain-ep2dp2", steps=1, grads=True, **TRAIN_LAYOUTS["ep2dp2"], **{**S2, "moe_aux_loss_coeff": 0.0},
             **llava),
        dict(name="control-aux_loss-tp2ep2", steps=1, grads=True, moe_router_load_balancing_type="aux_loss",
             **TRAIN_LAYOUTS["tp2ep2"], **S2, **llava),
        dict(name="llava-pp4", steps=1, grads=True, pp=4, micro_batch_size=2, **S2, **llava),
        dict(name="llava-cp2ep2", steps=1, grads=True, cp=2, ep=2, micro_batch_size=2, count_syncs=True, **S2,
             **llava),
        dict(name="llava-pp2vpp2ep2", steps=1, grads=True, pp=2, num_virtual_stages_per_pipeline_rank=2, ep=2,
             micro_batch_size=2, count_syncs=True, **S2, **llava),  # virtual pipeline stages (issue 51)
        dict(name="recompute-pp2ep2", steps=1, grads=True, recompute_granularity="full", **TRAIN_LAYOUTS["pp2ep2"],
             count_syncs=True, **S2, **llava),
        dict(name="stage1-pp2ep2", steps=1, grads=True, **TRAIN_LAYOUTS["pp2ep2"],
             **{**S2, "stage": 1, "freeze_lm": True}, **llava),
        dict(name="bf16-tp2ep2", steps=6, precision="bf16", **TRAIN_LAYOUTS["tp2ep2"], **S2,
             **{**llava, "batches": "llava-long"}),
    ]
    resume = dict(start=1, steps=2, resume=str(saved / "iter_0000001"), reset_data_position=True, dist_optim=True,
                  **S2, **llava)
    jobs += [dict(name="resume-ep2dp2", **{**resume, **TRAIN_LAYOUTS["ep2dp2"], "reset_data_position": False}),
             dict(name="resume-pp2ep2", **{**TRAIN_LAYOUTS["pp2ep2"], **resume}),
             dict(name="resume-ep4", ep=4, micro_batch_size=2, **resume),
             dict(name="refused-ep1", refused=True, micro_batch_size=2, **{**resume, "steps": 1})]
    # experts unsplit at TP2 and EP1: 0.16 refuses the layout, 0.19 trains it (and refuses 0.16's optimizer state)
    jobs.append(dict(name="tp2etp1", steps=1, grads=True, tp=2, etp=1, micro_batch_size=2, refused=not AT_019,
                     **S2, **llava))
    if AT_019:
        from megatron_vlm.checkpoint import layout as ckpt
        from tests.support import cross_version

        run = FIXTURE / cross_version.RUN
        jobs.append(dict(cross_version.moe_job(run, refused=True, reset_data_position=True), megatron_dir=str(run),
                         hf_dir=str(run / ckpt.TOKENIZER_DIR), batches="llava"))
    return jobs


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory):
    """{"logits": {(model, tp, pp, ep, etp): max |logit diff| vs HF}, "runs": {job name: result}, "hf": HF's numbers}:
    one 4-process world for every logits and trainer job, then HF's own model on the same batches."""
    from tests.support import family_jobs, hf_reference, worlds
    from tests.support.train_jobs import job_config, train_jobs, variable_length_batches

    root = tmp_path_factory.mktemp("moe_world")
    logit_jobs, keys = _logit_jobs(tiny, root)
    sets = {"llava": (str(tiny["llava"][0]), 3, False, 1), "onevision": (str(tiny["onevision"][0]), 3, False, 1),
            "llava-long": (str(tiny["llava"][0]), 3, False, 2)}
    gen_jobs, want = _sharded_generation_jobs(tiny)
    logits, runs, generated = run_world(worlds.in_turn, 4, [
        (family_jobs.logit_diffs, (logit_jobs,)), (train_jobs, (_train_jobs(tiny, root), None, None, sets)),
        (worlds.sharded_generation, (gen_jobs,))])[0]
    out = {"logits": dict(zip(keys, logits)), "runs": {r["name"]: r for r in runs}, "hf": {},
           "generated": (gen_jobs, generated, want)}
    cfg = job_config(dict(S2, micro_batch_size=2), 3, 8)
    for m in ("llava", "onevision"):
        batches = variable_length_batches(tiny[m][0], 3)
        out["hf"][m] = hf_reference.train(tiny[m][0], batches, cfg, grads=True)
        out[f"batches-{m}"] = batches
    llava, batches = tiny["llava"][0], out["batches-llava"]
    out["hf"]["plain"] = hf_reference.train(llava, batches, cfg, steps=1, grads=True, aux_coeff=0.0)
    out["hf"]["stage1"] = hf_reference.train(llava, batches, job_config(dict(S2, stage=1, freeze_lm=True,
                                                                              micro_batch_size=2), 1, 8),
                                             steps=1, grads=True)
    out["specs"] = {m: VLMSpec.from_hf_dir(tiny[m][0]) for m in tiny}
    print("moe logits:", out["logits"])  # the closing note's numbers (pytest -s)
    for name, r in sorted(out["runs"].items()):
        print(f"{name}: " + (f"error {r['error']}" if "error" in r else f"loss {r['loss']} grad norm "
                             f"{r['grad_norm']} lb {[s.get('moe_load_balancing_loss') for s in r['moe']]}"))
    for name, r in out["hf"].items():
        print(f"HF {name}: loss {r['loss']} grad norm {r['grad_norm']} lb {r['lb']}")
    return out


def _sharded_generation_jobs(tiny):
    """eval/generate.py --engine megatron's jobs for the Qwen3-MoE LLaVA at EP2 and PP2 x EP2 (an image, text only),
    and HF's greedy tokens of the same prompts."""
    from PIL import Image

    from megatron_vlm.eval.generate import Generator, Sampling
    from megatron_vlm.eval.model import load
    from megatron_vlm.eval.prompts import user_message

    prompts = [([user_message("what colour is it?", 1)], [Image.new("RGB", (32, 32), (220, 30, 30))]),
               ([user_message("hi", 0)], [])]
    gen = Generator(load(model_dir=tiny["llava"][0]), Sampling(max_new_tokens=8))
    want = [gen.generate_ids([gen.encode(m, ims)])[0] for m, ims in prompts]
    jobs = [dict(megatron_dir=str(tiny["llava"][1]), tp=1, pp=pp, ep=2, prompts=prompts, max_new_tokens=8)
            for pp in (1, 2)]
    return jobs, want


@pytest.mark.slow
def test_sharded_generation_at_ep2_equals_hf(world):
    """megatron-core's inference engine on the sharded Qwen3-MoE LLaVA (eval/sharded.py; dense and MoE layers, in this
    module's world) gives HF's greedy tokens at EP2 and PP2 x EP2; TP x EP is refused in one line."""
    from megatron_vlm.eval.sharded import ShardedUnsupported, check_layout

    jobs, generated, want = world["generated"]
    assert len(set(want[0])) > 1 and want[0] != want[1], want  # the image prompt's tokens vary: every step counts
    for job, ids in zip(jobs, generated):
        assert ids == want, (job["pp"], job["ep"], ids, want)
    with pytest.raises(ShardedUnsupported, match="--tp 2 with --ep 2: .* generate at --tp 1 --ep 2"):
        check_layout(world["specs"]["llava"], 2, 1, 2)


def _gradients(world, name: str, model: str = "llava") -> dict[str, float]:
    from tests.support import grad_reference

    r = world["runs"][name]
    return grad_reference.assemble(r["grads"], world["specs"][model], **r["layout"])


def _differences(world, name: str, ref: str, model: str = "llava") -> dict[str, float]:
    from tests.support import grad_reference

    return grad_reference.compare(_gradients(world, name, model), world["hf"][ref]["grads"])


# ---- the logits ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llava", "onevision", "next", "mixtral"])
def test_logits_match_hf_at_every_layout(name, world):
    mine = {k: v for k, v in world["logits"].items() if k[0] == name}
    assert len(mine) >= len(LOGIT_LAYOUTS)
    assert all(v <= TOL for v in mine.values()), mine


def test_wrong_top_k_normalisation_fails_the_comparison(world):
    assert world["logits"][("next_wrong_normalisation", 2, 1, 2, None)] > 1e-3


@pytest.mark.parametrize("name,fmt,layout", [
    ("onevision", "torch_dist", dict(tp=2, ep=2)),
    ("onevision", "torch", dict(tp=2, ep=2)),
    ("mixtral", "torch", dict(tp=2, pp=2, ep=2, etp=1)),
])
def test_round_trip_is_byte_identical(name, fmt, layout, tiny, tmp_path):
    from megatron_vlm.checkpoint import layout as ckpt

    src = tiny[name][0]
    experts = VLMSpec.from_hf_dir(src).num_moe_experts
    meg = convert_hf_to_megatron(src, tmp_path / "meg", ckpt_format=fmt, **layout)
    if fmt == "torch":  # Megatron-LM's rank files: one per (TP, PP, EP) rank, experts under their local index
        ranks = sorted(p.name for p in (meg / "release").glob("mp_rank_*"))
        assert len(ranks) == layout["tp"] * layout.get("pp", 1) * layout["ep"], ranks
        f = ckpt.load_legacy_rank(meg / "release", 0, 0, layout.get("pp", 1), ep_rank=1, ep=layout["ep"])["model"]
        local = {int(k.split("local_experts.")[1].split(".")[0]) for k in f if "local_experts." in k}
        assert local == set(range(experts // layout["ep"])), local
    out = convert_megatron_to_hf(meg, tmp_path / "hf")
    a, b = HFReader(src), HFReader(out)
    assert a.names() == b.names() and any(f".experts.{experts - 1}." in n for n in a.names())
    for n in a.names():
        assert a.get(n).dtype == b.get(n).dtype and torch.equal(a.get(n), b.get(n)), n


# ---- the trainer's objective against HF's --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
@pytest.mark.parametrize("model", ["llava", "onevision"])
def test_every_gradient_equals_hfs_objective(world, model, layout):
    """The first step's gradient of every trained tensor (each expert, each router) against HF's objective: cross
    entropy + coefficient x load_balancing_loss_func, per micro batch, on padded micro batches."""
    spec, diffs = world["specs"][model], _differences(world, f"{model}-{layout}", model, model)
    assert sum(".mlp.experts." in n for n in diffs) == 3 * spec.num_moe_experts * 3
    assert sum(".mlp.gate." in n for n in diffs) == 3 and not any(n.startswith("vision_tower.") for n in diffs)
    worst = max(diffs.items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst


def test_four_pipeline_stages_exchange_the_counts_exactly(world):
    """PP4 (one layer per stage; the two middle stages get each micro batch's positions of samples from the first,
    and one of them holds the dense layer only): every gradient equals HF's objective."""
    r, ref = world["runs"]["llava-pp4"], world["hf"]["llava"]
    worst = max(_differences(world, "llava-pp4", "llava").items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst
    assert rel(r["moe"][0]["moe_load_balancing_loss"], ref["lb"][0]) <= RTOL


def test_context_parallel_ranks_route_their_chunks_under_hfs_objective(world):
    """CP2 x EP2 (expert groups over DP x CP): each CP rank routes its two load-balanced chunks of every row, the
    statistics are gathered over the sequence's ranks and the padding to --seq-length stays out: the loss, the logged
    load-balancing loss and every gradient equal HF's objective."""
    r, ref = world["runs"]["llava-cp2ep2"], world["hf"]["llava"]
    worst = max(_differences(world, "llava-cp2ep2", "llava").items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst
    assert rel(r["loss"][0], ref["loss"][0]) <= RTOL, (r["loss"], ref["loss"])
    assert rel(r["moe"][0]["moe_load_balancing_loss"], ref["lb"][0]) <= RTOL


def test_recomputed_routers_keep_the_term_and_count_once(world):
    """Full activation recomputation re-runs every router's forward inside the backward: the term's gradient is
    still HF's, and the routing numbers count each position once."""
    spec, r = world["specs"]["llava"], world["runs"]["recompute-pp2ep2"]
    worst = max(_differences(world, "recompute-pp2ep2", "llava").items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst
    positions = sum(int(s.num_tokens) for s in world["batches-llava"][0])
    assert [sum(layer) for layer in r["moe"][0]["moe_tokens_per_expert"]] == [spec.moe_router_topk * positions] * 3


def test_virtual_pipeline_stages_carry_hfs_objective(world):
    """PP2 x VPP2 x EP2 (issue 51: each rank's two model chunks of one layer each, the middle chunks fed each micro
    batch's positions of samples): the statistics of a micro batch are summed over a rank's chunks and exchanged once
    per stage, and the loss, the logged load-balancing loss and every gradient (routers, each expert, the dense
    layer) equal HF's objective."""
    spec, r, ref = world["specs"]["llava"], world["runs"]["llava-pp2vpp2ep2"], world["hf"]["llava"]
    assert len(r["layout"]["layers"]) == 4  # the four virtual stages, as a PP4 world's stages
    diffs = _differences(world, "llava-pp2vpp2ep2", "llava")
    assert sum(".mlp.experts." in n for n in diffs) == 3 * spec.num_moe_experts * 3
    worst = max(diffs.items(), key=lambda kv: kv[1])
    print(f"\nPP2 x VPP2 x EP2 vs HF: loss {r['loss']} vs {ref['loss'][:1]}, worst tensor {worst}")
    assert worst[1] <= RTOL, worst
    assert rel(r["loss"][0], ref["loss"][0]) <= RTOL, (r["loss"], ref["loss"])
    assert rel(r["moe"][0]["moe_load_balancing_loss"], ref["lb"][0]) <= RTOL


@pytest.mark.parametrize("name", ["llava-tp2ep2", "llava-cp2ep2", "recompute-pp2ep2", "llava-pp2vpp2ep2"])
def test_the_per_router_path_waits_for_no_device(world, name):
    """The first step of every rank, counted by tests.support.train_jobs.moe_host_syncs: inside every router's
    routing (megatron-core's, as the trainer wraps it), the HF term's backward and the per-micro-batch calls, no
    host sync (item, tolist, a tensor's bool/float/int, nonzero), and each micro batch's positions of samples built
    once per rank, on the device, whatever the routers (three MoE layers over one or two stages, two model chunks
    a rank, each router run again by recomputation) and the micro batches."""
    counts = world["runs"][name]["host_syncs"]
    print(f"\n{name}: per rank {counts}")
    for rank, c in enumerate(counts):
        assert c["syncs"] == 0, (rank, c)
        assert c["micro_batches"] > 0 and c["position_builds"] == (c["micro_batches"] if c["router_calls"] else 0), \
            (rank, c)
    assert sum(c["router_calls"] for c in counts) > sum(c["micro_batches"] for c in counts), counts
    pp = 2 if "pp2" in name else 1  # the stages exchange on a group of each pipeline's ranks (4 ranks: tp-dp-pp)
    assert all(c["exchange_ranks"] == (None if pp == 1 else [rank % 2, rank % 2 + 2])
               for rank, c in enumerate(counts)), [c["exchange_ranks"] for c in counts]


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
@pytest.mark.parametrize("model", ["llava", "onevision"])
def test_losses_load_balancing_and_grad_norms_equal_hf_for_three_adamw_steps(world, model, layout):
    r, ref = world["runs"][f"{model}-{layout}"], world["hf"][model]
    assert close(r["loss"], ref["loss"]), (r["loss"], ref["loss"])
    assert close([s["moe_load_balancing_loss"] for s in r["moe"]], ref["lb"]), (r["moe"], ref["lb"])
    assert close(r["grad_norm"], ref["grad_norm"]), (r["grad_norm"], ref["grad_norm"])


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
def test_routing_numbers_count_the_samples_positions_only(world, layout):
    """Each MoE layer routed top-k x the samples' image-expanded positions over the global batch: the padding to
    --seq-length (and to the longest sample) is in none of the counts."""
    spec, r = world["specs"]["llava"], world["runs"][f"llava-{layout}"]
    for step, batch in zip(r["moe"], world["batches-llava"], strict=True):
        positions = sum(int(s.num_tokens) for s in batch)
        assert positions < len(batch) * SEQ
        assert [sum(layer) for layer in step["moe_tokens_per_expert"]] == [spec.moe_router_topk * positions] * 3
        assert step["moe_load_imbalance"] >= 1.0


def test_the_load_balancing_term_dominates_every_routers_gradient(world):
    """On HF's side: the coefficient's part of each router's gradient is larger than the cross entropy's, so the
    comparisons above see the term (and the control below fails by the term)."""
    with_term, without = world["hf"]["llava"]["grads"], world["hf"]["plain"]["grads"]
    gates = [n for n in with_term if n.endswith(".mlp.gate.weight")]
    assert len(gates) == 3
    for n in gates:
        assert (with_term[n] - without[n]).norm() > without[n].norm(), n


def test_megatron_cores_aux_loss_fails_the_comparison(world):
    """The control: megatron-core's per-layer switch loss at the same coefficient is another objective."""
    diffs = _differences(world, "control-aux_loss-tp2ep2", "llava")
    gates = {n: d for n, d in diffs.items() if n.endswith(".mlp.gate.weight")}
    assert min(gates.values()) > 1e-2, gates


def test_coefficient_zero_is_hf_llavas_plain_cross_entropy(world):
    r, ref = world["runs"]["plain-ep2dp2"], world["hf"]["plain"]
    assert rel(r["loss"][0], ref["loss"][0]) <= RTOL and ref["aux"] == [0.0]
    assert "moe_load_balancing_loss" not in r["moe"][0]
    worst = max(_differences(world, "plain-ep2dp2", "plain").items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst


def test_stage1_projector_gets_the_load_balancing_gradient_as_in_hf(world):
    """Stage 1 trains the projector only; the routers' inputs depend on it, so the term's gradient reaches it."""
    diffs = _differences(world, "stage1-pp2ep2", "stage1")
    assert diffs and all(n.startswith("multi_modal_projector.") for n in diffs), sorted(diffs)
    assert max(diffs.values()) <= RTOL, diffs


def test_bf16_at_tp2_ep2_starts_at_hf_and_falls(world):
    r = world["runs"]["bf16-tp2ep2"]
    assert rel(r["loss"][0], world["hf"]["llava"]["loss"][0]) <= BF16_LOSS_RTOL, r["loss"]
    assert sum(r["loss"][-2:]) / 2 < 0.9 * sum(r["loss"][:2]) / 2, r["loss"]


# ---- resume ------------------------------------------------------------------------------------------------------
def test_resume_with_the_distributed_optimizer_is_exact_and_reshards(world):
    runs, hf = world["runs"], world["hf"]["llava"]
    full, same = runs["llava-ep2dp2"], runs["resume-ep2dp2"]
    assert same["loss"] == full["loss"][1:3] and same["grad_norm"] == full["grad_norm"][1:3]
    assert same["weights"] == full["weights"]  # every rank's parameters, bit for bit
    for other in ("resume-pp2ep2", "resume-ep4"):
        r = runs[other]
        assert close(r["loss"], hf["loss"][1:3]) and close(r["grad_norm"], hf["grad_norm"][1:3]), (other, r)


def test_resume_at_ep1_explains_the_optimizer_layout(world):
    """The checkpoint (EP2) keeps the experts' optimizer state apart; EP1 at TP1 keeps it together in both
    versions: refused before anything loads, with this megatron-core's rule and the fix."""
    error = world["runs"]["refused-ep1"]["error"]
    assert error and error.startswith("OptimizerStateMismatch:"), error
    assert "was saved at --ep 2 --etp 1 --tp 1 by megatron-core " in error
    assert "this run at --ep 1 --etp 1 --tp 1 keeps it together" in error
    assert mcore_version.expert_optimizer_rule() in error and "--no-load-optim" in error
    assert "(--ep 2 --etp 1)" in error


def test_experts_unsplit_at_tp2_and_ep1(world):
    """megatron-core 0.16 leaves the experts' gradients unsummed over the TP ranks at EP1 with ETP != TP: the
    trainer refuses the layout there. 0.19 trains it as HF does, and a checkpoint 0.16 wrote at that layout keeps the
    experts' optimizer state together, which 0.19 keeps apart: refused, naming both rules."""
    r = world["runs"]["tp2etp1"]
    if not AT_019:
        assert r["error"] and "--etp 1 with --tp 2 at --ep 1: megatron-core 0.16" in r["error"], r
        return
    worst = max(_differences(world, "tp2etp1", "llava").items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst
    error = world["runs"]["moe-resume"]["error"]
    written = json.loads((FIXTURE / "expected.json").read_text())["written_by"]["megatron_core"]
    assert error and error.startswith("OptimizerStateMismatch:"), error
    assert mcore_version.expert_optimizer_rule(written) in error and mcore_version.expert_optimizer_rule() in error
    assert "kept together with the other parameters" in error and "--ep 1 with --etp equal to --tp" in error


# ---- the user's commands -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coloured_data(tmp_path_factory):
    from PIL import Image

    from tests.support import forked_cli

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


def test_build_convert_train_export_generate(tiny, coloured_data, tmp_path):
    from megatron_vlm.convert.verify import load_hf_model
    from tests.support import forked_cli

    from .conftest import ROOT, script

    real = tiny["onevision"][0]
    spec, meg = VLMSpec.from_hf_dir(real), tmp_path / "meg"
    script("convert/hf_to_megatron.py").main(["--hf-dir", str(real), "--megatron-dir", str(meg), "--tp", "2", "--ep",
                                              "2", "--verify"])
    argv = ["--device", "cpu", "-g", "4", "--tp", "2", "--ep", "2", "--etp", "1", "--precision", "bf16",
            "--stage", "2", "--megatron-load-dir", str(meg), "--tokenizer-load-dir", str(real), "--data-path",
            str(coloured_data), "--save-dir", str(tmp_path / "runs"), "--name", "moe", "--seq-length", "96",
            "--packing-buffer-size", "8", "--packed-seq-length", "192", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1", "--num-workers", "1",
            "--lr", "2e-3", "--moe-token-dispatcher-type", "alltoall"]
    p = forked_cli.run([sys.executable, "train/run.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    out = p.stdout + p.stderr
    assert "sequence parallelism on: the mixture-of-experts language model trains at --tp 2" in out
    assert (f"mixture of experts: {spec.num_moe_experts} experts of {spec.moe_ffn_hidden_size}, top "
            f"{spec.moe_router_topk} per token ({'' if spec.moe_norm_topk_prob else 'not '}renormalised)") in out
    assert "ep=2 etp=1" in out
    assert ("load balancing: HF's load_balancing_loss_func over all 3 MoE layers together, per micro batch, padding "
            "excluded, coefficient 0.001 (the HF config's router_aux_loss_coef)") in out
    assert "sequence parallel over tp=2" in out and "alltoall dispatcher" in out
    records = [json.loads(x) for x in (tmp_path / "runs" / "moe" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4 and all(r["moe_load_imbalance"] >= 1 and r["padding_fraction"] < 1 for r in steps)
    assert all(len(r["moe_tokens_per_expert"]) == 3 and r["moe_load_balancing_loss"] > 0 for r in steps)
    export = convert_megatron_to_hf(tmp_path / "runs" / "moe", tmp_path / "export")
    model = load_hf_model(export)
    batch = reference_batch(VLMSpec.from_hf_dir(export)).hf_inputs(0)
    gen = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == batch["input_ids"].shape[1] + 3


@pytest.mark.te
def test_transformer_engine_grouped_experts_load_and_save_the_converted_checkpoint(tiny, tmp_path):
    """The GPU path's MoE layers (Transformer Engine, built on CPU through the construction shim; no forward): at
    EP2 the TE model's experts are one TEGroupedMLP per layer with its own pre-MLP norm, every tensor loads from the
    converted checkpoint and equals the local SequentialMLP's under the same sharded key, and what the TE model
    saves (torch_dist, and legacy rank files with TEGroupedMLP's ``linear_fc1.weightN`` names) loads back into the
    local layers unchanged."""
    from .conftest import require_te

    require_te()
    from tests.support import te_jobs

    hf, meg = tiny["mixtral"]
    job = {"name": "moe", "megatron_dir": str(meg), "tp": 1, "pp": 1, "ep": 2,
           "save": {"torch_dist": str(tmp_path / "te_dist"), "torch": str(tmp_path / "te_legacy")}}
    reports = run_world(te_jobs.run, 2, [job], [], str(meg), str(hf))[0]["layouts"]["moe"]
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
