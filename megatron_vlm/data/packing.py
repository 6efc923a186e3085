"""Sequence packing: several encoded samples in one sequence the language model sees, with per-sample attention.

Owns the packing arithmetic and energon's packing hooks (``--packing-buffer-size`` / ``--packed-seq-length``):

- :func:`select_packs` (energon's ``select_samples_to_pack``): first-fit decreasing over a buffer of encoded
  samples by their image-expanded length (``VLMSample.num_tokens``), into packs of at most ``packed_seq_length``
  positions. Every sample of the buffer is placed, whole: truncation happens before, per sample, in the task
  encoder (to ``--seq-length``, never inside an image); a sample longer than a pack (which that truncation
  rules out) is left out and counted as a skip, with a warning naming it.
  A sample whose first token is the image token only ever opens a pack: megatron-core's LLaVAModel masks the
  loss of the position just before an image (a text token does not predict image embeddings), which behind
  another sample would drop that sample's last label.
- :meth:`PackingTaskEncoder.pack_selected_samples` concatenates the samples' tokens, labels, loss masks and images
  (images stay in token order) and records each sample's image-expanded length; with ``sample_multiple`` (context
  parallelism: 2 x CP, which Transformer Engine's and megatron-core's per-sample 'thd' split needs) each sample is
  followed by pad tokens (loss mask 0) up to a multiple of it, inside its own segment: they come after its last
  token, so causal attention keeps them out of its positions;
- :meth:`PackingTaskEncoder.batch` pads the pack with pad tokens (loss mask 0) to exactly ``packed_seq_length``
  image-expanded positions (a fixed shape: pipeline stages exchange [packed_seq_length, 1, hidden]) and builds
  ``cu_seqlens``: the boundaries in IMAGE-EXPANDED positions, i.e. where LLaVAModel's ``_preprocess_data`` puts
  each sample once every image token became its embeddings, with the padding as a last segment of its own;
- :func:`packed_seq_params` turns them into megatron-core's ``PackedSeqParams`` (qkv_format 'thd'): Transformer
  Engine attention then attends within each sample only, and the rotary embedding restarts at position 0 for
  each sample (megatron applies RoPE per ``cu_seqlens`` segment). Labels and loss mask need nothing more: they
  are shifted within each sample by the task encoder, and LLaVAModel expands them in the packed row exactly as
  in separate rows.

Packing runs with every layer implementation: Transformer Engine's fused 'thd' attention on a GPU, and megatron's
local attention taught the 'thd' format by :func:`megatron_vlm.runtime.cpu_compat.packed_local_attention` (the same
causal attention, once per ``cu_seqlens`` segment) on CPU or with ``--transformer-impl local``; the data path, the
``PackedSeqParams`` and megatron-core's per-segment RoPE are the same on both. Anyres models (LLaVA-NeXT,
OneVision: tiles, videos) pack with :class:`AnyresPackingTaskEncoder`, InternVL with
:class:`InternVLPackingTaskEncoder`, Qwen2.5-VL with :class:`QwenVLPackingTaskEncoder` (each sample keeps its own
M-RoPE positions); :func:`packing_task_encoder_for` picks.
"""

from __future__ import annotations

import logging
import math

import torch
from megatron.energon.edataclass import edataclass
from megatron.energon.task_encoder.base import stateless

from megatron_vlm.data.anyres_encoder import AnyresBatch, AnyresSample, AnyresTaskEncoder
from megatron_vlm.data.internvl_encoder import InternVLSample, InternVLTaskEncoder
from megatron_vlm.data.qwen_vl_encoder import QwenVLBatch, QwenVLSample, QwenVLTaskEncoder
from megatron_vlm.data.task_encoder import VLMBatch, VLMSample, VLMTaskEncoder

log = logging.getLogger("megatron_vlm.data")


def check_packing_supported(impl: str, device: str) -> None:
    """Make packed sequences run with layer implementation ``impl`` on ``device`` (called before the model is
    built). Transformer Engine ('thd' natively) needs nothing; local layers get megatron's local attention per
    segment (:func:`~megatron_vlm.runtime.cpu_compat.packed_local_attention`, pure torch: CPU or CUDA).
    Nothing is refused: TE on CPU is refused by :mod:`megatron_vlm.model.layer_impl` before this."""
    if impl != "transformer_engine":
        from megatron_vlm.runtime.cpu_compat import packed_local_attention

        packed_local_attention()


