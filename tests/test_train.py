"""Training through train/run.py on CPU with gloo (2 processes): loss falls at TP=2, PP=2 and DP=2 with the
distributed optimizer (also as two launcher "nodes" on loopback, and as a job on a real two-node SLURM cluster,
both with the one-node losses); a kill -9'd bf16 run with the distributed optimizer resumes exactly and its
checkpoint exports to an HF model that generates; a resume at another TP/DP layout is refused or, with
--reset-data-position, reshards and continues; frozen parameters stay bit-identical; PP evaluation with a
partial last batch ends. tests/test_train_parallel.py asserts the step's numbers across layouts."""

import os
import re
import time

import pytest
import torch

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.verify import verify_checkpoint
from megatron_vlm.launch.torchrun import free_port

from .launch_helpers import kill9_tree
from .slurm_cluster import start_cluster, stop
from .train_helpers import COLOURS, args, falls, launch, losses, run, setup, val_losses  # noqa: F401 (setup: fixture)

pytestmark = pytest.mark.slow

RESUME = ("--dist-optim", "--precision", "bf16", "--stage", "2", "--unfreeze-vit", "--global-batch-size", "8",
          "--save-interval", "6", "--deterministic")


@pytest.fixture(scope="module")
def bf16_full(setup):
    """An 18-iteration bf16 run at DP=2 with the distributed optimizer, checkpoints at 6, 12 and 18."""
    run(args(setup, "full", *RESUME, iters=18))
    return setup["root"] / "ckpt" / "full"


def test_bf16_dist_optim_loss_falls_and_kill9_resume_is_exact(setup, bf16_full, tmp_path):
    full = losses(bf16_full)
    falls(full)

    tracker = setup["root"] / "ckpt" / "part" / "latest_checkpointed_iteration.txt"
    p = launch(args(setup, "part", *RESUME, iters=18))
    deadline = time.time() + 300
    while time.time() < deadline and not (tracker.is_file() and tracker.read_text().strip() == "6"):
        assert p.poll() is None, p.stdout.read()[-4000:]
        time.sleep(0.02)
    kill9_tree(p.pid)
    p.wait()
    assert tracker.read_text().strip() == "6"
    out = run(args(setup, "part", *RESUME, iters=18))
    assert "resumed from" in out and "at iteration 6" in out, out[-3000:]
    part = losses(setup["root"] / "ckpt" / "part")
    assert [part[i]["loss"] for i in sorted(full)] == [full[i]["loss"] for i in sorted(full)]
    assert [part[i]["grad_norm"] for i in sorted(full)] == [full[i]["grad_norm"] for i in sorted(full)]

    # identical final weights; the bf16 training checkpoint exports to an HF model that loads and generates
    a = convert_megatron_to_hf(bf16_full, tmp_path / "full_hf")
    b = convert_megatron_to_hf(setup["root"] / "ckpt" / "part", tmp_path / "part_hf")
    ra, rb = HFReader(a), HFReader(b)
    assert ra.names() == rb.names()
    assert all(torch.equal(ra.get(n), rb.get(n)) for n in ra.names())
    orig = HFReader(setup["hf"])
    assert any(not torch.equal(orig.get(n).to(ra.get(n).dtype), ra.get(n)) for n in orig.names()
               if "layers.0.mlp" in n)
    generates(a)


