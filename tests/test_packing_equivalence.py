"""Sequence packing on CPU with local layers, proven equal to unpacked training (issue 36).

The same samples are trained for one step unpacked (separate padded rows) and packed (the packing task encoder's
own packs: one 'thd' row per pack, megatron-core ``PackedSeqParams``, megatron's local attention once per segment
behind the CPU compatibility layer, megatron's per-segment RoPE), with the trainer's build and step
(:func:`tests.support.packing_check.equivalence_jobs`), in ONE 2-process world:

- a LLaVA (Llama + CLIP, GQA) and a LLaVA-OneVision (Qwen2 + SigLIP: anyres tiles of four image sizes, a
  two-image sample, a video, a video with an image, a text-only sample); in both, one sample starts with its
  image token;
- at TP2, PP2 and DP2 in fp32: the summed loss of all samples and the loss-token count, the grad norm and every
  gradient tensor agree to a relative 1e-5 (measured: <= 4e-7);
- a dataset of six identical samples (the first-iteration loss and grad norm, DP2);
- every pack on every rank holds at least two samples (the checks compare packed rows, not relabelled ones);
- bf16 (DP2): packing may not move the loss, grad norm or any gradient tensor further from the unpacked bf16 step
  than bf16 itself is from fp32 on the same step (the unpacked bf16 step against the unpacked fp32 one, measured
  in the same world): a packing defect shows as an error larger than the precision's own;
- the negative control: the same packs with attention across the samples of a pack (the local 'thd' attention
  given one segment for the whole row) fail these checks, at PP2 and for the OneVision at DP2;
- ``--attention-backend sdpa`` (issue 63: one scaled_dot_product_attention per pack with the block-diagonal causal
  mask of its ``cu_seqlens``) at TP2 (LLaVA) and PP2 (OneVision), with its control (one segment per row) at DP2;
- context parallelism (issue 49) at CP2: packs split per sample over the two ranks (each sample padded to 2 x CP in
  its own segment) give the unpacked step's loss and every gradient, for the LLaVA and the OneVision (videos
  included), and the unpacked CP2 step is the unpacked CP1 (DP2) one; the control: the CP attention's mask at
  contiguous positions (rank r holding the r-th half of the row, not megatron-core's chunks r and 2 x CP - 1 - r)
  fails.
- virtual pipeline stages (issue 51): a LLaVA of four language layers at PP2 x VPP2 (one layer per model chunk),
  two packs and two unpacked micro batches per step (the interleaved schedule runs micro batches in groups of PP),
  the packed step equal to the unpacked one in fp32 as above; the middle chunks take each pack's boundaries.
"""

from __future__ import annotations

import pytest

from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.runtime.spawn import run_world
from tests.support.packing_check import equivalence_jobs, sample_sets
from tests.support.train_jobs import encoder_for

pytestmark = pytest.mark.slow

RTOL = 1e-5
#: pack lengths at which first-fit decreasing puts two samples or more into every pack on every rank, at DP1 and in
#: each DP2 half (LLaVA samples of 48, 65, 40, 89 (image-first), 48 and 65 positions: 208 holds 89 + 65 + 48;
#: OneVision's ten samples: 272 holds the second half's 267)
LLAVA = dict(model="llava", packed_seq_length=208, seq_length=96)
OV = dict(model="ov", packed_seq_length=272, seq_length=128)


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory):
    from tests.support.tiny import make_tiny_onevision

    root = tmp_path_factory.mktemp("packing_eq")
    hf = hf_models["llama_clip"]
    ov = make_tiny_onevision(root / "ov")
    from tests.support.tiny import make_tiny_llava

    four = make_tiny_llava(root / "llava4", text_overrides={"num_hidden_layers": 4})
    models = {"llava": (convert_hf_to_megatron(hf, root / "llava_meg", tp=1), hf),
              "ov": (convert_hf_to_megatron(ov, root / "ov_meg", tp=1), ov),
              "llava4": (convert_hf_to_megatron(four, root / "llava4_meg", tp=1), four)}
    sets = {f"llava-{k}": v for k, v in sample_sets(encoder_for(hf, LLAVA["seq_length"])).items()}
    sets.update({f"ov-{k}": v for k, v in sample_sets(encoder_for(ov, OV["seq_length"])).items()})
    sets["llava4-mixed"] = sample_sets(encoder_for(four, LLAVA["seq_length"]))["mixed"]
    jobs = [
        dict(name="llava-tp2", tp=2, samples="llava-mixed", **LLAVA),
        dict(name="llava-pp2", pp=2, samples="llava-mixed", **LLAVA),
        dict(name="llava-dp2", samples="llava-mixed", **LLAVA),
        dict(name="llava-identical", samples="llava-identical", **LLAVA),
        dict(name="llava-dp2-bf16", samples="llava-mixed", precision="bf16", **LLAVA),
        dict(name="llava-pp2-broken", pp=2, samples="llava-mixed", broken=True, **LLAVA),
        dict(name="ov-tp2", tp=2, samples="ov-mixed", **OV),
        dict(name="ov-pp2", pp=2, samples="ov-mixed", **OV),
        dict(name="ov-dp2", samples="ov-mixed", **OV),
        dict(name="ov-dp2-bf16", samples="ov-mixed", precision="bf16", **OV),
        dict(name="ov-dp2-broken", samples="ov-mixed", broken=True, **OV),
        dict(name="llava-cp2", cp=2, samples="llava-mixed", **LLAVA),
        dict(name="ov-cp2", cp=2, samples="ov-mixed", **OV),
        dict(name="llava-cp2-broken", cp=2, samples="llava-mixed", broken=True, **LLAVA),
        # --attention-backend sdpa: one masked kernel per pack (the block-diagonal causal mask of its cu_seqlens)
        dict(name="llava-tp2-sdpa", tp=2, samples="llava-mixed", attention_backend="sdpa", **LLAVA),
        dict(name="ov-pp2-sdpa", pp=2, samples="ov-mixed", attention_backend="sdpa", **OV),
        dict(name="llava-dp2-sdpa-broken", samples="llava-mixed", attention_backend="sdpa", broken=True, **LLAVA),
        dict(name="llava-pp2vpp2", pp=2, num_virtual_stages_per_pipeline_rank=2, samples="llava4-mixed",
             unpacked_micro_batches=2, **dict(LLAVA, model="llava4")),
    ]
    out = run_world(equivalence_jobs, 2, jobs, models, sets)[0]
    return {r["name"]: r for r in out}


