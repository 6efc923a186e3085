"""Any-resolution ("anyres") image geometry and feature packing of LLaVA-NeXT and LLaVA-OneVision.

The one place that knows how an image of size (h, w) becomes tiles and image tokens:

- ``AnyresGeometry.grid(h, w)``: the tile grid (rows, cols) of the pinpoint resolution HF's image processor
  resizes the image to (``select_best_resolution``, the function HF's processor and model both use);
- ``num_tiles(h, w)``: the base tile (the whole image at tile size) plus the grid tiles;
- ``packed_grid(h, w)``: the feature map of the grid after HF's ``unpad_image`` and, for OneVision
  (``vision_aspect_ratio='anyres_max_N'``), its bilinear downsampling to about N tiles' worth of features;
- ``num_tokens(h, w)``: image tokens of one image: the base tile's features, then each row of the grid's
  feature map followed by ``image_newline``; an image given as a single tile (OneVision's multi-image
  samples) is its features plus one ``image_newline``;
- ``pack(features, (h, w), newline)``: the same packing on tensors, operation for operation as HF's
  ``pack_image_features`` so the numbers are identical;
- videos (OneVision): ``video_tokens(frames)``, HF's ``frames * ceil(side/2)**2 + 1``, and
  ``pack_video(features, newline)``: each frame's features pooled as HF's ``apply_pooling`` does (bilinear to
  ceil(side/2) x ceil(side/2), after the projector), the frames one after the other, then ONE ``image_newline``.

The data side (task encoder, statistics) and the model (:mod:`megatron_vlm.model.anyres_model`) both count tokens
here, so the number of image tokens a sample carries always equals what the model produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ARCHS = ("llava_next", "llava_onevision")


class AnyresConfigError(ValueError):
    pass


@dataclass(frozen=True)
class AnyresGeometry:
    tile_size: int  # the vision encoder's input size (HF vision_config.image_size), e.g. 384
    patch_size: int  # e.g. 14: a 384-px tile gives 27 x 27 features (a valid convolution)
    grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) resolutions, multiples of tile_size
    max_tiles: int | None = None  # OneVision's anyres_max_N; None: no downsampling (LLaVA-NeXT)

    def __post_init__(self):
        for h, w in self.grid_pinpoints:
            if h % self.tile_size or w % self.tile_size:
                raise AnyresConfigError(
                    f"image_grid_pinpoints entry [{h}, {w}] is not a multiple of the tile size {self.tile_size}; "
                    "use resolutions that are whole numbers of tiles"
                )

    @classmethod
    def from_hf(cls, cfg) -> "AnyresGeometry":
        """From an HF LlavaNextConfig / LlavaOnevisionConfig (object or dict)."""
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        vision = get("vision_config")
        vget = vision.get if isinstance(vision, dict) else lambda k, d=None: getattr(vision, k, d)
        pins = get("image_grid_pinpoints")
        if not pins:
            raise AnyresConfigError("the config has no image_grid_pinpoints; an anyres model needs them")
        model_type = get("model_type")
        max_tiles = None
        if model_type == "llava_onevision":
            max_tiles = parse_vision_aspect_ratio(get("vision_aspect_ratio", "anyres_max_9"))
        return cls(int(vget("image_size")), int(vget("patch_size")), tuple((int(h), int(w)) for h, w in pins),
                   max_tiles)

    # ---- geometry (plain Python: the data side uses it without a model) -------------------------------
    @property
    def side(self) -> int:
        """Features per tile side (floor, as the valid patch convolution gives)."""
        return self.tile_size // self.patch_size

    def best_resolution(self, h: int, w: int) -> tuple[int, int]:
        from transformers.image_processing_utils import select_best_resolution

        return tuple(select_best_resolution((int(h), int(w)), [list(p) for p in self.grid_pinpoints]))

    def grid(self, h: int, w: int) -> tuple[int, int]:
        bh, bw = self.best_resolution(h, w)
        return bh // self.tile_size, bw // self.tile_size

    def num_tiles(self, h: int, w: int) -> int:
        rows, cols = self.grid(h, w)
        return rows * cols + 1

    def unpadded_grid(self, h: int, w: int) -> tuple[int, int]:
        """(height, width) of the grid's feature map after HF's ``unpad_image`` (same float arithmetic)."""
        rows, cols = self.grid(h, w)
        cur_h, cur_w = rows * self.side, cols * self.side
        if w / h > cur_w / cur_h:
            new_h = int(round(h * (cur_w / w), 7))
            return cur_h - 2 * ((cur_h - new_h) // 2), cur_w
        new_w = int(round(w * (cur_h / h), 7))
        return cur_h, cur_w - 2 * ((cur_w - new_w) // 2)

    def downsampled_size(self, cur_h: int, cur_w: int) -> tuple[int, int] | None:
        """OneVision's target size for a (cur_h, cur_w) feature map, or None when it is kept as it is."""
        if self.max_tiles is None:
            return None
        ratio = math.sqrt(cur_h * cur_w / (self.max_tiles * self.side**2))
        if ratio > 1.1:
            return int(cur_h // ratio), int(cur_w // ratio)
        return None

    def packed_grid(self, h: int, w: int) -> tuple[int, int]:
        """(rows, columns) of grid features that reach the language model (before the newlines)."""
        size = self.unpadded_grid(h, w)
        return self.downsampled_size(*size) or size

    def num_tokens(self, h: int, w: int, tiled: bool = True) -> int:
        """Image tokens of an (h, w) image: base tile, then rows of the grid each ending in image_newline."""
        base = self.side * self.side
        if not tiled:
            return base + 1
        rows, cols = self.packed_grid(h, w)
        return base + rows * (cols + 1)

    @property
    def pooled_side(self) -> int:
        """Features per side of a video frame after OneVision's 2x pooling (ceil, as HF's ``apply_pooling``)."""
        return math.ceil(self.side / 2)

    def video_tokens(self, frames: int) -> int:
        """Video tokens of a video of ``frames`` frames (HF's ``LlavaOnevisionProcessor.replace_video_token``)."""
        return int(frames) * self.pooled_side**2 + 1

    # ---- packing (tensors) -----------------------------------------------------------------------------
    def pack(self, features, image_size, newline):
        """Pack one image's projected features ``[n_tiles, side*side, C]`` (base tile first) into
        ``[num_tokens, C]`` as HF's ``pack_image_features`` does; ``newline`` is ``image_newline`` ``[C]``."""
        import torch
        import torch.nn.functional as F

        h, w = int(image_size[0]), int(image_size[1])
        if features.shape[0] == 1:
            return torch.cat([features[0], newline[None].to(features)], dim=0)
        base, grid = features[0], features[1:]
        rows, cols = self.grid(h, w)
        if grid.shape[0] != rows * cols:
            raise ValueError(f"image of size {h}x{w} needs {rows * cols + 1} tiles, got {features.shape[0]}")
        s = self.side
        fmap = grid.view(rows, cols, s, s, -1).permute(4, 0, 2, 1, 3).contiguous().flatten(1, 2).flatten(2, 3)
        uh, uw = self.unpadded_grid(h, w)
        top, left = (fmap.shape[1] - uh) // 2, (fmap.shape[2] - uw) // 2
        fmap = fmap[:, top:top + uh, left:left + uw]
        target = self.downsampled_size(uh, uw)
        if target is not None:
            fmap = F.interpolate(fmap[None], list(target), mode="bilinear")[0]
        column = newline[:, None, None].expand(*fmap.shape[:-1], 1).to(fmap.device, fmap.dtype)
        fmap = torch.cat([fmap, column], dim=-1)
        return torch.cat([base, fmap.flatten(1, 2).transpose(0, 1)], dim=0)

    def pool_frames(self, features):
        """HF's ``apply_pooling``: ``[F, side*side, C]`` -> ``[F, pooled_side**2, C]`` (bilinear, align_corners
        False), the same operations so the numbers are bitwise HF's."""
        import torch.nn.functional as F

        frames, _, dim = features.shape
        x = features.reshape(frames, self.side, self.side, dim).permute(0, 3, 1, 2).contiguous()
        x = F.interpolate(x, size=[self.pooled_side, self.pooled_side], mode="bilinear")
        return x.permute(0, 2, 3, 1).reshape(frames, -1, dim)

    def pack_video(self, features, newline):
        """One video's projected frame features ``[F, side*side, C]`` -> ``[video_tokens(F), C]``."""
        import torch

        pooled = self.pool_frames(features)
        return torch.cat([pooled.reshape(-1, pooled.shape[-1]), newline[None].to(pooled)], dim=0)

    def pack_batch(self, features, image_sizes, tiles_per_image, newline, videos=None):
        """Pack a batch's tiles ``[sum tiles, side*side, C]`` image by image (``videos[i]``: item ``i`` is a video
        whose frames are its tiles); returns ``[sum tokens, C]``."""
        import torch

        out = []
        videos = videos or [False] * len(tiles_per_image)
        for feats, size, video in zip(features.split([int(n) for n in tiles_per_image], dim=0), image_sizes, videos):
            out.append(self.pack_video(feats, newline) if video else
                       self.pack(feats, (int(size[0]), int(size[1])), newline))
        return torch.cat(out, dim=0)


def parse_vision_aspect_ratio(value: str) -> int:
    """OneVision's ``vision_aspect_ratio`` 'anyres_max_N' -> N."""
    prefix = "anyres_max_"
    if not isinstance(value, str) or not value.startswith(prefix) or not value[len(prefix):].isdigit():
        raise AnyresConfigError(f"vision_aspect_ratio {value!r} is not supported; use 'anyres_max_N' "
                                "(e.g. anyres_max_9)")
    return int(value[len(prefix):])
