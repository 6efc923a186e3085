"""The energon TaskEncoder for anyres models (LLaVA-NeXT, LLaVA-OneVision).

As :class:`~megatron_vlm.data.task_encoder.VLMTaskEncoder` (chat template, one image token per image, labels
and loss mask, truncation that never splits an image), with what anyres adds:

- tiles from the model's own HF image processor (the PIL one, ``LlavaOnevisionImageProcessorPil`` /
  ``LlavaNextImageProcessorPil``: HF's OneVision *processor* class needs torchvision for videos), applied to
  the image at its original size: the base tile first, then the grid tiles;
- per image: its size (h, w), its tiles and its image tokens, counted by :mod:`megatron_vlm.model.anyres` (the
  model packs with the same geometry, and checks the count); the counts travel in the batch so that every
  pipeline stage has them;
- OneVision's multi-image rule: a sample with several images gives each its base tile only (as HF's
  ``batch_num_images`` does); LLaVA-NeXT tiles every image;
- OneVision videos (:mod:`megatron_vlm.data.videos`): LLaVA-NeXT's frame choice (``video_fps``, ``video_frames``),
  only the chosen frames decoded through energon, each squashed to the tile size; a video is one item of the
  sample's image list in token order (its frames as tiles, ``frames * ceil(side/2)**2 + 1`` tokens, its frame
  size), marked by the video token. Truncation never cuts inside a video; a video that cannot fit is a
  counted skip. A video for a model that is not OneVision (or has no ``<video>`` token) stops the run with
  :class:`~megatron_vlm.data.task_encoder.VideoNotSupportedError` naming the architecture.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless

from megatron_vlm.data import videos as vid
from megatron_vlm.data.task_encoder import VideoNotSupportedError  # noqa: F401 - re-exported (its old home)
from megatron_vlm.data.task_encoder import (VLMBatch, VLMSample, VLMTaskEncoder, _as_pil, framed, kept_tokens,
                                            refuse_videos)

IMAGE_PROCESSORS = {"llava_next": "LlavaNextImageProcessorPil", "llava_onevision": "LlavaOnevisionImageProcessorPil"}


@edataclass
class AnyresSample(VLMSample):
    """Images and videos are one list of items in token order: ``images`` holds their tiles / frames."""

    image_sizes: torch.Tensor  # int64 [n_items, 2] original (h, w) (a video: its frames')
    num_image_tiles: torch.Tensor  # int32 [n_items] (a video: its frames)
    num_image_tokens: torch.Tensor  # int32 [n_items]


@edataclass
class AnyresBatch(VLMBatch):
    """``images`` holds the tiles of all images in token order ``[sum tiles, 3, S, S]``."""

    image_sizes: torch.Tensor  # int64 [n_images, 2]
    num_image_tokens: torch.Tensor  # int32 [n_images]

    def model_kwargs(self, device) -> dict:
        """Keyword inputs of :class:`~megatron_vlm.model.anyres_model.AnyresLLaVAModel` beyond LLaVAModel's."""
        return dict(image_sizes=self.image_sizes, num_image_tokens=self.num_image_tokens.to(device, non_blocking=True))


def load_image_processor(hf_dir, arch: str):
    """The PIL image processor of an anyres model directory (its preprocessor_config.json)."""
    import transformers

    return getattr(transformers, IMAGE_PROCESSORS[arch]).from_pretrained(str(hf_dir))


