"""The energon TaskEncoder for InternVL (InternVL3 / InternVL3.5): the samples HF's ``InternVLProcessor`` makes.

As :class:`~megatron_vlm.data.task_encoder.VLMTaskEncoder` (chat template, labels and loss mask, truncation that
never splits an image), with what InternVL's processor does:

- **tiles**: GotOcr2's ``crop_to_patches`` dynamic tiling (the model's own image processor, its PIL backend, with
  ``crop_to_patches=True`` as ``InternVLProcessor`` calls it): the grid of 1..``max_patches`` tiles whose aspect
  ratio is closest to the image's, as HF chooses it (``get_optimal_tiled_canvas``), the tiles row by row, then a
  thumbnail of the whole image (when there is more than one tile);
- **tokens**: the chat template writes ``<IMG_CONTEXT>`` for an image and ``<video>`` for a video; as HF's processor,
  an image becomes ``<img><IMG_CONTEXT></img>`` and a video ``Frame1: <img><IMG_CONTEXT></img>\\nFrame2: ...`` (one
  line per frame) in the rendered text before it is tokenized (:class:`InternVLChat`). ONE ``<IMG_CONTEXT>`` stands
  for each image (each frame) in ``tokens``: megatron-core's ``LLaVAModel`` expands it into ``image_seq_length`` x
  its tiles embeddings (``num_image_tiles``; a frame is one tile), where HF's processor writes that many
  ``<IMG_CONTEXT>`` tokens. Expanded, the ids are HF's, token for token (tests compare them with ``AutoProcessor``);
- **videos** (a tokenizer with a video token): the frames LLaVA-NeXT's rule chooses (``video_fps``,
  ``video_frames``; :mod:`megatron_vlm.data.videos`), each resized to the tile size (BICUBIC), rescaled and
  normalised by the image processor, as HF's ``InternVLVideoProcessor`` does to the frames it is given.

Samples carry ``num_image_tiles`` (per image or frame, in token order); a batch concatenates them, and the trainer
passes them to ``LLaVAModel`` on every stage that lays out image embeddings or labels.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless

from megatron_vlm.data import videos as vid
from megatron_vlm.data.chat_tokens import ChatTokenizer
from megatron_vlm.data.task_encoder import (VLMBatch, VLMSample, VLMTaskEncoder, _as_pil, framed, kept_tokens,
                                            refuse_videos)
from megatron_vlm.model.tokenizer import token_id

START, END = "<img>", "</img>"  # InternVL's defaults when the tokenizer names none


@edataclass
class InternVLSample(VLMSample):
    """``images`` holds the tiles of every image and the frames of every video, in token order."""

    num_image_tiles: torch.Tensor  # int32 [images + frames]: tiles of each image (1 per frame), in token order


def media_tokens(tokenizer) -> tuple[str, str, str, str | None]:
    """(image, start, end, video) token strings of an InternVL tokenizer (its named extra special tokens, as HF's
    ``InternVLProcessor`` reads them)."""
    image = getattr(tokenizer, "context_image_token", None) or "<IMG_CONTEXT>"
    start = getattr(tokenizer, "start_image_token", None) or START
    end = getattr(tokenizer, "end_image_token", None) or END
    video = getattr(tokenizer, "video_token", None)
    return image, start, end, (video if video and token_id(tokenizer, video) is not None else None)


class InternVLChat(ChatTokenizer):
    """:class:`~megatron_vlm.data.chat_tokens.ChatTokenizer` rendering media as HF's ``InternVLProcessor`` writes
    them into the text (one ``<IMG_CONTEXT>`` per image or frame); ``frames`` holds the frame count of each video of
    the conversation being encoded."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.image, self.start, self.end, self.video = media_tokens(tokenizer)
        alternatives = [re.escape(self.image)] + ([re.escape(self.video)] if self.video else [])
        self.pattern = re.compile("|".join(alternatives))
        self.frames: list[int] = []
        super().__init__(tokenizer, chat_template)

    def kinds(self, text: str) -> list[str]:
        """'image' / 'video' for each media token of an unexpanded rendering, in order."""
        return ["image" if m.group(0) == self.image else "video" for m in self.pattern.finditer(text)]

    def expand(self, text: str) -> str:
        tile = f"{self.start}{self.image}{self.end}"
        videos = iter(self.frames)

        def one(m):
            if m.group(0) == self.image:
                return tile
            n = next(videos, None)
            if n is None:
                raise ValueError("the conversation has more video parts than videos")
            return "\n".join(f"Frame{i + 1}: {tile}" for i in range(n))

        return self.pattern.sub(one, text)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.expand(super().render(messages, add_generation_prompt))


