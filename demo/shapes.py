"""The demo's synthetic visual question answering data: coloured shapes at positions.

Each image holds one shape (colour, kind, position) or, for counting questions, 1-3 shapes of one colour.
Questions are about colour, shape, position and count; answers are single words. ``write_split`` writes
the images and the ``vqa`` manifest that ``data_prep/make_wds.py --format vqa`` reads.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 70, 230), "yellow": (235, 215, 40),
           "purple": (150, 50, 190)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"left": (0.27, 0.5), "right": (0.73, 0.5), "top": (0.5, 0.27), "bottom": (0.5, 0.73)}
COUNTS = {1: "one", 2: "two", 3: "three"}
QUESTIONS = {
    "colour": "what colour is the shape ?",
    "shape": "what shape is it ?",
    "position": "where is the shape ?",
    "count": "how many shapes are there ?",
}


def corpus() -> list[str]:
    """Text the demo's tokenizer is trained on (every question and answer word)."""
    words = list(COLOURS) + list(SHAPES) + list(POSITIONS) + list(COUNTS.values())
    return list(QUESTIONS.values()) * 4 + [" ".join(words)] * 4 + ["USER: ASSISTANT: SYSTEM:"] * 2


def _draw(draw, kind: str, cx: float, cy: float, r: float, fill) -> None:
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


def make_sample(rng: random.Random, size: int):
    """(PIL image, question type, question, answer)."""
    from PIL import Image, ImageDraw

    bg = tuple(rng.randint(215, 245) for _ in range(3))
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    qtype = rng.choice(list(QUESTIONS))
    colour = rng.choice(list(COLOURS))
    r = size * 0.17
    if qtype == "count":
        n = rng.randint(1, 3)
        slots = rng.sample(list(POSITIONS.values()), n)
        for sx, sy in slots:
            _draw(d, rng.choice(SHAPES), sx * size, sy * size, r * 0.8, COLOURS[colour])
        return img, qtype, QUESTIONS[qtype], COUNTS[n]
    kind = rng.choice(SHAPES)
    pos = rng.choice(list(POSITIONS))
    px, py = POSITIONS[pos]
    _draw(d, kind, px * size, py * size, r, COLOURS[colour])
    answer = {"colour": colour, "shape": kind, "position": pos}[qtype]
    return img, qtype, QUESTIONS[qtype], answer


def write_split(out_dir, n: int, seed: int, size: int) -> Path:
    """Write ``n`` samples' images and ``manifest.jsonl`` (vqa format) under ``out_dir``."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        img, qtype, question, answer = make_sample(rng, size)
        name = f"{i:06d}.png"
        img.save(out_dir / "images" / name)
        rows.append({"id": f"{seed}-{i}", "image": f"images/{name}", "question": question, "answer": answer, "type": qtype})
    manifest = out_dir / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def majority_baseline(train_manifest, eval_rows) -> dict[str, float]:
    """Accuracy per question type of always answering that type's most common training answer."""
    train = [json.loads(x) for x in Path(train_manifest).read_text().splitlines()]
    best = {t: Counter(r["answer"] for r in train if r["type"] == t).most_common(1)[0][0] for t in QUESTIONS}
    out = {}
    for t in QUESTIONS:
        rows = [r for r in eval_rows if r["type"] == t]
        out[t] = sum(r["answer"] == best[t] for r in rows) / max(len(rows), 1)
    out["overall"] = sum(r["answer"] == best[r["type"]] for r in eval_rows) / max(len(eval_rows), 1)
    return out
