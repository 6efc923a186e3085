"""Synthetic images and input files for tests and benchmarks (no downloads)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def image_array(size: int | tuple[int, int], seed: int) -> np.ndarray:
    """A deterministic photo-like RGB image: smooth gradient, a coloured square, mild noise."""
    w, h = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([xx / max(w, 1) * 255, yy / max(h, 1) * 255, (xx + yy) / max(w + h, 1) * 255], -1)
    colour = list(COLOURS.values())[seed % len(COLOURS)]
    x0, y0 = int(rng.integers(0, max(1, w // 2))), int(rng.integers(0, max(1, h // 2)))
    base[y0:y0 + h // 3, x0:x0 + w // 3] = colour
    base += rng.normal(0, 8, base.shape)
    return base.clip(0, 255).astype(np.uint8)


def image_bytes(size=32, seed: int = 0, fmt: str = "JPEG", **save_kwargs) -> bytes:
    from PIL import Image

    im = Image.fromarray(image_array(size, seed))
    if fmt in ("PNG", "WEBP", "GIF") and save_kwargs.pop("alpha", False):
        im = im.convert("RGBA")
    buf = io.BytesIO()
    if fmt == "JPEG":
        save_kwargs.setdefault("quality", 90)
    im.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def write_image(path: str | Path, size=32, seed: int = 0, fmt: str = "JPEG", **save_kwargs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(image_bytes(size, seed, fmt, **save_kwargs))
    return path


def write_jsonl(path: str | Path, rows: list) -> Path:
    """Rows may be dicts (dumped as JSON) or raw ``bytes`` lines (written as they are)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for row in rows:
            f.write(row if isinstance(row, bytes) else json.dumps(row).encode("utf-8"))
            f.write(b"\n")
    return path
