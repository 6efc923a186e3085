"""The energon TaskEncoder that turns prepared samples into Megatron LLaVAModel inputs.

Per sample (:meth:`VLMTaskEncoder.encode_sample`):
- conversation from a :class:`~megatron_vlm.data.sample.ConversationSample` or an energon ``VQASample``
  (crude samples are cooked by :func:`megatron_vlm.data.sample.cook`);
- tokens from the model's chat template (:mod:`megatron_vlm.data.chat_tokens`), ONE image token per image
  (LLaVAModel expands it into the image's embeddings; InternVL's encoder, :mod:`megatron_vlm.data.internvl_encoder`,
  writes ``<img>``/``</img>`` around it);
- Megatron convention: the conversation x[0..n] gives tokens = x[:-1], labels = x[1:], loss_mask = 1
  where the label is assistant content (answer tokens and the eos closing the turn). A mixture-of-experts language
  model takes HF's framing instead (:func:`whole_sequence`): tokens = x, every position HF's forward routes, labels
  = x[1:] and one pad label whose loss mask is 0 (the last position predicts nothing), so the cross entropy is the
  same and the routers also see the last position;
- truncation to ``seq_length`` counted with images expanded (the positions the model sees: the tokens); it removes
  text from the end and never splits an image (an image past the cut is dropped with its pixels). A sample whose
  images alone do not fit, or that keeps no answer token, is skipped (counted by reason in
  :attr:`VLMTaskEncoder.skipped`); after ``max_consecutive_skips`` skips in a row the encoder stops the run with the
  reasons counted (:mod:`megatron_vlm.data.skips`);
- image size and image tokens per image from the model's spec (:mod:`megatron_vlm.data.geometry`); an image
  processor whose output size differs from the spec's is refused;
- pixel values from the model's own HF image processor (``AutoProcessor.from_pretrained``, its PIL backend),
  i.e. the exact transform HF inference applies with ``backend="pil"``. Images are decoded by energon to PIL RGB.

Per batch (:meth:`VLMTaskEncoder.batch`): right padding with the pad id to the longest sample, loss_mask 0
on padding; all images of the batch stacked in token order. With ``pad_to_multiple_of`` (FP8: 16, or 32 for
mxfp8) the text is padded further so that the sequence the language model sees, images expanded, is a multiple
of it (:func:`padded_text_length`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from megatron.energon import Batch, Sample, TaskEncoder
from megatron.energon.edataclass import edataclass
from megatron.energon.errors import FatalSampleError
from megatron.energon.flavors.webdataset.sample_decoder import SampleDecoder
from megatron.energon.task_encoder.base import stateless
from megatron.energon.task_encoder.cooking import Cooker

from megatron_vlm.data.chat_tokens import ChatTokenizer
from megatron_vlm.data.geometry import ImageGeometry, check_image_processor
from megatron_vlm.data.sample import conversation_of, cook, videos_of
from megatron_vlm.data.skips import DEFAULT_MAX_CONSECUTIVE_SKIPS, SkipCounter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@edataclass
class VLMSample(Sample):
    """One encoded sample (before batching)."""

    images: torch.Tensor  # float32 [n_images, 3, H, W]
    tokens: torch.Tensor  # int64 [s]
    labels: torch.Tensor  # int64 [s]
    loss_mask: torch.Tensor  # float32 [s]
    num_tokens: int  # s with images expanded


@edataclass
class VLMBatch(Batch):
    """What the training step consumes. S = the longest sample of the batch."""

    images: torch.Tensor  # float32 [num_images_in_batch, 3, H, W] (0 rows without images)
    num_image_tiles: torch.Tensor  # int32 [num_images_in_batch], all ones
    tokens: torch.Tensor  # int64 [B, S], one image token per image
    labels: torch.Tensor  # int64 [B, S]
    loss_mask: torch.Tensor  # float32 [B, S]
    num_tokens: int  # unpadded positions of the batch with images expanded
    #: int64 [B]: each row's positions with images expanded that hold its samples (a row is padded after them);
    #: a mixture-of-experts model's routing counts only these (megatron_vlm.training.moe.micro_batch)
    row_tokens: torch.Tensor


def _as_pil(image):
    """PIL RGB for the HF image processor. Images come as PIL from this encoder's decoder; a tensor from
    energon's default decoder (CHW, float in [0, 1] or uint8) is converted back exactly."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, torch.Tensor):
        t = image.detach().cpu()
        if t.is_floating_point():
            t = (t * 255).round().clamp(0, 255)
        arr = t.to(torch.uint8).permute(1, 2, 0).numpy()
        return Image.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr).convert("RGB")
    raise TypeError(f"unsupported image type {type(image).__name__}")


