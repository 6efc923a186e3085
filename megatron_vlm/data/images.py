"""Image references -> validated image bytes ready for a tar.

Owns: resolving an image reference (a path under ``--image-root``, or a base64 ``data:`` URL) without
letting it escape the root; decoding every image; applying EXIF orientation; converting formats other
than JPEG/PNG. Problems raise :class:`~megatron_vlm.data.conversation.Reject` with the reason.

What is written:
- a JPEG without a rotating EXIF orientation is kept byte for byte (``jpg``); it is still decoded
  (libjpeg's DCT scaling: every entropy-coded block is read, so truncation and corruption are caught,
  but the inverse DCT runs at 1/8 size);
- a PNG is kept byte for byte (``png``), or re-encoded to JPEG when ``jpeg_only`` (the VQA layout);
- anything else (WebP, GIF, BMP, TIFF, ...), and any image whose EXIF orientation is not 1, is decoded,
  rotated upright and re-encoded: PNG (lossless) or JPEG quality 95 when ``jpeg_only`` or the source
  was a JPEG. Transparency is composited on white for JPEG (as HF's ``convert_rgb`` does).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import posixpath
import warnings
from pathlib import Path

from megatron_vlm.data.conversation import Reject

JPEG_QUALITY = 95
_ORIENTATION = 0x0112


def resolve_path(ref: str, image_root: Path, allow_outside_symlinks: bool = False) -> Path:
    """``ref`` relative to ``image_root``; absolute paths and ``..`` that leave the root are rejected.

    The path as written is checked first (``os.path.normpath``). Then symlinks are resolved: one that leads
    outside the root is refused unless ``allow_outside_symlinks`` (``--allow-symlinks-outside-image-root``);
    symlinks whose target stays inside the root are followed.
    """
    if "\x00" in ref:
        raise Reject("image path contains a NUL byte")
    if ref.startswith("file://"):
        ref = ref[len("file://"):]
    if os.path.isabs(ref) or ref.startswith("~") or posixpath.isabs(ref.replace("\\", "/")):
        raise Reject(f"absolute image path {ref!r} escapes --image-root (use paths relative to it)")
    for norm in {posixpath.normpath(ref), posixpath.normpath(ref.replace("\\", "/"))}:
        if norm == ".." or norm.startswith("../"):
            raise Reject(f"image path {ref!r} escapes --image-root")
    path = image_root / posixpath.normpath(ref)
    if not allow_outside_symlinks:
        root = os.path.realpath(image_root)
        real = os.path.realpath(path)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise Reject(f"symlink outside --image-root: image path {ref!r} leads to {real} (pass "
                         "--allow-symlinks-outside-image-root to follow such links)")
    return path


def read_ref(ref, image_root: Path, allow_outside_symlinks: bool = False, kind: str = "image") -> bytes:
    """The bytes behind an image (``kind="video"``: a video) reference (a path, a ``data:`` URL, or bytes)."""
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref)
    if not isinstance(ref, str) or not ref:
        raise Reject(f"empty {kind} reference")
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if ";base64" not in header:
            raise Reject(f"data URL {kind} is not base64-encoded")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise Reject(f"invalid base64 {kind} data: {e}") from None
    if ref.startswith(("http://", "https://")):
        raise Reject(f"remote {kind} {ref[:80]!r} is not supported; download it and pass a path")
    path = resolve_path(ref, image_root, allow_outside_symlinks)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise Reject(f"missing {kind} {ref!r}") from None
    except IsADirectoryError:
        raise Reject(f"{kind} {ref!r} is a directory") from None
    except OSError as e:
        raise Reject(f"unreadable {kind} {ref!r}: {e.strerror or e}") from None


def _to_rgb(im):
    """RGB for JPEG; transparency composited on white like HF's image_transforms.convert_rgb."""
    from PIL import Image

    if im.mode == "RGB":
        return im
    if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return im.convert("RGB")


def _encode(im, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpg":
        _to_rgb(im).save(buf, format="JPEG", quality=JPEG_QUALITY)
    else:
        if im.mode not in ("RGB", "RGBA", "L", "LA"):
            im = im.convert("RGBA" if "transparency" in im.info or im.mode in ("PA",) else "RGB")
        im.save(buf, format="PNG")
    return buf.getvalue()


def process_image(data: bytes, jpeg_only: bool = False, what: str = "image") -> tuple[str, bytes]:
    """Decode and check ``data``; return ``(extension, bytes)`` to store (see the module docstring)."""
    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            fmt = im.format
            is_jpeg = fmt in ("JPEG", "MPO")  # MPO: a camera JPEG with extra pictures; re-encoded (first one)
            orientation = im.getexif().get(_ORIENTATION, 1) if is_jpeg else None
            if fmt == "JPEG" and orientation == 1:
                im.draft(im.mode, (max(1, im.width // 8), max(1, im.height // 8)))
                im.load()
                _check_size(im, what)
                return "jpg", data
            im.load()
            _check_size(im, what)
            if orientation is None:
                orientation = im.getexif().get(_ORIENTATION, 1)
            if orientation not in (1, None):
                im = ImageOps.exif_transpose(im)
            elif fmt == "PNG" and not jpeg_only:
                return "png", data
            out = "jpg" if (jpeg_only or is_jpeg) else "png"
            if getattr(im, "n_frames", 1) > 1:
                im.seek(0)
            return out, _encode(im, out)
    except Reject:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as e:
        raise Reject(f"unreadable {what}: {e}") from None


def _check_size(im, what: str) -> None:
    if im.width < 1 or im.height < 1:
        raise Reject(f"unreadable {what}: empty ({im.width}x{im.height})")
