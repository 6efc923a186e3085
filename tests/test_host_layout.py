"""The image/text layout computed on the host (megatron_vlm/model/host_layout.py) against megatron-core's own
``LLaVAModel._preprocess_data`` on the same inputs: the expanded embeddings, labels and loss mask bit for bit, and the
gradients of the text and image embeddings through them, for plain LLaVA batches (several tiles per image, text-only
samples, a text-only batch), pipeline-parallel padding, truncation at the language model's length, the first and the
last pipeline stage alone, context parallelism's [b, s] layout, a packed row, and anyres batches with videos (the
anyres model reads video tokens as image tokens, one embedding per "tile").

The models are megatron-core's classes with only the attributes ``_preprocess_data`` reads set (no parallel state,
no layers): the function under test and its reference are megatron-core's own code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.multimodal.llava_model import LLaVAModel

from megatron_vlm.model.anyres_model import AnyresLLaVAModel
from megatron_vlm.model.host_layout import HostLayoutLLaVAModel

IMAGE, VIDEO, H = 7, 8, 6


def _model(cls=HostLayoutLLaVAModel, img_seq_len=5, pre=True, post=True, pp=False, max_len=64, cp=1, **extra):
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    for k, v in dict(pre_process=pre, post_process=post, add_decoder=True, add_encoder=pre, img_seq_len=img_seq_len,
                     _language_is_pipeline_parallel=pp, _language_max_sequence_length=max_len,
                     context_parallel_lm=cp, image_token_index=IMAGE, vision_model=None, _tile_tags=None,
                     **extra).items():
        setattr(model, k, v)
    return model


def _batch(rows, tiles, seed=0):
    """Token rows (lists; IMAGE / VIDEO mark media), tiles per image in token order."""
    g = torch.Generator().manual_seed(seed)
    s = max(len(r) for r in rows)
    tokens = torch.tensor([r + [1] * (s - len(r)) for r in rows])
    labels = torch.randint(10, 50, tokens.shape, generator=g)
    loss_mask = (torch.rand(tokens.shape, generator=g) > 0.3).float()
    return SimpleNamespace(tokens=tokens, labels=labels, loss_mask=loss_mask,
                           num_image_tiles=torch.tensor(tiles, dtype=torch.int))


def _compare(model, batch, ids, tiles, rows_of_images):
    """Ours (the host layout, then the model's _preprocess_data) against megatron-core's on the same tensors."""
    g = torch.Generator().manual_seed(1)
    b, s = ids.shape
    text = torch.randn(b, s, H, generator=g, requires_grad=True) if model.pre_process else None
    images = None
    if model.pre_process:
        n = int(tiles.sum())
        images = (torch.randn(model.img_seq_len, n, H, generator=g) if n else torch.zeros(0, 0, 0)).requires_grad_()
    labels = batch.labels if model.post_process else None
    loss_mask = batch.loss_mask
    reference = LLaVAModel._preprocess_data(model, images, text, ids, loss_mask, labels, False, None, IMAGE, tiles)
    layout = model.host_layout(batch)
    assert layout.image_rows == rows_of_images
    with model._laid_out(layout):
        ours = model._preprocess_data(images, text, ids, loss_mask, labels, False, None, IMAGE, tiles)
    for r, o in zip(reference, ours, strict=True):
        assert (r is None) == (o is None)
        if r is not None:
            assert r.shape == o.shape and r.dtype == o.dtype and torch.equal(r, o)
    if model.pre_process:
        cotangent = torch.randn(reference[0].shape, generator=g)
        leaves = [t for t in (text, images) if t.numel()]
        want = torch.autograd.grad(reference[0], leaves, cotangent, allow_unused=True)
        got = torch.autograd.grad(ours[0], leaves, cotangent, allow_unused=True)
        for w, o in zip(want, got, strict=True):
            assert torch.equal(w if w is not None else torch.zeros_like(o), o if o is not None else torch.zeros_like(w))
    return reference


PLAIN = [[1, IMAGE, 2, 3, 4], [IMAGE, 5, IMAGE, 6, 2, 2], [3, 4, 5]]  # a text-only sample too
PLAIN_TILES = [2, 1, 3]


@pytest.mark.parametrize("options", [
    dict(),
    dict(pp=True, max_len=40),  # pipeline parallelism pads to the language model's length
    dict(max_len=12),  # truncated at the language model's length
    dict(post=False),  # the first pipeline stage: embeddings only
    dict(pre=False),  # the last: labels and loss mask only
    dict(cp=2),  # context parallelism keeps [b, s, h]
], ids=["plain", "pp-padded", "truncated", "first-stage", "last-stage", "cp"])
def test_plain_layout_is_megatron_cores(options):
    batch = _batch(PLAIN, PLAIN_TILES)
    _compare(_model(**options), batch, batch.tokens, batch.num_image_tiles, sum(PLAIN_TILES) * 5)


def test_text_only_and_packed_batches():
    text = _batch([[1, 2, 3], [4, 5]], [])
    _compare(_model(), text, text.tokens, text.num_image_tiles, 0)
    packed = _batch([[1, IMAGE, 2, 3, 9, IMAGE, 4, 9, 5, IMAGE, IMAGE, 6]], [1, 2, 1, 1])  # one row, three samples
    _compare(_model(pp=True, max_len=48), packed, packed.tokens, packed.num_image_tiles, 25)


def test_anyres_layout_with_videos_is_megatron_cores():
    """Anyres: one embedding per "tile", the tokens per image as megatron's tiles; a video token reads as an image
    token (the model's forward does the same before megatron-core's _preprocess_data)."""
    rows = [[1, IMAGE, 2, VIDEO, 3], [VIDEO, 4, 5, 6], [IMAGE, IMAGE, 1]]
    batch = _batch(rows, [3, 1, 2, 1, 1])
    batch.num_image_tokens = torch.tensor([7, 4, 9, 3, 2], dtype=torch.int)
    model = _model(AnyresLLaVAModel, img_seq_len=1, video_token_index=VIDEO)
    ids = torch.where(batch.tokens == VIDEO, IMAGE, batch.tokens)
    _compare(model, batch, ids, batch.num_image_tokens, 25)
    extra = model.host_layout(batch).extra
    assert extra == dict(videos=[False, True, True, False, False], tokens=25, tiles=[3, 1, 2, 1, 1])


def test_a_wrong_layout_is_told_apart():
    """The comparison fails for a layout that puts one text token elsewhere (the check can fail)."""
    batch = _batch(PLAIN, PLAIN_TILES)
    model = _model()
    layout = model.host_layout(batch)
    layout.embedding_index = layout.embedding_index.clone()
    layout.embedding_index[3, 0] += 1
    g = torch.Generator().manual_seed(1)
    text, images = torch.randn(3, 6, H, generator=g), torch.randn(5, 6, H, generator=g)
    args = (images, text, batch.tokens, batch.loss_mask, batch.labels, False, None, IMAGE, batch.num_image_tiles)
    reference = LLaVAModel._preprocess_data(model, *args)
    with model._laid_out(layout):
        ours = model._preprocess_data(*args)
    assert not torch.equal(reference[0], ours[0])
    with model._laid_out(layout), pytest.raises(ValueError, match="num_image_tiles does not match the images"):
        model._preprocess_data(images[:, :5], *args[1:])