class InternVLTaskEncoder(VLMTaskEncoder):
    """Energon task encoder for InternVL training; see the module docstring."""

    sample_type = InternVLSample

    def __init__(self, *args, video_fps: float = vid.DEFAULT_VIDEO_FPS,
                 video_frames: int = vid.DEFAULT_VIDEO_FRAMES, **kwargs):
        if not video_fps > 0 or int(video_frames) < 1:
            raise ValueError(f"--video-fps {video_fps} must be positive and --video-frames {video_frames} at "
                             "least 1")
        self.video_fps, self.video_frames = float(video_fps), int(video_frames)
        super().__init__(*args, **kwargs)
        self.tile = self.spec.vit_image_size
        self.skips.hints.update({
            "image_tokens": f"check the chat template in {self.hf_dir}: it must render every image part of a message "
                            f"as {self.chat.image!r} and every video part as {self.chat.video!r}, once each",
            "video": "the video does not decode; rebuild the dataset with data_prep/make_wds.py (it checks videos)",
        })

    def _load_processor(self):
        """The tokenizer and GotOcr2's PIL image processor (HF's InternVL processor class needs torchvision for its
        video processor; the PIL backend gives the same pixels in every environment)."""
        from transformers import AutoTokenizer, GotOcr2ImageProcessorPil

        tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        return SimpleNamespace(tokenizer=tokenizer, image_processor=GotOcr2ImageProcessorPil.from_pretrained(self.hf_dir),
                               image_token=None, chat_template=tokenizer.chat_template)

    def _make_chat(self, template):
        return InternVLChat(self.tokenizer, template)

    def _check_image_processor(self) -> None:
        size = dict(self.image_processor.size or {})
        tile = (size.get("height"), size.get("width"))
        if tile != (self.spec.image_size, self.spec.image_size):
            raise ValueError(f"the image processor of {self.hf_dir} makes {tile[0]}x{tile[1]} tiles, but the model's "
                             f"vision encoder takes {self.spec.image_size}x{self.spec.image_size}; set size in "
                             "preprocessor_config.json to the vision config's image_size")

    # -- media --------------------------------------------------------------------------------------
    def image_tiles(self, height: int, width: int) -> int:
        """Tiles of an image of this size (HF's ``get_number_of_image_patches`` with ``crop_to_patches``)."""
        return int(self.image_processor.get_number_of_image_patches(int(height), int(width),
                                                                    {"crop_to_patches": True}))

    def tile_pixels(self, images: list) -> tuple[torch.Tensor, list[int]]:
        """Tiles of ``images`` (each image's grid row by row, then its thumbnail) and the count of each."""
        if not images:
            return torch.zeros(0, 3, self.tile, self.tile), []
        out = self.image_processor(images=[_as_pil(im) for im in images], crop_to_patches=True, return_tensors="pt")
        return out["pixel_values"].to(torch.float32), [int(n) for n in out["num_patches"]]

    def frame_indices(self, video) -> list[int]:
        """The frames LLaVA-NeXT's rule takes from ``video`` (an energon ``AVDecoder`` or bytes)."""
        info = vid.probe(vid.av_decoder(video).stream)
        return vid.frame_indices(info.frames, info.fps, self.video_fps, self.video_frames)

    def frame_count(self, info: vid.VideoInfo) -> int:
        """Frames chosen from a video of ``info`` (for statistics, without decoding)."""
        return len(vid.frame_indices(info.frames, info.fps, self.video_fps, self.video_frames))

    def media_items(self, kinds: list[str]) -> list[tuple]:
        """One item per ``<IMG_CONTEXT>`` of a conversation whose media are ``kinds`` (:meth:`InternVLChat.kinds`,
        the frames of each video in ``self.chat.frames``), in token order: ``("image", image index)`` or
        ``("frame", video index, frame)``."""
        items, n_img, n_vid = [], 0, 0
        for kind in kinds:
            if kind == "image":
                items.append(("image", n_img))
                n_img += 1
            else:
                items += [("frame", n_vid, f) for f in range(self.chat.frames[n_vid])]
                n_vid += 1
        return items

    def item_pixels(self, items: list[tuple], pixels, tiles: list[int], videos: list, plans: list,
                    key: str = "?") -> tuple[list[torch.Tensor], list[int]]:
        """The tiles (an image's, from :meth:`tile_pixels`) or the frame of each item, and its tile count."""
        starts = [0]
        for t in tiles:
            starts.append(starts[-1] + t)
        frames, parts, counts = {}, [], []
        for it in items:
            if it[0] == "image":
                parts.append(pixels[starts[it[1]]:starts[it[1] + 1]])
                counts.append(tiles[it[1]])
                continue
            v = it[1]
            if v not in frames:
                try:
                    frames[v] = vid.frame_pixels(vid.decode_frames(videos[v], plans[v]), self.image_processor,
                                                 self.tile)
                except Exception as e:  # noqa: BLE001 - any PyAV failure on a stored video: the sample is skipped
                    self.skips.skip(key, "video", f"video does not decode: {getattr(e, 'strerror', None) or e}")
            parts.append(frames[v][it[2]:it[2] + 1])
            counts.append(1)
        return parts, counts

    # -- per sample ---------------------------------------------------------------------------------
    def encode_conversation(self, messages: list[dict], images: list, key: str = "?", videos=()) -> dict:
        videos = list(videos)
        if videos and self.chat.video is None:
            refuse_videos(self.spec, key, has_video_token=False)
        plans = self.video_plans(key, videos, self.frame_indices)
        kinds = self.chat.kinds(ChatTokenizer.render(self.chat, messages))
        if kinds.count("image") != len(images) or kinds.count("video") != len(videos):
            self.skips.skip(key, "image_tokens", f"{kinds.count('image')} image and {kinds.count('video')} video "
                                                 f"parts but {len(images)} images and {len(videos)} videos")
        self.chat.frames = [len(p) for p in plans]
        conv = self.chat(messages)
        x, assistant = conv.ids, conv.assistant
        pixels, tiles = self.tile_pixels(images)
        items = self.media_items(kinds)
        image_id = self.tokenizer_image_token_id
        if x.count(image_id) != len(items):
            self.skips.skip(key, "image_tokens", f"{x.count(image_id)} image tokens for {len(items)} images and frames")
        k = self.tokens_per_image
        costs = [k * (tiles[it[1]] if it[0] == "image" else 1) for it in items]
        if sum(costs) > self.seq_length:
            self.skips.skip(key, "too_long", f"{len(images)} images and {len(videos)} videos need {sum(costs)} > "
                                             f"seq_length {self.seq_length} tokens")
        m = kept_tokens(x, {image_id: costs}, self.seq_length, self.whole)  # media whole; past the cut, with pixels
        n = x[:m].count(image_id)
        ids = [self.image_token_id if t == image_id else t for t in x]
        text = framed(ids, assistant, m, self.whole, self.pad_token_id)
        if text["loss_mask"].sum() == 0:
            self.skips.skip(key, "no_answer", "no answer token left within seq_length")
        parts, counts = self.item_pixels(items[:n], pixels, tiles, videos, plans, key)
        self.skips.kept()
        return dict(images=torch.cat(parts) if parts else torch.zeros(0, 3, self.tile, self.tile),
                    num_image_tiles=torch.tensor(counts, dtype=torch.int32), **text,
                    num_tokens=m - n + sum(costs[:n]))

    # -- per batch ----------------------------------------------------------------------------------
    @stateless
    def batch(self, samples: list[InternVLSample]) -> VLMBatch:
        return VLMBatch.from_samples(samples, images=torch.cat([s.images for s in samples]),
                                     num_image_tiles=torch.cat([s.num_image_tiles for s in samples]),
                                     **self.padded_text(samples))