def select_packs(lengths: list[int], opens_only: list[bool], capacity: int) -> list[list[int]]:
    """Indices of the samples grouped into packs of at most ``capacity`` positions (first-fit decreasing).

    ``lengths``: each sample's image-expanded length; ``opens_only[i]``: sample i may only be the first of a pack
    (it starts with an image token). Every sample is placed; packs keep the buffer order inside them except that
    an ``opens_only`` sample comes first. Deterministic for the same input."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has {n} image-expanded positions, more than --packed-seq-length {capacity}; "
                         "raise --packed-seq-length to at least --seq-length")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if opens_only[i]:
            packs.append([i])
            room.append(capacity - lengths[i])
            continue
        for p, free in enumerate(room):
            if lengths[i] <= free:
                packs[p].append(i)
                room[p] -= lengths[i]
                break
        else:
            packs.append([i])
            room.append(capacity - lengths[i])
    return [[p[0]] + sorted(p[1:]) if opens_only[p[0]] else sorted(p) for p in packs]


def boundaries(seq_lengths: list[int], packed_seq_length: int) -> list[int]:
    """``cu_seqlens`` of a pack: 0, the running sums of its samples' image-expanded lengths, and
    ``packed_seq_length`` closing the padding segment (when the samples do not fill the pack)."""
    cu = [0]
    for n in seq_lengths:
        cu.append(cu[-1] + int(n))
    if cu[-1] > packed_seq_length:
        raise ValueError(f"pack of {cu[-1]} positions exceeds --packed-seq-length {packed_seq_length}")
    if cu[-1] < packed_seq_length:
        cu.append(packed_seq_length)
    return cu


@edataclass
class VLMPackedSample(VLMSample):
    """Several encoded samples concatenated (images in token order)."""

    seq_lengths: list  # image-expanded length of each sample, in order


@edataclass
class QwenVLPackedSample(QwenVLSample):
    """Several encoded Qwen2.5-VL samples concatenated: their patches, grids and each one's own M-RoPE positions
    (``position_ids`` ``[3, pack]``), in order."""

    seq_lengths: list


@edataclass
class AnyresPackedSample(AnyresSample):
    """Several encoded anyres samples concatenated (images / videos, their tiles and counts in token order)."""

    seq_lengths: list


@edataclass
class InternVLPackedSample(InternVLSample):
    """Several encoded InternVL samples concatenated (tiles and frames, and their counts, in token order)."""

    seq_lengths: list


@edataclass
class VLMPackedBatch(VLMBatch):
    """One packed sequence (B = 1) padded to ``packed_seq_length`` image-expanded positions."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1], image-expanded boundaries (last segment: padding)
    max_seqlen: int  # longest segment
    num_samples: int  # samples packed (the logged sample count)


@edataclass
class AnyresPackedBatch(AnyresBatch):
    """:class:`VLMPackedBatch` for anyres models (with each item's size, tiles and image tokens)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_samples: int


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, context_parallel: bool = False):
    """megatron-core ``PackedSeqParams`` ('thd') for one packed sequence with boundaries ``cu_seqlens``. Under
    ``context_parallel`` the padded boundaries (``cu_seqlens_q_padded``, by which megatron-core's LLaVAModel and
    Transformer Engine split each sample over the CP ranks) are the same: each sample's padding is its own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    padded = dict(cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu) if context_parallel else {}
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(max_seqlen),
                           max_seqlen_kv=int(max_seqlen), **padded)