def fp32_failures(r: dict) -> list[str]:
    """What differs between the packed and the unpacked step beyond RTOL (empty: equal)."""
    bad = [k for k in ("loss_tokens", "samples", "tokens") if r[k][0] != r[k][1]]
    bad += [f"{k} {r[k]:.2e}" for k in ("loss_rel", "grad_norm_rel", "grad_rel") if not r[k] <= RTOL]
    return bad


@pytest.mark.parametrize("name", ["llava-tp2", "llava-pp2", "llava-dp2", "llava-identical", "ov-tp2", "ov-pp2",
                                  "ov-dp2", "llava-pp2vpp2", "llava-tp2-sdpa", "ov-pp2-sdpa"])
def test_packed_step_equals_unpacked_in_fp32(results, name):
    r = results[name]
    assert not fp32_failures(r), (fp32_failures(r), r)
    assert r["samples"][0] == (6 if name.startswith("llava") else 10)
    # really packed: every pack on every rank holds two samples or more (at DP2 each rank packs its own share)
    print(f"\n{name}: samples per pack on each rank {r['pack_sizes']}")
    assert all(sizes and min(sizes) >= 2 for sizes in r["pack_sizes"]), r["pack_sizes"]


@pytest.mark.parametrize("name", ["llava-dp2-bf16", "ov-dp2-bf16"])
def test_packed_bf16_within_bf16s_own_error(results, name):
    """Tolerance: bf16's own error on the same step (unpacked bf16 vs unpacked fp32, measured here), so a packing
    defect cannot hide in it; the loss sum is computed in fp32 from bf16 logits, its floor is 1e-5."""
    r = results[name]
    assert r["loss_tokens"][0] == r["loss_tokens"][1]
    assert r["precision_grad_rel"] > 1e-3  # the yardstick is bf16's (not zero: an fp32 step would give ~1e-7)
    assert r["grad_rel"] <= r["precision_grad_rel"], r
    assert r["grad_norm_rel"] <= max(r["precision_grad_norm_rel"], RTOL), r
    assert r["loss_rel"] <= max(r["precision_loss_rel"], RTOL), r


@pytest.mark.parametrize("name", ["llava-pp2-broken", "ov-dp2-broken", "llava-dp2-sdpa-broken"])
def test_attention_across_samples_fails_the_check(results, name):
    r = results[name]
    assert fp32_failures(r) and r["grad_rel"] > 1e-2 and r["loss_rel"] > 1e-5, r


@pytest.mark.parametrize("model", ["llava", "ov"])
def test_context_parallel_packs_equal_unpacked_and_cp1(results, model):
    r, cp1 = results[f"{model}-cp2"], results[f"{model}-dp2"]
    assert not fp32_failures(r), (fp32_failures(r), r)
    assert all(sizes and min(sizes) >= 2 for sizes in r["pack_sizes"]), r["pack_sizes"]
    # unpacked: CP2 on one row split over two ranks is CP1's step of the same samples
    assert r["loss_tokens"][0] == cp1["loss_tokens"][0]
    assert abs(r["loss_sum"][0] - cp1["loss_sum"][0]) <= 1e-6 * cp1["loss_sum"][0], (r["loss_sum"], cp1["loss_sum"])
    assert abs(r["grad_norm"][0] - cp1["grad_norm"][0]) <= 1e-6 * cp1["grad_norm"][0]


def test_context_parallel_mask_out_of_megatrons_order_fails_the_check(results):
    r = results["llava-cp2-broken"]
    assert fp32_failures(r) and r["grad_rel"] > 1e-2 and r["loss_rel"] > 1e-5, r


def test_megatron_core_is_changed_only_by_active_registry_patches(results):
    """Issue 62: after every job of the world (the CPU layer switched on, models built at TP2, PP2, DP2, CP2 and
    PP2 x VPP2, packed and unpacked steps forward and backward), on every rank, each change to megatron-core's
    modules and classes (and torch.cuda's, the mode stack, sys.modules' named entries) since the rank started is
    held by an active entry of megatron_vlm/runtime/mcore_patches.py; the active ones are process-wide (the CPU
    layer, packed local attention): none of the scoped ones (context parallelism's, the build's attention check)
    outlives the build or forward it served."""
    from megatron_vlm.runtime import mcore_patches

    for name, r in results.items():
        for rank, (unregistered, active, at_start) in enumerate(r["patches"]):
            assert at_start == [], (name, rank, at_start)
            assert unregistered == [], (name, rank, unregistered)
            scoped = [n for n in active if not mcore_patches.get(n).process_wide]
            assert not scoped, (name, rank, scoped)
            assert {"cpu-device-mode", "packed-local-attention"} <= set(active), (name, rank, active)
