"""Checks before anything starts: paths, prepared data, the checkpoint and its spec, the hardware.

Everything a run depends on is checked here, before any rank starts: the checkpoint it loads or the run it
resumes (tracker, shards, the spec against the tensors, optimizer state and learning-rate schedule against
this run), the tokenizer, every dataset split it reads (train; validation when ``--eval-iters`` > 0), and
the directories it writes (writable, and not inside an input). Every check returns problems as strings that
name the input and the fix; the launcher reports all of them at once (``ConfigError``) instead of failing on
the first after minutes of start-up on a cluster. File-system checks (``check_request``) need only the
config; hardware checks (``check_hardware``) take the facts ``probe`` gathered in the runtime that will
train (which also loads the tokenizer). A finished run (``finished_iteration``) is not started at all.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from pathlib import Path

from megatron_vlm.files import storage
from megatron_vlm.model.spec import SPEC_FILE, ParallelismError, VLMSpec, family_name
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


def check_checkpoint(ckpt_dir: str, iteration: int | None = None) -> list[str]:
    """``--megatron-load-dir`` of a new run: its tracker's iteration, or ``iteration`` (``--ckpt-step``)."""
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
    if iteration is not None:
        it = str(iteration)
    elif not (d / TRACKER_FILE).is_file():
        problems.append(f"--megatron-load-dir {d} has no {TRACKER_FILE}: the checkpoint is incomplete or not a "
                        "Megatron checkpoint; point at the directory that holds it"
                        + (", or pick one of its iterations with --ckpt-step" if _iterations(d) else ""))
        return problems
    else:
        it = read_tracker(d)
    if it == "release":
        sub = "release"
    elif re.fullmatch(r"\d+", it):
        sub = f"iter_{int(it):07d}"
    else:
        return problems + [f"--megatron-load-dir {d}: {TRACKER_FILE} reads {it!r}, expected an iteration number "
                           "or 'release'"]
    if not (d / sub).is_dir():
        which = f"--ckpt-step {iteration} names" if iteration is not None else f"{TRACKER_FILE} points at"
        have = ", ".join(f"iter_{i:07d}" for i in _iterations(d)) or "none"
        problems.append(f"--megatron-load-dir {d}: {which} {sub}/, which does not exist (iterations there: {have})")
    elif not storage.is_remote(ckpt_dir):
        from megatron_vlm.cli import InputError
        from megatron_vlm.checkpoint.checks import check_iteration_files, newest_complete_iteration

        try:  # JSON files, the checksum manifest's sizes, torch_dist shards and torch files, before ranks read them
            check_iteration_files(d / sub, "re-convert it")
        except InputError:
            other = newest_complete_iteration(d, other_than=it)
            fix = "re-convert it" + (f", or load its newest complete iteration with --ckpt-step {other}"
                                     if other is not None else "")
            try:
                check_iteration_files(d / sub, fix)
            except InputError as e:
                problems.append(f"--megatron-load-dir {d}: {e}")
        else:
            problems += _check_spec_files(d, d / sub, "--megatron-load-dir")
    return problems


def _iterations(d) -> list[int]:
    """The ``iter_XXXXXXX`` directories of a local checkpoint directory (complete or not)."""
    d = Path(d)
    return sorted(int(p.name[5:]) for p in d.iterdir() if re.fullmatch(r"iter_\d{7}", p.name) and p.is_dir()) \
        if d.is_dir() else []


def resumes(cfg: TrainConfig) -> bool:
    """Whether this launch resumes the run in ``<save-dir>/<name>``: it has a tracker, or ``--ckpt-step`` names one
    of its iteration directories."""
    try:
        d = storage.path(cfg.checkpoint_dir)
        return (d / TRACKER_FILE).is_file() or \
            (cfg.ckpt_step is not None and (d / f"iter_{cfg.ckpt_step:07d}").is_dir())
    except Exception:  # noqa: BLE001 - an unreachable object store is reported by check_request
        return False


def _iteration_dir(ckpt_dir, iteration: int | None = None):
    """The iteration directory ``iteration`` of ``ckpt_dir``, else the one its tracker points at (``ckpt_dir``
    itself when it is one), or None when it cannot be told (no or bad tracker: reported by the other checks)."""
    d = storage.path(ckpt_dir)
    if (d / "ckpt_meta.json").is_file() or (d / ".metadata").is_file():
        return d
    try:
        it = str(iteration) if iteration is not None else read_tracker(d)
    except OSError:
        return None
    sub = "release" if it == "release" else f"iter_{int(it):07d}" if re.fullmatch(r"\d+", it) else None
    return d / sub if sub is not None and (d / sub).is_dir() else None


