"""stats: exact sample / token counts per split, and a metadataset blend energon can load."""

from __future__ import annotations

import json

import pytest
import yaml

from megatron_vlm.data.loader import build_train_loader
from megatron_vlm.data.stats import dataset_stats, iter_tar_samples
from megatron_vlm.data.task_encoder import VLMTaskEncoder
from tests.data_fixtures import (  # noqa: F401
    chat_dataset,
    chat_inputs,
    llava_dataset,
    llava_inputs,
    tiny_llava,
    vqa_dataset,
    vqa_inputs,
)

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="stats.py counts tokens with the tokenizer and writes an energon blend: pinned alike in both lanes")


def test_counts_match_task_encoder(llava_dataset, tmp_path_factory):
    enc = VLMTaskEncoder(tiny_llava(tmp_path_factory), seq_length=60)
    st = dataset_stats(llava_dataset.output, enc)
    k = enc.tokens_per_image
    for split, shards in llava_dataset.splits.items():
        exp = dict(samples=0, images=0, text_tokens=0, over=0)
        for shard in shards:
            for key, parts in iter_tar_samples(llava_dataset.output / shard):
                messages = json.loads(parts["json"])["messages"]
                n = sum(p["type"] == "image" for m in messages for p in m["content"])
                rendered = enc.processor.apply_chat_template(messages, tokenize=False)
                text = len(enc.tokenizer(rendered, add_special_tokens=False)["input_ids"]) - n
                exp["samples"] += 1
                exp["images"] += n
                exp["text_tokens"] += text
                exp["over"] += text + n * k > 60
        got = st[split]
        assert (got["samples"], got["images"], got["text_tokens"], got["image_tokens"], got["over_seq_length"]) == (
            exp["samples"], exp["images"], exp["text_tokens"], exp["images"] * k, exp["over"])
        assert got["tokens"] == got["text_tokens"] + got["image_tokens"]
    assert st["train"]["samples"] + st["val"]["samples"] == 6 and st["test"]["samples"] == 0
    assert st["train"]["over_seq_length"] + st["val"]["over_seq_length"] >= 1  # the two-image sample


def test_cli_writes_summary_and_loadable_blend(vqa_dataset, chat_dataset, tmp_path, tmp_path_factory, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data_prep" / "stats.py"
    spec = importlib.util.spec_from_file_location("data_prep_stats", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    llava = tiny_llava(tmp_path_factory)
    out = tmp_path / "blend"
    rc = mod.main([str(vqa_dataset.output), str(chat_dataset.output), "--tokenizer", str(llava),
                   "--seq-length", "64", "--weights", "3,1", "--output-dir", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "stats.json").read_text())
    vqa = summary["datasets"][str(vqa_dataset.output)]
    assert (vqa["train"]["samples"], vqa["val"]["samples"], vqa["train"]["images"]) == (9, 1, 9)
    assert summary["total"]["train"]["samples"] == 9 + summary["datasets"][str(chat_dataset.output)]["train"]["samples"]
    meta = yaml.safe_load((out / "metadataset.yaml").read_text())
    assert [b["weight"] for b in meta["splits"]["train"]["blend"]] == [3.0, 1.0]
    # energon reads the blend: both datasets contribute training samples
    enc = VLMTaskEncoder(llava, seq_length=256)
    it = iter(build_train_loader(out / "metadataset.yaml", enc, 1, 0, 1, 0, seed=0))
    from_vqa = [" is shape " in enc.tokenizer.decode(next(it).tokens[0]) for _ in range(60)]
    assert 0 < sum(from_vqa) < 60


def test_cli_writes_into_the_dataset_by_default(vqa_dataset, tmp_path, tmp_path_factory, capsys):
    """`stats.py DIR` writes DIR/stats.json and DIR/metadataset.yaml (not into DIR's parent, where two datasets'
    stats would overwrite each other), prints both paths, and the blend there loads."""
    import importlib.util
    import shutil
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data_prep" / "stats.py"
    spec = importlib.util.spec_from_file_location("data_prep_stats", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ds = shutil.copytree(vqa_dataset.output, tmp_path / "vqa")
    llava = tiny_llava(tmp_path_factory)
    assert mod.main([str(ds), "--tokenizer", str(llava), "--seq-length", "64", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {ds / 'stats.json'} and {ds / 'metadataset.yaml'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vqa"]
    assert json.loads((ds / "stats.json").read_text())["datasets"][str(ds)]["train"]["samples"] == 9
    meta = yaml.safe_load((ds / "metadataset.yaml").read_text())
    assert [b["path"] for b in meta["splits"]["train"]["blend"]] == ["."]
    enc = VLMTaskEncoder(llava, seq_length=256)
    sample = next(iter(build_train_loader(ds / "metadataset.yaml", enc, 1, 0, 1, 0, seed=0)))
    assert " is shape " in enc.tokenizer.decode(sample.tokens[0])
