"""The learning-rate schedule on resume (issue 27 item 2): a finished 4-iteration cosine run extended to 8.

megatron-core's own ``OptimizerParamScheduler`` is driven here on a plain torch optimizer (no world): the state a
checkpoint holds is loaded the way a resume loads it, under each of Megatron-LM's two flags; without a flag the
resume is refused before anything is loaded. Also the refusal of optimizer state saved for other trained
parameters (item 5), from what ``ckpt_meta.json`` records.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.training import resume, schedule
from megatron_vlm.training.config import TrainConfig

REQ = ["--data-path", "/d", "--tokenizer-load-dir", "/t", "--init", "--device", "cpu", "--lr", "1e-3",
       "--lr-warmup-fraction", "0"]


def cfg(iters: int, *extra: str) -> TrainConfig:
    return TrainConfig.from_args([*REQ, "--train-iters", str(iters), *extra])


def finished_state() -> dict:
    """The scheduler state a 4-iteration cosine run saves at its end (learning rate decayed to --min-lr 0)."""
    s = schedule.build(cfg(4), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    s.step(increment=4)
    assert s.get_lr(s.optimizer.param_groups[0]) == 0.0
    return s.state_dict()


def resumed_lrs(c: TrainConfig, state: dict, steps: int) -> list[float]:
    """The learning rate of each step after loading ``state`` as a resume does."""
    s = schedule.build(c, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    s.load_state_dict(state)
    out = []
    for _ in range(steps):
        s.step(increment=1)
        out.append(s.get_lr(s.optimizer.param_groups[0]))
    return out


def test_extending_a_finished_run_needs_one_of_megatron_lms_flags():
    state = finished_state()
    saved = schedule.saved(state)
    assert "num_steps" not in saved and saved["lr_decay_steps"] == 4
    # no flag: refused, naming what differs and both flags (megatron-core's scheduler would assert)
    assert schedule.problem(saved, cfg(8), "/runs/x", 4) == (
        "/runs/x (iteration 4) was saved with another learning-rate schedule: --train-iters 4 (this run: 8). Pass "
        "--override-opt-param-scheduler to follow this command line (its schedule, continued at iteration 4), or "
        "--use-checkpoint-opt-param-scheduler to keep the checkpoint's (it ends at iteration 4; after that the "
        "learning rate stays at --min-lr 0.0)")
    with pytest.raises(AssertionError, match="do not match"):  # what megatron-core itself would do
        resumed_lrs(cfg(8), state, 1)
    assert schedule.problem(saved, cfg(4), "/runs/x", 4) is None  # the same schedule resumes as before
    assert "--lr 0.001 (this run: 0.002)" in schedule.problem(saved, cfg(4, "--lr", "2e-3"), "/runs/x", 4)

    # --override-opt-param-scheduler: the new 8-iteration cosine, continued at iteration 4
    c = cfg(8, "--override-opt-param-scheduler")
    assert schedule.problem(saved, c, "/runs/x", 4) is None
    want = [1e-3 * 0.5 * (1 + math.cos(math.pi * i / 8)) for i in (5, 6, 7, 8)]
    assert resumed_lrs(c, state, 4) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert schedule.note(saved, c, 4) == ("--override-opt-param-scheduler: this command line's learning-rate "
                                          "schedule from iteration 4 on (--train-iters 4 (this run: 8))")

    # --use-checkpoint-opt-param-scheduler: the checkpoint's schedule, which has ended: --min-lr, and the log says so
    c = cfg(8, "--use-checkpoint-opt-param-scheduler")
    assert resumed_lrs(c, state, 4) == [0.0] * 4
    assert schedule.note(saved, c, 4).endswith("it ends at iteration 4, so iterations 5-8 train at --min-lr 0.0")


def test_optimizer_state_of_another_stage_is_refused_naming_name_and_no_load_optim():
    meta = ckpt.CheckpointMeta("torch_dist", 1, 1, [2], iteration=10,
                               extra={"stage": 1, "trained": ["projector"], "optimizer": True})
    stage2 = cfg(20, "--stage", "2", "--save-dir", "/runs", "--name", "s1")
    assert resume.optimizer_problem(stage2, meta, "--save-dir/--name /runs/s1") == (
        "--save-dir/--name /runs/s1 holds the optimizer state of a stage-1 run that trained the projector, and this "
        "run trains the projector and language model (--stage 2): that state does not cover the parameters this run "
        "trains. To start stage 2 from its weights, give the new run another --name (with --megatron-load-dir "
        "/runs/s1); to continue in this run directory with a fresh optimizer, pass --no-load-optim")
    assert resume.optimizer_problem(cfg(20, "--stage", "1"), meta, "x") is None  # the same parts: resumes
    assert resume.optimizer_problem(cfg(20, "--stage", "2", "--no-load-optim"), meta, "x") is None
    meta.extra.pop("trained")  # a checkpoint that does not record it: the ranks check the tensors instead
    assert resume.optimizer_problem(stage2, meta, "x") is None