def load_spec(cfg: TrainConfig) -> tuple[VLMSpec | None, str]:
    """The architecture the run will build, and where it came from ('' when unknown): the ``vlm_spec.json``
    of the iteration the trainer reads (the run it resumes, else ``--megatron-load-dir``), which travels with
    the weights; the directory-level copy must agree with it (:func:`check_spec_copies`)."""
    ckpt_dir = cfg.checkpoint_dir if resumes(cfg) else cfg.megatron_load_dir
    if ckpt_dir:
        it_dir = _iteration_dir(ckpt_dir, cfg.ckpt_step)
        for d in ([it_dir] if it_dir is not None else []) + [storage.path(ckpt_dir)]:
            if (d / SPEC_FILE).is_file():
                return VLMSpec.load(d), str(d / SPEC_FILE)
    if cfg.init and cfg.tokenizer_load_dir and (Path(cfg.tokenizer_load_dir) / "config.json").is_file():
        try:
            return VLMSpec.from_hf_dir(cfg.tokenizer_load_dir), str(Path(cfg.tokenizer_load_dir) / "config.json")
        except ImportError:  # a bare host that launches into a container: the trainer checks it
            return None, ""
    return None, ""


def check_spec_copies(ckpt_dir, flag: str, it_dir=None) -> list[str]:
    """A checkpoint directory's ``vlm_spec.json`` and its iteration's copy (the one read with the weights) agree."""
    d = storage.path(ckpt_dir)
    it_dir = it_dir if it_dir is not None else _iteration_dir(ckpt_dir)
    top, inner = d / SPEC_FILE, (it_dir / SPEC_FILE) if it_dir is not None else None
    if inner is None or it_dir == d or not top.is_file() or not inner.is_file():
        return []
    try:
        a, b = json.loads(top.read_text()), json.loads(inner.read_text())
    except ValueError:
        return []  # an unreadable JSON file is reported by check_iteration_files
    diff = sorted(k for k in set(a) | set(b) if k != "hf_config" and a.get(k) != b.get(k))
    if not diff:
        return []
    shown = ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in diff[:3]) + (", ..." if len(diff) > 3 else "")
    return [f"{flag} {d}: {top} disagrees with {inner} ({shown}); the iteration's copy was saved with the weights: "
            f"restore {top} from it (cp {inner} {top}) if the weights are what you want"]


