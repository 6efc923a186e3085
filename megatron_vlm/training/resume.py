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
  and the iteration (deterministic, and logged with the samples consumed before it);
- optimizer state covers the parameters the saving run trained (``extra["trained"]``): a run that trains others
  (stage 1's run directory resumed as stage 2) is refused, naming ``--name`` and ``--no-load-optim``;
- the loss objective (padded vocabulary rows in the softmax or not) is the checkpoint's (:mod:`.objective`);
- the learning-rate schedule is the checkpoint's (``extra["schedule"]``); another one needs
  ``--override-opt-param-scheduler`` or ``--use-checkpoint-opt-param-scheduler`` (:mod:`.schedule`);
- which iteration: the tracker's, or ``--ckpt-step N`` (Megatron-LM's flag). A damaged iteration (a file whose
  size or crc32 differs from the checksum manifest, a shard torch cannot read) is never loaded: the resume stops,
  naming the file and the newest complete iteration to pass to ``--ckpt-step`` (:func:`check_integrity`).

The launcher runs the same checks on ``ckpt_meta.json`` before any rank starts
(:func:`megatron_vlm.launch.preflight.check_resume_layout`); the ranks check again against the tensors they load,
for checkpoints that do not record it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.files import storage
from megatron_vlm.training import checkpointing, objective, schedule

log = logging.getLogger("megatron_vlm.train")


class ResumeError(RuntimeError):
    """A resume that cannot continue as asked; the message names the flag that allows it."""


#: what :func:`megatron_vlm.cli.describe_error` says of a torch_dist checkpoint whose files cannot be read
DAMAGED_WORDS = ("missing or truncated", "input/output error", "no such file or directory")


def resumes(cfg) -> bool:
    """Whether the run resumes ``<save-dir>/<name>``: it has a tracker, or ``--ckpt-step`` names one of its iteration
    directories (the launcher's :func:`megatron_vlm.launch.preflight.resumes`, for local and remote run dirs)."""
    run_dir = cfg.checkpoint_dir
    if ckpt.read_tracker(run_dir) is not None:
        return True
    step = getattr(cfg, "ckpt_step", None)
    return step is not None and storage.path(storage.join(run_dir, ckpt.iter_dir_name(step))).is_dir()


def _fix(cfg, iter_dir, resuming: bool) -> str:
    from megatron_vlm.checkpoint.checks import newest_complete_iteration, resume_fix

    where = ckpt.run_dir(iter_dir)
    if storage.is_remote(where):
        return "re-save it, or resume from an earlier iteration with --ckpt-step N"
    it = ckpt.CheckpointMeta.load(iter_dir).iteration if (storage.path(iter_dir) / ckpt.META).is_file() else None
    if resuming:
        return resume_fix(where, it)
    other = newest_complete_iteration(where, other_than=it)
    return "re-convert it" + (f", or load its newest complete iteration with --ckpt-step {other}" if other is not None
                              else "")


def report_run_dir(cfg, resumed_dir) -> None:
    """Log (rank 0) what the run directory holds besides the iteration it resumes: the temporary directories of
    saves that never committed (left for the user; never read), and, with ``--ckpt-step``, the tracker's newer
    iteration that the run passes over."""
    for d in checkpointing.interrupted_saves(cfg.checkpoint_dir):
        log.warning("an interrupted save left %s: not a checkpoint, never loaded; delete it when you no longer need "
                    "it", d)
    step = getattr(cfg, "ckpt_step", None)
    if resumed_dir is None or step is None:
        return
    tracked = ckpt.read_tracker(cfg.checkpoint_dir)
    if tracked is not None and tracked != step:
        log.warning("resuming from iteration %d (--ckpt-step) while the tracker names %s: the iterations after %d are "
                    "left as they are, and each is replaced when the run saves that iteration again; drop "
                    "--ckpt-step once the run has saved", step, tracked, step)


def check_integrity(cfg, iter_dir, resuming: bool) -> None:
    """Refuse a damaged iteration before anything is loaded: its files against its checksum manifests (collective;
    checkpoints without one, and every checkpoint with ``--no-verify-integrity``, pass). ``resuming``: ``iter_dir``
    is the run's own (the message names ``--ckpt-step``), else ``--megatron-load-dir``'s."""
    problems = checkpointing.damaged_files(iter_dir, getattr(cfg, "verify_integrity", True))
    if not problems:
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    what = f"cannot resume the run in {ckpt.run_dir(iter_dir)}" if resuming else \
        f"--megatron-load-dir {cfg.megatron_load_dir}"
    raise ResumeError(f"{what}: {problems[0]}{more}; the checkpoint is damaged: {_fix(cfg, iter_dir, resuming)}")


@dataclass
class ResumePlan:
    iter_dir: str
    iteration: int
    load_optim: bool
    load_rng: bool
    load_data: bool
    loader_seed: int
    notes: list[str] = field(default_factory=list)
    cfg: object = None  # the run's TrainConfig: the scheduler state read is checked against it


PART_NAMES = {"vision": "vision encoder", "projector": "projector", "language": "language model"}


def layout_extra(cfg, dp: int, consumed_samples: int, scheduler=None) -> dict:
    """What a training checkpoint records about the run that saved it (``ckpt_meta.json`` ``extra``): layout,
    precision, data consumed, what it trains (``trained``, whose optimizer state it holds) and, given the
    ``scheduler``, its learning-rate schedule."""
    out = {"dp": dp, "precision": cfg.precision, "dist_optim": bool(cfg.dist_optim),
           "consumed_samples": int(consumed_samples), "global_batch_size": cfg.global_batch_size,
           "stage": cfg.stage, "trained": [k for k, v in cfg.trained_parts.items() if v],
           objective.META_KEY: bool(cfg.loss_over_padded_vocab)}
    if cfg.cp > 1:  # context parallelism changes no weight, only which ranks hold the RNG states
        out["cp"] = cfg.cp
    if scheduler is not None:
        out["schedule"] = schedule.saved(scheduler.state_dict())
    return out


