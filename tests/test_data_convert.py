"""make_wds: each format from small inputs with broken records -> exact tars, rejections, energon metadata."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import pytest
from PIL import Image, ImageOps

from megatron_vlm.files.atomic import OutputExistsError
from megatron_vlm.data.make_wds import TooManyRejectsError, make_wds
from megatron_vlm.data.prepare import split_shards
from megatron_vlm.data.stats import iter_tar_samples
from tests.data_fixtures import (  # noqa: F401
    chat_dataset,
    chat_inputs,
    exif_jpeg,
    llava_dataset,
    llava_inputs,
    vqa_dataset,
    vqa_inputs,
)

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="make_wds on images and text: PIL, webdataset and energon's prepare, pinned alike in both lanes")


def read_samples(out: Path) -> list[tuple[str, dict]]:
    """All samples of all tars in file order, with every part's bytes."""
    samples = []
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as t:
            members = t.getmembers()
            for m in members:
                assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
        samples += list(iter_tar_samples(tar, parts=tuple(_all_parts(tar))))
    return samples


def _all_parts(tar):
    with tarfile.open(tar) as t:
        return {m.name.split(".", 1)[1] for m in t.getmembers()}


def rejected(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]


def assert_rejections(rows, expected, source_of):
    got = [(r["source"], r["reason"]) for r in rows]
    assert len(got) == len(expected), got
    for (source, reason), (loc, prefix) in zip(got, expected):
        assert source == source_of(loc) and reason.startswith(prefix), (source, reason, loc, prefix)


def test_vqa_jsonl(vqa_dataset, vqa_inputs):
    out = vqa_dataset.output
    good = vqa_inputs["good"]
    assert (vqa_dataset.total, vqa_dataset.written, vqa_dataset.rejected) == (18, 10, 8)
    samples = read_samples(out)
    assert sorted(k for k, _ in samples) == vqa_inputs["keys"]  # keys are the records' input positions
    assert [len(p) for _, p in samples] == [3] * 10 and all(set(p) == {"jpg", "json", "txt"} for _, p in samples)
    samples = sorted(samples)  # train shards first, then val: back to input order
    for (key, parts), row in zip(samples, good):
        assert parts["txt"].decode() == row["answer"]
        meta = json.loads(parts["json"])
        assert meta["question"] == row["question"] and meta["id"] == row["id"]
        im = Image.open(io.BytesIO(parts["jpg"]))
        assert im.format == "JPEG"
        src = vqa_inputs["images"] / Path(row["image"])
        if row["id"].startswith("q"):  # plain JPEGs are stored byte for byte
            assert parts["jpg"] == src.read_bytes()
    # PNG with alpha -> JPEG; EXIF orientation 6 applied (40x20 stored upright as 20x40)
    assert Image.open(io.BytesIO(samples[8][1]["jpg"])).size == (48, 40)
    rot = Image.open(io.BytesIO(samples[9][1]["jpg"]))
    assert rot.size == (20, 40) and rot.getexif().get(0x0112) is None
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(exif_jpeg()))).convert("RGB")
    diff = max(abs(a - b) for a, b in zip(rot.convert("RGB").tobytes(), upright.tobytes()))
    assert diff < 40  # same picture, re-encoded once at quality 95
    assert_rejections(rejected(out), vqa_inputs["expected_bad"], lambda line: f"qa.jsonl:{line}")
    by_reason = vqa_dataset.reasons
    assert by_reason["missing image"] == 1 and by_reason["unreadable image"] == 2
    assert by_reason["invalid UTF-8"] == 1 and by_reason["N <image> placeholders in the question but N image"] == 1
    # energon metadata: VQASample with the VQA field map; 9,1,0 split sample by sample (9 train, 1 val)
    assert "VQASample" in (out / ".nv-meta" / "dataset.yaml").read_text()
    assert vqa_dataset.splits == {"train": [f"{i:06d}.tar" for i in range(5)], "val": ["000005.tar"], "test": []}
    assert split_shards(out) == vqa_dataset.splits
    summary = json.loads((out / "make_wds.json").read_text())
    assert summary["written"] == 10 and summary["rejected"] == 8
    assert {k: v["samples"] for k, v in summary["splits"].items()} == {"train": 9, "val": 1, "test": 0}
    val_key = [k for k, _ in iter_tar_samples(out / "000005.tar")]
    assert val_key == [vqa_inputs["keys"][5]]  # val is spread through the input: the 6th sample here


