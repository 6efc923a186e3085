"""Model inputs of a prompt, encoded as training encodes samples, then expanded into HF ``generate``'s inputs.

A prompt is a conversation that ends in a user turn, with its images (PIL) and videos (bytes or energon
``AVDecoder``s) in part order. :class:`PromptEncoder` renders it with the model's chat template and
``add_generation_prompt=True`` (the text a trained model continues with its answer; BOS added where the
tokenizer adds one and the template writes none, as :mod:`megatron_vlm.data.chat_tokens` does in training), and
takes pixels from the training task encoder itself (:mod:`megatron_vlm.data.task_encoder`,
:mod:`megatron_vlm.data.anyres_encoder`): the model's image processor (its PIL backend, the one training
uses), anyres tiles and token counts from :mod:`megatron_vlm.model.anyres`, OneVision's multi-image rule, and video
frames chosen by ``--video-fps``/``--video-frames``. Each image or video token is then repeated as many times
as the model expands it, which is what HF's processors give its ``generate`` (``input_ids`` with the media
tokens expanded, ``pixel_values`` [+ ``image_sizes``, ``batch_num_images``], ``pixel_values_videos``). InternVL
prompts are rendered as its processor writes them (``<img><IMG_CONTEXT></img>``, ``FrameN:`` lines), every tile and
frame in ``pixel_values``. Qwen2.5-VL and Qwen3-VL prompts get each ``<|image_pad|>`` repeated once per merged patch,
the processor's flattened ``pixel_values`` and ``image_grid_thw``, and (:func:`collate`) the ``mm_token_type_ids``
from which HF's model computes its M-RoPE positions (without them it would silently fall back to 1-D positions).

:func:`collate` left-pads several prompts into one batch for ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_vlm.data import videos as vid
from megatron_vlm.model.spec import QWEN_VL_ARCHS


@dataclass
class Prompt:
    """One encoded prompt: HF input ids (media expanded) and its media inputs."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None  # plain LLaVA [n, 3, H, W]; anyres [n, tiles, 3, s, s]
    image_sizes: torch.Tensor | None = None  # anyres [n, 2]
    pixel_values_videos: torch.Tensor | None = None  # [n_videos, frames, 3, s, s]
    num_images: int = 0
    num_videos: int = 0
    extra: dict = field(default_factory=dict)
    # each image / video item in token order: the tokens it is expanded to, and its tiles (frames) in pixel_values
    # (what megatron-core's LLaVAModel takes as one media token and num_image_tiles: eval/sharded.py)
    items: list[int] = field(default_factory=list)
    tiles: list[int] = field(default_factory=list)


def user_message(text: str, images: int = 0, videos: int = 0) -> dict:
    """A user turn with ``images`` image parts and ``videos`` video parts before ``text`` (LLaVA's order)."""
    parts = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": text}]
    return {"role": "user", "content": [dict(p) for p in parts]}