def generates(hf_dir) -> None:
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(hf_dir))
    proc = AutoProcessor.from_pretrained(str(hf_dir))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape ?"}]}]
    inputs = proc(images=Image.new("RGB", (32, 32), COLOURS["blue"]),
                  text=proc.apply_chat_template(msgs, add_generation_prompt=True), return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    gen = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == inputs["input_ids"].shape[1] + 3
    answer = proc.tokenizer.decode(gen[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip(), "empty answer"


def test_resume_at_another_layout(setup, bf16_full):
    """iteration 12 of the DP=2 run resumed at TP=2 (DP=1): refused without --reset-data-position (before any
    rank starts); with it, model and distributed-optimizer state reshard and training continues from the
    checkpoint's weights (its loss, not the initial one)."""
    import shutil

    moved = setup["root"] / "ckpt" / "moved"
    shutil.copytree(bf16_full, moved, ignore=shutil.ignore_patterns("iter_0000018", "tensorboard", "wandb"))
    (moved / "latest_checkpointed_iteration.txt").write_text("12")
    (moved / "metrics.jsonl").unlink()
    other = ("--dist-optim", "--precision", "bf16", "--stage", "2", "--unfreeze-vit", "--global-batch-size", "8",
             "--save-interval", "100", "--tp", "2",
             "--use-checkpoint-opt-param-scheduler")  # the 18-iteration run's schedule, continued to 14
    p = launch(args(setup, "moved", *other, iters=14))
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0 and "data-parallel size 2 and this run has 1" in out and "--reset-data-position" in out
    assert "Traceback" not in out, out[-3000:]

    out = run(args(setup, "moved", *other, "--reset-data-position", iters=14))
    assert "at iteration 12" in out and "data position reset" in out and "RNG state not restored" in out, out[-3000:]
    resumed = losses(moved)
    before = losses(bf16_full)
    assert sorted(resumed) == [13, 14]
    assert abs(resumed[13]["loss"] - before[12]["loss"]) < 0.5 * before[12]["loss"] < before[1]["loss"] * 0.5


def test_stage1_freezes_lm_and_vit_and_skips_iterations(setup, tmp_path):
    out = run(args(setup, "stage1", "--tp", "2", "--stage", "1", "--global-batch-size", "8",
                   "--skip-train-iteration-range", "3-4", "--no-log-throughput", "--timing-log-level", "0",
                   iters=14, lr="1e-2"))
    ls = losses(setup["root"] / "ckpt" / "stage1")
    assert [i for i in sorted(ls) if ls[i]["skipped"]] == [3, 4]
    assert all(("timers" in r) != r["skipped"] and set(r.get("timers", {"step": 0})) == {"step"} for r in ls.values())
    assert "time ms (minmax over ranks): step " in out and " ms/iter" in out and "real tokens/s" not in out
    falls(ls, factor=0.98)  # only the projector learns in stage 1
    # (a TP=2 resume, where only TP rank 0 reads data and saves its position, is exact in test_remote_storage)
    out = convert_megatron_to_hf(setup["root"] / "ckpt" / "stage1", tmp_path / "hf")
    a, b = HFReader(setup["hf"]), HFReader(out)
    for n in a.names():
        same = torch.equal(a.get(n), b.get(n))
        if n.startswith("multi_modal_projector."):
            assert not same, f"{n} was not trained"
        else:
            assert same, f"frozen {n} changed"
    # the exported training checkpoint: HF logits equal Megatron's (fp32)
    assert verify_checkpoint(out, setup["root"] / "ckpt" / "stage1", tp=2, pp=1) < 1e-4


def test_pp2_loss_falls_with_validation_and_logs_timers_throughput_and_a_profile(setup):
    # micro batch 5 leaves a partial last validation batch, which PP stages must still exchange in full shape
    out = run(args(setup, "pp2", "--pp", "2", "--stage", "2", "--global-batch-size", "10", "--micro-batch-size", "5",
                   "--save-interval", "100", "--eval-interval", "6", "--eval-iters", "10", "--timing-log-level", "2",
                   "--timing-log-option", "all", "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
                   "--profile-ranks", "0,1", iters=12))
    run_dir = setup["root"] / "ckpt" / "pp2"
    ls = losses(run_dir)
    falls(ls)
    val = val_losses(run_dir)
    assert sorted(val) == [6, 12] and val[12] < val[6]
    # the training curves, drawn at the end by the rank that wrote metrics.jsonl (the last stage's, rank 1)
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    step_timers_throughput_and_profile(out, run_dir, ls, profiled=3)


def step_timers_throughput_and_profile(out: str, run_dir, ls: dict, profiled: int) -> None:
    """Every iteration's timers (level 2) partition its step, and the step is the iteration's time where nothing
    else ran between two (no log, evaluation or profile write); tokens/s in TensorBoard are the window's real
    tokens over its wall time; the profile of iteration ``profiled`` on both ranks, within its cap."""
    import gzip
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    parts = ("data-wait", "forward-backward", "optimizer", "loss-reduce")
    for r in ls.values():
        t = r["timers"]
        assert set(t) == {"step", "batch-load", "batch-distribute", *parts}, t
        assert sum(t[k] for k in parts) == pytest.approx(t["step"], rel=1e-9) and min(t.values()) >= 0
        assert t["data-wait"] == pytest.approx(t["batch-load"] + t["batch-distribute"], rel=1e-9)
    # not after a log (4), an evaluation (6), a stop-flag check (10), nor the profiler's start or trace write
    quiet = [i for i in ls if i - 1 in ls and (i - 1) % 4 and (i - 1) % 6 and (i - 1) % 10
             and i not in (profiled - 1, profiled + 1)]
    assert len(quiet) >= 4, quiet
    gaps = {i: ls[i]["time"] - ls[i - 1]["time"] for i in quiet}
    assert all(ls[i]["timers"]["step"] <= gaps[i] + 1e-3 for i in quiet), [(ls[i]["timers"]["step"], gaps[i])
                                                                            for i in quiet]  # (two clocks)
    assert sum(ls[i]["timers"]["step"] for i in quiet) >= 0.9 * sum(gaps.values()), (quiet, gaps)
    assert re.search(r"time ms \(all over ranks\): step [\d.]+/[\d.]+, data-wait ", out), out[-3000:]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {"timers/forward-backward-max", "timers/step-min", "perf/iteration_ms"} <= set(events.Tags()["scalars"])
    tps = {e.step: e.value for e in events.Scalars("perf/tokens_per_s")}
    assert sorted(tps) == [4, 8, 12]
    for a, b in ((4, 8), (8, 12)):  # the window's wall: from the log after iteration a to the one after b
        want = sum(ls[i]["tokens"] for i in range(a + 1, b + 1)) / (ls[b]["time"] - ls[a]["time"])
        assert tps[b] == pytest.approx(want, rel=0.1), (tps, want)
    files = sorted(p.name for p in (run_dir / "profile").iterdir())
    stems = [f"rank{r}_iter{profiled}-{profiled}" for r in (0, 1)]
    assert files == sorted(f"{s}.{kind}" for s in stems for kind in ("top.txt", "trace.json.gz")), files
    for stem in stems:
        trace = run_dir / "profile" / f"{stem}.trace.json.gz"
        assert trace.stat().st_size <= 16 * 2**20
        names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
        assert {"forward-backward", "optimizer", "batch-load"} <= names and "aten::mm" in names, sorted(names)[:50]
        table = (run_dir / "profile" / f"{stem}.top.txt").read_text()
        assert "Top ops by host (CPU) self time" in table and "Nothing was cut" in table, table[-2000:]


DP2 = ("--tp", "1", "--dist-optim", "--stage", "2", "--global-batch-size", "8", "--save-interval", "100",
       "--deterministic")
# on CPU the launcher gives each rank cores/-g threads (1 at -g 2 on this 2-core machine): the same per node
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def dp2_reference(setup):
    """The one-node DP=2 run (two processes, distributed optimizer, W&B offline) that multi-node runs repeat."""
    out = run(args(setup, "dp2", *DP2, "--wandb", iters=12), env={"WANDB_MODE": "offline"})
    return out, setup["root"] / "ckpt" / "dp2"


def test_dp2_distributed_optimizer_loss_falls_and_logs_and_two_nodes_match(setup, dp2_reference):
    out, run_dir = dp2_reference
    assert "dp=2" in out
    falls(losses(run_dir))
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline Weights & Biases run"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == [4, 8, 12] and {"perf/tokens_per_s", "perf/tflops_per_gpu"} <= set(events.Tags()["scalars"])
    assert all(r["flops"] > 0 for r in losses(run_dir).values())  # model FLOPs of every iteration recorded

    # the same run as two launcher processes ("nodes" on loopback, one rank each): identical losses, one checkpoint
    two_nodes = ("-g", "1", "--node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                 "--interface", "lo")
    nodes = [launch(args(setup, "dp2nodes", *DP2, *two_nodes, "--rank", str(r), iters=12), env=ONE_THREAD)
             for r in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "dp=2" in logs[0]
    multi = setup["root"] / "ckpt" / "dp2nodes"
    same_run(multi, run_dir)
    assert (multi / "config.yaml").is_file() and (multi / "config.node1.yaml").is_file()


def same_run(run_dir, reference) -> None:
    """Identical per-iteration losses, and one checkpoint at the last iteration."""
    assert {i: r["loss"] for i, r in losses(run_dir).items()} == {i: r["loss"] for i, r in losses(reference).items()}
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".iter", "iter_"))) == ["iter_0000012"]


def test_sbatch_job_on_a_real_slurm_cluster(setup, dp2_reference, tmp_path):
    """train/run.py --sbatch ... --submit on a real SLURM (two slurmd "nodes" on loopback, see slurm_cluster.py):
    the job's launchers take node count, rank and node 0's address from SLURM and repeat the one-node run."""
    cluster, daemons = start_cluster(tmp_path / "slurm")
    try:
        n = len(cluster.nodes)
        if n != 2 and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"one loopback host name only ({cluster.nodes}): the second node's rank and master address "
                        "cannot be checked; under CI they must be (add a 127.x alias for a second name to /etc/hosts)")
        out = run(args(setup, "slurm", *DP2, "-g", str(2 // n), "--sbatch", str(tmp_path / "job.sh"), "--nodes",
                       str(n), "--interface", "lo", "--submit", iters=12), env={**cluster.env, **ONE_THREAD})
        job_id = re.search(r"Submitted batch job (\d+)", out).group(1)
        cluster.wait_job(job_id, timeout=600)
    finally:
        stop(daemons)
    run_dir = setup["root"] / "ckpt" / "slurm"
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert f"SLURM job {job_id}: " in log and "dp=2" in log, log[-4000:] + cluster.logs()
    same_run(run_dir, dp2_reference[1])
    if n == 2:
        m = re.search(r"SLURM job \d+: node_rank=1, master_addr=([^,\s]+)", log)
        assert m and m.group(1) in cluster.nodes, log[-4000:]
        assert (run_dir / "config.node1.yaml").is_file()


ANSWERING = ("--tp", "2", "--pp", "2", "-g", "4", "--stage", "2", "--unfreeze-vit", "--global-batch-size", "8",
             "--dist-optim", "--save-interval", "3", "--deterministic")


def test_tp2_pp2_answers_during_training_equal_the_exports_and_leave_training_unchanged(setup, tmp_path):
    """A TP2 x PP2 run saved at 3 and 6 without held-out answers, then resumed from 3 with them every 2 iterations
    (at 4 and 6): the losses after each answering equal the run's without it, bit for bit; the rows and accuracy at
    each equal eval/evaluate.py's on that iteration's checkpoint, read as an HF model (HF's own generate)."""
    import json
    import sys

    from tests.support import forked_cli

    from .conftest import ROOT

    name = "answering"
    run(args(setup, name, *ANSWERING, iters=6))
    without = losses(setup["root"] / "ckpt" / name)
    k = ("--eval-generate-interval", "2", "--eval-generate-samples", "5", "--eval-generate-max-new-tokens", "4")
    out = run(args(setup, name, *ANSWERING, *k, "--ckpt-step", "3", iters=6))
    run_dir = setup["root"] / "ckpt" / name
    assert "at iteration 3" in out and "held-out answers: 5 samples of" in out, out[-3000:]
    with_answers = losses(run_dir)
    assert [with_answers[i]["loss"] for i in (4, 5, 6)] == [without[i]["loss"] for i in (4, 5, 6)]
    assert [with_answers[i]["grad_norm"] for i in (4, 5, 6)] == [without[i]["grad_norm"] for i in (4, 5, 6)]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    answered = {r["iteration"]: r for r in records if "eval_exact" in r}
    assert sorted(answered) == [4, 6] and all(r["eval_samples"] == 5 for r in answered.values()), answered
    for it in (4, 6):
        mine = run_dir / "eval_generate" / f"iter_{it:07d}.jsonl"
        assert re.search(rf"iter {it} \| held-out answers: accuracy [\d.]+% \(exact match\)", out), out[-3000:]
        if it == 6:  # iteration 4 has no checkpoint
            theirs = tmp_path / "export.jsonl"
            forked_cli.run([sys.executable, "eval/evaluate.py", "--megatron-dir", str(run_dir), "--iteration",
                            str(it), "--data-path", str(setup["data"]), "--split", "val", "--limit", "5", "--output",
                            str(theirs), "--max-new-tokens", "4", "--device", "cpu", "--dtype", "fp32",
                            "--no-progress"], check=True, cwd=ROOT, capture_output=True)
            assert mine.read_text() == theirs.read_text()
        rows = [json.loads(x) for x in mine.read_text().splitlines()]
        assert len(rows) == 5 and answered[it]["eval_exact"] == sum(r["correct"] for r in rows) / 5
    assert any(r["prediction"] for r in rows), rows  # the model answers something
    # a held-out prompt that cannot fit --seq-length with its new tokens: one line naming the sample, before a step
    p = launch(args(setup, "answering-long", *ANSWERING, "--eval-generate-interval", "2",
                    "--eval-generate-max-new-tokens", "60", iters=2))
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert re.search(r"--data-path \S+ 'val' split: sample \d+'s prompt is \d+ tokens \(images expanded\), which with "
                     r"--eval-generate-max-new-tokens 60 exceeds --seq-length 64", out), out[-3000:]
    assert "iter 1/2" not in out
    # an empty split: refused by the launcher, before any rank starts
    p = launch(args(setup, "answering-empty", *ANSWERING, "--eval-generate-interval", "2", "--eval-generate-split",
                    "test", iters=2))
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0 and "Traceback" not in out and "torchrun" not in out, out[-3000:]
    assert re.search(r"--data-path \S+ has (no|an empty) 'test' split, which --eval-generate-interval answers; pass "
                     r"--eval-generate-split train", out), out[-3000:]
