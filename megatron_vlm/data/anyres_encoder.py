"""The energon TaskEncoder for anyres models (LLaVA-NeXT, LLaVA-OneVision).

As :class:`~megatron_vlm.data.task_encoder.VLMTaskEncoder` (chat template, one image token per image, labels
and loss mask, truncation that never splits an image), with what anyres adds:

- tiles from the model's own HF image processor (the PIL one, ``LlavaOnevisionImageProcessorPil`` /
  ``LlavaNextImageProcessorPil``: HF's OneVision *processor* class needs torchvision for videos), applied to
  the image at its original size: the base tile first, then the grid tiles;
- per image: its size (h, w), its tiles and its image tokens, counted by :mod:`megatron_vlm.anyres` (the
  model packs with the same geometry, and checks the count); the counts travel in the batch so that every
  pipeline stage has them;
- OneVision's multi-image rule: a sample with several images gives each its base tile only (as HF's
  ``batch_num_images`` does); LLaVA-NeXT tiles every image;
- video inputs are refused (out of scope).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless

from megatron_vlm.data.sample import conversation_of
from megatron_vlm.data.task_encoder import VLMBatch, VLMSample, VLMTaskEncoder, _as_pil

IMAGE_PROCESSORS = {"llava_next": "LlavaNextImageProcessorPil", "llava_onevision": "LlavaOnevisionImageProcessorPil"}


class VideoNotSupportedError(ValueError):
    pass


@edataclass
class AnyresSample(VLMSample):
    image_sizes: torch.Tensor  # int64 [n_images, 2] original (h, w)
    num_image_tiles: torch.Tensor  # int32 [n_images]
    num_image_tokens: torch.Tensor  # int32 [n_images]


@edataclass
class AnyresBatch(VLMBatch):
    """``images`` holds the tiles of all images in token order ``[sum tiles, 3, S, S]``."""

    image_sizes: torch.Tensor  # int64 [n_images, 2]
    num_image_tokens: torch.Tensor  # int32 [n_images]

    def model_kwargs(self, device) -> dict:
        """Keyword inputs of :class:`~megatron_vlm.anyres_model.AnyresLLaVAModel` beyond LLaVAModel's."""
        return dict(image_sizes=self.image_sizes, num_image_tokens=self.num_image_tokens.to(device))


def load_image_processor(hf_dir, arch: str):
    """The PIL image processor of an anyres model directory (its preprocessor_config.json)."""
    import transformers

    return getattr(transformers, IMAGE_PROCESSORS[arch]).from_pretrained(str(hf_dir))


def _refuse_video(messages, key) -> None:
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else []
        video_part = any(isinstance(p, dict) and p.get("type") == "video" for p in parts)
        if video_part or (isinstance(m, dict) and m.get("video")):
            raise VideoNotSupportedError(
                f"sample {key} has a video: video inputs are not supported (out of scope for LLaVA-NeXT / "
                "OneVision training here); remove video samples from the dataset or give frames as images")