class VideoNotSupportedError(FatalSampleError):
    """A sample holds a video but the model is not a LLaVA-OneVision with a video token. An energon (ValueError)
    ``FatalSampleError``: energon's error handler does not swallow it, it stops the run with its one line
    (:func:`megatron_vlm.data.skips.skip_error_line`)."""


def refuse_videos(spec, key: str, has_video_token: bool = False) -> None:
    """Stop the run for a sample with a video unless the model is a OneVision with a video token (not a skip:
    every video sample would fail the same way)."""
    if spec.arch in ("llava_onevision", "internvl") and has_video_token:
        return
    why = ("its tokenizer has no '<video>' token" if spec.arch in ("llava_onevision", "internvl") else
           f"the model is {spec.arch}, and only llava_onevision and internvl models take videos")
    raise VideoNotSupportedError(
        f"sample {key} has a video, but {why}; build the model with convert/build_llava.py --arch "
        "llava_onevision (it adds '<video>'), or leave the video samples out of --data-path")


def padded_text_length(text_lengths: list[int], image_extra: list[int], multiple: int | None) -> int:
    """Token columns of a batch whose samples have ``text_lengths`` tokens (one image token per image) and
    ``image_extra`` = (tokens per image - 1) x images positions added by image expansion.

    Megatron's LLaVAModel expands every row to (columns + that row's extra) and pads to the longest row, so the
    language model sees ``columns + max(image_extra)`` positions; with ``multiple`` the columns are chosen so
    that this is the smallest multiple of it that holds the longest sample.
    """
    columns = max(text_lengths)
    if not multiple:
        return columns
    combined = columns + max(image_extra)
    return columns + (-combined) % multiple


def whole_sequence(spec) -> bool:
    """Whether the model's input is the whole kept sequence, as HF's forward takes it (tokens ``x``, the last
    position labelled with nothing), rather than Megatron's ``x[:-1]``: for a mixture-of-experts language model,
    whose load-balancing statistics are over every position its routers route (HF's ``load_balancing_loss_func``
    over HF's forward counts the last one too). The cross entropy is the same either way; the last position costs
    one more position per sample."""
    return bool(getattr(spec, "is_moe", False))


def framed(x: list[int], assistant: list[int], m: int, whole: bool, pad_id: int) -> dict:
    """``tokens``, ``labels`` and ``loss_mask`` of a sample that keeps ``m`` input tokens of the conversation ``x``
    (``assistant``: 1 where ``x`` is assistant content): tokens ``x[:m]``; labels ``x[1:m + 1]`` (Megatron's
    framing), or with ``whole`` (HF's, :func:`whole_sequence`) ``x[1:m]`` and a pad label of loss mask 0 at the last
    position."""
    labels, mask = x[1:m + 1], assistant[1:m + 1]
    if whole and m:
        labels, mask = x[1:m] + [pad_id], assistant[1:m] + [0]
    return dict(tokens=torch.tensor(x[:m], dtype=torch.int64), labels=torch.tensor(labels, dtype=torch.int64),
                loss_mask=torch.tensor(mask, dtype=torch.float32))


def kept_tokens(x: list[int], costs: dict[int, list[int]], seq_length: int, whole: bool = False) -> int:
    """How many input tokens of the conversation ``x`` a sample keeps (tokens ``x[:m]``; :func:`framed`) within
    ``seq_length`` positions, media expanded: ``costs[t]`` lists the positions of each media token ``t`` in the order
    they come (an image's tiles' tokens, a video's); text is cut from the end, never inside an image or a video.
    At most ``len(x) - 1`` (the last token is a label only), or ``len(x)`` with ``whole``."""
    m, used, seen = 0, 0, {t: 0 for t in costs}
    for i in range(len(x) - (0 if whole else 1)):
        t = x[i]
        cost = costs[t][seen[t]] if t in costs else 1
        if used + cost > seq_length:
            break
        used, m = used + cost, i + 1
        if t in costs:
            seen[t] += 1
    return m


