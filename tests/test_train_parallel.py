"""The trainer's step at every layout users run, asserted as equal numbers (gloo worlds on CPU).

The same three global batches of eight variable-length samples are trained at TP=1/PP=1/DP=1 (the reference),
with gradient accumulation, at TP=2, PP=2 and DP=2 (with and without the distributed optimizer, with overlapped
grad reduce / param gather), and with full or selective activation recomputation: the per-iteration loss and grad
norm must equal the reference's (fp32: 1e-5 relative). bf16 (megatron's Float16Module + mixed-precision /
distributed optimizer with fp32 main params) trains at TP=2, PP=2 and DP=2, its loss falls and its first loss is
within 1% of fp32's. A bf16 checkpoint resumed without optimizer state continues exactly as a fresh start from
its weights (the fp32 main params are refreshed); leaving them stale (the old defect) is shown to diverge. The
trainer's held-out answers between two steps (bf16 at PP2, and at DP2 with overlapped gathers) change no later step.

Each world runs every job of its size in one process group (one start-up per world).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.runtime.spawn import run_world
from tests.support.train_jobs import train_jobs
from tests.support.train_jobs import variable_length_batches as global_batches

pytestmark = pytest.mark.slow

RTOL = 1e-5


@pytest.fixture(scope="module")
def worlds(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    hf = hf_models["llama_clip"]
    meg = convert_hf_to_megatron(hf, root / "meg", tp=1)
    gbs = global_batches(hf, 3)
    bf16_ckpt = root / "bf16run"
    answering = dict(answer_after=3, eval_generate_interval=1, eval_generate_samples=4,
                     eval_generate_max_new_tokens=3, eval_generate_data=str(_held_out(root)),
                     tokenizer_load_dir=str(hf))
    one = [
        dict(name="ref", micro_batch_size=8),
        dict(name="accum", micro_batch_size=2, count_step_syncs=True),
        dict(name="recompute-full", micro_batch_size=8, recompute_granularity="full"),
        dict(name="recompute-block", micro_batch_size=8, recompute_granularity="full", recompute_method="block",
             recompute_num_layers=1),
        dict(name="recompute-selective", micro_batch_size=8, recompute_granularity="selective"),
        # bf16 resume without optimizer state: save after step 1, then continue three ways
        dict(name="bf16-save", micro_batch_size=4, precision="bf16", steps=1, save=str(bf16_ckpt)),
        dict(name="bf16-noopt", micro_batch_size=4, precision="bf16", resume=str(bf16_ckpt / "iter_0000001"),
             load_optim=False),
        dict(name="bf16-stale", micro_batch_size=4, precision="bf16", resume=str(bf16_ckpt / "iter_0000001"),
             load_optim=False, reload_weights=False),
    ]
    r1 = {r["name"]: r for r in run_world(train_jobs, 1, one, meg, hf, gbs)[0]}
    # the fresh start from the bf16 checkpoint's weights (a new world: the checkpoint exists now)
    fresh = [dict(name="bf16-fresh", micro_batch_size=4, precision="bf16")]
    long = gbs * 3  # nine steps for the bf16 "loss falls" checks
    two = [
        dict(name="tp2", tp=2, micro_batch_size=8, count_step_syncs=True),
        dict(name="pp2", pp=2, micro_batch_size=4, count_step_syncs=True),
        dict(name="dp2", micro_batch_size=4),
        dict(name="dp2-dist", micro_batch_size=2, dist_optim=True),
        dict(name="dp2-overlap", micro_batch_size=2, dist_optim=True, overlap_grad_reduce=True,
             overlap_param_gather=True, ddp_bucket_size=4000),
        dict(name="bf16-tp2", tp=2, micro_batch_size=8, precision="bf16", steps=9),
        dict(name="bf16-pp2", pp=2, micro_batch_size=4, precision="bf16", steps=9),
        # the trainer's held-out answers after step 3 (bf16 at PP2; DP2 replicas sharing them, the distributed
        # optimizer's overlapped parameter gathers paused), then the rest of the job
        dict(name="bf16-pp2-answering", pp=2, micro_batch_size=4, precision="bf16", steps=9, **answering),
        dict(name="dp2-overlap-answering", micro_batch_size=2, dist_optim=True, overlap_grad_reduce=True,
             overlap_param_gather=True, ddp_bucket_size=4000, **answering),
        dict(name="bf16-dp2-dist", micro_batch_size=4, precision="bf16", dist_optim=True, steps=9),
        # exact resume of the distributed optimizer in bf16: save after step 1, resume and run steps 2-3
        dict(name="dist-save", micro_batch_size=4, precision="bf16", dist_optim=True, steps=1,
             save=str(root / "distrun")),
        dict(name="dist-resume", micro_batch_size=4, precision="bf16", dist_optim=True, start=1, steps=2,
             resume=str(root / "distrun" / "iter_0000001")),
    ]
    r2 = {r["name"]: r for r in run_world(train_jobs, 2, two, meg, hf, long)[0]}
    r3 = {r["name"]: r for r in run_world(train_jobs, 1, fresh, bf16_ckpt, hf, gbs)[0]}
    return {**r1, **r2, **r3}


def _held_out(root):
    """A make_wds VQA dataset of four coloured squares, all in its 'val' split."""
    import json

    from PIL import Image

    from megatron_vlm.data.make_wds import make_wds

    (root / "img").mkdir()
    rows = []
    for i, (c, rgb) in enumerate({"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220),
                                  "yellow": (230, 210, 40)}.items()):
        Image.new("RGB", (32, 32), rgb).save(root / "img" / f"{i}.png")
        rows.append({"image": f"{i}.png", "question": "what colour is the square?", "answer": c, "id": str(i)})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_wds("vqa", root / "qa.jsonl", root / "held_out", image_root=root / "img", shard_size=4, split="0,1,0",
             progress=False)
    return root / "held_out"


def close(a: list, b: list, rtol=RTOL) -> bool:
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["accum", "tp2", "pp2", "dp2", "dp2-dist", "dp2-overlap", "recompute-full",
                                  "recompute-block", "recompute-selective"])
def test_same_global_batch_same_loss_and_grad_norm(worlds, name):
    ref, r = worlds["ref"], worlds[name]
    n = len(ref["loss"])
    assert close(r["loss"][:n], ref["loss"]), (name, r["loss"][:n], ref["loss"])
    assert close(r["grad_norm"][:n], ref["grad_norm"]), (name, r["grad_norm"][:n], ref["grad_norm"])


@pytest.mark.parametrize("name,reference", [("bf16-pp2-answering", "bf16-pp2"),
                                            ("dp2-overlap-answering", "dp2-overlap")])
def test_held_out_answers_between_steps_leave_training_unchanged(worlds, name, reference):
    """The trainer's held-out answers (megatron-core's generation on the trained model) after step 3: every later
    step's loss and grad norm, and the final weights, equal the job's without them, bit for bit; the four samples are
    answered in order (at DP2 each replica answered two)."""
    r, ref = worlds[name], worlds[reference]
    assert r["loss"] == ref["loss"] and r["grad_norm"] == ref["grad_norm"], (name, r["loss"], ref["loss"])
    assert r["weights"] == ref["weights"]
    assert [a["id"] for a in r["answers"]] == [f"{i:09d}" for i in range(4)], r["answers"]
    assert {a["reference"] for a in r["answers"]} == {"red", "green", "blue", "yellow"}


@pytest.mark.parametrize("name", ["bf16-tp2", "bf16-pp2", "bf16-dp2-dist"])
def test_bf16_trains_and_starts_within_1pct_of_fp32(worlds, name):
    r, ref = worlds[name], worlds["ref"]
    assert abs(r["loss"][0] - ref["loss"][0]) <= 0.01 * ref["loss"][0], (r["loss"][0], ref["loss"][0])
    first, last = sum(r["loss"][:3]) / 3, sum(r["loss"][-3:]) / 3
    assert last < 0.8 * first, f"{name}: loss did not fall ({first:.3f} -> {last:.3f})"
    assert all(g is not None and g > 0 for g in r["grad_norm"])


def test_bf16_resume_without_optimizer_state_continues_from_checkpoint_weights(worlds):
    fresh, noopt, stale = worlds["bf16-fresh"], worlds["bf16-noopt"], worlds["bf16-stale"]
    assert noopt["loss"] == fresh["loss"] and noopt["grad_norm"] == fresh["grad_norm"]
    # the negative control: without refreshing the fp32 main params the second step starts from random weights
    assert stale["loss"][0] == fresh["loss"][0]
    assert abs(stale["loss"][1] - fresh["loss"][1]) > 0.05, (stale["loss"], fresh["loss"])


#: what megatron-core itself reads back once per step: finalize_model_grads' `num_tokens > 0`, the grad norm
MCORE_PER_STEP = 2


@pytest.mark.parametrize("name", ["accum", "tp2", "pp2"])
def test_a_step_syncs_the_host_a_fixed_few_times(worlds, name):
    """The second step of a job, counted by tests/support/sync_count.py (the calls that would make the host wait
    for a GPU, the host batches excepted), by caller: with 4 micro batches (accum) or 2 at TP2 / PP2, ~50 parameter
    tensors and 2 + 3 layers, megatron-core reads back its two values of the step and nothing else does outside the
    step (no sync per micro batch, layer or tensor: the host layout, the foreach grad norm; the step's loss and counts
    stay on the device until the loop's log interval)."""
    for rank, sites in enumerate(worlds[name]["step_syncs"]):
        print(f"{name} rank {rank}: {sum(sites.values())} syncs", *(f"  {n} {k}" for k, n in sites.items()),
              sep="\n")
        assert sum(sites.values()) <= MCORE_PER_STEP, (name, rank, sites)
        assert all(k.split(" at ")[1].startswith("megatron/core/") for k in sites), (name, rank, sites)


def test_local_layers_mark_their_norms_for_sequence_parallelism(hf_models):
    """Local layers under sequence parallelism: torch's RMSNorm, each norm weight marked for the tensor-parallel
    gradient all-reduce (megatron-core's finalize sums the partial gradients of a norm applied to a sequence
    shard); without it the weights are unmarked. tests/test_train_reference.py and tests/test_moe.py train such
    layouts against HF."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vlm.model.build import LocalNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            tensor_model_parallel_size=2, sequence_parallel=True)
    norm = LocalNorm(cfg, 8, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-5 and norm.weight.sequence_parallel is True
    cfg.sequence_parallel = False
    assert not hasattr(LocalNorm(cfg, 8).weight, "sequence_parallel")


def test_bf16_distributed_optimizer_resume_is_exact(worlds):
    full, resumed = worlds["bf16-dp2-dist"], worlds["dist-resume"]
    assert resumed["loss"] == full["loss"][1:3] and resumed["grad_norm"] == full["grad_norm"][1:3]


@pytest.mark.parametrize("name,readers", [("ref", [0]), ("tp2", [0]), ("bf16-tp2", [0]), ("pp2", [0, 1]),
                                          ("dp2", [0, 1])])
def test_data_is_read_once_per_tensor_parallel_group(worlds, name, readers):
    """Only TP rank 0 of the first and last pipeline stage read data (the others receive it by broadcast); the
    TP=2 runs above still give the TP=1 losses and grad norms."""
    assert worlds[name]["readers"] == readers
