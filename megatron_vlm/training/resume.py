"""What a resumed run restores, decided from the checkpoint's metadata and this run's layout, and the restore.

A training checkpoint records the layout it was saved at (``ckpt_meta.json``: tp, pp and, in ``extra``, dp,
precision, distributed optimizer, samples consumed). On resume:

- model weights always load (torch_dist reshards them to any TP/PP);
- optimizer and scheduler load unless ``--no-load-optim`` or the checkpoint has none. Without them the optimizer
  starts fresh from the loaded weights (its fp32 main parameters are refreshed) and the learning-rate schedule
  continues at the checkpoint's iteration;
- the RNG state is per rank, so it loads only at the same TP/PP/DP (and unless ``--no-load-rng``);
- energon's data position is per data-parallel rank, so it loads only at the same DP size. At another DP size
  the resume is refused unless ``--reset-data-position``, which reads from a fresh position seeded by the seed
  and the iteration (deterministic, and logged with the samples consumed before it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from megatron_vlm import checkpoint as ckpt
from megatron_vlm.training import checkpointing

log = logging.getLogger("megatron_vlm.train")


class ResumeError(RuntimeError):
    """A resume that cannot continue as asked; the message names the flag that allows it."""


@dataclass
class ResumePlan:
    iter_dir: str
    iteration: int
    load_optim: bool
    load_rng: bool
    load_data: bool
    loader_seed: int
    notes: list[str] = field(default_factory=list)


def layout_extra(cfg, dp: int, consumed_samples: int) -> dict:
    """What a training checkpoint records about the run that saved it (``ckpt_meta.json`` ``extra``)."""
    return {"dp": dp, "precision": cfg.precision, "dist_optim": bool(cfg.dist_optim),
            "consumed_samples": int(consumed_samples), "global_batch_size": cfg.global_batch_size}


def check_data_position(cfg, meta: ckpt.CheckpointMeta, dp: int, where) -> str | None:
    """None if the data position can be restored at ``dp``, else the refusal (without --reset-data-position)."""
    saved = meta.extra.get("dp")
    if saved is None or saved == dp or cfg.reset_data_position:
        return None
    return (f"{where} was saved at data-parallel size {saved} and this run has {dp}: energon's data position is "
            f"kept per data-parallel rank and cannot move to another DP size. Resume with the same "
            f"-g/--node/--tp/--pp layout (DP {saved}), or pass --reset-data-position to continue from the "
            f"checkpoint's weights and optimizer with the data read from a fresh, deterministic position")


def plan(cfg, iter_dir, tp: int, pp: int, dp: int) -> ResumePlan:
    meta = ckpt.CheckpointMeta.load(iter_dir)
    problem = check_data_position(cfg, meta, dp, iter_dir)
    if problem:
        raise ResumeError(problem)
    iteration = int(meta.iteration)
    notes = []
    saved_dp = meta.extra.get("dp", dp)
    same_layout = (meta.tp, meta.pp, saved_dp) == (tp, pp, dp)
    load_optim = bool(cfg.load_optim and meta.extra.get("optimizer", False))
    if load_optim:
        for key, mine in (("dist_optim", bool(cfg.dist_optim)), ("precision", cfg.precision)):
            theirs = meta.extra.get(key)
            if theirs is not None and theirs != mine:
                raise ResumeError(
                    f"{iter_dir} holds optimizer state of a run with {key}={theirs}, this run has {key}={mine}; "
                    f"use the same setting, or pass --no-load-optim to continue from its weights with a fresh "
                    f"optimizer")
    elif cfg.load_optim:
        notes.append("the checkpoint has no optimizer state: fresh optimizer from its weights")
    else:
        notes.append("--no-load-optim: fresh optimizer from the checkpoint's weights")
    load_rng = cfg.load_rng and same_layout
    if cfg.load_rng and not same_layout:
        notes.append(f"RNG state not restored: saved at tp={meta.tp} pp={meta.pp} dp={saved_dp}, "
                     f"now tp={tp} pp={pp} dp={dp}")
    load_data = saved_dp == dp
    seed = cfg.seed
    if not load_data:
        seed = cfg.seed + iteration
        notes.append(f"data position reset (--reset-data-position): {meta.extra.get('consumed_samples', '?')} "
                     f"samples were consumed at dp={saved_dp}; reading from a fresh position seeded with "
                     f"{seed} at dp={dp}")
    return ResumePlan(str(iter_dir), iteration, load_optim, load_rng, load_data, seed, notes)


def restore(training, p: ResumePlan):
    """Load what ``p`` says into ``training`` (collective); returns this DP rank's loader state or None."""
    from megatron_vlm.training.build import weights_changed

    state = checkpointing.load(p.iter_dir, training.model, training.optimizer, training.scheduler, p.load_optim,
                               with_rng=p.load_rng, with_data=p.load_data)
    if int(state["iteration"]) != p.iteration:
        raise ResumeError(f"{p.iter_dir}: its ckpt_meta.json says iteration {p.iteration} but the checkpoint "
                          f"holds {state['iteration']}")
    if not p.load_optim:
        weights_changed(training)
        training.scheduler.step(increment=p.iteration)  # the learning-rate schedule continues where it was
    if p.load_rng:
        checkpointing.set_rng_state(state["rng_state"])
    if p.load_data and state["loader_state"] is None:
        raise ResumeError(f"{p.iter_dir} has no data-loader state; pass --reset-data-position to continue")
    return state["loader_state"]
