"""The energon TaskEncoder for Qwen2.5-VL and Qwen3-VL: the samples HF's ``Qwen2_5_VLProcessor`` /
``Qwen3VLProcessor`` make, images only (the two share the image processor and the image tokens; Qwen3-VL's patches
are 16 px, its chat template its own).

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

Refused in one line: videos (a video, a video part of a message, or the ``<|video_pad|>`` token: not supported yet,
:class:`~megatron_vlm.data.task_encoder.VideoNotSupportedError`, which stops the run), a spec that is not
a Qwen-VL one; Qwen2-VL / Qwen3-VL-MoE directories are refused by the spec itself
(:data:`megatron_vlm.model.spec.NOT_YET`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless

from megatron_vlm.data.task_encoder import (VideoNotSupportedError, VLMBatch, VLMSample, VLMTaskEncoder, _as_pil,
                                            framed, kept_tokens)
from megatron_vlm.model.spec import family_name

VISION_START, VIDEO_PAD = "<|vision_start|>", "<|video_pad|>"


@edataclass
class QwenVLSample(VLMSample):
    """``images`` is the processor's ``pixel_values`` of the kept images ``[patches, C x T x P x P]``; ``tokens``
    hold every image's ``<|image_pad|>`` tokens (``num_tokens == len(tokens)``)."""

    image_grid_thw: torch.Tensor  # int64 [n_images, 3]
    position_ids: torch.Tensor  # int64 [3, s] M-RoPE positions of tokens


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


def expand_images(x: list[int], assistant: list, image_id: int, counts: list[int]) -> tuple[list[int], list]:
    """``x`` with its ``i``-th ``image_id`` repeated ``counts[i]`` times (as the processor writes them), and the
    per-token ``assistant`` flags with them."""
    ids, mask, k = [], [], 0
    for t, a in zip(x, assistant):
        n = 1
        if t == image_id and k < len(counts):
            n, k = counts[k], k + 1
        ids += [t] * n
        mask += [a] * n
    return ids, mask


class QwenVLTaskEncoder(VLMTaskEncoder):
    """Energon task encoder for Qwen2.5-VL and Qwen3-VL samples; see the module docstring."""

    sample_type = QwenVLSample

    def __init__(self, *args, **kwargs):
        for unused in ("video_fps", "video_frames"):  # task_encoder_for's frame choice: no videos here
            kwargs.pop(unused, None)
        super().__init__(*args, **kwargs)
        self.hf_config = self.spec.to_hf_config()
        self.merge = int(self.spec.spatial_merge_size)
        self.vision_start_id = self.tokenizer.convert_tokens_to_ids(VISION_START)
        self.video_pad_id = self.tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        self.skips.hints["too_long"] = (f"raise --seq-length (now {self.seq_length}) or lower max_pixels in "
                                        f"{self.hf_dir}/preprocessor_config.json (an image takes one token per "
                                        f"{self.merge}x{self.merge} patches of {self.spec.patch_size} px)")

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

    def positions(self, tokens: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """``[3, s]`` M-RoPE positions of a sample's ``tokens`` (images expanded), from ``get_rope_index``."""
        from megatron_vlm.model.qwen_vl import mrope_position_ids

        return mrope_position_ids(self.hf_config, tokens[None], grid if len(grid) else None, self.image_token_id)[:, 0]

    # -- per sample ---------------------------------------------------------------------------------
    def check_no_videos(self, messages: list[dict], ids: list[int], key: str, videos) -> None:
        """Stop the run for a sample with a video (one line, naming the sample and what holds the video)."""
        parts = sum(1 for m in messages for p in (m.get("content") or []) if isinstance(p, dict)
                    and p.get("type") == "video")
        what = (f"{len(list(videos))} video(s)" if videos else f"{parts} video part(s)" if parts else
                f"the video token {VIDEO_PAD!r}" if self.video_pad_id in ids else None)
        if what:
            raise VideoNotSupportedError(f"sample {key} has {what}: videos of {family_name(self.spec.arch)} are not "
                                         "supported yet; leave the video samples out of --data-path")

    def kept(self, x: list[int], costs: list[int]) -> int:
        """Input tokens of ``x`` (one ``<|image_pad|>`` per image) kept within ``seq_length``: cut from the end,
        never inside an image; an image past the cut takes its ``<|vision_start|>`` with it."""
        m = kept_tokens(x, {self.image_token_id: costs}, self.seq_length, self.whole)
        if 0 < m < len(x) and x[m] == self.image_token_id and x[m - 1] == self.vision_start_id:
            m -= 1
        return m

    def encode_conversation(self, messages: list[dict], images: list, key: str = "?", videos=()) -> dict:
        conv = self.chat(messages)
        x, assistant = conv.ids, conv.assistant
        if self.image_token_id != self.tokenizer_image_token_id:
            x = [self.image_token_id if t == self.tokenizer_image_token_id else t for t in x]
        self.check_no_videos(messages, x, key, videos)
        if x.count(self.image_token_id) != len(images):
            self.skips.skip(key, "image_tokens", f"{x.count(self.image_token_id)} image tokens but {len(images)} "
                                                 "images")
        costs = self.image_tokens(images)
        if sum(costs) > self.seq_length:
            self.skips.skip(key, "too_long", f"{len(images)} images need {sum(costs)} > seq_length "
                                             f"{self.seq_length} tokens")
        m = self.kept(x, costs)
        n_img = x[:m].count(self.image_token_id)
        ids, mask = expand_images(x[:m + 1], assistant[:m + 1], self.image_token_id, costs)
        out = framed(ids, mask, m + sum(costs[:n_img]) - n_img, self.whole, self.pad_token_id)
        if out["loss_mask"].sum() == 0:
            self.skips.skip(key, "no_answer", "no answer token left within seq_length")
        self.skips.kept()
        media = self.image_inputs(images[:n_img])
        return dict(**out, **media, num_tokens=len(out["tokens"]),
                    position_ids=self.positions(out["tokens"], media["image_grid_thw"]))

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