class AnyresTaskEncoder(VLMTaskEncoder):
    """Energon task encoder for LLaVA-NeXT / OneVision training; see the module docstring.

    ``video_fps`` / ``video_frames``: LLaVA-NeXT's frame choice (``--video-fps``, ``--video-frames``)."""

    sample_type = AnyresSample

    def __init__(self, *args, video_fps: float = vid.DEFAULT_VIDEO_FPS,
                 video_frames: int = vid.DEFAULT_VIDEO_FRAMES, **kwargs):
        if not video_fps > 0 or int(video_frames) < 1:
            raise ValueError(f"--video-fps {video_fps} must be positive and --video-frames {video_frames} at "
                             "least 1")
        self.video_fps, self.video_frames = float(video_fps), int(video_frames)
        super().__init__(*args, **kwargs)
        self.skips.hints.update({
            "video_tokens": f"check the chat template in {self.hf_dir}: it must render every video part of a "
                            "message as '<video>', once per video",
            "video": "the video does not decode; rebuild the dataset with data_prep/make_wds.py (it checks videos)",
        })
        #: the tokenizer's and the model's video token ids (None: the model takes no videos)
        self.tokenizer_video_token_id = self.video_token_id = None
        if self.spec.video_token_id is not None:
            from megatron_vlm.model.tokenizer import video_token_id

            self.tokenizer_video_token_id = video_token_id(self.tokenizer)
            self.video_token_id = int(self.spec.video_token_id)

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

    def frame_indices(self, video) -> tuple[list[int], vid.VideoInfo]:
        """The frames LLaVA-NeXT's rule takes from ``video`` (an energon ``AVDecoder`` or bytes), and its probe."""
        info = vid.probe(vid.av_decoder(video).stream)
        return vid.frame_indices(info.frames, info.fps, self.video_fps, self.video_frames), info

    def video_inputs(self, video, indices: list[int], info: vid.VideoInfo) -> dict:
        """Frames (pixel values at the tile size), size, frame and token counts of one video, as one item."""
        s = self.spec.anyres.tile_size
        pixels = vid.frame_pixels(vid.decode_frames(video, indices), self.image_processor, s)
        return dict(images=pixels, image_sizes=torch.tensor([[info.height, info.width]], dtype=torch.int64),
                    num_image_tiles=torch.tensor([len(indices)], dtype=torch.int32),
                    num_image_tokens=torch.tensor([self.spec.anyres.video_tokens(len(indices))], dtype=torch.int32))

    def _model_ids(self, x: list[int]) -> list[int]:
        """Tokenizer ids -> the ids the model takes for the image and video tokens."""
        swap = {self.tokenizer_image_token_id: self.image_token_id}
        if self.video_token_id is not None:
            swap[self.tokenizer_video_token_id] = self.video_token_id
        swap = {a: b for a, b in swap.items() if a != b}
        return [swap.get(t, t) for t in x] if swap else x

    def encode_conversation(self, messages: list[dict], images: list, key: str = "?", videos=()) -> dict:
        videos = list(videos)
        if videos or any(p.get("type") == "video" for m in messages for p in m.get("content") or []
                         if isinstance(p, dict)):
            refuse_videos(self.spec, key, has_video_token=self.video_token_id is not None)
        conv = self.chat(messages)
        x, assistant = self._model_ids(conv.ids), conv.assistant
        image_id, video_id = self.image_token_id, self.video_token_id
        n_image_tokens, n_video_tokens = x.count(image_id), x.count(video_id) if video_id is not None else 0
        if n_image_tokens != len(images):
            self.skips.skip(key, "image_tokens", f"{n_image_tokens} image tokens but {len(images)} images")
        if n_video_tokens != len(videos):
            self.skips.skip(key, "video_tokens", f"{n_video_tokens} video tokens but {len(videos)} videos")
        tiled = self.tiled(len(images))
        image_costs = self.image_costs(images, tiled)
        plans = self.video_plans(key, videos, self.frame_indices)
        video_costs = [self.spec.anyres.video_tokens(len(idx)) for idx, _ in plans]
        total = sum(image_costs) + sum(video_costs)
        if total > self.seq_length:
            self.skips.skip(key, "too_long", f"{len(images)} images and {len(videos)} videos need {total} > "
                                             f"seq_length {self.seq_length} tokens")
        # keep x[:m] with text + image/video tokens <= seq_length; media past the cut go with their pixels
        costs = {image_id: image_costs, **({video_id: video_costs} if video_id is not None else {})}
        m = kept_tokens(x, costs, self.seq_length, self.whole)
        n_img = x[:m].count(image_id)
        text = framed(x, assistant, m, self.whole, self.pad_token_id)
        if text["loss_mask"].sum() == 0:
            self.skips.skip(key, "no_answer", "no answer token left within seq_length")
        items = []  # per image / video in token order: its inputs
        image_part = self.image_inputs(images[:n_img], tiled)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), image_part["num_image_tiles"].cumsum(0)]).tolist()
        i_img = i_vid = 0
        for t in x[:m]:
            if t == image_id:
                items.append({k: (v[starts[i_img]:starts[i_img + 1]] if k == "images" else v[i_img:i_img + 1])
                              for k, v in image_part.items()})
                i_img += 1
            elif t == video_id:
                try:
                    items.append(self.video_inputs(videos[i_vid], *plans[i_vid]))
                except Exception as e:  # noqa: BLE001 - as above
                    self.skips.skip(key, "video", f"video does not decode: {getattr(e, 'strerror', None) or e}")
                i_vid += 1
        self.skips.kept()
        inputs = {k: torch.cat([it[k] for it in items]) if items else v for k, v in self.image_inputs([]).items()}
        return dict(**text, num_tokens=m - len(items) + int(inputs["num_image_tokens"].sum()), **inputs)

    @stateless
    def batch(self, samples: list[AnyresSample]) -> AnyresBatch:
        return AnyresBatch.from_samples(
            samples, images=torch.cat([s.images for s in samples]),
            num_image_tiles=torch.cat([s.num_image_tiles for s in samples]),
            image_sizes=torch.cat([s.image_sizes for s in samples]),
            num_image_tokens=torch.cat([s.num_image_tokens for s in samples]), **self.padded_text(samples))


def task_encoder_for(spec, hf_dir, seq_length: int, video_fps: float = vid.DEFAULT_VIDEO_FPS,
                     video_frames: int = vid.DEFAULT_VIDEO_FRAMES, **kwargs) -> VLMTaskEncoder:
    """The task encoder of ``spec``'s architecture (anyres, InternVL, Qwen2.5-VL or plain LLaVA; the frame choice
    for those that take videos)."""
    if spec.is_anyres:
        return AnyresTaskEncoder(hf_dir, seq_length, spec=spec, video_fps=video_fps, video_frames=video_frames,
                                 **kwargs)
    if spec.is_internvl:
        from megatron_vlm.data.internvl_encoder import InternVLTaskEncoder

        return InternVLTaskEncoder(hf_dir, seq_length, spec=spec, video_fps=video_fps, video_frames=video_frames,
                                   **kwargs)
    if spec.is_qwen_vl:
        from megatron_vlm.data.qwen_vl_encoder import QwenVLTaskEncoder

        return QwenVLTaskEncoder(hf_dir, seq_length, spec=spec, video_fps=video_fps, video_frames=video_frames,
                                 **kwargs)
    return VLMTaskEncoder(hf_dir, seq_length, spec=spec, **kwargs)