def test_split_assigner_exact_prefixes():
    from megatron_vlm.data.make_wds import SplitAssigner

    for weights in ((9, 1, 0), (8, 1, 1), (1, 1, 1), (0, 1, 0)):
        assign, counts = SplitAssigner(weights), [0, 0, 0]
        for n in range(1, 1001):
            counts[assign()] += 1
            for c, w in zip(counts, weights):
                assert abs(c - n * w / sum(weights)) < 1
        assert counts == [1000 * w // sum(weights) for w in weights] or weights == (1, 1, 1)


def test_vqa_csv_gives_same_samples(vqa_inputs, vqa_dataset, tmp_path):
    res = make_wds("vqa", vqa_inputs["csv"], tmp_path / "out", image_root=vqa_inputs["images"], shard_size=2,
                   max_bad_fraction=0.7, progress=False, prepare=False)
    assert (res.written, res.rejected) == (10, 8)
    for a, b in zip(read_samples(tmp_path / "out"), sorted(read_samples(vqa_dataset.output))):
        assert a[0] == b[0]
        assert a[1]["jpg"] == b[1]["jpg"] and a[1]["txt"] == b[1]["txt"]
        assert json.loads(a[1]["json"])["question"] == json.loads(b[1]["json"])["question"]
    assert_rejections(rejected(tmp_path / "out"), vqa_inputs["expected_bad"], lambda line: f"qa.csv:{line + 1}")


def test_llava_json(llava_dataset, llava_inputs):
    out = llava_dataset.output
    assert (llava_dataset.total, llava_dataset.written) == (llava_inputs["total"], 6)
    samples = sorted(read_samples(out))
    assert len(list(out.glob("*.tar"))) == 6 and [k for k, _ in samples] == llava_inputs["keys"]
    assert {k: len(v) for k, v in llava_dataset.splits.items()} == {"train": 4, "val": 2, "test": 0}
    for (key, parts), item, answers, n_img in zip(
        samples, llava_inputs["good"], llava_inputs["answers"], llava_inputs["n_images"]
    ):
        meta = json.loads(parts["json"])
        assert meta["id"] == item["id"]
        got = [m["content"][0]["text"] for m in meta["messages"] if m["role"] == "assistant"]
        assert got == answers
        imgs = sorted(p for p in parts if p.startswith("img"))
        assert len(imgs) == n_img == sum(p["type"] == "image" for m in meta["messages"] for p in m["content"])
    two = dict(samples[3][1])
    assert sorted(p for p in two if p.startswith("img")) == ["img0.jpg", "img1.png"]  # webp -> png
    assert Image.open(io.BytesIO(two["img1.png"])).format == "PNG"
    src = Image.open(llava_inputs["images"] / "w.webp").convert("RGB")
    assert Image.open(io.BytesIO(two["img1.png"])).convert("RGB").tobytes() == src.tobytes()  # lossless
    assert "img0.png" in samples[4][1]  # gif -> png
    first = json.loads(samples[0][1]["json"])["messages"]
    assert first[0]["content"] == [{"type": "image"}, {"type": "text", "text": "what colour is the shape ?"}]
    rows = rejected(out)
    assert_rejections(rows, llava_inputs["expected_bad"], lambda i: f"llava.json[{i}]")
    assert [r["id"] for r in rows[:3]] == ["no_placeholder", "two_placeholders", "missing"]
    assert '"id": "missing"' in rows[2]["record"] and '"nope.jpg"' in rows[2]["record"]
    assert "caf\\udce9" in rows[-1]["record"]  # the undecodable byte, shown escaped
    assert "ConversationSample" in (out / ".nv-meta" / "dataset.yaml").read_text()
    assert (out / ".nv-meta" / "sample_loader.py").is_file()


def test_chat_jsonl_gz(chat_dataset, chat_inputs):
    out = chat_dataset.output
    assert (chat_dataset.total, chat_dataset.written) == (chat_inputs["total"], 3)
    samples = sorted(read_samples(out))
    assert [k for k, _ in samples] == chat_inputs["keys"]
    for (key, parts), answers, n_img in zip(samples, chat_inputs["answers"], chat_inputs["n_images"]):
        meta = json.loads(parts["json"])
        assert [m["content"][0]["text"] for m in meta["messages"] if m["role"] == "assistant"] == answers
        assert len([p for p in parts if p.startswith("img")]) == n_img
    assert "img0.png" in samples[0][1]  # base64 PNG kept as PNG
    assert samples[1][1]["img0.jpg"] == (chat_inputs["images"] / "a.jpg").read_bytes()
    assert json.loads(samples[1][1]["json"])["messages"][0] == {
        "role": "system", "content": [{"type": "text", "text": "be brief"}]}
    assert_rejections(rejected(out), chat_inputs["expected_bad"], lambda line: f"messages.jsonl.gz:{line}")


def test_deterministic_and_parallel(llava_inputs, llava_dataset, tmp_path):
    """Same input -> byte-identical tars, whatever the number of workers."""
    a = make_wds("llava", llava_inputs["json"], tmp_path / "a", image_root=llava_inputs["images"], shard_size=1,
                 workers=2, max_bad_fraction=0.8, progress=False, split="2,1,0")
    assert a.shards == llava_dataset.shards
    for tar in sorted(llava_dataset.output.glob("*.tar")):
        assert (tmp_path / "a" / tar.name).read_bytes() == tar.read_bytes()
    assert (tmp_path / "a" / "rejected.jsonl").read_bytes() == (llava_dataset.output / "rejected.jsonl").read_bytes()


def test_tar_bytes_match_tarfile(tmp_path):
    """The writer's hand-built members are what Python's tarfile writes for the same entries."""
    from megatron_vlm.data.shards import ShardWriter

    samples = [("000000003", {"json": b"{}", "jpg": bytes(range(256)) * 3}), ("000000007", {"txt": b"x" * 512})]
    with ShardWriter(tmp_path, shard_size=10) as w:
        for key, members in samples:
            w.write(key, members)
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for key, members in samples:
            for ext in sorted(members):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode = len(members[ext]), 0, 0o644
                t.addfile(info, io.BytesIO(members[ext]))
    assert (tmp_path / "000000.tar").read_bytes() == ref.getvalue()


def test_overwrite_and_atomic(vqa_inputs, tmp_path):
    out = tmp_path / "ds"
    kw = dict(image_root=vqa_inputs["images"], max_bad_fraction=0.7, progress=False, prepare=False)
    make_wds("vqa", vqa_inputs["jsonl"], out, shard_size=2, **kw)
    assert len(list(out.glob("*.tar"))) == 5  # no split without prepare: 10 samples in one sequence
    with pytest.raises(OutputExistsError, match="--overwrite"):
        make_wds("vqa", vqa_inputs["jsonl"], out, shard_size=2, **kw)
    make_wds("vqa", vqa_inputs["jsonl"], out, shard_size=100, overwrite=True, **kw)
    assert sorted(p.name for p in out.glob("*.tar")) == ["000000.tar"]  # no stale shards mixed in
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary leftovers


def test_max_bad_fraction(vqa_inputs, tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(TooManyRejectsError) as e:
        make_wds("vqa", vqa_inputs["jsonl"], out, image_root=vqa_inputs["images"], progress=False)
    assert "8 of 18 records rejected" in str(e.value) and "missing image: 1" in str(e.value)
    assert not out.exists()
    kept = tmp_path / "ds.rejected.jsonl"
    assert len(kept.read_text().splitlines()) == 8
    assert [p.name for p in tmp_path.iterdir()] == ["ds.rejected.jsonl"]


def test_energon_lint_passes(vqa_dataset, llava_dataset, chat_dataset):
    from click.testing import CliRunner
    from megatron.energon.tools.lint import command as lint

    for ds in (vqa_dataset, llava_dataset, chat_dataset):
        res = CliRunner().invoke(lint, [str(ds.output)], catch_exceptions=False)
        assert res.exit_code == 0, res.output


def test_no_prepare_then_interactive_energon_prepare(vqa_inputs, tmp_path):
    """--no-prepare writes only tars; `energon prepare ./` answered as a user would makes it loadable."""
    import inspect

    import megatron.energon as energon
    from click.testing import CliRunner
    from megatron.energon import Sample, get_val_dataset, WorkerConfig, get_loader
    from megatron.energon.tools.prepare import command as prepare

    out = tmp_path / "ds"
    make_wds("vqa", vqa_inputs["jsonl"], out, image_root=vqa_inputs["images"], shard_size=2,
             max_bad_fraction=0.7, progress=False, prepare=False)
    assert not (out / ".nv-meta").exists()
    names = [n for n, c in inspect.getmembers(energon) if isinstance(c, type) and issubclass(c, Sample)]
    answers = ["9,1,0", "y", str(names.index("VQASample")), "y", "jpg", "json[question]", "txt", ""]
    res = CliRunner().invoke(prepare, [str(out)], input="\n".join(answers) + "\n", catch_exceptions=False)
    assert res.exit_code == 0, res.output
    ds = get_val_dataset(str(out), split_part="train", batch_size=None,
                         worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    got = {s.__key__: (s.context, s.answers) for s in get_loader(ds)}
    assert len(got) == 8
    expected = {k: (r["question"], r["answer"]) for k, r in zip(vqa_inputs["keys"], vqa_inputs["good"])}
    assert all(expected[k] == v for k, v in got.items())


def test_cli_help_and_run(vqa_inputs, tmp_path, capsys):
    import importlib.util

    def load(name):
        path = Path(__file__).resolve().parents[1] / "data_prep" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"data_prep_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    make, stats = load("make_wds"), load("stats")
    for mod in (make, stats):
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0
    helps = capsys.readouterr().out
    assert "--max-bad-fraction" in helps
    # --format has its own help line; stats says where its files go
    assert re.search(r"--format \{vqa,llava,chat\}\n\s+input format: vqa \(rows of image, question, answer\)", helps)
    assert "default, for one dataset: its own directory; required for several" in re.sub(r"\s+", " ", helps)
    args = ["--format", "vqa", "--input", str(vqa_inputs["jsonl"]), "--image-root", str(vqa_inputs["images"]),
            "--output", str(tmp_path / "o"), "--no-prepare", "--no-progress", "--shard-size", "4"]
    assert make.main(args) == 2  # 8/18 rejected > 1 %
    assert "records rejected" in capsys.readouterr().err
    assert make.main(args + ["--max-bad-fraction", "0.5"]) == 0
    assert "energon prepare ./" in capsys.readouterr().out
    assert make.main(args + ["--max-bad-fraction", "0.5"]) == 2
    assert "--overwrite" in capsys.readouterr().err
