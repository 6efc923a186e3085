"""The energon TaskEncoder for Qwen2.5-VL and Qwen3-VL: the samples HF's ``Qwen2_5_VLProcessor`` /
``Qwen3VLProcessor`` make, images and videos (the two share the image processor and the image tokens;
Qwen3-VL's patches are 16 px, its chat template its own).

As :class:`~megatron_vlm.data.task_encoder.VLMTaskEncoder` (the processor's chat template, labels and loss mask by
the assistant-mask rules of :mod:`megatron_vlm.data.chat_tokens`, truncation that never splits an image, skips
counted by :mod:`megatron_vlm.data.skips`), with what Qwen2.5-VL's processor does:

- **pixels**: the model's own image processor, its PIL backend (``Qwen2VLImageProcessorPil``: HF's processor
  class needs torchvision for its video half; PIL gives the same pixels in every environment): each image resized
  to whole merged patches within ``min_pixels``..``max_pixels`` (``smart_resize``), cut into ``pixel_values``
  ``[patches, C x T x P x P]`` (the still image repeated over the temporal patch) and ``image_grid_thw``
  ``[images, 3]``, all images of a sample concatenated in token order;
- **tokens**: the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for an image; as HF's
  processor, each ``<|image_pad|>`` becomes ``t x h x w / merge^2`` of them (the image's merged patches; the count
  HF's ``get_number_of_image_patches`` gives before any pixel is computed). ``tokens`` hold them all: the model
  (:class:`~megatron_vlm.model.qwen_vl.QwenVLModel`) scatters the merged vision embeddings at those positions;
- **positions**: ``position_ids`` ``[3, s]`` of M-RoPE from :func:`megatron_vlm.model.qwen_vl.mrope_position_ids`
  (transformers' own ``get_rope_index``): text positions count on after each image's grid;
- **truncation**: the tokens are cut from the end to ``seq_length`` (images counted at their tokens), never inside
  an image: an image past the cut goes with its pixels and its ``<|vision_start|>``. A sample whose images alone
  exceed ``seq_length``, or that keeps no answer token, is skipped with the reason.

Per batch (:meth:`QwenVLTaskEncoder.batch`): right padding with the pad id (loss mask 0), each row's padding
positions counting on after its last position (what ``get_rope_index`` gives on the padded batch), every image's
``pixel_values`` concatenated in token order and the grids with them; the training step
(:func:`megatron_vlm.training.step.forward_step`) passes the positions in the position argument and
:meth:`QwenVLBatch.model_kwargs` (the grids) by keyword.

**Videos** (the template's ``<|vision_start|><|video_pad|><|vision_end|>``), as each family's video processor and
processor make them (:meth:`QwenVLTaskEncoder.plan_of`, :meth:`QwenVLTaskEncoder.video_inputs`): the frames taken at
``video_fps`` (at most ``video_frames``; Qwen2.5-VL: :func:`qwen_frame_indices`, HF's ``Qwen2VLVideoProcessor``
rule; Qwen3-VL: its ``Qwen3VLVideoProcessor.sample_frames`` and ``smart_resize``), decoded through energon
(:mod:`megatron_vlm.data.videos`), each resized, rescaled and normalised by the PIL image processor (HF's torchvision
resize differs by at most 2 of 255 levels), the last repeated to whole temporal patches, cut into
``pixel_values_videos`` rows in the video processor's order. Qwen2.5-VL: ``<|video_pad|>`` repeated once per merged
patch, and ``second_per_grid_ts`` (the temporal patch over the sampled fps), whose time steps ``get_rope_index`` puts
in the positions. Qwen3-VL: the processor's own text for the video (``Qwen3VLProcessor.replace_video_token``: each
temporal patch as ``<t seconds><|vision_start|>``, its ``<|video_pad|>`` tokens, ``<|vision_end|>``, inside the
template's own vision tokens). A sample keeps its images' and videos' patches and grids in one list in token order
(``images``, ``image_grid_thw``, and ``second_per_grid_ts`` 0 for an image): the model scatters the ViT's outputs at
the image and video tokens in that order. A video token without its video, or a video that does not decode, is a
counted skip; truncation never cuts inside a video.

Refused in one line: a spec that is not a Qwen-VL one; Qwen2-VL / Qwen3-VL-MoE directories are refused by the spec
itself (:data:`megatron_vlm.model.spec.NOT_YET`); eval/generate.py's prompts with a video
(:meth:`QwenVLTaskEncoder.check_no_videos`).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless

from megatron_vlm.data import videos as vid
from megatron_vlm.data.task_encoder import (VideoNotSupportedError, VLMBatch, VLMSample, VLMTaskEncoder, _as_pil,
                                            framed, kept_tokens)
from megatron_vlm.model.spec import family_name

VISION_START, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"


@edataclass
class QwenVLSample(VLMSample):
    """``images`` is the processor's ``pixel_values`` of the kept images and videos (``pixel_values_videos``) in
    token order ``[patches, C x T x P x P]``, ``image_grid_thw`` their grids (a video's ``video_grid_thw``);
    ``tokens`` hold every image's ``<|image_pad|>`` and every video's ``<|video_pad|>`` tokens
    (``num_tokens == len(tokens)``)."""

    image_grid_thw: torch.Tensor  # int64 [n_items, 3]
    position_ids: torch.Tensor  # int64 [3, s] M-RoPE positions of tokens
    #: float32 [n_items]: a video's seconds per temporal grid step (the processor's ``second_per_grid_ts``), 0 for
    #: an image (HF's reference model computes its positions from them; the trainer takes ``position_ids``)
    second_per_grid_ts: torch.Tensor


@edataclass
class QwenVLBatch(VLMBatch):
    """``images``: every image's patches in token order; ``num_image_tiles`` one per image."""

    image_grid_thw: torch.Tensor  # int64 [n_images, 3]
    position_ids: torch.Tensor  # int64 [3, B, S]

    def model_kwargs(self, device) -> dict:
        """The keyword inputs of :class:`~megatron_vlm.model.qwen_vl.QwenVLModel`'s forward beyond the training
        step's positional ones (images, tokens, ``position_ids``, labels, loss mask), on ``device``."""
        return dict(image_grid_thw=self.image_grid_thw.to(device, non_blocking=True))


def processor_chat_template(hf_dir, tokenizer) -> str | None:
    """The chat template HF's processor of ``hf_dir`` loads (``chat_template.jinja``, else ``chat_template.json``),
    else the tokenizer's."""
    d = Path(str(hf_dir))
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    if (d / "chat_template.json").is_file():
        return json.loads((d / "chat_template.json").read_text()).get("chat_template")
    return tokenizer.chat_template


def expand_media(x: list[int], assistant: list, replacements: dict[int, list[list[int]]]) -> tuple[list[int], list]:
    """``x`` with the ``i``-th occurrence of each media token ``t`` replaced by ``replacements[t][i]`` (the ids the
    processor writes for it: an image's ``<|image_pad|>`` tokens, a video's), and the per-token ``assistant`` flags
    with them."""
    ids, mask, seen = [], [], {t: 0 for t in replacements}
    for t, a in zip(x, assistant):
        new = [t]
        if t in replacements and seen[t] < len(replacements[t]):
            new, seen[t] = replacements[t][seen[t]], seen[t] + 1
        ids += new
        mask += [a] * len(new)
    return ids, mask


def qwen_frame_indices(num_frames: int, fps: float, video_fps: float, max_frames: int, temporal: int,
                       min_frames: int = 4) -> list[int]:
    """The frames HF's ``Qwen2VLVideoProcessor.sample_frames`` takes from a video of ``num_frames`` at ``fps`` when
    asked for ``video_fps`` frames a second (qwen-vl-utils' rule): ``num_frames / fps x video_fps`` frames, at least
    ``min_frames`` and at most ``max_frames`` and the video's, rounded down to whole temporal patches, evenly spaced
    from frame 0. A video shorter than one temporal patch takes every frame (the last is repeated to fill it)."""
    cap = math.floor(min(max_frames, num_frames) / temporal) * temporal
    n = min(max(num_frames / fps * video_fps, min_frames), cap, num_frames)
    n = math.floor(n / temporal) * temporal
    if n <= 0:
        return list(range(int(num_frames)))
    return torch.arange(0, num_frames, num_frames / n).int().tolist()


class QwenVLTaskEncoder(VLMTaskEncoder):
    """Energon task encoder for Qwen2.5-VL and Qwen3-VL samples; see the module docstring."""

    sample_type = QwenVLSample

    def __init__(self, *args, video_fps: float = vid.DEFAULT_VIDEO_FPS, video_frames: int = vid.DEFAULT_VIDEO_FRAMES,
                 **kwargs):
        if not video_fps > 0 or int(video_frames) < 1:
            raise ValueError(f"--video-fps {video_fps} must be positive and --video-frames {video_frames} at "
                             "least 1")
        super().__init__(*args, **kwargs)
        if int(video_frames) < self.spec.temporal_patch_size:
            raise ValueError(f"--video-frames {video_frames}: {family_name(self.spec.arch)} takes a video's frames "
                             f"{self.spec.temporal_patch_size} at a time (its temporal patch); give at least "
                             f"{self.spec.temporal_patch_size}")
        self.video_fps, self.video_frames = float(video_fps), int(video_frames)
        self.hf_config = self.spec.to_hf_config()
        self.merge = int(self.spec.spatial_merge_size)
        self.vision_start_id = self.tokenizer.convert_tokens_to_ids(VISION_START)
        self.video_pad_id = self.tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        self.skips.hints["too_long"] = (f"raise --seq-length (now {self.seq_length}) or lower max_pixels in "
                                        f"{self.hf_dir}/preprocessor_config.json (an image takes one token per "
                                        f"{self.merge}x{self.merge} patches of {self.spec.patch_size} px; a video "
                                        "as many per temporal patch of its frames: lower --video-fps or "
                                        "--video-frames)")
        self.skips.hints["video_tokens"] = (f"check the chat template in {self.hf_dir}: it must render every video "
                                            f"part of a message as '{VIDEO_PAD}', once per video")
        self.skips.hints["video"] = ("the video does not decode; rebuild the dataset with data_prep/make_wds.py (it "
                                     "checks videos)")

    def _check_spec(self, spec) -> None:
        if not spec.is_qwen_vl:
            raise ValueError(f"the Qwen2.5-VL task encoder got a {spec.arch} model; take the encoder "
                             "megatron_vlm.data.anyres_encoder.task_encoder_for picks for it")

    def _load_processor(self):
        """The tokenizer, the PIL image processor and the processor's chat template of ``hf_dir``."""
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(self.hf_dir)
        return SimpleNamespace(tokenizer=tokenizer, image_processor=image_processor, image_token=self.spec.image_token,
                               chat_template=processor_chat_template(self.hf_dir, tokenizer))

    def _check_image_processor(self) -> None:
        ip, s = self.image_processor, self.spec
        mine = (ip.patch_size, ip.temporal_patch_size, ip.merge_size)
        want = (s.patch_size, s.temporal_patch_size, s.spatial_merge_size)
        if tuple(int(v) for v in mine) != want:
            raise ValueError(f"the image processor of {self.hf_dir} (patch_size, temporal_patch_size, merge_size) "
                             f"{mine} does not match the model's vision config {want}; set them in "
                             "preprocessor_config.json to the vision config's")

    # -- media --------------------------------------------------------------------------------------
    def tokens_of_size(self, height: int, width: int) -> int:
        """``<|image_pad|>`` tokens of an image of this size: its merged patches after ``smart_resize`` (HF's
        ``get_number_of_image_patches``; ``data_prep/stats.py`` counts them from the stored sizes)."""
        return int(self.image_processor.get_number_of_image_patches(int(height), int(width), {})) // self.merge ** 2

    def image_tokens(self, images: list) -> list[int]:
        """``<|image_pad|>`` tokens of each image (its merged patches), from its size alone."""
        return [self.tokens_of_size(im.height, im.width) for im in (_as_pil(i) for i in images)]

    def image_inputs(self, images: list) -> dict:
        """The processor's ``pixel_values`` ``[patches, C x T x P x P]`` and ``image_grid_thw`` of ``images``."""
        if not images:
            width = 3 * self.spec.temporal_patch_size * self.spec.patch_size ** 2
            return dict(images=torch.zeros(0, width), image_grid_thw=torch.zeros(0, 3, dtype=torch.int64))
        out = self.image_processor(images=[_as_pil(im) for im in images], return_tensors="pt")
        return dict(images=out["pixel_values"].to(torch.float32), image_grid_thw=out["image_grid_thw"].to(torch.int64))

    def pixel_values(self, images: list) -> torch.Tensor:
        return self.image_inputs(images)["images"]

    @functools.cached_property
    def video_processor(self):
        """Qwen3-VL's own ``Qwen3VLVideoProcessor`` (its ``video_preprocessor_config.json``; its frame choice, size
        rule and normalisation are used, not its torchvision resize), its ``max_frames`` set to ``--video-frames``."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        vp = Qwen3VLVideoProcessor.from_pretrained(self.hf_dir)
        vp.max_frames = self.video_frames
        return vp

    def video_plan(self, video) -> dict:
        """:meth:`plan_of` one video (an energon ``AVDecoder`` or bytes), from its container's probe."""
        return self.plan_of(vid.probe(vid.av_decoder(video).stream))

    def plan_of(self, info: vid.VideoInfo) -> dict:
        """What a video of ``info`` (frames, fps, size) becomes, before a frame is decoded: the probe, the
        frames taken, the frame size (Qwen3-VL; Qwen2.5-VL resizes each frame as an image), its grid, the token ids
        that stand for it and its seconds per temporal patch. Qwen2.5-VL: :func:`qwen_frame_indices`, one
        ``<|video_pad|>`` per merged patch. Qwen3-VL: its video processor's ``sample_frames`` and ``smart_resize``
        (over the frames), and the processor's own text for it (``Qwen3VLProcessor.replace_video_token``: each
        temporal patch as ``<t seconds><|vision_start|>`` + its ``<|video_pad|>`` tokens + ``<|vision_end|>``)."""
        t, p = self.spec.temporal_patch_size, self.spec.patch_size
        if self.spec.arch != "qwen3_vl":
            indices = qwen_frame_indices(info.frames, info.fps, self.video_fps, self.video_frames, t)
            n = self.video_tokens(len(indices), info.height, info.width)
            return dict(info=info, indices=indices, size=None, ids=[self.video_pad_id] * n,
                        seconds=t / (len(indices) / info.frames * info.fps))  # HF's VideoMetadata.sampled_fps
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
        from transformers.video_utils import VideoMetadata

        vp = self.video_processor
        indices = vp.sample_frames(VideoMetadata(total_num_frames=info.frames, fps=info.fps),
                                   fps=self.video_fps).tolist()
        if len(indices) < t:
            raise ValueError(f"{len(indices)} frame(s): {family_name(self.spec.arch)} takes at least {t}")
        h, w = smart_resize(len(indices), info.height, info.width, temporal_factor=t, factor=p * self.merge,
                            min_pixels=vp.size.shortest_edge, max_pixels=vp.size.longest_edge)
        grid = torch.tensor([[-(-len(indices) // t), h // p, w // p]])
        host = SimpleNamespace(video_processor=vp, vision_start_token=VISION_START, vision_end_token=VISION_END,
                               video_token=VIDEO_PAD)
        host._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, host)
        meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, frames_indices=list(indices))
        text = Qwen3VLProcessor.replace_video_token(host, dict(video_grid_thw=grid, video_metadata=[meta]), 0)
        return dict(info=info, indices=indices, size=(h, w), ids=self.tokenizer(text, add_special_tokens=False)[
            "input_ids"], seconds=t / (len(indices) / info.frames * info.fps))

    def video_tokens(self, frames: int, height: int, width: int) -> int:
        """Qwen2.5-VL: ``<|video_pad|>`` tokens of ``frames`` frames of this size: its merged patches per temporal
        patch."""
        return -(-frames // self.spec.temporal_patch_size) * self.tokens_of_size(height, width)

    def video_inputs(self, video, plan: dict) -> dict:
        """One video as the processor makes it (``pixel_values_videos`` ``[patches, C x T x P x P]``,
        ``video_grid_thw`` ``[1, 3]``, ``second_per_grid_ts``) after :meth:`video_plan`: the chosen frames, each
        resized (Qwen2.5-VL: as an image; Qwen3-VL: to the plan's size), rescaled and normalised by the model's
        (PIL) image processor (with Qwen3-VL's video processor's mean and std), the last repeated to whole temporal
        patches, cut into patches in the video processor's order (a temporal patch's frames side by side)."""
        import numpy as np
        from transformers import Qwen2VLImageProcessorPil
        from transformers.image_utils import SizeDict

        ip, s = self.image_processor, self.spec
        t, p, m = s.temporal_patch_size, s.patch_size, self.merge
        norm = self.video_processor if plan["size"] else ip
        size = ip.size if isinstance(ip.size, SizeDict) else SizeDict(**ip.size)
        frames = []
        for f in vid.decode_frames(video, plan["indices"]).numpy():
            if plan["size"]:  # the frames' own size, as the video processor chose it
                h, w = plan["size"]
                x = super(Qwen2VLImageProcessorPil, ip).resize(f, SizeDict(height=h, width=w), resample=ip.resample)
            else:
                x = ip.resize(f, size, resample=ip.resample, factor=p * m)
            x = ip.normalize(ip.rescale(x, norm.rescale_factor), norm.image_mean, norm.image_std)
            frames.append(torch.from_numpy(np.asarray(x, dtype=np.float32)))
        v = torch.stack(frames)
        if pad := -v.shape[0] % t:
            v = torch.cat([v, v[-1:].expand(pad, *v.shape[1:])])
        c, gt, gh, gw = v.shape[1], v.shape[0] // t, v.shape[2] // p, v.shape[3] // p
        patches = v.reshape(gt, t, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return dict(images=patches.reshape(gt * gh * gw, c * t * p * p),
                    image_grid_thw=torch.tensor([[gt, gh, gw]], dtype=torch.int64),
                    second_per_grid_ts=torch.tensor([plan["seconds"]], dtype=torch.float32))

    def positions(self, tokens: torch.Tensor, grid: torch.Tensor, seconds: torch.Tensor) -> torch.Tensor:
        """``[3, s]`` M-RoPE positions of a sample's ``tokens`` (images and videos expanded; ``grid`` and
        ``seconds`` theirs in token order), from ``get_rope_index``."""
        from megatron_vlm.model.qwen_vl import mrope_position_ids

        video = seconds > 0
        steps = seconds[video].tolist() if self.spec.arch != "qwen3_vl" else None  # Qwen3-VL: timestamps in text
        return mrope_position_ids(self.hf_config, tokens[None], grid[~video], self.image_token_id, grid[video],
                                  self.video_pad_id, steps)[:, 0]

    # -- per sample ---------------------------------------------------------------------------------
    def check_no_videos(self, messages: list[dict], ids: list[int], key: str, videos) -> None:
        """Stop eval/generate.py's prompt ``key`` if it holds a video (one line, naming what holds it): generation
        takes images only for now."""
        parts = sum(1 for m in messages for p in (m.get("content") or []) if isinstance(p, dict)
                    and p.get("type") == "video")
        what = (f"{len(list(videos))} video(s)" if videos else f"{parts} video part(s)" if parts else
                f"the video token {VIDEO_PAD!r}" if self.video_pad_id in ids else None)
        if what:
            raise VideoNotSupportedError(f"{key} has {what}: generation from {family_name(self.spec.arch)} videos "
                                         "is not supported yet; give images only")

    def kept(self, x: list[int], costs: dict[int, list[int]]) -> int:
        """Input tokens of ``x`` (one ``<|image_pad|>`` per image, one ``<|video_pad|>`` per video) kept within
        ``seq_length``: cut from the end, never inside an image or a video; one past the cut takes its
        ``<|vision_start|>`` with it."""
        m = kept_tokens(x, costs, self.seq_length, self.whole)
        if 0 < m < len(x) and x[m] in costs and x[m - 1] == self.vision_start_id:
            m -= 1
        return m

    def encode_conversation(self, messages: list[dict], images: list, key: str = "?", videos=()) -> dict:
        conv = self.chat(messages)
        x, assistant = conv.ids, conv.assistant
        videos = list(videos)
        if self.image_token_id != self.tokenizer_image_token_id:
            x = [self.image_token_id if t == self.tokenizer_image_token_id else t for t in x]
        image_id, video_id = self.image_token_id, self.video_pad_id
        if x.count(image_id) != len(images):
            self.skips.skip(key, "image_tokens", f"{x.count(image_id)} image tokens but {len(images)} images")
        if x.count(video_id) != len(videos):
            self.skips.skip(key, "video_tokens", f"{x.count(video_id)} video tokens but {len(videos)} videos")
        plans = self.video_plans(key, videos, self.video_plan)
        image_ids = [[image_id] * n for n in self.image_tokens(images)]
        replacements = {image_id: image_ids, video_id: [plan["ids"] for plan in plans]}
        costs = {t: [len(r) for r in rs] for t, rs in replacements.items()}
        total = sum(costs[image_id]) + sum(costs[video_id])
        if total > self.seq_length:
            media = f"{len(images)} images" + (f" and {len(videos)} videos" if videos else "")
            self.skips.skip(key, "too_long", f"{media} need {total} > seq_length {self.seq_length} tokens")
        m = self.kept(x, costs)
        ids, mask = expand_media(x[:m + 1], assistant[:m + 1], replacements)
        media = [t for t in x[:m] if t in costs]
        out = framed(ids, mask, m - len(media) + sum(costs[image_id][:media.count(image_id)]) +
                     sum(costs[video_id][:media.count(video_id)]), self.whole, self.pad_token_id)
        if out["loss_mask"].sum() == 0:
            self.skips.skip(key, "no_answer", "no answer token left within seq_length")
        pictures, items = self.image_inputs(images[:media.count(image_id)]), []
        grids = pictures["image_grid_thw"]
        kept_images = iter(zip(pictures["images"].split(grids.prod(-1).tolist()), grids.split(1)))
        kept_videos = iter(zip(videos, plans))
        for t in media:  # each image's and video's inputs, in token order
            if t == image_id:
                rows, grid = next(kept_images)
                items.append(dict(images=rows, image_grid_thw=grid, second_per_grid_ts=torch.zeros(1)))
                continue
            video, plan = next(kept_videos)
            try:
                items.append(self.video_inputs(video, plan))
            except Exception as e:  # noqa: BLE001 - any PyAV failure on a stored video: the sample is skipped
                self.skips.skip(key, "video", f"video does not decode: {getattr(e, 'strerror', None) or e}")
        self.skips.kept()
        inputs = {k: torch.cat([it[k] for it in items]) for k in ("images", "image_grid_thw", "second_per_grid_ts")} \
            if items else dict(**self.image_inputs([]), second_per_grid_ts=torch.zeros(0))
        return dict(**out, **inputs, num_tokens=len(out["tokens"]), position_ids=self.positions(
            out["tokens"], inputs["image_grid_thw"], inputs["second_per_grid_ts"]))

    # -- per batch ----------------------------------------------------------------------------------
    @staticmethod
    def padded_positions(samples: list[QwenVLSample], columns: int) -> torch.Tensor:
        """``[3, B, columns]``: each sample's positions, its padding counting on after its last one (the text
        positions ``get_rope_index`` gives padding tokens at the end of a row)."""
        out = torch.zeros(3, len(samples), columns, dtype=torch.int64)
        for b, s in enumerate(samples):
            n = s.position_ids.shape[1]
            out[:, b, :n] = s.position_ids
            start = int(s.position_ids.max()) + 1 if n else 0
            out[:, b, n:] = torch.arange(start, start + columns - n)
        return out

    @stateless
    def batch(self, samples: list[QwenVLSample]) -> QwenVLBatch:
        text = self.padded_text(samples)
        grid = torch.cat([s.image_grid_thw for s in samples])
        return QwenVLBatch.from_samples(samples, images=torch.cat([s.images for s in samples]), image_grid_thw=grid,
                                        num_image_tiles=torch.ones(grid.shape[0], dtype=torch.int32),
                                        position_ids=self.padded_positions(samples, text["tokens"].shape[1]), **text)