class VLMTaskEncoder(TaskEncoder[Sample, VLMSample, VLMBatch, VLMBatch]):
    """Energon task encoder for LLaVA-style training; see the module docstring."""

    decoder = SampleDecoder(image_decode="pilrgb")
    cookers = [Cooker(cook)]
    #: what :meth:`encode_sample` makes of a record
    sample_type = VLMSample

    def __init__(self, hf_dir, seq_length: int, image_token_id: int | None = None, pad_token_id: int | None = None,
                 *, spec=None, max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
                 pad_to_multiple_of: int | None = None):
        """``hf_dir``: the HF LLaVA directory whose tokenizer, chat template and image processor are used.
        ``spec``: the model's :class:`~megatron_vlm.model.spec.VLMSpec` (default: read from ``hf_dir``'s config.json);
        image size and image tokens per image come from it. ``max_consecutive_skips``: stop with
        :class:`~megatron_vlm.data.skips.TooManySkippedSamples` after that many skipped samples in a row. ``pad_to_multiple_of``: pad each batch so its
        image-expanded length is a multiple of this (FP8 GEMMs); None pads to the longest sample."""
        from megatron_vlm.model.spec import VLMSpec
        from megatron_vlm.model.tokenizer import special_token_ids

        self.hf_dir = str(hf_dir)
        self.seq_length = int(seq_length)
        if spec is None:
            if not (Path(self.hf_dir) / "config.json").is_file():
                raise FileNotFoundError(
                    f"{self.hf_dir} has no config.json: the image size and image tokens per image come from the "
                    "model's config; give the LLaVA directory written by convert/build_llava.py (or the "
                    "tokenizer/ directory of a training checkpoint)")
            spec = VLMSpec.from_hf_dir(self.hf_dir)
        self._check_spec(spec)
        self.spec = spec
        #: the model's input is the whole kept sequence, HF's framing (a mixture-of-experts LM: whole_sequence)
        self.whole = whole_sequence(spec)
        #: pad each batch so the image-expanded length is a multiple of this (FP8 GEMMs), None: longest sample
        self.pad_to_multiple_of = pad_to_multiple_of
        self.processor = self._load_processor()
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        # the model's image token (its config's id, checked against this tokenizer and the processor's name)
        ids = special_token_ids(self.tokenizer, getattr(self.processor, "image_token", None) or spec.image_token,
                                spec.image_token_id if spec.image_token_id >= 0 else None,
                                config_src="the model (config.json / vlm_spec.json)",
                                named_src="the processor's image_token", tokenizer_src=f"the tokenizer in {hf_dir}")
        #: the tokenizer's id for the image token (what the chat template produces)
        self.tokenizer_image_token_id = int(ids.image)
        #: the id written into ``tokens`` for each image (default: the tokenizer's; Megatron's LLaVAModel
        #: must be built with the same ``image_token_index``)
        self.image_token_id = int(image_token_id if image_token_id is not None else ids.image)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else ids.pad)
        template = getattr(self.processor, "chat_template", None) or self.tokenizer.chat_template
        self.chat = self._make_chat(template)
        #: pixel shape and image tokens per image, from the spec (never from optional processor fields)
        self.geometry = ImageGeometry.from_spec(self.spec)
        self.tokens_per_image = self.geometry.tokens_per_image
        self._check_image_processor()
        image_token = ids.image_token
        k = self.tokens_per_image
        self.skips = SkipCounter(max_consecutive_skips, hints={
            "image_tokens": f"check the chat template in {self.hf_dir}: it must render every image part of a "
                            f"message as {image_token!r}, once per image",
            "too_long": f"raise --seq-length (now {self.seq_length}; one image takes {k} positions)",
            "no_answer": f"raise --seq-length (now {self.seq_length}) or check that the samples have assistant "
                         "answers",
            "conversation": "check the dataset: rewrite it with data_prep/make_wds.py",
        })

    def _check_spec(self, spec) -> None:
        """Refuse a model this encoder does not encode for, in one line (a Qwen2.5-VL model has its own encoder,
        :mod:`megatron_vlm.data.qwen_vl_encoder`, which :func:`~megatron_vlm.data.anyres_encoder.task_encoder_for`
        picks)."""
        spec.check_supported("the data pipeline (task encoder: images, videos, chat template)")

    def _load_processor(self):
        """The HF processor of ``hf_dir`` (tokenizer, image processor, chat template), with the image processor's
        PIL backend: transformers picks its torchvision backend whenever torchvision is installed, whose resize
        differs from PIL's by a level or two on some pixels; PIL gives the same pixels in every environment."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.hf_dir, backend="pil")

    def _make_chat(self, template) -> ChatTokenizer:
        """The conversation tokenizer (InternVL's renders media as its processor writes them)."""
        return ChatTokenizer(self.tokenizer, template)

    def _check_image_processor(self) -> None:
        check_image_processor(self.image_processor, self.geometry, self.hf_dir)

    def video_plans(self, key: str, videos: list, plan) -> list:
        """``plan(video)`` of each of a sample's videos (its frames, read from the container); a video that fails
        (any PyAV error on a stored video) skips the sample with the reason."""
        plans = []
        for v in videos:
            try:
                plans.append(plan(v))
            except Exception as e:  # noqa: BLE001 - any PyAV failure on a stored video: the sample is skipped
                self.skips.skip(key, "video", f"video does not decode: {getattr(e, 'strerror', None) or e}")
        return plans

    @property
    def skipped(self):
        """reason -> samples skipped for it (in this process or data worker)."""
        return self.skips.total

    # -- per sample -------------------------------------------------------------------------------
    def pixel_values(self, images: list) -> torch.Tensor:
        g = self.geometry
        if not images:
            return torch.zeros(0, g.channels, g.height, g.width, dtype=torch.float32)
        out = self.image_processor(images=[_as_pil(im) for im in images], return_tensors="pt")["pixel_values"]
        return out.to(torch.float32)

    def encode_conversation(self, messages: list[dict], images: list, key: str = "?", videos=()) -> dict:
        """Tokens / labels / loss mask / pixel values for one conversation (see the module docstring); a model
        without video input refuses ``videos``."""
        if videos:
            refuse_videos(self.spec, key)
        conv = self.chat(messages)
        x, assistant = conv.ids, conv.assistant
        if self.image_token_id != self.tokenizer_image_token_id:
            x = [self.image_token_id if t == self.tokenizer_image_token_id else t for t in x]
        k = self.tokens_per_image
        positions = [i for i, t in enumerate(x) if t == self.image_token_id]
        if len(positions) != len(images):
            self.skips.skip(key, "image_tokens", f"{len(positions)} image tokens but {len(images)} images")
        if len(images) * k > self.seq_length:
            self.skips.skip(key, "too_long",
                            f"{len(images)} images need {len(images) * k} > seq_length {self.seq_length} tokens")
        # Keep tokens x[:m] with m + (k-1) * images_in(x[:m]) <= seq_length.
        m = kept_tokens(x, {self.image_token_id: [k] * len(positions)}, self.seq_length, self.whole)
        n_img = sum(1 for p in positions if p < m)
        out = framed(x, assistant, m, self.whole, self.pad_token_id)
        if out["loss_mask"].sum() == 0:
            self.skips.skip(key, "no_answer", "no answer token left within seq_length")
        self.skips.kept()
        return dict(images=self.pixel_values(images[:n_img]), **out, num_tokens=m + (k - 1) * n_img)

    @stateless
    def encode_sample(self, sample: Sample) -> VLMSample:
        """One record's conversation, images and videos as :attr:`sample_type` (each encoder's
        :meth:`encode_conversation` says what it takes)."""
        try:
            messages, images = conversation_of(sample)
        except ValueError as e:
            self.skips.skip(sample.__key__, "conversation", str(e))
        return self.sample_type.derive_from(sample, **self.encode_conversation(messages, images, sample.__key__,
                                                                               videos_of(sample)))

    # -- per batch --------------------------------------------------------------------------------
    def padded_text(self, samples: list) -> dict:
        """``tokens``, ``labels`` (padded with the pad id) and ``loss_mask`` (0 on padding) of ``samples`` as
        ``[batch, seq]`` rows, their image-expanded ``num_tokens`` and each row's (``row_tokens``); ``seq`` per
        :func:`padded_text_length`."""
        seq = padded_text_length([len(s.tokens) for s in samples], [s.num_tokens - len(s.tokens) for s in samples],
                                 self.pad_to_multiple_of)
        tokens = torch.full((len(samples), seq), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((len(samples), seq), self.pad_token_id, dtype=torch.int64)
        loss_mask = torch.zeros((len(samples), seq), dtype=torch.float32)
        for b, s in enumerate(samples):
            n = len(s.tokens)
            tokens[b, :n] = s.tokens
            labels[b, :n] = s.labels
            loss_mask[b, :n] = s.loss_mask
        return dict(tokens=tokens, labels=labels, loss_mask=loss_mask,
                    num_tokens=int(sum(s.num_tokens for s in samples)),
                    row_tokens=torch.tensor([int(s.num_tokens) for s in samples], dtype=torch.int64))

    @stateless
    def batch(self, samples: list[VLMSample]) -> VLMBatch:
        images = torch.cat([s.images for s in samples], dim=0)
        return VLMBatch.from_samples(samples, images=images,
                                     num_image_tiles=torch.ones(images.shape[0], dtype=torch.int32),
                                     **self.padded_text(samples))