def _parts(names) -> str:
    names = [PART_NAMES.get(n, n) for n in PART_NAMES if n in names]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]


def optimizer_problem(cfg, meta: ckpt.CheckpointMeta, where) -> str | None:
    """The refusal of loading optimizer state saved for other trained parameters (None: it matches, it is not
    loaded, or the checkpoint does not record what it trained)."""
    saved = meta.extra.get("trained")
    if saved is None or not cfg.load_optim or not meta.extra.get("optimizer", False):
        return None
    now = [k for k, v in cfg.trained_parts.items() if v]
    if sorted(saved) == sorted(now):
        return None
    stage = meta.extra.get("stage")
    then = f"a stage-{stage} run" if stage is not None else "a run"
    return (f"{where} holds the optimizer state of {then} that trained the {_parts(saved)}, and this run trains the "
            f"{_parts(now)} (--stage {cfg.stage}): that state does not cover the parameters this run trains. To "
            f"start stage {cfg.stage} from its weights, give the new run another --name (with --megatron-load-dir "
            f"{cfg.checkpoint_dir}); to continue in this run directory with a fresh optimizer, pass --no-load-optim")


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
    """What to restore from ``iter_dir`` at this layout; raises :class:`ResumeError` for a resume that cannot
    continue as asked."""
    meta = ckpt.CheckpointMeta.load(iter_dir)
    problem = check_data_position(cfg, meta, dp, iter_dir)
    if problem:
        raise ResumeError(problem)
    notes: list[str] = []
    try:  # the run keeps the objective it was trained with (decided before the model is built)
        cfg.loss_over_padded_vocab = objective.resolve(cfg.loss_over_padded_vocab, meta.extra, iter_dir, notes)
    except ValueError as e:
        raise ResumeError(str(e)) from None
    iteration = int(meta.iteration)
    for refusal in (optimizer_problem(cfg, meta, iter_dir),
                    schedule.problem(meta.extra.get("schedule"), cfg, iter_dir, iteration) if cfg.load_optim else None):
        if refusal:
            raise ResumeError(refusal)
    saved_dp, saved_cp = meta.extra.get("dp", dp), meta.extra.get("cp", 1)
    same_layout = (meta.tp, meta.pp, saved_dp, saved_cp) == (tp, pp, dp, cfg.cp)
    load_optim = bool(cfg.load_optim and meta.extra.get("optimizer", False))
    if load_optim:
        for key, mine in (("dist_optim", bool(cfg.dist_optim)), ("precision", cfg.precision)):
            theirs = meta.extra.get(key)
            if theirs is not None and theirs != mine:
                raise ResumeError(
                    f"{iter_dir} holds optimizer state of a run with {key}={theirs}, this run has {key}={mine}; "
                    f"use the same setting, or pass --no-load-optim to continue from its weights with a fresh "
                    f"optimizer")
        schedule_note = schedule.note(meta.extra.get("schedule"), cfg, iteration)
        if schedule_note:
            notes.append(schedule_note)
    elif cfg.load_optim:
        notes.append("the checkpoint has no optimizer state: fresh optimizer from its weights")
    else:
        notes.append("--no-load-optim: fresh optimizer from the checkpoint's weights")
    load_rng = cfg.load_rng and same_layout
    if cfg.load_rng and not same_layout:
        cps = (f" cp={saved_cp}", f" cp={cfg.cp}") if (saved_cp, cfg.cp) != (1, 1) else ("", "")
        notes.append(f"RNG state not restored: saved at tp={meta.tp} pp={meta.pp} dp={saved_dp}{cps[0]}, "
                     f"now tp={tp} pp={pp} dp={dp}{cps[1]}")
    load_data = saved_dp == dp
    seed = cfg.seed
    if not load_data:
        seed = cfg.seed + iteration
        notes.append(f"data position reset (--reset-data-position): {meta.extra.get('consumed_samples', '?')} "
                     f"samples were consumed at dp={saved_dp}; reading from a fresh position seeded with "
                     f"{seed} at dp={dp}")
    return ResumePlan(str(iter_dir), iteration, load_optim, load_rng, load_data, seed, notes, cfg)


def _check_schedule(state: dict, p: ResumePlan) -> None:
    """The scheduler state read from the checkpoint against the run's config (for checkpoints whose
    ckpt_meta.json does not record the schedule, which the launcher could not check)."""
    refusal = schedule.problem(schedule.saved(state), p.cfg, p.iter_dir, p.iteration) if p.cfg is not None else None
    if refusal:
        raise ResumeError(refusal)


def restore(training, p: ResumePlan):
    """Load what ``p`` says into ``training`` (collective); returns this DP rank's loader state or None."""
    from megatron_vlm.training.build import weights_changed

    try:
        state = checkpointing.load(p.iter_dir, training.models, training.optimizer, training.scheduler, p.load_optim,
                                   with_rng=p.load_rng, with_data=p.load_data,
                                   schedule_check=lambda state: _check_schedule(state, p))
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        from megatron_vlm.cli import describe_error

        line = describe_error(e) if type(e).__name__ == "CheckpointException" else None
        if line is None or not any(w in line for w in DAMAGED_WORDS):
            raise  # not damage (a model that does not fit, a full disk, ...): its own message says what to do
        raise ResumeError(f"cannot resume the run in {ckpt.run_dir(p.iter_dir)} from {p.iter_dir}: {line}; "
                          f"{_fix(p.cfg, p.iter_dir, True)}") from e
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