class PromptEncoder:
    """Prompts -> HF inputs for the model of ``spec`` whose tokenizer/processor files are in ``files_dir``."""

    def __init__(self, files_dir, spec, video_fps: float = vid.DEFAULT_VIDEO_FPS,
                 video_frames: int = vid.DEFAULT_VIDEO_FRAMES):
        from megatron_vlm.data.anyres_encoder import task_encoder_for

        # seq_length bounds nothing here: a prompt is never truncated
        self.enc = task_encoder_for(spec, files_dir, 1 << 30, video_fps=video_fps, video_frames=video_frames)
        self.spec = spec
        self.tokenizer = self.enc.tokenizer
        self.chat = self.enc.chat
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.enc.pad_token_id)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` + the generation prompt (tokenizer ids, one token per image/video)."""
        text = self.chat.render(messages, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token
        if self.chat.adds_bos and not text.startswith(bos):
            ids = [self.tokenizer.bos_token_id] + ids
        return list(ids)

    def encode(self, messages: list[dict], images: list = (), videos: list = ()) -> Prompt:
        images, videos = list(images), list(videos)
        if self.spec.is_internvl:
            return self._encode_internvl(messages, images, videos)
        if self.spec.is_qwen_vl:
            return self._encode_qwen_vl(messages, images, videos)
        ids = self.prompt_ids(messages)
        enc = self.enc
        if videos:
            from megatron_vlm.data.task_encoder import refuse_videos

            refuse_videos(self.spec, "the prompt", has_video_token=getattr(enc, "video_token_id", None) is not None)
        if self.spec.is_anyres:
            ids = enc._model_ids(ids)
        elif enc.image_token_id != enc.tokenizer_image_token_id:
            ids = [enc.image_token_id if t == enc.tokenizer_image_token_id else t for t in ids]
        image_id = self.spec.image_token_id
        video_id = getattr(enc, "video_token_id", None)
        if ids.count(image_id) != len(images) or (video_id is not None and ids.count(video_id) != len(videos)):
            raise ValueError(f"the chat template rendered {ids.count(image_id)} image and "
                             f"{ids.count(video_id) if video_id is not None else 0} video token(s) for "
                             f"{len(images)} image(s) and {len(videos)} video(s); check the chat template of "
                             f"{enc.hf_dir}")
        out = Prompt([], num_images=len(images), num_videos=len(videos))
        if not self.spec.is_anyres:
            counts = [self.spec.num_image_tokens] * len(images)
            if images:
                out.pixel_values = enc.pixel_values(images)
            video_counts = []
        else:
            part = enc.image_inputs(images)
            counts = part["num_image_tokens"].tolist()
            if images:
                tiles = part["num_image_tiles"].tolist()
                starts = [0] + torch.tensor(tiles).cumsum(0).tolist()
                rows = [part["images"][a:b] for a, b in zip(starts, starts[1:])]
                s = self.spec.anyres.tile_size
                padded = torch.zeros(len(rows), max(tiles), 3, s, s)
                for i, r in enumerate(rows):
                    padded[i, :len(r)] = r
                out.pixel_values, out.image_sizes = padded, part["image_sizes"]
            video_counts, frames = [], []
            for v in videos:
                idx, info = enc.frame_indices(v)
                item = enc.video_inputs(v, idx, info)
                video_counts.append(int(item["num_image_tokens"][0]))
                frames.append(item["images"])
            if frames:
                if len({f.shape[0] for f in frames}) > 1:
                    raise ValueError("videos of one prompt must give the same number of frames; lower "
                                     "--video-frames to the shortest one's")
                out.pixel_values_videos = torch.stack(frames)
        image_tiles = part["num_image_tiles"].tolist() if self.spec.is_anyres and images else [1] * len(images)
        expanded, i_img, i_vid = [], 0, 0
        for t in ids:
            if t == image_id:
                expanded += [t] * counts[i_img]
                out.items.append(counts[i_img])
                out.tiles.append(image_tiles[i_img])
                i_img += 1
            elif video_id is not None and t == video_id:
                expanded += [t] * video_counts[i_vid]
                out.items.append(video_counts[i_vid])
                out.tiles.append(out.pixel_values_videos.shape[1])
                i_vid += 1
            else:
                expanded.append(t)
        out.input_ids = expanded
        return out


    def _encode_qwen_vl(self, messages: list[dict], images: list, videos: list) -> Prompt:
        """Qwen2.5-VL / Qwen3-VL: each ``<|image_pad|>`` the template writes repeated by the image's merged patches;
        ``pixel_values`` ``[patches, C x T x P x P]`` and ``image_grid_thw`` from the training encoder's image
        processor, as HF's processor gives them (videos refused: images only for now)."""
        enc = self.enc
        ids = self.prompt_ids(messages)
        if enc.image_token_id != enc.tokenizer_image_token_id:
            ids = [enc.image_token_id if t == enc.tokenizer_image_token_id else t for t in ids]
        enc.check_no_videos(messages, ids, "the prompt", videos)
        image_id = self.spec.image_token_id
        if ids.count(image_id) != len(images):
            raise ValueError(f"the chat template rendered {ids.count(image_id)} image token(s) for {len(images)} "
                             f"image(s); check the chat template of {enc.hf_dir}")
        part = enc.image_inputs(images)
        counts = iter((part["image_grid_thw"].prod(-1) // self.spec.spatial_merge_size ** 2).tolist())
        expanded = []
        for t in ids:
            expanded += [t] * next(counts) if t == image_id else [t]
        extra = dict(image_grid_thw=part["image_grid_thw"]) if images else {}
        return Prompt(expanded, pixel_values=part["images"] if images else None, num_images=len(images), extra=extra)

    def _encode_internvl(self, messages: list[dict], images: list, videos: list) -> Prompt:
        """InternVL: the prompt rendered as its processor writes it (``<img><IMG_CONTEXT></img>``, ``FrameN:``
        lines), each ``<IMG_CONTEXT>`` repeated by its tiles' tokens; ``pixel_values`` every tile and frame in token
        order ``[sum tiles, 3, s, s]``, as HF's processor gives them."""
        from megatron_vlm.data.chat_tokens import ChatTokenizer
        from megatron_vlm.data.task_encoder import refuse_videos

        enc = self.enc
        if videos and enc.chat.video is None:
            refuse_videos(self.spec, "the prompt", has_video_token=False)
        plans = [enc.frame_indices(v) for v in videos]
        enc.chat.frames = [len(p) for p in plans]
        ids = self.prompt_ids(messages)
        kinds = enc.chat.kinds(ChatTokenizer.render(enc.chat, messages, add_generation_prompt=True))
        if kinds.count("image") != len(images) or kinds.count("video") != len(videos):
            raise ValueError(f"the chat template rendered {kinds.count('image')} image and {kinds.count('video')} "
                             f"video part(s) for {len(images)} image(s) and {len(videos)} video(s); check the chat "
                             f"template of {enc.hf_dir}")
        pixels, tiles = enc.tile_pixels(images)
        parts, counts = enc.item_pixels(enc.media_items(kinds), pixels, tiles, videos, plans)
        image_id, tiles = enc.tokenizer_image_token_id, list(counts)
        counts, expanded = iter(tiles), []
        for t in ids:
            expanded += [self.spec.image_token_id] * (next(counts) * self.spec.num_image_tokens) if t == image_id \
                else [t]
        return Prompt(expanded, pixel_values=torch.cat(parts) if parts else None, num_images=len(images),
                      num_videos=len(videos), items=[n * self.spec.num_image_tokens for n in tiles], tiles=tiles)


def collate(prompts: list[Prompt], pad_token_id: int, arch: str = "llava", image_token_id: int | None = None) -> dict:
    """``generate`` inputs of ``prompts``, left-padded (the new tokens of every row start at the same column).
    OneVision (``arch``) also gets ``batch_num_images``: a prompt with several images gives each its base tile.
    Qwen-VL: the images' ``image_grid_thw`` in order, and ``mm_token_type_ids`` (1 at ``image_token_id``)."""
    n = max(len(p.input_ids) for p in prompts)
    ids = torch.full((len(prompts), n), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), n), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, n - len(p.input_ids):] = torch.tensor(p.input_ids, dtype=torch.int64)
        mask[b, n - len(p.input_ids):] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    pix = [p.pixel_values for p in prompts if p.pixel_values is not None]
    if pix:
        if pix[0].dim() == 5:  # anyres: [n, tiles, 3, s, s], padded to the batch's most tiles
            tiles = max(x.shape[1] for x in pix)
            pix = [torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 0, 0, tiles - x.shape[1])) for x in pix]
            out["image_sizes"] = torch.cat([p.image_sizes for p in prompts if p.image_sizes is not None])
            if arch == "llava_onevision":
                out["batch_num_images"] = torch.tensor([p.num_images for p in prompts if p.num_images])
        out["pixel_values"] = torch.cat(pix)
    grids = [p.extra["image_grid_thw"] for p in prompts if "image_grid_thw" in p.extra]
    if grids:
        out["image_grid_thw"] = torch.cat(grids)
    if arch in QWEN_VL_ARCHS:
        out["mm_token_type_ids"] = (ids == image_token_id).to(torch.int32)
    vids = [p.pixel_values_videos for p in prompts if p.pixel_values_videos is not None]
    if vids:
        if len({v.shape[1] for v in vids}) > 1:
            raise ValueError("videos of one batch must give the same number of frames")
        out["pixel_values_videos"] = torch.cat(vids)
    return out
