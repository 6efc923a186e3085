"""The energon prepare step, run non-interactively on the tars ``make_wds`` wrote.

It calls energon's own ``energon prepare`` command (in-process, ``--non-interactive``) so the result is
exactly what ``cd DATA && energon prepare ./`` produces: ``.nv-meta/.info.json``, ``split.yaml``,
``index.sqlite`` and the ``.tar.idx`` files. The dataset definition depends on the layout:
- ``vqa``: energon's ``VQASample`` with field map image=jpg, context=json[question], answers=txt;
- ``llava`` / ``chat``, and ``vqa`` with videos (energon's ``VQASample`` has no video):
  :class:`megatron_vlm.data.sample.ConversationSample` with the sample loader ``.nv-meta/sample_loader.py``
  (energon only offers its own sample types on the command line, so this dataset.yaml is written here).

:func:`interactive_hint` tells users of ``--no-prepare`` what to answer in ``energon prepare ./``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
VQA_FIELD_MAP = {"image": "jpg", "context": "json[question]", "answers": "txt"}
CONVERSATION_DATASET_YAML = {
    "sample_type": {"__module__": "megatron_vlm.data.sample", "__class__": "ConversationSample"},
    "sample_loader": "sample_loader.py:sample_loader",
    "part_filter": "sample_loader.py:part_filter",
}


def parse_split(split: str | tuple | list) -> tuple[float, float, float]:
    """``"9,1,0"`` -> (9.0, 1.0, 0.0): train/val/test weights, as ``energon prepare`` takes them."""
    try:
        values = tuple(float(x) for x in (split.split(",") if isinstance(split, str) else split))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise ValueError(f"--split {split!r}: expected three non-negative train,val,test weights like 9,1,0")
    if any(v < 0 or v != v or v == float("inf") for v in values):
        raise ValueError(f"--split {split!r}: the weights must be finite and not negative, e.g. 9,1,0")
    if sum(values) <= 0:
        raise ValueError(f"--split {split!r}: all three weights are 0, so no sample would go to any split; give "
                         "train a positive weight, e.g. 9,1,0 (or 1,0,0 for training data only)")
    return values


def dataset_layout(fmt: str, videos: int) -> str:
    """How a ``make_wds --format fmt`` dataset holding ``videos`` videos is prepared: 'vqa' (energon's
    VQASample) or 'conversation' (ConversationSample, whose loader also reads VQA rows with a video)."""
    return "vqa" if fmt == "vqa" and not videos else "conversation"


def split_patterns(splits: dict[str, list[str]]) -> list[str]:
    """``--split-parts`` values for energon prepare: ``train:{000000..000008}\\.tar`` per split.

    An empty split gets a regular expression that matches no shard (``(?!)``), so that energon still
    lists it (``energon lint`` and ``get_val_dataset`` expect train, val and test).
    """
    out = []
    for name, shards in splits.items():
        if not shards:
            out.append(f"{name}:(?!)")
            continue
        stems = [s[: -len(".tar")] for s in shards]
        contiguous = all(int(b) == int(a) + 1 for a, b in zip(stems, stems[1:]))
        if len(stems) > 1 and contiguous:
            out.append(f"{name}:{{{stems[0]}..{stems[-1]}}}\\.tar")
        else:
            out.append(f"{name}:{{{','.join(stems)}}}\\.tar" if len(stems) > 1 else f"{name}:{stems[0]}\\.tar")
    return out


def run_energon_prepare(path: Path, fmt: str, splits: dict[str, list[str]], workers: int = 1) -> str:
    """Run ``energon prepare`` non-interactively on ``path`` with the given shards per split.

    ``path`` may be an ``msc://`` URL: energon then reads the tar headers and writes ``.nv-meta`` in the
    object store itself. Returns energon's console output.
    """
    from megatron.energon.tools.prepare import command

    args = [str(path), "--non-interactive", "--no-progress", "--num-workers", str(max(1, workers))]
    for pattern in split_patterns(splits):
        args += ["--split-parts", pattern]
    if fmt == "vqa":
        args += ["--sample-type", "VQASample", "--field-map", json.dumps(VQA_FIELD_MAP)]
    else:
        args += ["--skip-dataset-yaml"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        command.main(args, standalone_mode=False, prog_name="energon prepare")
    if fmt != "vqa":
        write_conversation_dataset_yaml(path)
    text = out.getvalue()
    log.debug("energon prepare output:\n%s", text)
    return text


def write_conversation_dataset_yaml(path: Path) -> None:
    from megatron_vlm.files import storage
    from megatron_vlm.data.sample import SAMPLE_LOADER_PY

    meta = storage.join(path, ".nv-meta")
    storage.write_text(storage.join(meta, "sample_loader.py"), SAMPLE_LOADER_PY)
    storage.write_text(storage.join(meta, "dataset.yaml"), yaml.safe_dump(CONVERSATION_DATASET_YAML, sort_keys=False))


def split_shards(path: Path) -> dict[str, list[str]]:
    """Shard names per split part of a prepared dataset, as energon reads them (excluded shards left out)."""
    return {name: [s.name for s in meta.shards] for name, meta in split_metas(path).items()}


def split_metas(path: Path) -> dict:
    """Energon's ``WebdatasetMeta`` (shards, sample excludes) per split part listed in ``split.yaml``."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
    from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

    from megatron_vlm.files import storage

    names = (yaml.safe_load((storage.path(path) / ".nv-meta" / "split.yaml").read_text()) or {}).get("split_parts", {})
    out = {}
    for name in names:
        try:
            out[name] = WebdatasetMeta.from_config(EPath(str(path)), split_part=name)
        except EmptyDatasetError:
            out[name] = WebdatasetMeta(sample_excludes=set(), shards=[], split_part_files=[], info_shard_files=[])
    return out


def interactive_hint(path: Path, fmt: str, split) -> str:
    """What to answer in ``energon prepare`` for a ``make_wds --format fmt`` dataset (a VQA one with videos:
    the conversation answers)."""
    split = ",".join(f"{v:g}" for v in parse_split(split))
    how = f"energon prepare {path}" if "://" in str(path) else f"cd {path} && energon prepare ./"
    head = (f"Prepare it with energon: {how}\n"
            f"  split: {split} (energon splits whole shards: use a --shard-size that gives enough shards)\n")
    if fmt == "vqa":
        return head + (
            "  create dataset.yaml: yes; sample type: VQASample; simple field_map: yes\n"
            "  image: jpg, context: json[question], answers: txt, answer_weights: (empty)"
        )
    return head + (
        "  create dataset.yaml: yes; sample type: 'Crude sample (plain dict for cooking)'\n"
        "  (megatron_vlm.data.task_encoder.VLMTaskEncoder cooks these samples; or re-run make_wds.py\n"
        "  without --no-prepare to get a ConversationSample dataset that `energon lint` can check)"
    )
