"""Sequence packing through train/run.py on CPU (local layers, gloo, 2 processes): exact resume (issue 36).

- a packed DP=2 run (energon packs from a buffer of samples, ``--packed-seq-length`` rows, the distributed
  optimizer) kill -9'd after its iteration-3 checkpoint and resumed gives bit-identical losses and grad norms at
  every iteration (the packing buffer's position is part of energon's saved loader state);
- its iteration-6 checkpoint resumed at TP=2 (DP=1) is refused without ``--reset-data-position`` and continues
  with it from the checkpoint's weights: the resumed run steps over iteration 7 (``--skip-train-iteration-range``)
  and evaluates there, and its validation loss (the whole 'val' split, packed) equals the straight run's at
  iteration 6, whose weights it holds, to a relative 1e-5 (fp32 at another TP/DP; measured 3e-8). A restart from
  the initial weights cannot pass: the training loss fell from 5.80 to 4.79 by iteration 6;
- the metrics count real samples and real (non-pad) tokens of the packs, with the padding fraction and the
  samples per pack.
"""

import shutil
import time

import pytest

from .launch_helpers import kill9_tree
from .train_helpers import args, launch, losses, run, setup, val_losses  # noqa: F401 (setup: fixture)

pytestmark = pytest.mark.slow

PACK = ("--packing-buffer-size", "8", "--packed-seq-length", "160", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--stage", "2", "--dist-optim", "--save-interval", "3", "--log-interval", "1",
        "--deterministic", "--eval-iters", "100", "--eval-interval", "6")
RTOL = 1e-5


@pytest.fixture(scope="module")
def packed_full(setup):
    out = run(args(setup, "packed", *PACK, iters=8))
    return out, setup["root"] / "ckpt" / "packed"


def test_packed_kill9_resume_is_exact(setup, packed_full):
    out, full_dir = packed_full
    assert "sequence packing into 160 positions" in out, out[-3000:]
    full = losses(full_dir)
    tracker = setup["root"] / "ckpt" / "packed_part" / "latest_checkpointed_iteration.txt"
    p = launch(args(setup, "packed_part", *PACK, iters=8))
    deadline = time.time() + 300
    while time.time() < deadline and not (tracker.is_file() and tracker.read_text().strip() == "3"):
        assert p.poll() is None, p.stdout.read()[-4000:]
        time.sleep(0.02)
    kill9_tree(p.pid)
    p.wait()
    assert tracker.read_text().strip() == "3"
    out = run(args(setup, "packed_part", *PACK, iters=8))
    assert "at iteration 3" in out, out[-3000:]
    part = losses(setup["root"] / "ckpt" / "packed_part")
    assert sorted(part) == sorted(full) == list(range(1, 9))
    assert [part[i]["loss"] for i in full] == [full[i]["loss"] for i in full]
    assert [part[i]["grad_norm"] for i in full] == [full[i]["grad_norm"] for i in full]
    # a pack holds several samples: the logged samples exceed the 4 packs of a global batch; the tokens are the
    # samples' own (real) positions, and the padding fraction is the rest of the 4 x 160 positions run
    assert all(r["samples"] > 4 for r in full.values())
    assert all(abs(r["padding_fraction"] - (1 - r["tokens"] / 640)) < 1e-12 and 0 <= r["padding_fraction"] < 0.5
               and r["samples_per_pack"] == r["samples"] / 4 for r in full.values())
    assert "real tokens/s | padding " in out and " samples/pack" in out


def test_packed_resume_at_another_data_parallel_size(setup, packed_full):
    _, full_dir = packed_full
    moved = setup["root"] / "ckpt" / "packed_moved"
    shutil.copytree(full_dir, moved, ignore=shutil.ignore_patterns("tensorboard", "wandb"))
    (moved / "latest_checkpointed_iteration.txt").write_text("6")
    (moved / "metrics.jsonl").unlink()
    other = (*PACK, "--tp", "2", "--save-interval", "100")
    p = launch(args(setup, "packed_moved", *other, iters=8))
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0 and "--reset-data-position" in out and "Traceback" not in out, out[-3000:]
    # iteration 7 consumes its batch without training, then evaluates: the weights are the checkpoint's
    out = run(args(setup, "packed_moved", *other, "--reset-data-position", "--skip-train-iteration-range", "7-7",
                   "--eval-interval", "7", iters=8))
    assert "at iteration 6" in out and "data position reset" in out, out[-3000:]
    resumed, before = losses(moved), losses(full_dir)
    assert sorted(resumed) == [7, 8] and resumed[7]["skipped"] and not resumed[8]["skipped"]
    val, val_before = val_losses(moved), val_losses(full_dir)
    rel = abs(val[7] - val_before[6]) / val_before[6]
    print(f"\nval loss of iteration 6's weights: straight (TP1 x DP2) {val_before[6]!r}, resumed at TP2 x DP1 "
          f"{val[7]!r}: relative {rel:.2e}; training loss at 1: {before[1]['loss']:.4f}, at 6: {before[6]['loss']:.4f}")
    assert rel <= RTOL, (val, val_before)
    assert before[6]["loss"] < 0.9 * before[1]["loss"]  # the checkpoint's weights are far from the initial ones
