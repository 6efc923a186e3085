"""Shared inputs for the data tests: a tiny HF LLaVA dir and small VQA / LLaVA / chat inputs with known
good and bad records. Built once per test session (cached here, so every test module shares them)."""

from __future__ import annotations

import base64
import csv
import gzip
import io
import json
from pathlib import Path

import pytest

from megatron_vlm.data.synthetic import image_bytes, write_image, write_jsonl

_CACHE: dict = {}


def _base(tmp_path_factory) -> Path:
    if "base" not in _CACHE:
        _CACHE["base"] = tmp_path_factory.mktemp("data_session")
    return _CACHE["base"]


def cached(name, tmp_path_factory, build):
    if name not in _CACHE:
        _CACHE[name] = build(_base(tmp_path_factory))
    return _CACHE[name]


def tiny_llava(tmp_path_factory, text_family="llama", vision_family="clip") -> Path:
    from tests.support.tiny import make_tiny_llava

    name = f"llava_{text_family}_{vision_family}"
    return cached(name, tmp_path_factory, lambda base: make_tiny_llava(base / name, text_family, vision_family))


def exif_jpeg(size=(40, 20), seed=3, orientation=6) -> bytes:
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array

    im = Image.fromarray(image_array(size, seed))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------
# VQA: 10 good rows, 8 bad ones. Expected (answer, image file) of good rows in order, and the bad rows'
# (line, reason prefix).
def build_vqa_inputs(base: Path) -> dict:
    d = base / "vqa_in"
    images = d / "images"
    (images / "sub").mkdir(parents=True, exist_ok=True)
    good = []
    for i in range(8):
        write_image(images / f"{i}.jpg", 32, seed=i)
        good.append({"id": f"q{i}", "image": f"{i}.jpg", "question": f"what colour is shape {i} ?",
                     "answer": ["red", "green", "blue", "yellow"][i % 4]})
    write_image(images / "sub" / "p.png", (48, 40), seed=20, fmt="PNG", alpha=True)  # PNG -> JPEG for VQA
    good.append({"id": "png", "image": "sub/p.png", "question": "where is the shape ?", "answer": "left"})
    (images / "rot.jpg").write_bytes(exif_jpeg())  # EXIF orientation 6 -> rotated upright
    good.append({"id": "rot", "image": "./sub/../rot.jpg", "question": "<image>\nhow many shapes ?", "answer": "one"})
    (images / "broken.jpg").write_bytes(image_bytes(32, seed=1)[:300])
    (images / "noise.jpg").write_bytes(b"not an image at all" * 10)
    outside = d / "outside.jpg"
    write_image(outside, 32, seed=2)
    bad = [
        ({"id": "b1", "image": "missing.jpg", "question": "q", "answer": "a"}, "missing image"),
        ({"id": "b2", "image": "broken.jpg", "question": "q", "answer": "a"}, "unreadable image"),
        ({"id": "b3", "image": "noise.jpg", "question": "q", "answer": "a"}, "unreadable image"),
        ({"id": "b4", "image": str(outside), "question": "q", "answer": "a"}, "absolute image path"),
        ({"id": "b5", "image": "../outside.jpg", "question": "q", "answer": "a"}, "image path"),
        ({"id": "b6", "image": "0.jpg", "question": "q", "answer": "  "}, "empty answer"),
        ({"id": "b7", "image": "0.jpg", "question": "<image> and <image>", "answer": "a"}, "2 <image> placeholders"),
        (b'{"id": "b8", "image": "0.jpg", "question": "caf\xe9 ?", "answer": "a"}', "invalid UTF-8"),
    ]
    # Interleave: bad rows at fixed positions.
    rows, expected_bad = [], []
    b = [row for row, _ in bad]
    order = [good[0], b[0], good[1], good[2], b[1], b[2], good[3], b[3], good[4], b[4],
             good[5], b[5], good[6], good[7], b[6], good[8], b[7], good[9]]
    bad_ids = {id(row): reason for row, reason in bad}
    for line, row in enumerate(order, start=1):
        rows.append(row)
        if id(row) in bad_ids:
            expected_bad.append((line, bad_ids[id(row)]))
    jsonl = write_jsonl(d / "qa.jsonl", rows)
    # The same rows as CSV (the invalid UTF-8 row written as raw bytes).
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["id", "image", "question", "answer"])
    csv_bytes = buf.getvalue().encode()
    for row in rows:
        if isinstance(row, bytes):
            csv_bytes += b'b8,0.jpg,caf\xe9 ?,a\n'
        else:
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerow([row["id"], row["image"], row["question"], row["answer"]])
            csv_bytes += buf.getvalue().encode()
    (d / "qa.csv").write_bytes(csv_bytes)
    keys = [f"{i:09d}" for i, row in enumerate(order) if id(row) not in bad_ids]
    return dict(dir=d, jsonl=jsonl, csv=d / "qa.csv", images=images, good=good, keys=keys, expected_bad=expected_bad)