def _expected_shapes(spec: VLMSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Global shapes of a few torch_dist tensors, from the spec (and the spec fields that give them)."""
    h, vh = spec.hidden_size, spec.vision_hidden_size
    merged = spec.projector_input_size
    projector = {  # the Qwen-VL patch merger: merged width -> merged width -> hidden_size
        "vision_projection.encoder.linear_fc1.weight": ((merged, merged), "the patch merger's width, "
                                                        "vision_hidden_size x spatial_merge_size^2, twice"),
        "vision_projection.encoder.linear_fc2.weight": ((h, merged), "hidden_size, the patch merger's width"),
    } if spec.is_qwen_vl else {
        "vision_projection.encoder.linear_fc1.weight":
            ((h, merged), "hidden_size, vision_hidden_size (x4 after InternVL's pixel shuffle)"),
    }
    return {
        "language_model.embedding.word_embeddings.weight":
            ((spec.padded_vocab_size, h), "vocab_size padded to make_vocab_size_divisible_by, hidden_size"),
        "language_model.decoder.layers.self_attention.linear_proj.weight":
            ((spec.num_layers, h, spec.num_attention_heads * spec.kv_channels),
             "num_layers, hidden_size, num_attention_heads x kv_channels"),
        "vision_model.decoder.layers.self_attention.linear_proj.weight":
            ((spec.vit_num_layers, vh, vh), "vision layers up to vision_feature_layer, vision_hidden_size"),
        **projector,
    }


def check_spec_against_tensors(spec: VLMSpec, source: str, it_dir) -> list[str]:
    """The spec's shapes against the tensors of a torch_dist checkpoint (its ``.metadata`` index): a spec that
    does not describe the weights fails here instead of in every rank's load."""
    it_dir = Path(it_dir)
    if storage.is_remote(it_dir) or not (it_dir / ".metadata").is_file():
        return []
    from megatron_vlm.checkpoint.dcp_index import UnreadableIndex, read_index

    try:
        shapes = read_index(it_dir).shapes
    except UnreadableIndex:  # a damaged index: check_iteration_files reports it
        return []
    for key, (want, fields) in _expected_shapes(spec).items():
        for name in (key, "model." + key):  # older megatron-vlm checkpoints: keys under "model."
            have = shapes.get(name)
            if have is not None and have != want:
                return [f"{source} does not describe the checkpoint's tensors in {it_dir}: {key} has shape "
                        f"{tuple(have)}, the spec gives {want} ({fields}); restore the {SPEC_FILE} that was saved "
                        "with these weights"]
    return []


def check_supported(spec: VLMSpec, source: str) -> list[str]:
    """The one problem of a model family that megatron-vlm converts but does not train yet, or none."""
    from megatron_vlm.model.spec import UnsupportedArchitectureError

    try:
        spec.check_supported("training")
    except UnsupportedArchitectureError as e:
        return [f"{e} (model: {source})"]
    return []


def qwen_vl_problems(cfg: TrainConfig, spec: VLMSpec, source: str) -> list[str]:
    """What a Qwen2.5-VL or Qwen3-VL run asks for that its training does not do yet (issue 64: megatron-core's local
    layers), one line each naming the flag and the fix; none for another model."""
    if not spec.is_qwen_vl:
        return []
    asked = [("--fp8", cfg.fp8, "drop it"),
             ("--sequence-parallel", cfg.sequence_parallel, "drop it"),
             (f"--recompute-granularity {cfg.recompute_granularity}", cfg.recompute_granularity, "drop it"),
             ("Transformer Engine layers", cfg.transformer_impl == "transformer_engine" or (
                 cfg.device == "cuda" and cfg.transformer_impl is None), "pass --transformer-impl local")]
    family = family_name(spec.arch)
    return [f"{flag} with {family} is not supported yet ({source} trains on megatron-core's local layers); {fix}"
            for flag, on, fix in asked if on]


def check_spec(cfg: TrainConfig, spec: VLMSpec, source: str) -> list[str]:
    problems = check_supported(spec, source) + qwen_vl_problems(cfg, spec, source)
    try:
        spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers, cfg.ep, cfg.etp)
        cfg.vpp_size(spec)  # virtual pipeline stages: each rank's layers split into equal chunks
    except ParallelismError as e:
        problems.append(f"{e} (model: {source})")
    if spec.is_moe and cfg.container is None:  # the megatron-core that will train is this environment's
        problem = _expert_layout_problem(cfg)
        if problem:
            problems.append(f"{problem} (model: {source})")
    if spec.is_moe and cfg.cp > 1 and cfg.packing:
        problems.append(f"sequence packing with --cp {cfg.cp} is not supported for the mixture-of-experts language "
                        f"model of {source} (each packed sample is padded to 2 x CP inside its segment, and that "
                        "padding would be routed and counted): drop --packed-seq-length, or use --cp 1")
    if cfg.cp > 1 and cfg.cp_comm_type == "a2a":
        heads, groups = spec.num_attention_heads // cfg.tp, spec.num_query_groups // max(cfg.tp, 1)
        if heads % cfg.cp or groups % cfg.cp:
            problems.append(f"--cp-comm-type a2a spreads attention heads over the CP ranks: the {heads} heads and "
                            f"{groups} KV heads per TP rank of {source} do not divide by --cp {cfg.cp}; use "
                            "--cp-comm-type p2p or allgather")
    if cfg.seq_length <= spec.num_image_tokens:
        problems.append(f"--seq-length {cfg.seq_length} cannot hold the {spec.num_image_tokens} image tokens of one "
                        f"image plus text (model: {source}); use a larger --seq-length")
    if cfg.no_add_class_token and spec.has_class_token:
        problems.append(f"--no-add-class-token: the {spec.vision_family} vision encoder of {source} has a class "
                        "token, and its weights include it (the architecture comes from the checkpoint's "
                        "vlm_spec.json); drop the flag, or convert a model whose encoder has none (SigLIP)")
    return problems


