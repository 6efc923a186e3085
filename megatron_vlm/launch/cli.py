"""``train/run.py``: validate a training request, then start it (or print it, or write a SLURM job).

Steps: parse (``TrainConfig.from_args``) -> fill from SLURM (``slurm``) -> resolve and validate the config ->
file-system checks (``preflight.check_request``; spec vs --tp/--pp) -> ask the runtime that will train about
GPUs, FP8 and the tokenizer (``probe``; inside the container when there is one) -> write the resolved config
to ``<save_dir>/<name>/config.yaml`` (node r > 0: ``config.node<r>.yaml``) -> run torchrun (in this process; in a
child process when a container wraps it), which starts ``train/pretrain_vlm.py --config <that file>`` on every
rank -> exit with torchrun's exit code.

A run that already reached ``--train-iters`` is not started: the launcher says so and exits 0 before the probe.
``--dry-run`` stops before writing and prints the memory estimate per GPU (``sizing``), the resolved config and the
command (the trainer's settings given as flags, since the config file is not written); a launch whose estimate
exceeds the GPU's memory (or ``--gpu-memory-gb``) gets a warning, not a refusal. ``--sbatch`` writes a batch script instead of launching. Every
failure ends in one line (``train/run.py: error: ...``, exit 2; a failed rank's reason is the last line); ``-v``
adds the traceback. The environment variable ``MEGATRON_VLM_ENTRYPOINT`` replaces the trainer script (tests use a
stand-in); it is not a user option.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_vlm.launch import container, failures, preflight, probe, process, sbatch, slurm
from megatron_vlm.launch.torchrun import Command, rank_env, rendezvous_port, torchrun_command
from megatron_vlm.training.config import ConfigError, TrainConfig

ENTRYPOINT_ENV = "MEGATRON_VLM_ENTRYPOINT"
DEFAULT_REPO_ROOT = Path(__file__).resolve().parents[2]


def _say(msg: str) -> None:
    print(f"[train/run.py] {msg}", file=sys.stderr, flush=True)


def entrypoint(repo_root: str) -> str:
    return os.path.abspath(os.environ.get(ENTRYPOINT_ENV) or Path(repo_root) / "train" / "pretrain_vlm.py")


class NothingToTrain(Exception):
    """The run in ``<save-dir>/<name>`` already reached ``--train-iters``; the message says so."""


def _fail_on(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else "\n".join(f"- {p}" for p in problems))


def prepare(argv: list[str] | None, repo_root: str) -> tuple[TrainConfig, Command | None, list[str]]:
    """Everything up to (not including) writing and launching: the resolved config, this node's command
    (None for --sbatch) and notes for the user; the memory estimate and its warning (:func:`memory_notes`) ride on
    the config as ``memory_estimate`` / ``memory_warning``.
    Raises ConfigError listing every problem found, and NothingToTrain (before any other check) when the run it
    resumes already reached --train-iters."""
    notes: list[str] = []
    request = TrainConfig.from_args(argv, resolve=False)
    job = None if request.sbatch else slurm.detect_slurm()
    env_defaults = slurm.defaults_from_slurm(job, request.nodes)
    if job is not None:
        notes.append(f"SLURM job {job.job_id}: " + ", ".join(f"{k}={v}" for k, v in env_defaults.items()
                                                                  if v is not None and getattr(request, k) is None))
    cfg = request.resolved(env_defaults)  # device still provisional ("cuda") when not given
    done = None if cfg.sbatch else preflight.finished_iteration(cfg)
    if done is not None:  # decided before anything heavy is imported or checked
        raise NothingToTrain(
            f"{cfg.checkpoint_dir} is already at iteration {done} of --train-iters {cfg.train_iters}: nothing to "
            "train. To train further, raise --train-iters and pass --override-opt-param-scheduler (this command "
            "line's learning-rate schedule) or --use-checkpoint-opt-param-scheduler (the checkpoint's); to start "
            "over, use another --name")

    problems = preflight.check_request(cfg)
    try:
        spec, source = preflight.load_spec(cfg)
    except Exception as e:  # an unreadable spec or config.json: report it with the others
        spec, source = None, ""
        problems.append(f"cannot read the model architecture: {e}")
    if spec is not None:
        unsupported = preflight.check_supported(spec, source)
        if unsupported:  # a family megatron-vlm does not train yet: that one line, before anything else
            _fail_on(unsupported)
        problems += _settle(cfg, spec, notes)
        problems += preflight.check_spec(cfg, spec, source)
    entry = entrypoint(repo_root)
    if not Path(entry).is_file():
        msg = f"trainer script {entry} not found"
        if cfg.dry_run or cfg.sbatch:
            notes.append(msg)
        else:
            problems.append(msg + "; run train/run.py from a complete megatron-vlm checkout")
    _fail_on(problems)
    if cfg.sbatch:  # the nodes' GPUs are not visible from here: --gpu-memory-gb is the limit, if given
        cfg.memory_estimate, cfg.memory_warning = memory_notes(cfg, spec, {})
        return cfg, None, notes

    # Ask the runtime that will train: the container when there is one (not in a dry run: that would start it).
    runtime = container.find_runtime(cfg, required=not cfg.dry_run) if cfg.container else None
    in_container = cfg.container is not None and not cfg.dry_run
    want_cuda = request.device != "cpu" and (in_container or cfg.container is None)
    want_tok = (cfg.image_token_id is None or cfg.pad_token_id is None) and cfg.tokenizer_load_dir
    facts: dict = {}
    tok_dir = cfg.tokenizer_load_dir if want_tok else None
    if want_cuda or in_container:  # CUDA is asked of a child (this process never initialises it), or the container
        env = rank_env(cfg)
        if in_container:
            prefix = container.wrap(Command(["python"], env), cfg, repo_root, runtime).argv
        else:
            prefix = [sys.executable]
        full_env = {**os.environ, **env}
        facts = probe.run_probe(prefix, full_env, repo_root, want_cuda, cfg.fp8 and want_cuda, tok_dir,
                                te=want_cuda and cfg.transformer_impl != "local")  # which layers and attention
    elif tok_dir:  # only the tokenizer, read by this host's python: no CUDA, so no process to start
        facts = probe.probe(False, False, tok_dir)
    if request.device is None and "device_count" in facts:
        device = "cuda" if facts["device_count"] > 0 else "cpu"
        if device == "cpu":
            notes.append("no CUDA GPU visible: running on CPU (gloo); pass --device cuda to insist")
        cfg = dataclasses.replace(request).resolved({**env_defaults, "device": device})
        if spec is not None:
            _fail_on(_settle(cfg, spec, []))
    if cfg.container and cfg.dry_run:
        notes.append(f"dry run: GPU/FP8 checks run inside the {cfg.container} container at launch")

    if spec is not None and request.micro_batch_size is None:  # stage 2 on CUDA: a micro batch that fits, not 1
        from megatron_vlm.launch import sizing
        from megatron_vlm.training.config.resolve import size_micro_batch

        note = size_micro_batch(cfg, spec, sizing.device_limit_gib(cfg, facts)[0], sizing.fused_attention(cfg, facts))
        if note:
            notes.append(note)
    problems = preflight.check_hardware(cfg, facts) if "device_count" in facts else []
    origin = "--image-token-id/--pad-token-id"
    tok = facts.get("tokenizer")
    if tok is not None:
        if "error" in tok:
            problems.append(f"cannot read the image/pad token ids from the tokenizer in {cfg.tokenizer_load_dir} "
                            f"({tok['error']}); pass --image-token-id and --pad-token-id")
        else:
            origin = f"tokenizer in {cfg.tokenizer_load_dir}"
            if cfg.image_token_id is None:
                cfg.image_token_id = tok["image"]
            if cfg.pad_token_id is None:
                cfg.pad_token_id = tok["pad"]
    if tok is None or "error" not in tok:
        problems += preflight.check_token_ids(cfg, spec, source, origin)
    _fail_on(problems)

    cfg.master_port = rendezvous_port(cfg)  # recorded in the config: the port actually used
    python = "python" if cfg.container else sys.executable
    # a dry run writes no config file: its command gives the trainer the same settings as flags
    trainer_args = dataclasses.replace(cfg, dry_run=False).to_argv() if cfg.dry_run else None
    cmd = torchrun_command(cfg, str(cfg.config_path), entry, python=python, port=cfg.master_port,
                           trainer_args=trainer_args)
    if cfg.container:
        cmd = container.wrap(cmd, cfg, repo_root, runtime)
    cfg.memory_estimate, cfg.memory_warning = memory_notes(cfg, spec, facts)
    notes = list(cfg.resolution_notes) + notes
    return cfg, cmd, notes


def _settle(cfg: TrainConfig, spec, notes: list[str]) -> list[str]:
    """The settings that follow from the model (``resolve.settle_with_spec``, e.g. sequence parallelism for a
    mixture-of-experts LM at --tp > 1): notes appended to ``notes``, problems returned."""
    from megatron_vlm.training.config.resolve import settle_with_spec

    try:
        notes += settle_with_spec(cfg, spec)
    except ConfigError as e:
        return [str(e)]
    return []


def memory_notes(cfg: TrainConfig, spec, facts: dict) -> tuple[list[str], str | None]:
    """The memory estimate's lines and its warning (``launch/sizing.py``); an estimate that cannot be made is a
    note, never a refusal."""
    if spec is None:
        return ["memory estimate: the model's architecture is read inside the container at launch"], None
    try:
        from megatron_vlm.launch import sizing

        return sizing.estimate_lines(cfg, spec, facts)
    except Exception as e:  # noqa: BLE001 - an estimate never stops a launch
        return [f"memory estimate unavailable ({type(e).__name__}: {e})"], None


def main(argv: list[str] | None = None, repo_root: str | os.PathLike | None = None) -> int:
    repo_root = str(Path(repo_root or DEFAULT_REPO_ROOT).resolve())
    cfg = None
    try:
        cfg, cmd, notes = prepare(argv, repo_root)
        for n in notes:
            _say(f"note: {n}")
        if getattr(cfg, "memory_warning", None):
            _say(f"warning: {cfg.memory_warning}")
        if cfg.sbatch:
            return _sbatch(cfg, repo_root)
        if cfg.dry_run:
            for line in getattr(cfg, "memory_estimate", ()):
                print(f"# {line}")
            print(f"# resolved config (dry run: not written; a launch writes it to {cfg.config_path} and starts the "
                  "trainer with --config)")
            print(cfg.to_yaml().rstrip())
            print(f"# command on node {cfg.node_rank} of {cfg.nodes} (dry run: not started; the trainer's settings "
                  "are given as flags)")
            print(cmd.display())
            return 0
        return _launch(cfg, cmd)
    except NothingToTrain as e:
        _say(str(e))
        return 0
    except (ConfigError, probe.ProbeError) as e:
        text = str(e)
        print("train/run.py: error:" + ("\n" if "\n" in text else " ") + text, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the launcher's error boundary: known faults in one line
        from megatron_vlm.cli import debug_requested, describe_error

        verbose = (cfg is not None and cfg.verbose) or debug_requested([a for a in (argv or []) if a != "--debug"])
        if verbose:
            import traceback

            traceback.print_exc()
        line = describe_error(e)
        if line is None:
            print(f"train/run.py: error: unexpected {type(e).__name__}: {e} (a bug: please report it with the "
                  + ("traceback above)" if verbose else "traceback that -v prints)"), file=sys.stderr)
            return 1
        print(f"train/run.py: error: {line}", file=sys.stderr)
        return 2


def _launch(cfg: TrainConfig, cmd: Command) -> int:
    """Write the config and run torchrun; a failed rank's reason is the last line."""
    from megatron_vlm.files.atomic import atomic_write_text

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cfg.config_path, cfg.to_yaml())
    _say(f"config: {cfg.config_path}")
    _say(f"node {cfg.node_rank}/{cfg.nodes}: {cmd.display()}")
    failures.clear(cfg.run_dir)
    # where a rank reports its failure when the run directory cannot take it (a full or read-only disk)
    fallback = tempfile.mkdtemp(prefix="mvlm-failures-")
    try:
        env = {**cmd.env, failures.FALLBACK_ENV: fallback}
        agent_args = cmd.agent_args_here()
        rc = (process.run_agent_here(agent_args, env) if agent_args is not None
              else process.run_forwarding_signals(cmd.argv, env))
        if rc:
            _say(f"training exited with code {rc}")
            failed = failures.first(cfg.run_dir, fallback)
            if failed is not None and rc < 128:  # a signal's ending is no rank's fault
                rank, reason, tb = failed
                where = f" (traceback: {tb})" if tb.is_file() and Path(fallback) not in tb.parents else ""
                _say(f"rank {rank} failed: {reason}{where}")
        return rc
    finally:
        shutil.rmtree(fallback, ignore_errors=True)


def _sbatch(cfg: TrainConfig, repo_root: str) -> int:
    if cfg.dry_run:
        config = sbatch.job_config_path(cfg.sbatch)
        for line in getattr(cfg, "memory_estimate", ()):
            print(f"# {line}")
        print(f"# {config} (dry run: not written)")
        print(sbatch.job_config(cfg).rstrip())
        print(f"# {cfg.sbatch} (dry run: not written)")
        print(sbatch.render_sbatch(cfg, config, repo_root, sys.executable).rstrip())
        return 0
    script, config = sbatch.write_job(cfg, repo_root, sys.executable)
    _say(f"wrote {script} and {config}")
    if cfg.submit:
        print(sbatch.submit(script))
    else:
        _say(f"submit with: sbatch {script}")
    return 0
