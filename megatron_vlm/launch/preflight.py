"""Checks before anything starts: paths, prepared data, the checkpoint and its spec, the hardware.

Every check returns problems as strings that name the input and the fix; the launcher reports all of them
at once (``ConfigError``) instead of failing on the first after minutes of start-up on a cluster.
File-system checks (``check_request``) need only the config; hardware checks (``check_hardware``) take the
facts ``probe`` gathered in the runtime that will train.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_vlm import storage
from megatron_vlm.spec import SPEC_FILE, ParallelismError, VLMSpec
from megatron_vlm.training.config import TrainConfig

TRACKER_FILE = "latest_checkpointed_iteration.txt"
ENERGON_META = Path(".nv-meta") / "dataset.yaml"
FP8_MIN_CAPABILITY = (8, 9)


def check_data(data_path: str) -> list[str]:
    """An energon dataset directory with ``.nv-meta/dataset.yaml``, or a metadataset ``.yaml`` file."""
    if storage.is_remote(data_path):
        try:
            url = storage.check_url(data_path, "--data-path")
            base = storage.path(url)
            if url.endswith((".yaml", ".yml")) and base.is_file():
                return []
            if not (base / ENERGON_META).is_file():
                return [f"--data-path {url} is not a prepared energon dataset (no {ENERGON_META} there); write it "
                        f"with data_prep/make_wds.py --output {url}"]
        except storage.RemoteStorageError as e:
            return [str(e)]
        except Exception as e:  # unreachable endpoint, denied access, ...
            return [f"--data-path {data_path}: cannot read it ({type(e).__name__}: {e}); check the MSC profile's "
                    "endpoint and credentials"]
        return []
    p = Path(data_path)
    if not p.exists():
        return [f"--data-path {p}: no such file or directory"]
    if p.is_file():
        if p.suffix not in (".yaml", ".yml"):
            return [f"--data-path {p}: a file must be an energon metadataset .yaml; give the dataset "
                    "directory otherwise"]
        import yaml

        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            return [f"--data-path {p}: not valid YAML ({e})"]
        if not isinstance(data, dict):
            return [f"--data-path {p}: not an energon metadataset (expected a YAML mapping)"]
        if data.get("__class__", "MetadatasetV2") == "MetadatasetV2":
            return check_blend(p, data)
        return []
    if not (p / ENERGON_META).is_file():
        return [f"--data-path {p} is not a prepared energon dataset (no {ENERGON_META}); prepare it with "
                "data_prep/ (which runs `energon prepare`)"]
    return check_shards(p)


def check_shards(dataset: Path) -> list[str]:
    """Every shard energon's ``.nv-meta/.info.json`` lists exists and is as long as its ``.tar.idx`` says.

    The index holds each sample's start offset and the end of the last one, so a copy cut short (a full
    disk, an interrupted rsync) is found here by file sizes alone, before any rank starts."""
    import json

    import yaml

    fix = "copy the dataset again, or rebuild it with data_prep/make_wds.py"
    info_json, info_yaml = dataset / ".nv-meta" / ".info.json", dataset / ".nv-meta" / ".info.yaml"
    try:
        if info_json.is_file():
            info = json.loads(info_json.read_text())
        elif info_yaml.is_file():
            info = yaml.safe_load(info_yaml.read_text())
        else:  # nothing to compare with (energon itself reports it)
            return []
    except (ValueError, yaml.YAMLError) as e:
        return [f"--data-path {dataset}: {info_json.name} is corrupt ({str(e).splitlines()[0]}); run "
                "`energon prepare` again"]
    counts = info.get("shard_counts") if isinstance(info, dict) else None
    if not counts:
        return [f"--data-path {dataset}: the dataset has no shards (empty shard_counts); {fix}"]
    problems = []
    for name in counts:
        tar, idx = dataset / name, dataset / (name + ".idx")
        if not tar.is_file():
            problems.append(f"--data-path {dataset}: shard {tar} is missing; {fix}")
        elif idx.is_file() and idx.stat().st_size >= 8:
            with open(idx, "rb") as f:
                f.seek(idx.stat().st_size // 8 * 8 - 8)
                end = int.from_bytes(f.read(8), "little")
            size = tar.stat().st_size
            if size < end:
                problems.append(f"--data-path {dataset}: shard {tar} is truncated ({size} bytes, its index "
                                f"{idx.name} needs {end}); {fix}")
        if len(problems) >= 3:
            problems.append(f"--data-path {dataset}: (further shards not checked)")
            break
    return problems


def check_blend(yaml_path: Path, data: dict, depth: int = 0) -> list[str]:
    """An energon metadataset: every split blends at least one dataset with positive weight, each of them
    checked like ``--data-path`` (paths are relative to the YAML file)."""
    splits = data.get("splits")
    if not isinstance(splits, dict) or not splits:
        return [f"--data-path {yaml_path}: no 'splits' in the metadataset; write it with data_prep/stats.py"]
    problems = []
    for split, node in splits.items():
        if not isinstance(node, dict):
            problems.append(f"--data-path {yaml_path}: split {split!r} is not a mapping")
            continue
        if "blend" in node:
            entries = node["blend"] or []
            if not isinstance(entries, list):
                problems.append(f"--data-path {yaml_path}: split {split!r}: 'blend' must be a list")
                continue
            weights = [e.get("weight", 1.0) if isinstance(e, dict) else 0 for e in entries]
            if not any(isinstance(w, (int, float)) and w > 0 for w in weights):
                problems.append(f"--data-path {yaml_path}: split {split!r} blends no dataset with a positive "
                                "weight (empty blend); give positive weights (data_prep/stats.py --weights)")
                continue
            paths = [e.get("path") for e, w in zip(entries, weights) if isinstance(e, dict) and w and w > 0]
        elif "path" in node:
            paths = [node["path"]]
        else:  # other energon forms (blend_epochized, join, ...): energon checks them
            continue
        for rel in paths:
            if not isinstance(rel, str):
                problems.append(f"--data-path {yaml_path}: split {split!r} has an entry without a 'path'")
                continue
            target = (yaml_path.parent / rel) if not Path(rel).is_absolute() else Path(rel)
            if depth < 4 and not storage.is_remote(rel):
                problems += [f"{q} (in {yaml_path}, split {split!r})" for q in _check_local(target, depth + 1)]
    return sorted(set(problems), key=problems.index)


def _check_local(p: Path, depth: int) -> list[str]:
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            return [f"--data-path {p}: not valid YAML ({e})"]
        return check_blend(p, data, depth) if isinstance(data, dict) else \
            [f"--data-path {p}: not an energon metadataset (expected a YAML mapping)"]
    return check_data(str(p))


def read_tracker(ckpt_dir) -> str:
    """The iteration a Megatron checkpoint directory points at: an integer string or ``release``."""
    return (ckpt_dir / TRACKER_FILE).read_text().strip()


def check_checkpoint(ckpt_dir: str) -> list[str]:
    if storage.is_remote(ckpt_dir):
        try:
            ckpt_dir = storage.check_url(ckpt_dir, "--megatron-load-dir")
        except storage.RemoteStorageError as e:
            return [str(e)]
    d = storage.path(ckpt_dir)
    if not d.is_dir():
        return [f"--megatron-load-dir {d}: no such directory"]
    problems = []
    if not (d / SPEC_FILE).is_file():
        problems.append(f"--megatron-load-dir {d} has no {SPEC_FILE}: not a megatron-vlm checkpoint; convert one "
                        "with convert/hf_to_megatron.py (or pass --init to start from random weights)")
    if not (d / TRACKER_FILE).is_file():
        problems.append(f"--megatron-load-dir {d} has no {TRACKER_FILE}: the checkpoint is incomplete or not a "
                        "Megatron checkpoint; point at the directory that holds it")
        return problems
    it = read_tracker(d)
    if it == "release":
        sub = "release"
    elif re.fullmatch(r"\d+", it):
        sub = f"iter_{int(it):07d}"
    else:
        return problems + [f"--megatron-load-dir {d}: {TRACKER_FILE} reads {it!r}, expected an iteration number "
                           "or 'release'"]
    if not (d / sub).is_dir():
        problems.append(f"--megatron-load-dir {d}: {TRACKER_FILE} points at {sub}/, which does not exist")
    elif not storage.is_remote(ckpt_dir):
        from megatron_vlm.cli import InputError
        from megatron_vlm.cli.inputs import check_iteration_files

        try:  # JSON files and torch_dist shards, before the ranks read them
            check_iteration_files(d / sub)
        except InputError as e:
            problems.append(f"--megatron-load-dir {d}: {e}")
    return problems


def load_spec(cfg: TrainConfig) -> tuple[VLMSpec | None, str]:
    """The architecture the run will build, and where it came from ('' when unknown)."""
    if cfg.megatron_load_dir and (storage.path(cfg.megatron_load_dir) / SPEC_FILE).is_file():
        return VLMSpec.load(cfg.megatron_load_dir), storage.join(cfg.megatron_load_dir, SPEC_FILE)
    if cfg.init and cfg.tokenizer_load_dir and (Path(cfg.tokenizer_load_dir) / "config.json").is_file():
        try:
            return VLMSpec.from_hf_dir(cfg.tokenizer_load_dir), str(Path(cfg.tokenizer_load_dir) / "config.json")
        except ImportError:  # a bare host that launches into a container: the trainer checks it
            return None, ""
    return None, ""


def check_spec(cfg: TrainConfig, spec: VLMSpec, source: str) -> list[str]:
    problems = []
    try:
        spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers)
    except ParallelismError as e:
        problems.append(f"{e} (model: {source})")
    if cfg.seq_length <= spec.num_image_tokens:
        problems.append(f"--seq-length {cfg.seq_length} cannot hold the {spec.num_image_tokens} image tokens of one "
                        f"image plus text (model: {source}); use a larger --seq-length")
    if cfg.no_add_class_token and spec.has_class_token:
        problems.append(f"--no-add-class-token: the {spec.vision_family} vision encoder of {source} has a class "
                        "token, and its weights include it (the architecture comes from the checkpoint's "
                        "vlm_spec.json); drop the flag, or convert a model whose encoder has none (SigLIP)")
    return problems


def check_token_ids(cfg: TrainConfig, spec: VLMSpec | None, source: str, origin: str) -> list[str]:
    if spec is None:
        return []
    problems = []
    if spec.image_token_id >= 0 and cfg.image_token_id != spec.image_token_id:
        problems.append(f"image token id {cfg.image_token_id} ({origin}) differs from {spec.image_token_id} in "
                        f"{source}: the tokenizer and the checkpoint come from different model directories")
    if spec.pad_token_id is not None and cfg.pad_token_id != spec.pad_token_id:
        problems.append(f"pad token id {cfg.pad_token_id} ({origin}) differs from {spec.pad_token_id} in "
                        f"{source}: the tokenizer and the checkpoint come from different model directories")
    return problems


def check_request(cfg: TrainConfig) -> list[str]:
    """File-system checks of a resolved config."""
    problems: list[str] = []
    if cfg.data_path:
        problems += check_data(cfg.data_path)
    tok = Path(cfg.tokenizer_load_dir) if cfg.tokenizer_load_dir else None
    if tok is not None:
        if not tok.is_dir():
            problems.append(f"--tokenizer-load-dir {tok}: no such directory")
        elif not any((tok / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
            problems.append(f"--tokenizer-load-dir {tok} holds no tokenizer (tokenizer_config.json); give the "
                            "LLaVA directory written by convert/build_llava.py")
    problems += check_resume(cfg)
    if cfg.megatron_load_dir and not cfg.init:
        problems += check_checkpoint(cfg.megatron_load_dir)
    elif cfg.megatron_load_dir and not storage.is_remote(cfg.megatron_load_dir) and \
            not Path(cfg.megatron_load_dir).is_dir():
        problems.append(f"--megatron-load-dir {cfg.megatron_load_dir}: no such directory")
    if cfg.sif_path and not Path(cfg.sif_path).is_file():
        problems.append(f"--sif-path {cfg.sif_path}: no such image file")
    for b in cfg.bind:
        src = Path(b.split(":")[0]).expanduser()
        if not src.exists():
            problems.append(f"--bind {b}: {src} does not exist")
    if storage.is_remote(cfg.save_dir):
        try:
            storage.check_url(cfg.save_dir, "--save-dir")
        except storage.RemoteStorageError as e:
            problems.append(str(e))
    run = cfg.run_dir
    if run.exists() and not run.is_dir():
        problems.append(f"--save-dir/--name: {run} exists and is not a directory")
    problems += check_resume_layout(cfg)
    return problems


def check_resume_layout(cfg: TrainConfig) -> list[str]:
    """A resume at another data-parallel size is refused before ranks start (unless --reset-data-position)."""
    try:  # torch is imported here; a bare host that launches into a container leaves this to the trainer
        from megatron_vlm import checkpoint as ckpt
        from megatron_vlm.training.resume import check_data_position

        if ckpt.read_tracker(cfg.checkpoint_dir) is None:
            return []
        it_dir = ckpt.resolve_iteration_dir(cfg.checkpoint_dir)
        meta = ckpt.CheckpointMeta.load(it_dir)
    except Exception:  # an unreadable run dir is reported by the trainer with its own message
        return []
    world = cfg.world_size
    if world % (cfg.tp * cfg.pp):
        return []
    problem = check_data_position(cfg, meta, world // (cfg.tp * cfg.pp), it_dir)
    return [problem] if problem else []


def check_resume(cfg: TrainConfig) -> list[str]:
    """The run directory this launch resumes (``<save-dir>/<name>`` with a tracker): tracker, iteration
    directory, JSON files and torch_dist shards are checked like a converter's input."""
    if storage.is_remote(cfg.checkpoint_dir):
        return []
    d = Path(cfg.checkpoint_dir)
    if not (d / TRACKER_FILE).is_file():
        return []  # a new run
    from megatron_vlm.cli import InputError
    from megatron_vlm.cli.inputs import check_checkpoint

    try:
        check_checkpoint(d, flag="--save-dir/--name")
    except InputError as e:
        return [f"cannot resume the run in {d}: {e}; or start a new run with another --name"]
    return []