def _expert_layout_problem(cfg: TrainConfig) -> str | None:
    """megatron-core's version-dependent refusal of an expert layout (:mod:`megatron_vlm.runtime.mcore_version`); None
    where this environment has no megatron-core (the ranks check again at start-up)."""
    import importlib.metadata

    from megatron_vlm.runtime import mcore_version

    try:
        return mcore_version.expert_layout_problem(cfg.ep, cfg.expert_tp, cfg.tp)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    """File-system checks of a resolved config: inputs, the run it resumes, outputs."""
    problems: list[str] = []
    if cfg.data_path:
        problems += check_data(cfg.data_path)
        if not problems:
            problems += check_splits(cfg)
    problems += check_eval_generate_data(cfg)
    if cfg.tokenizer_load_dir:
        from megatron_vlm.cli import InputError
        from megatron_vlm.cli.inputs import check_tokenizer_dir

        try:  # its JSON files parse; the probe then loads it with transformers
            check_tokenizer_dir(cfg.tokenizer_load_dir, "--tokenizer-load-dir")
        except InputError as e:
            problems.append(str(e))
    problems += check_resume(cfg)
    if cfg.megatron_load_dir and not cfg.init:
        problems += check_checkpoint(cfg.megatron_load_dir, None if resumes(cfg) else cfg.ckpt_step)
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
    problems += check_output_not_in_inputs(cfg)
    run = cfg.run_dir
    if run.exists() and not run.is_dir():
        problems.append(f"--save-dir/--name: {run} exists and is not a directory")
    else:
        problems += check_outputs(cfg)
    problems += check_resume_layout(cfg)
    return problems


# ---- what the run reads: every split ---------------------------------------------------------------------
def _split_names(data_path: str) -> dict[str, bool] | None:
    """Split name -> has data, for an energon dataset directory (``split.yaml``) or a metadataset (its
    ``splits``); None when it cannot be told here (energon decides)."""
    import yaml

    p = storage.path(data_path)
    try:
        if str(data_path).endswith((".yaml", ".yml")):
            data = yaml.safe_load(p.read_text()) or {}
            splits = data.get("splits") if isinstance(data, dict) else None
            return {k: bool(v) for k, v in splits.items()} if isinstance(splits, dict) else None
        data = yaml.safe_load((p / ".nv-meta" / "split.yaml").read_text()) or {}
    except Exception:  # noqa: BLE001 - no split.yaml, unreadable: energon reports it
        return None
    parts = data.get("split_parts") if isinstance(data, dict) else None
    return {k: bool(v) for k, v in parts.items()} if isinstance(parts, dict) else None


def check_splits(cfg: TrainConfig) -> list[str]:
    """The splits the run reads have data: 'train', and 'val' when --eval-iters > 0."""
    names = _split_names(cfg.data_path)
    if names is None:
        return []
    needed = [("train", "")] + ([("val", f" and --eval-iters {cfg.eval_iters} evaluates on it")]
                                if cfg.eval_iters > 0 else [])
    problems = []
    for split, why in needed:
        if not names.get(split):
            what = "has no" if split not in names else "has an empty"
            fix = "rebuild it with data_prep/make_wds.py --split (e.g. 9,1,0)" + \
                (", or pass --eval-iters 0" if split == "val" else "")
            problems.append(f"--data-path {cfg.data_path} {what} '{split}' split{why}; {fix}")
    return problems


def check_eval_generate_data(cfg: TrainConfig) -> list[str]:
    """The dataset and split ``--eval-generate-interval`` answers (``--eval-generate-data``, else ``--data-path``)."""
    if not cfg.eval_generate_interval:
        return []
    path, flag = cfg.eval_generate_data or cfg.data_path, "--eval-generate-data" if cfg.eval_generate_data else \
        "--data-path"
    if not path:
        return []
    if cfg.eval_generate_data:
        problems = [m.replace("--data-path", flag, 1) for m in check_data(path)]
        if problems:
            return problems
    names = _split_names(path)
    split = cfg.eval_generate_split
    if names is None or names.get(split):
        return []
    what = "has no" if split not in names else "has an empty"
    others = [k for k, v in names.items() if v and k != split]
    return [f"{flag} {path} {what} '{split}' split, which --eval-generate-interval answers; "
            + (f"pass --eval-generate-split {others[0]}, or " if others else "")
            + "rebuild it with data_prep/make_wds.py --split (e.g. 9,1,0)"]