# ---------------------------------------------------------------------------------------------------
# LLaVA: a json array. Each good item is listed with its expected answers (assistant turns in order)
# and number of images.
def build_llava_inputs(base: Path) -> dict:
    d = base / "llava_in"
    images = d / "images"
    images.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        write_image(images / f"{i}.jpg", 32, seed=10 + i)
    write_image(images / "w.webp", 36, seed=30, fmt="WEBP")  # WEBP -> PNG
    write_image(images / "g.gif", 30, seed=31, fmt="GIF")  # GIF -> PNG
    (images / "broken.png").write_bytes(image_bytes(32, seed=1, fmt="PNG")[:200])

    def turns(*pairs):
        out = []
        for h, g in pairs:
            out += [{"from": "human", "value": h}, {"from": "gpt", "value": g}]
        return out

    good = [
        {"id": "single", "image": "0.jpg", "conversations": turns(("<image>\nwhat colour is the shape ?", "red"))},
        {"id": "multi_turn", "image": "1.jpg", "conversations": turns(
            ("<image>\nwhat shape is it ?", "a square"), ("where is it ?", "top left"), ("how many ?", "one"))},
        {"id": "text_only", "conversations": turns(("say yes please", "yes"))},
        {"id": "two_images", "image": ["2.jpg", "w.webp"], "conversations": turns(
            ("<image>\n<image>\nwhich is red ?", "the first"))},
        {"id": "system", "image": "g.gif", "conversations": [{"from": "system", "value": "answer in one word"}] + turns(
            ("what colour ?\n<image>", "blue"))},
        {"id": "image_mid", "image": ["3.jpg"], "conversations": turns(("look: <image> which corner ?", "right"))},
    ]
    bad = [
        ({"id": "no_placeholder", "image": "4.jpg", "conversations": turns(("what is it ?", "a dog"))},
         "0 <image> placeholder(s) but 1 image(s)"),
        ({"id": "two_placeholders", "image": "4.jpg", "conversations": turns(("<image> <image>", "a dog"))},
         "2 <image> placeholder(s) but 1 image(s)"),
        ({"id": "missing", "image": "nope.jpg", "conversations": turns(("<image>\nq", "a"))}, "missing image"),
        ({"id": "broken", "image": "broken.png", "conversations": turns(("<image>\nq", "a"))}, "unreadable image"),
        ({"id": "empty_conv", "image": "5.jpg", "conversations": []}, "empty conversation"),
        ({"id": "empty_answer", "conversations": turns(("hi", ""))}, "empty answer"),
        ({"id": "escape", "image": "../../etc/passwd", "conversations": turns(("<image>\nq", "a"))}, "image path"),
        ({"id": "abs", "image": "/etc/hostname", "conversations": turns(("<image>\nq", "a"))}, "absolute image path"),
        ({"id": "no_answer", "conversations": [{"from": "human", "value": "hello"}]},
         "conversation has no assistant turn"),
    ]
    b = [row for row, _ in bad]
    items = [good[0], b[0], good[1], b[1], b[2], good[2], b[3], good[3], b[4], b[5], good[4],
             b[6], b[7], good[5], b[8]]
    bad_ids = {id(row): reason for row, reason in bad}
    expected_bad = [(i, bad_ids[id(it)]) for i, it in enumerate(items) if id(it) in bad_ids]
    text = json.dumps(items, indent=1).encode()
    # One more item whose text holds a byte sequence that is not UTF-8 (index len(items)).
    bad_utf8 = (b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}, '
                b'{"from": "gpt", "value": "ok"}]}')
    text = text.rstrip()[:-1] + b",\n" + bad_utf8 + b"\n]\n"
    expected_bad.append((len(items), "invalid UTF-8"))
    path = d / "llava.json"
    path.write_bytes(text)
    answers = [[t["value"] for t in g["conversations"] if t["from"] == "gpt"] for g in good]
    n_images = [len(g["image"]) if isinstance(g.get("image"), list) else (1 if g.get("image") else 0) for g in good]
    keys = [f"{i:09d}" for i, it in enumerate(items) if id(it) not in bad_ids]
    return dict(dir=d, json=path, images=images, good=good, answers=answers, n_images=n_images, keys=keys,
                expected_bad=expected_bad, total=len(items) + 1)