class AnyresTaskEncoder(VLMTaskEncoder):
    """Energon task encoder for LLaVA-NeXT / OneVision training; see the module docstring."""

    def _load_processor(self):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        return SimpleNamespace(tokenizer=tokenizer, image_processor=load_image_processor(self.hf_dir, self.spec.arch),
                               image_token=None, chat_template=tokenizer.chat_template)

    def _check_image_processor(self) -> None:
        geo, ip = self.spec.anyres, self.image_processor
        size = getattr(ip, "size", None) or {}
        tile = (size.get("height"), size.get("width")) if hasattr(size, "get") else (None, None)
        pins = sorted(tuple(p) for p in (ip.image_grid_pinpoints or []))
        if tile != (geo.tile_size, geo.tile_size) or pins != sorted(geo.grid_pinpoints):
            raise ValueError(
                f"the image processor of {self.hf_dir} (tile {tile}, {len(pins)} grid pinpoints) does not match the "
                f"model (tile {geo.tile_size}, {len(geo.grid_pinpoints)} pinpoints); set size and "
                "image_grid_pinpoints in preprocessor_config.json to the model config's")

    def tiled(self, n_images: int) -> bool:
        """Whether a sample's images are tiled: LLaVA-NeXT always, OneVision only a sample's single image."""
        return self.spec.arch == "llava_next" or n_images == 1

    def image_inputs(self, images: list, tiled: bool | None = None) -> dict:
        """Tiles, sizes, tile and token counts of a sample's images (OneVision: several images -> base tiles)."""
        geo = self.spec.anyres
        if not images:
            s = geo.tile_size
            return dict(images=torch.zeros(0, 3, s, s), image_sizes=torch.zeros(0, 2, dtype=torch.int64),
                        num_image_tiles=torch.zeros(0, dtype=torch.int32),
                        num_image_tokens=torch.zeros(0, dtype=torch.int32))
        out = self.image_processor(images=[_as_pil(im) for im in images], return_tensors="pt")
        pixels, sizes = out["pixel_values"].to(torch.float32), out["image_sizes"].to(torch.int64)
        tiled = self.tiled(len(images)) if tiled is None else tiled
        tiles, tokens = [], []
        for (h, w) in sizes.tolist():
            tiles.append(geo.num_tiles(h, w) if tiled else 1)
            tokens.append(geo.num_tokens(h, w, tiled))
        return dict(images=torch.cat([p[:n] for p, n in zip(pixels, tiles)]), image_sizes=sizes,
                    num_image_tiles=torch.tensor(tiles, dtype=torch.int32),
                    num_image_tokens=torch.tensor(tokens, dtype=torch.int32))

    def image_costs(self, images: list, tiled: bool) -> list[int]:
        """Image tokens of each image (without computing pixels)."""
        geo = self.spec.anyres
        return [geo.num_tokens(im.height, im.width, tiled) for im in (_as_pil(i) for i in images)]

    def encode_conversation(self, messages: list[dict], images: list, key: str = "?") -> dict:
        _refuse_video(messages, key)
        conv = self.chat(messages)
        x, assistant = conv.ids, conv.assistant
        if self.image_token_id != self.tokenizer_image_token_id:
            x = [self.image_token_id if t == self.tokenizer_image_token_id else t for t in x]
        positions = [i for i, t in enumerate(x) if t == self.image_token_id]
        if len(positions) != len(images):
            self.skips.skip(key, "image_tokens", f"{len(positions)} image tokens but {len(images)} images")
        tiled = self.tiled(len(images))
        costs = self.image_costs(images, tiled)
        if sum(costs) > self.seq_length:
            self.skips.skip(key, "too_long", f"{len(images)} images need {sum(costs)} > seq_length "
                                             f"{self.seq_length} tokens")
        # keep x[:m] with text + image tokens <= seq_length; an image past the cut goes with its pixels
        m, used, n_img = 0, 0, 0
        for i in range(len(x) - 1):
            cost = costs[n_img] if x[i] == self.image_token_id else 1
            if used + cost > self.seq_length:
                break
            used, m = used + cost, i + 1
            n_img += x[i] == self.image_token_id
        loss_mask = torch.tensor(assistant[1:m + 1], dtype=torch.float32)
        if loss_mask.sum() == 0:
            self.skips.skip(key, "no_answer", "no answer token left within seq_length")
        self.skips.kept()
        inputs = self.image_inputs(images[:n_img], tiled)
        return dict(tokens=torch.tensor(x[:m], dtype=torch.int64), labels=torch.tensor(x[1:m + 1], dtype=torch.int64),
                    loss_mask=loss_mask, num_tokens=m - n_img + int(inputs["num_image_tokens"].sum()), **inputs)

    @stateless
    def encode_sample(self, sample) -> AnyresSample:
        try:
            messages, images = conversation_of(sample)
        except ValueError as e:
            self.skips.skip(sample.__key__, "conversation", str(e))
        return AnyresSample.derive_from(sample, **self.encode_conversation(messages, images, sample.__key__))

    @stateless
    def batch(self, samples: list[AnyresSample]) -> AnyresBatch:
        return AnyresBatch.from_samples(
            samples, images=torch.cat([s.images for s in samples]),
            num_image_tiles=torch.cat([s.num_image_tiles for s in samples]),
            image_sizes=torch.cat([s.image_sizes for s in samples]),
            num_image_tokens=torch.cat([s.num_image_tokens for s in samples]), **self.padded_text(samples))


def task_encoder_for(spec, hf_dir, seq_length: int, **kwargs) -> VLMTaskEncoder:
    """The task encoder of ``spec``'s architecture (anyres or plain LLaVA)."""
    cls = AnyresTaskEncoder if spec.is_anyres else VLMTaskEncoder
    return cls(hf_dir, seq_length, spec=spec, **kwargs)