# ---- what the run writes ------------------------------------------------------------------------------------
def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def writable_problem(d, flag: str) -> str | None:
    """None if a file can be created in directory ``d`` (or, when ``d`` does not exist yet, in its nearest
    existing parent, where it would be created); else the problem, naming ``flag`` and the path."""
    d = Path(d)
    base = _nearest_existing(d)
    if not base.is_dir():
        return f"{flag} {d}: {base} is not a directory; choose another directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".mvlm-write-check-", dir=base)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        why = {errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
               errno.EDQUOT: "disk quota exceeded"}.get(e.errno, os.strerror(e.errno) if e.errno else str(e))
        return f"{flag} {d}: cannot write in {base} ({why.lower()}); choose a directory you can write"
    return None


def check_outputs(cfg: TrainConfig) -> list[str]:
    """The local directories the run writes (checkpoints, config/metrics/logs, TensorBoard) can be written
    (each existing directory tried once)."""
    dirs = [("--save-dir/--name", cfg.checkpoint_dir)] if not storage.is_remote(cfg.checkpoint_dir) else []
    dirs += [("--log-dir" if cfg.log_dir else "--save-dir/--name", cfg.run_dir)]
    dirs += [("--tensorboard-dir", cfg.tensorboard_dir)] if cfg.tensorboard_dir else []
    problems, tried = [], set()
    for flag, d in dirs:
        base = _nearest_existing(Path(d))
        if base not in tried:
            tried.add(base)
            problem = writable_problem(d, flag)
            if problem:
                problems.append(problem)
    return problems


def check_output_not_in_inputs(cfg: TrainConfig) -> list[str]:
    """``<save-dir>/<name>`` is not an input of the run, nor inside one, nor holding one (the rule of every
    command that writes, :mod:`megatron_vlm.cli.overlap`): saving (and pruning with --save-total-limit) would
    write into, or delete, the checkpoint, dataset or tokenizer it reads. ``--save-dir`` itself may hold the
    loaded run (stage 2 loads ``<save-dir>/stage1``)."""
    from megatron_vlm.cli.overlap import CONTAINS, SAME, relation

    out = cfg.checkpoint_dir
    problems = []
    for flag, inp in (("--megatron-load-dir", cfg.megatron_load_dir), ("--data-path", cfg.data_path),
                      ("--tokenizer-load-dir", cfg.tokenizer_load_dir),
                      ("--eval-generate-data", cfg.eval_generate_data)):
        rel = relation(out, inp) if inp else None
        if rel is not None:
            where = {SAME: "is", CONTAINS: "contains"}.get(rel, rel)
            problems.append(f"--save-dir/--name {out} {where} {flag} {inp}: the run would write its checkpoints "
                            f"into its own input; choose another --save-dir or --name")
    return problems


# ---- the run this launch resumes ---------------------------------------------------------------------------
def finished_iteration(cfg: TrainConfig) -> int | None:
    """The iteration of the run in ``<save-dir>/<name>`` when it already reached ``--train-iters`` (nothing to
    train), else None."""
    try:
        d = storage.path(cfg.checkpoint_dir)
        it = str(cfg.ckpt_step) if cfg.ckpt_step is not None else read_tracker(d)
        if not re.fullmatch(r"\d+", it) or int(it) < cfg.train_iters:
            return None
        complete = (d / f"iter_{int(it):07d}" / "ckpt_meta.json").is_file()  # written last by a save
    except Exception:  # noqa: BLE001 - no tracker (a new run), or unreadable (reported by check_request)
        return None
    return int(it) if complete else None


