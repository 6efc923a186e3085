"""Image geometry for the data pipeline: pixel size and image tokens per image, taken from the model's spec.

The number of image tokens a sample expands to follows from the vision encoder (image size, patch size,
class token, feature select strategy), all of which :class:`~megatron_vlm.model.spec.VLMSpec` records. Optional
processor fields (``patch_size``, ``num_additional_image_tokens`` in ``processor_config.json``) are absent
from older llava-hf uploads, so nothing here reads them.

What the data pipeline does take from the HF image processor is the transform itself (resize, crop,
normalise). :func:`check_image_processor` makes sure that transform produces the pixel size the spec's
vision encoder was built for, and refuses the processor otherwise (naming both sizes and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# A non-square dummy image: a processor that resizes without cropping gives a non-square result from it,
# which the vision encoder (square position embeddings) cannot take either.
_PROBE_SIZE = (64, 48)


class ImageProcessorMismatchError(ValueError):
    """The image processor's output size differs from the size the model's vision encoder takes."""


@dataclass(frozen=True)
class ImageGeometry:
    """Pixel shape of one image as the vision encoder takes it, and image tokens it becomes in the LM."""

    channels: int
    height: int
    width: int
    tokens_per_image: int

    @classmethod
    def from_spec(cls, spec) -> "ImageGeometry":
        vision = (spec.hf_config or {}).get("vision_config") or {}
        channels = int(vision.get("num_channels", 3))
        return cls(channels, int(spec.image_size), int(spec.image_size), int(spec.num_image_tokens))


def processed_shape(image_processor) -> tuple[int, int, int]:
    """(channels, height, width) of what ``image_processor`` makes of one image."""
    from PIL import Image

    dummy = Image.new("RGB", _PROBE_SIZE, (127, 127, 127))
    out = image_processor(images=[dummy], return_tensors="pt")["pixel_values"]
    if out.ndim != 4:
        raise ImageProcessorMismatchError(
            f"{type(image_processor).__name__} gives pixel values of shape {tuple(out.shape)} for one image; "
            "LLaVA training takes one [channels, height, width] image per image (no tiles)")
    _, c, h, w = out.shape
    return int(c), int(h), int(w)


def _settings(image_processor) -> str:
    """The processor settings that decide its output size, as the user would find them in its JSON."""
    parts = []
    if getattr(image_processor, "do_center_crop", False) and getattr(image_processor, "crop_size", None):
        parts.append(f"crop_size {dict(image_processor.crop_size)}")
    if getattr(image_processor, "size", None):
        parts.append(f"size {dict(image_processor.size)}")
    return ", ".join(parts) or type(image_processor).__name__


def _processor_file(where) -> str:
    d = Path(str(where))
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (d / name).is_file():
            return str(d / name)
    return str(d)


def check_image_processor(image_processor, geometry: ImageGeometry, where) -> None:
    """Refuse an image processor (loaded from directory ``where``) whose output is not the spec's size."""
    c, h, w = processed_shape(image_processor)
    if (c, h, w) == (geometry.channels, geometry.height, geometry.width):
        return
    raise ImageProcessorMismatchError(
        f"the image processor in {where} produces {c}x{h}x{w} pixel values ({_settings(image_processor)}) but "
        f"the model's vision encoder takes {geometry.channels}x{geometry.height}x{geometry.width} (its "
        f"vision_config image_size is {geometry.height}); set crop_size (and size) to {geometry.height} in "
        f"{_processor_file(where)}, or use the processor that was saved with this model"
    )
