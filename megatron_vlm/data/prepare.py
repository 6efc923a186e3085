"""The energon prepare step, run non-interactively on the tars ``make_wds`` wrote.

It calls energon's own ``energon prepare`` command (in-process, ``--non-interactive``) so the result is
exactly what ``cd DATA && energon prepare ./`` produces: ``.nv-meta/.info.json``, ``split.yaml``,
``index.sqlite`` and the ``.tar.idx`` files. The dataset definition depends on the layout:
- ``vqa``: energon's ``VQASample`` with field map image=jpg, context=json[question], answers=txt;
- ``llava`` / ``chat``: :class:`megatron_vlm.data.sample.ConversationSample` with the sample loader
  ``.nv-meta/sample_loader.py`` (energon only offers its own sample types on the command line, so this
  dataset.yaml is written here).

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
    if len(values) != 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: expected three non-negative train,val,test weights like 9,1,0")
    return values


def run_energon_prepare(path: Path, fmt: str, split=(9, 1, 0), workers: int = 1) -> str:
    """Run ``energon prepare`` non-interactively on ``path``; returns energon's console output."""
    from megatron.energon.tools.prepare import command

    path = Path(path)
    split = parse_split(split)
    args = [
        str(path),
        "--non-interactive",
        "--no-progress",
        "--num-workers", str(max(1, workers)),
        "--split-ratio", ",".join(f"{v:g}" for v in split),
    ]
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
    from megatron_vlm.data.sample import SAMPLE_LOADER_PY

    meta = Path(path) / ".nv-meta"
    meta.mkdir(exist_ok=True)
    (meta / "sample_loader.py").write_text(SAMPLE_LOADER_PY)
    (meta / "dataset.yaml").write_text(yaml.safe_dump(CONVERSATION_DATASET_YAML, sort_keys=False))


def split_shards(path: Path) -> dict[str, list[str]]:
    """Shard names per split part, from energon's ``.nv-meta/split.yaml`` (brace patterns expanded)."""
    import braceexpand

    data = yaml.safe_load((Path(path) / ".nv-meta" / "split.yaml").read_text())
    parts = data.get("split_parts", {})
    return {
        name: [s for pattern in (shards or []) for s in braceexpand.braceexpand(pattern)]
        for name, shards in parts.items()
    }


def check_split(path: Path, split) -> list[str]:
    """Warnings for splits that asked for data but got no shard (energon splits by whole shards)."""
    split = parse_split(split)
    shards = split_shards(path)
    warnings = []
    for name, weight in zip(("train", "val", "test"), split):
        if weight > 0 and not shards.get(name):
            n = sum(len(v) for v in shards.values())
            warnings.append(
                f"split {name!r} (weight {weight:g}) got no shard: energon splits whole shards and there are "
                f"only {n}; use a smaller --shard-size to get more shards"
            )
    return warnings


def interactive_hint(path: Path, fmt: str, split) -> str:
    split = ",".join(f"{v:g}" for v in parse_split(split))
    head = f"Prepare it with energon: cd {path} && energon prepare ./\n  split: {split}\n"
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
