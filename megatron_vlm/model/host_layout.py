"""megatron-core's ``LLaVAModel`` with the image/text layout of each micro batch computed on the host.

megatron-core's ``LLaVAModel._preprocess_data`` derives, from the tokens and the tiles per image, where every text
token and image embedding goes in the image-expanded sequence, and the expanded labels and loss mask. On the device
that costs ~17 host syncs per micro batch (``.tolist()``, a ``torch.tensor`` of per-sample sums, sizes from device
tensors, ``torch.where`` of masks, boolean-mask reads and writes, and in the backward the gradient of the masked
write); every one of them waits for the GPU to catch up.

All of it follows from host data: the batch's tokens, labels, loss mask and tiles, as the loader hands them over.
:meth:`HostLayoutLLaVAModel.host_layout` runs megatron-core's own ``_preprocess_data`` on the host, on the batch's host
tensors, with stand-in embeddings of width one that hold each text position's and each image embedding's index: its
"embeddings" come out as the index map of the expanded sequence (:class:`HostLayout`), its labels and loss mask as
they are. ``forward_step`` (:mod:`megatron_vlm.training.step`) computes it from the host batch before the copies to
the device and hands it to the model (``host_layout=``); the model's ``_preprocess_data`` then gathers the text and
image embeddings with that map (one indexing op, whose backward is the scatter of megatron's own text gather), and
takes the labels and loss mask as computed. The result is megatron-core's, bit for bit (the same values copied to
the same places; tests/test_host_layout.py holds it against megatron-core's ``_preprocess_data`` on the same inputs,
for plain, anyres, video, packed and pipeline-stage layouts). Without a layout (generation, a caller that passes
none) megatron-core's own computation runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.models.multimodal.llava_model import LLaVAModel


@dataclass
class HostLayout:
    """One micro batch's expanded sequence, computed on the host by megatron-core's ``_preprocess_data``.

    ``embedding_index`` (first stage; long, the shape of megatron's final embedding without its hidden dimension:
    ``[S, B]``, or ``[B, S]`` under context parallelism): 0 for padding, ``1 + i`` for text position ``i`` of the
    flattened ``[B, s]`` tokens, ``1 + B*s + k`` for image embedding ``k`` (tile-major, as megatron flattens them).
    ``labels`` / ``loss_mask`` (last stage): megatron's expanded labels and loss mask. ``image_rows``: the image
    embeddings the map expects. ``extra``: a subclass's host values (anyres: items that are videos, tiles, tokens)."""

    embedding_index: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    image_rows: int
    extra: dict

    def to(self, device) -> HostLayout:
        """The layout's tensors on ``device`` (non-blocking copies: the host tensors are pinned on a GPU)."""
        def move(t):
            if t is None or t.device == torch.device(device):
                return t
            return (t.pin_memory() if torch.device(device).type == "cuda" else t).to(device, non_blocking=True)

        return HostLayout(move(self.embedding_index), move(self.labels), move(self.loss_mask), self.image_rows,
                          self.extra)


def _given(value) -> bool:
    """Whether one of megatron-core 0.19's further ``_preprocess_data`` inputs asks for more than the layout holds
    (packed dynamic resolution, sounds); its forward passes empty sound tensors when there are none."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    return value is not None and value is not False


class HostLayoutLLaVAModel(LLaVAModel):
    """``LLaVAModel`` whose forward takes the micro batch's :class:`HostLayout` (``host_layout=``)."""

    _host_layout: HostLayout | None = None

    @contextlib.contextmanager
    def _laid_out(self, layout: HostLayout | None):
        self._host_layout = layout
        try:
            yield
        finally:
            self._host_layout = None

    def forward(self, *args, host_layout: HostLayout | None = None, **kwargs):
        with self._laid_out(host_layout):
            return super().forward(*args, **kwargs)

    def layout_inputs(self, batch) -> tuple:
        """(tokens, tiles per image) of a host batch as ``_preprocess_data`` reads them."""
        return batch.tokens, batch.num_image_tiles

    def host_layout(self, batch) -> HostLayout | None:
        """The layout of ``batch`` (host tensors: tokens, labels, loss mask, tiles per image), or None where
        megatron-core's own computation must run (a middle pipeline stage, tile tags)."""
        if batch is None or batch.tokens is None or getattr(self, "_tile_tags", None) is not None:
            return None
        if not self.add_decoder or not (self.pre_process or self.post_process):
            return None
        tokens, tiles = self.layout_inputs(batch)
        b, s = tokens.shape
        tiles = tiles if tiles is not None else torch.ones(0, dtype=torch.int)
        rows = int(tiles.sum()) * self.img_seq_len
        text = None
        images = None
        if self.pre_process:  # each text position's and image embedding's index, as "embeddings" of width one
            text = torch.arange(1, b * s + 1, dtype=torch.float64).view(b, s, 1)
            images = (torch.arange(rows, dtype=torch.float64).view(-1, self.img_seq_len).t() + 1 + b * s)[..., None] \
                if rows else torch.zeros(0, 0, 1, dtype=torch.float64)  # as megatron's forward passes no images
        labels = batch.labels if self.post_process else None
        loss_mask = batch.loss_mask if self.post_process else None
        with torch.no_grad():
            index, new_labels, new_loss_mask = LLaVAModel._preprocess_data(
                self, images, text, tokens, loss_mask, labels, False, None, self.image_token_index, tiles)
        if index is not None:
            index = index.squeeze(-1).to(torch.long)
        return HostLayout(index, new_labels, new_loss_mask, rows, self.layout_extra(batch))

    def layout_extra(self, batch) -> dict:
        return {}

    def _preprocess_data(self, image_embeddings, language_embeddings, input_ids, loss_mask, labels,
                         use_inference_kv_cache, inference_context, image_token_index, num_image_tiles, **kwargs):
        layout = self._host_layout
        if layout is None or use_inference_kv_cache or any(_given(v) for v in kwargs.values()):
            return super()._preprocess_data(image_embeddings, language_embeddings, input_ids, loss_mask, labels,
                                            use_inference_kv_cache, inference_context, image_token_index,
                                            num_image_tiles, **kwargs)
        if not self.pre_process and not self.post_process:
            return None, None, None
        embedding = None
        if self.pre_process:
            h = language_embeddings.shape[-1]
            parts = [language_embeddings.new_zeros(1, h), language_embeddings.reshape(-1, h)]
            if layout.image_rows:
                n = image_embeddings.shape[0] * image_embeddings.shape[1]
                if n != layout.image_rows:
                    raise ValueError(f"the micro batch's images give {n} image embeddings, but its tokens and tiles "
                                     f"place {layout.image_rows}: num_image_tiles does not match the images")
                parts.append(image_embeddings.permute(1, 0, 2).reshape(-1, h).to(language_embeddings.dtype))
            embedding = torch.cat(parts)[layout.embedding_index]
        new_labels, new_loss_mask = layout.labels, layout.loss_mask
        if new_loss_mask is not None and loss_mask is not None and new_loss_mask.dtype != loss_mask.dtype:
            new_loss_mask = new_loss_mask.to(loss_mask.dtype)
        return embedding, new_labels, new_loss_mask