# ---------------------------------------------------------------------------------------------------
def data_url(png: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(png).decode()


def build_chat_inputs(base: Path) -> dict:
    d = base / "chat_in"
    images = d / "images"
    images.mkdir(parents=True, exist_ok=True)
    write_image(images / "a.jpg", 32, seed=40)
    png = image_bytes(28, seed=41, fmt="PNG")

    def user(*parts):
        return {"role": "user", "content": list(parts)}

    def asst(text):
        return {"role": "assistant", "content": text}

    def img(url):
        return {"type": "image_url", "image_url": {"url": url}}

    def txt(t):
        return {"type": "text", "text": t}

    good = [
        {"messages": [user(img(data_url(png)), txt("what colour is the shape ?")), asst("green")]},
        {"messages": [{"role": "system", "content": "be brief"}, user(txt("which corner ?"), img("a.jpg")),
                      asst("top left"), {"role": "user", "content": "and the colour ?"},
                      {"role": "assistant", "content": [txt("red")]}]},
        {"messages": [{"role": "user", "content": "say no"}, asst("no")]},
    ]
    bad = [
        ({"messages": [user(img("data:image/png;base64,!!!notbase64"), txt("q")), asst("a")]}, "invalid base64"),
        ({"messages": [user(txt("<image>\nwhat is it ?")), asst("a")]}, "1 <image> placeholder(s) in text"),
        ({"messages": []}, "empty conversation"),
        ({"messages": [user(txt("q")), asst("")]}, "empty answer"),
        ({"messages": [user(txt("q")), {"role": "assistant", "content": [img("a.jpg")]}]}, "empty answer"),
        ({"messages": [user(img("https://example.com/x.jpg"), txt("q")), asst("a")]}, "remote image"),
        ({"messages": [user(img("../x.jpg"), txt("q")), asst("a")]}, "image path"),
    ]
    b = [row for row, _ in bad]
    rows = [good[0], b[0], b[1], good[1], b[2], b[3], b[4], good[2], b[5], b[6]]
    bad_ids = {id(row): reason for row, reason in bad}
    expected_bad = [(i + 1, bad_ids[id(r)]) for i, r in enumerate(rows) if id(r) in bad_ids]
    raw = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    raw += b'{"messages": [{"role": "user", "content": "\xff"}, {"role": "assistant", "content": "x"}]}\n'
    expected_bad.append((len(rows) + 1, "invalid UTF-8"))
    path = d / "messages.jsonl.gz"
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write(raw)
    answers = [["green"], ["top left", "red"], ["no"]]
    keys = [f"{i:09d}" for i, r in enumerate(rows) if id(r) not in bad_ids]
    return dict(dir=d, jsonl=path, images=images, good=good, answers=answers, n_images=[1, 1, 0], keys=keys,
                expected_bad=expected_bad, total=len(rows) + 1)


@pytest.fixture
def llava_dir(tmp_path_factory):
    return tiny_llava(tmp_path_factory)


@pytest.fixture
def vqa_inputs(tmp_path_factory):
    return cached("vqa_inputs", tmp_path_factory, build_vqa_inputs)


@pytest.fixture
def llava_inputs(tmp_path_factory):
    return cached("llava_inputs", tmp_path_factory, build_llava_inputs)


@pytest.fixture
def chat_inputs(tmp_path_factory):
    return cached("chat_inputs", tmp_path_factory, build_chat_inputs)


def _prepared(name, tmp_path_factory, fmt, input_key, inputs_builder, **kw):
    from megatron_vlm.data.make_wds import make_wds

    def build(base):
        inputs = cached(f"{fmt}_inputs", tmp_path_factory, inputs_builder)
        return make_wds(fmt, inputs[input_key], base / name, image_root=inputs["images"], max_bad_fraction=0.8,
                        progress=False, **kw)

    return cached(name, tmp_path_factory, build)


@pytest.fixture
def vqa_dataset(tmp_path_factory):
    return _prepared("vqa_ds", tmp_path_factory, "vqa", "jsonl", build_vqa_inputs, shard_size=2)


@pytest.fixture
def llava_dataset(tmp_path_factory):
    return _prepared("llava_ds", tmp_path_factory, "llava", "json", build_llava_inputs, shard_size=1, split="2,1,0")


@pytest.fixture
def chat_dataset(tmp_path_factory):
    return _prepared("chat_ds", tmp_path_factory, "chat", "jsonl", build_chat_inputs, shard_size=1, split="2,1,0")