def check_hardware(cfg: TrainConfig, facts: dict) -> list[str]:
    """GPU count and FP8 support, from ``probe`` facts of the runtime that will train."""
    problems: list[str] = []
    if cfg.device != "cuda":
        return problems
    n = facts.get("device_count", 0)
    where = f" (torch {facts['torch']})" if "torch" in facts else ""
    if n == 0:
        problems.append(f"no CUDA GPU is visible{where}; run on a GPU node, or pass --device cpu")
    elif n < cfg.gpus:
        which = f" of --gpu-ids {','.join(map(str, cfg.gpu_ids))}" if cfg.gpu_ids else ""
        problems.append(f"-g {cfg.gpus} but only {n} CUDA GPU(s){which} are visible{where}; lower -g"
                        + (" or fix --gpu-ids" if cfg.gpu_ids else ""))
    if cfg.fp8:
        if not facts.get("transformer_engine"):
            err = facts.get("transformer_engine_error", "")
            problems.append(f"--fp8 needs Transformer Engine, which does not import here ({err}); use the NGC "
                            "container from containers/ (--sif-path/--docker-image) or drop --fp8")
        caps = [tuple(c) for c in facts.get("capabilities", [])[: cfg.gpus]]
        old = [f"GPU {i} is sm_{a}{b}" for i, (a, b) in enumerate(caps) if (a, b) < FP8_MIN_CAPABILITY]
        if old:
            problems.append(f"--fp8 needs compute capability 8.9+ (Ada, Hopper or newer): {', '.join(old)}; "
                            "drop --fp8")
        else:
            from megatron_vlm.fp8 import recipe_problem

            refused = [m for i, c in enumerate(caps) if (m := recipe_problem(cfg.fp8_recipe, c, gpu=f"GPU {i}"))]
            problems += refused[:1]
    return problems
