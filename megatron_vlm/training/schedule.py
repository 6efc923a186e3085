"""The learning-rate schedule: its settings from the config, megatron-core's scheduler built from them, and
what a resume does when the checkpoint was saved with another schedule.

The settings are those of megatron-core's ``OptimizerParamScheduler`` state (``max_lr``, ``lr_decay_steps``, ...),
so a checkpoint's ``scheduler`` state and its ``ckpt_meta.json`` record (``extra["schedule"]``) compare with
:func:`settings` key by key. A resume whose schedule differs (a larger ``--train-iters`` to extend a finished
run, another ``--lr``) follows Megatron-LM's flags:

- ``--override-opt-param-scheduler``: this command line's schedule, continued at the checkpoint's iteration;
- ``--use-checkpoint-opt-param-scheduler``: the checkpoint's schedule (past its end the learning rate stays at
  its ``--min-lr``, 0 by default);
- neither: refused, naming both flags (megatron-core's scheduler itself refuses a mismatch then, with an
  assertion; this says it before any rank starts, or before the optimizer state is read).

Imports nothing heavy; the launcher runs :func:`problem` before starting the ranks.
"""

from __future__ import annotations

#: the scheduler's settings that come from the config: state key -> how the user sets it
_SOURCE = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_decay_steps": "--train-iters",
    "lr_warmup_steps": "--lr-warmup-fraction",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "--train-iters",
    "wd_incr_style": None,
}


def settings(cfg) -> dict:
    """The schedule ``cfg`` asks for, as megatron-core's scheduler state (without its position ``num_steps``)."""
    return {
        "max_lr": float(cfg.lr), "min_lr": float(cfg.min_lr),
        "lr_warmup_steps": int(cfg.lr_warmup_fraction * cfg.train_iters), "lr_decay_steps": int(cfg.train_iters),
        "lr_decay_style": cfg.lr_decay_style, "start_wd": float(cfg.weight_decay), "end_wd": float(cfg.weight_decay),
        "wd_incr_steps": int(cfg.train_iters), "wd_incr_style": "constant",
    }


def build(cfg, optimizer):
    """megatron-core's ``OptimizerParamScheduler`` for ``cfg``, with Megatron-LM's two resume flags."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = settings(cfg)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if s["lr_warmup_steps"] else s["max_lr"], **s,
        use_checkpoint_opt_param_scheduler=bool(cfg.use_checkpoint_opt_param_scheduler),
        override_opt_param_scheduler=bool(cfg.override_opt_param_scheduler))


def saved(state: dict | None) -> dict | None:
    """The settings part of a scheduler state (``scheduler.state_dict()``, or the record in ``ckpt_meta.json``)."""
    if not state:
        return None
    return {k: state[k] for k in _SOURCE if k in state}


def differences(saved_settings: dict, cfg) -> list[str]:
    """What differs, in the user's flags: ``['--train-iters 4 (this run: 8)', ...]`` (one entry per flag)."""
    now = settings(cfg)
    out: dict[str, str] = {}
    for key, flag in _SOURCE.items():
        if flag is None or key not in saved_settings or saved_settings[key] == now[key] or flag in out:
            continue
        if key == "lr_warmup_steps":
            if saved_settings.get("lr_decay_steps") != now["lr_decay_steps"]:
                continue  # follows --train-iters, which is named
            out[flag] = f"{flag}: {saved_settings[key]} warmup iterations (this run: {now[key]})"
        elif key in ("wd_incr_steps",):
            continue  # equals lr_decay_steps (--train-iters)
        else:
            out[flag] = f"{flag} {saved_settings[key]} (this run: {now[key]})"
    return list(out.values())


def problem(saved_settings: dict | None, cfg, where, iteration: int) -> str | None:
    """The refusal of a resume whose schedule differs when neither flag was given (None: nothing to refuse)."""
    if saved_settings is None or cfg.override_opt_param_scheduler or cfg.use_checkpoint_opt_param_scheduler:
        return None
    diff = differences(saved_settings, cfg)
    if not diff:
        return None
    ends = saved_settings.get("lr_decay_steps")
    keep = f" (it ends at iteration {ends}; after that the learning rate stays at --min-lr " \
           f"{saved_settings.get('min_lr')})" if ends is not None and cfg.train_iters > ends else ""
    return (f"{where} (iteration {iteration}) was saved with another learning-rate schedule: {', '.join(diff)}. "
            f"Pass --override-opt-param-scheduler to follow this command line (its schedule, continued at iteration "
            f"{iteration}), or --use-checkpoint-opt-param-scheduler to keep the checkpoint's{keep}")


def note(saved_settings: dict | None, cfg, iteration: int) -> str | None:
    """What a resume with one of the two flags does to a differing schedule, for the log (None: nothing)."""
    if saved_settings is None:
        return None
    diff = differences(saved_settings, cfg)
    if not diff:
        return None
    if cfg.override_opt_param_scheduler:
        return (f"--override-opt-param-scheduler: this command line's learning-rate schedule from iteration "
                f"{iteration} on ({', '.join(diff)})")
    if cfg.use_checkpoint_opt_param_scheduler:
        ends = saved_settings.get("lr_decay_steps")
        past = f"; it ends at iteration {ends}, so iterations {max(ends, iteration) + 1}-{cfg.train_iters} " \
               f"train at --min-lr {saved_settings.get('min_lr')}" if ends is not None and cfg.train_iters > ends \
            else ""
        return f"--use-checkpoint-opt-param-scheduler: the checkpoint's learning-rate schedule ({', '.join(diff)}){past}"
    return None