class _PackingHooks:
    """energon's packing hooks over a task encoder's encoded samples (mixed in before the plain, anyres and InternVL
    encoders, whose ``__init__`` it extends)."""

    #: per-sample tensors concatenated into a pack besides tokens, labels and loss mask
    item_fields: tuple = ("images",)

    def __init__(self, *args, packed_seq_length: int, sample_multiple: int | None = None, **kwargs):
        """The task encoder's arguments, and ``packed_seq_length`` (each pack's positions) and ``sample_multiple``
        (each sample's positions in a pack are a multiple of it: context parallelism's 2 x CP)."""
        super().__init__(*args, **kwargs)
        self.packed_seq_length = int(packed_seq_length)
        self.sample_multiple = int(sample_multiple or 1)
        if self.packed_seq_length < self.seq_length:
            raise ValueError(f"--packed-seq-length {self.packed_seq_length} is below --seq-length {self.seq_length}: "
                             "every sample must fit in a pack")
        multiple = math.lcm(self.pad_to_multiple_of or 1, self.sample_multiple)
        if self.packed_seq_length % multiple:
            raise ValueError(f"--packed-seq-length {self.packed_seq_length} must be a multiple of {multiple} "
                             "(FP8 / sequence- and context-parallel alignment)")

    def padded_length(self, sample) -> int:
        """The positions ``sample`` takes in a pack: its image-expanded length, up to a multiple of
        ``sample_multiple``."""
        return -(-int(sample.num_tokens) // self.sample_multiple) * self.sample_multiple

    def media_ids(self) -> set:
        """Token ids that megatron expands into image embeddings (images; videos for OneVision)."""
        return {self.image_token_id} | ({self.video_token_id} if getattr(self, "video_token_id", None) is not None
                                        else set())

    def select_samples_to_pack(self, samples: list) -> list[list]:
        too_long = [s for s in samples if self.padded_length(s) > self.packed_seq_length]
        if too_long:  # cannot come from this encoder (it truncates to --seq-length): counted and left out
            for s in too_long:
                self.skips.total["longer than --packed-seq-length"] += 1
                log.warning("sample %s skipped: %d image-expanded positions, more than --packed-seq-length %d",
                            s.__key__, self.padded_length(s), self.packed_seq_length)
            samples = [s for s in samples if self.padded_length(s) <= self.packed_seq_length]
        lengths = [self.padded_length(s) for s in samples]
        media = self.media_ids()
        opens = [len(s.tokens) > 0 and int(s.tokens[0]) in media for s in samples]
        return [[samples[i] for i in group] for group in select_packs(lengths, opens, self.packed_seq_length)]

    def _packed_fields(self, samples: list) -> dict:
        fields = {k: torch.cat([getattr(s, k) for s in samples], dim=0) for k in self.item_fields}
        pads = [self.padded_length(s) - int(s.num_tokens) for s in samples]  # text positions after each sample

        def joined(name, fill):
            return torch.cat([t for s, n in zip(samples, pads) for t in
                              (getattr(s, name), torch.full((n,), fill, dtype=getattr(s, name).dtype))])

        return dict(__key__=",".join(s.__key__ for s in samples), tokens=joined("tokens", self.pad_token_id),
                    labels=joined("labels", self.pad_token_id), loss_mask=joined("loss_mask", 0),
                    num_tokens=int(sum(s.num_tokens for s in samples)),
                    seq_lengths=[self.padded_length(s) for s in samples], **fields)

    def _packed_row(self, samples: list) -> dict:
        if len(samples) != 1:
            raise ValueError(f"a packed micro batch holds one packed sequence, got {len(samples)}; use "
                             "--micro-batch-size 1 with --packing-buffer-size")
        (s,) = samples
        cu = boundaries(s.seq_lengths, self.packed_seq_length)
        pad = self.packed_seq_length - sum(s.seq_lengths)  # text positions added (one each)
        n = len(s.tokens)
        tokens = torch.full((1, n + pad), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((1, n + pad), self.pad_token_id, dtype=torch.int64)
        loss_mask = torch.zeros((1, n + pad), dtype=torch.float32)
        tokens[0, :n], labels[0, :n], loss_mask[0, :n] = s.tokens, s.labels, s.loss_mask
        return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, num_tokens=int(s.num_tokens),
                    row_tokens=torch.tensor([int(s.num_tokens)], dtype=torch.int64),
                    cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                    max_seqlen=max(b - a for a, b in zip(cu, cu[1:])), num_samples=len(s.seq_lengths))


class PackingTaskEncoder(_PackingHooks, VLMTaskEncoder):
    """:class:`VLMTaskEncoder` with energon's packing hooks; use with ``packing_buffer_size`` in the loader."""

    @stateless
    def pack_selected_samples(self, samples: list[VLMSample]) -> VLMPackedSample:
        return VLMPackedSample.derive_from(samples[0], **self._packed_fields(samples))

    @stateless
    def batch(self, samples: list[VLMPackedSample]) -> VLMPackedBatch:
        row = self._packed_row(samples)
        images = samples[0].images
        return VLMPackedBatch.from_samples(samples, images=images,
                                           num_image_tiles=torch.ones(images.shape[0], dtype=torch.int32), **row)


class AnyresPackingTaskEncoder(_PackingHooks, AnyresTaskEncoder):
    """:class:`~megatron_vlm.data.anyres_encoder.AnyresTaskEncoder` (LLaVA-NeXT / OneVision: tiles, videos) with
    energon's packing hooks: a pack keeps each image's / video's tiles, size and image-token count in order."""

    item_fields = ("images", "image_sizes", "num_image_tiles", "num_image_tokens")

    @stateless
    def pack_selected_samples(self, samples: list[AnyresSample]) -> AnyresPackedSample:
        return AnyresPackedSample.derive_from(samples[0], **self._packed_fields(samples))

    @stateless
    def batch(self, samples: list[AnyresPackedSample]) -> AnyresPackedBatch:
        row = self._packed_row(samples)
        s = samples[0]
        return AnyresPackedBatch.from_samples(samples, images=s.images, num_image_tiles=s.num_image_tiles,
                                              image_sizes=s.image_sizes, num_image_tokens=s.num_image_tokens, **row)


@edataclass
class QwenVLPackedBatch(QwenVLBatch):
    """:class:`VLMPackedBatch` for Qwen2.5-VL: with the patches' grids and the pack's M-RoPE positions ``[3, 1, S]``."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_samples: int


class QwenVLPackingTaskEncoder(_PackingHooks, QwenVLTaskEncoder):
    """:class:`~megatron_vlm.data.qwen_vl_encoder.QwenVLTaskEncoder` with energon's packing hooks: a pack keeps every
    image's patches and grid in token order and each sample's own M-RoPE positions (what ``get_rope_index`` gives it
    alone: a packed sample is positioned as if it were the only one, whatever comes before it). Its padding positions
    count on after each sample's last one, as a padded row's do. megatron-core's rotary takes the pack's positions
    ``[3, 1, packed_seq_length]`` and applies each segment's own rows (its 'thd' RoPE maps a rotary table as long as
    the pack by offset)."""

    item_fields = ("images", "image_grid_thw", "second_per_grid_ts")

    @staticmethod
    def _counted_on(positions: torch.Tensor, n: int) -> torch.Tensor:
        """``positions`` ``[3, k]`` and ``n`` more counting on after their largest."""
        start = int(positions.max()) + 1 if positions.numel() else 0
        return torch.cat([positions, torch.arange(start, start + n, dtype=positions.dtype)[None].expand(3, n)], 1)

    @stateless
    def pack_selected_samples(self, samples: list[QwenVLSample]) -> QwenVLPackedSample:
        positions = torch.cat([self._counted_on(s.position_ids, self.padded_length(s) - int(s.num_tokens))
                               for s in samples], dim=1)
        return QwenVLPackedSample.derive_from(samples[0], **self._packed_fields(samples), position_ids=positions)

    @stateless
    def batch(self, samples: list[QwenVLPackedSample]) -> QwenVLPackedBatch:
        row = self._packed_row(samples)
        s = samples[0]
        positions = self._counted_on(s.position_ids, row["tokens"].shape[1] - s.position_ids.shape[1])[:, None]
        return QwenVLPackedBatch.from_samples(samples, images=s.images, image_grid_thw=s.image_grid_thw,
                                              num_image_tiles=torch.ones(s.image_grid_thw.shape[0], dtype=torch.int32),
                                              position_ids=positions, **row)


class InternVLPackingTaskEncoder(_PackingHooks, InternVLTaskEncoder):
    """:class:`~megatron_vlm.data.internvl_encoder.InternVLTaskEncoder` with energon's packing hooks: a pack keeps each
    image's tiles (and each video's frames) and their counts in token order."""

    item_fields = ("images", "num_image_tiles")

    @stateless
    def pack_selected_samples(self, samples: list[InternVLSample]) -> InternVLPackedSample:
        return InternVLPackedSample.derive_from(samples[0], **self._packed_fields(samples))

    @stateless
    def batch(self, samples: list[InternVLPackedSample]) -> VLMPackedBatch:
        row = self._packed_row(samples)
        return VLMPackedBatch.from_samples(samples, images=samples[0].images,
                                           num_image_tiles=samples[0].num_image_tiles, **row)


def packing_task_encoder_for(spec, hf_dir, seq_length: int, packed_seq_length: int, video_fps: float | None = None,
                             video_frames: int | None = None, **kwargs):
    """The packing task encoder of ``spec``'s architecture (anyres, InternVL, Qwen2.5-VL or plain LLaVA)."""
    extra = {k: v for k, v in dict(video_fps=video_fps, video_frames=video_frames).items() if v is not None}
    if spec.is_qwen_vl:
        return QwenVLPackingTaskEncoder(hf_dir, seq_length, spec=spec, packed_seq_length=packed_seq_length, **kwargs)
    if spec.is_anyres:
        return AnyresPackingTaskEncoder(hf_dir, seq_length, spec=spec, packed_seq_length=packed_seq_length,
                                        **extra, **kwargs)
    if spec.is_internvl:
        return InternVLPackingTaskEncoder(hf_dir, seq_length, spec=spec, packed_seq_length=packed_seq_length,
                                          **extra, **kwargs)
    return PackingTaskEncoder(hf_dir, seq_length, spec=spec, packed_seq_length=packed_seq_length, **kwargs)