def check_resume_layout(cfg: TrainConfig) -> list[str]:
    """What the resumed checkpoint records (``ckpt_meta.json``) against this run, before ranks start (the ranks
    check it again): the data-parallel size (unless --reset-data-position), the optimizer state against the
    parameters this run trains, the loss objective (a resume keeps it), and the learning-rate schedule (unless one of Megatron-LM's two scheduler
    flags; not for a finished run, which is not started at all)."""
    if not storage.is_remote(cfg.checkpoint_dir) and not resumes(cfg):
        return []  # a new run: nothing to check, and no torch to import for it (~1.5 s of a CPU launch)
    try:  # torch is imported here; a bare host that launches into a container leaves this to the trainer
        from megatron_vlm.checkpoint import layout as ckpt
        from megatron_vlm.training import objective, schedule
        from megatron_vlm.training.resume import check_data_position, optimizer_problem

        if ckpt.read_tracker(cfg.checkpoint_dir) is None and cfg.ckpt_step is None:
            return []
        it_dir = ckpt.resolve_iteration_dir(cfg.checkpoint_dir, cfg.ckpt_step)
        meta = ckpt.CheckpointMeta.load(it_dir)
    except Exception:  # an unreadable run dir is reported by the trainer with its own message
        return []
    where = f"--save-dir/--name {cfg.checkpoint_dir}"
    problems = [optimizer_problem(cfg, meta, where)]
    try:  # the objective the run was trained with (the ranks resolve it again; this only refuses early)
        objective.resolve(cfg.loss_over_padded_vocab, meta.extra, where)
    except ValueError as e:
        problems.append(str(e))
    world = cfg.world_size
    if world % cfg.model_parallel == 0:
        problems.append(check_data_position(cfg, meta, cfg.dp, it_dir))
    if cfg.load_optim and meta.extra.get("optimizer") and finished_iteration(cfg) is None and problems[0] is None:
        problems.append(schedule.problem(meta.extra.get("schedule"), cfg, where, int(meta.iteration)))
    return [q for q in problems if q]


def check_resume(cfg: TrainConfig) -> list[str]:
    """The run directory this launch resumes (``<save-dir>/<name>`` with a tracker): tracker, iteration
    directory, JSON files and torch_dist shards are checked like a converter's input."""
    if storage.is_remote(cfg.checkpoint_dir):
        return []
    d = Path(cfg.checkpoint_dir)
    if not resumes(cfg):
        return []  # a new run
    from megatron_vlm.cli import InputError
    from megatron_vlm.checkpoint.checks import check_checkpoint, resume_fix

    try:
        it_dir = check_checkpoint(d, cfg.ckpt_step, "--save-dir/--name", fix="start a new run with another --name")
    except InputError as first:
        try:  # the same check again, its message naming the iteration to resume from instead
            check_checkpoint(d, cfg.ckpt_step, "--save-dir/--name", fix=resume_fix(d, _resumed(d, cfg)))
        except InputError as e:
            return [f"cannot resume the run in {d}: {e}"]
        return [f"cannot resume the run in {d}: {first}"]
    return _check_spec_files(d, it_dir, "--save-dir/--name")


def _resumed(d: Path, cfg: TrainConfig):
    """The iteration this launch resumes: ``--ckpt-step``, else the tracker's (None if it cannot be read)."""
    if cfg.ckpt_step is not None:
        return cfg.ckpt_step
    text = (d / TRACKER_FILE).read_text(errors="replace").strip()
    return int(text) if re.fullmatch(r"\d+", text) else None


def _check_spec_files(ckpt_dir, it_dir, flag: str) -> list[str]:
    """The two copies of the spec agree, and the iteration's describes its tensors."""
    problems = check_spec_copies(ckpt_dir, flag, it_dir)
    if not problems and (Path(it_dir) / SPEC_FILE).is_file():
        try:
            spec = VLMSpec.load(it_dir)
        except Exception:  # noqa: BLE001 - reported when the spec is read for the other checks
            return problems
        problems += check_spec_against_tensors(spec, f"{flag} {Path(it_dir) / SPEC_FILE}", it_dir)
    return problems


def check_hardware(cfg: TrainConfig, facts: dict) -> list[str]:
    """GPU count, FP8 support and context parallelism's attention, from ``probe`` facts of the runtime that will
    train."""
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
    if cfg.cp > 1 and cfg.transformer_impl is None and facts.get("transformer_engine") is False:
        from megatron_vlm.model.layer_impl import cp_without_te

        problems.append(cp_without_te(cfg.cp, facts.get("transformer_engine_error", "")))
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
            from megatron_vlm.model.fp8 import recipe_problem

            refused = [m for i, c in enumerate(caps) if (m := recipe_problem(cfg.fp8_recipe, c, gpu=f"GPU {i}"))]
            problems += refused[:1]
    return problems
