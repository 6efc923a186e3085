"""Which ranks read training data, and how each micro batch reaches the ranks that need it (Megatron-LM's
``get_batch``: read on tensor-parallel rank 0, broadcast to the other TP ranks).

- :func:`reads_data`: only TP rank 0 of the FIRST and of the LAST pipeline stage build an energon loader and
  decode samples. The first stage needs images and tokens; the last needs tokens, labels and loss mask (megatron's
  LLaVAModel expands labels and loss mask with the image positions found in the tokens, so it needs the tokens
  and the image count per image, not the pixels); middle stages need only each micro batch's rows' positions of
  samples (a mixture-of-experts model's routing), packed, its ``cu_seqlens`` (their attention), and an M-RoPE
  model's 3-D positions (every layer's rotary). energon shards by data-parallel rank, so each DP rank's slice is
  read once per stage that needs it instead of once per GPU. The loader state saved in checkpoints is that of
  TP rank 0 of the first stage (the other reader of the same DP rank reads the same samples).
- :func:`distribute`: the collective that turns what the readers hold into what every rank's forward step
  takes: a reader's own batch, a :class:`MicroBatch` received over the tensor-parallel group (its pixels on the
  device, the rest copied back to the host, where the reader holds it too), or, on middle
  stages, a :class:`MicroBatch` holding only each row's positions of samples (and a packed batch's boundaries).

Anyres batches (LLaVA-NeXT / OneVision) also carry each image's original size and image-token count, which every
stage's model needs; Qwen-VL batches carry their images' grids (``image_grid_thw``) and their M-RoPE positions
``[3, B, S]``, which every stage's rotary needs (middle stages get them too). The tensors go as one int64 and one
float32 buffer after a small header (shapes and counts), so a micro batch
costs three broadcasts whatever its contents; megatron's ``tensor_parallel.broadcast_data`` is not used because
it cannot carry a zero-sized dimension (a micro batch without images).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# B, S, pixel rows (images or anyres tiles; Qwen-VL: patches), C (Qwen-VL: a patch's values), H, W (Qwen-VL: 1),
# num_tokens, cu_seqlens length, max_seqlen, pixels sent, num_image_tiles length, anyres images (-1: not an anyres
# batch), Qwen-VL image grids (-1: not a Qwen-VL batch, whose pixels are [patches, values] and positions [3, B, S])
_HEADER = 13


def reads_data(tp_rank: int, pp_rank: int, pp: int) -> bool:
    """Whether this rank builds a loader and reads/decodes samples: TP rank 0 of the first and last stage."""
    return tp_rank == 0 and needs_data(pp_rank, pp)


def needs_data(pp_rank: int, pp: int) -> bool:
    """Whether this pipeline stage consumes batch tensors (first: inputs; last: labels and loss mask)."""
    return pp_rank == 0 or pp_rank == pp - 1


@dataclass
class MicroBatch:
    """A micro batch as received from the TP group's reader (the attributes the training step reads)."""

    images: torch.Tensor | None  # None off the first stage (the pixels are not sent there)
    num_image_tiles: torch.Tensor | None
    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    num_tokens: int = 0
    cu_seqlens: torch.Tensor | None = None  # packed sequences: image-expanded boundaries
    max_seqlen: int | None = None
    image_sizes: torch.Tensor | None = None  # anyres: [images, 2] original (height, width)
    num_image_tokens: torch.Tensor | None = None  # anyres: image tokens per image (every stage needs them)
    row_tokens: torch.Tensor | None = None  # each row's positions of samples (every stage's MoE routing needs them)
    image_grid_thw: torch.Tensor | None = None  # Qwen-VL: [images, 3] (the first stage's ViT)
    position_ids: torch.Tensor | None = None  # Qwen-VL: [3, B, S] M-RoPE positions (every stage's rotary)

    def model_kwargs(self, device) -> dict:
        """The model's extra inputs, as :class:`~megatron_vlm.data.anyres_encoder.AnyresBatch` (image sizes and
        tokens) or :class:`~megatron_vlm.data.qwen_vl_encoder.QwenVLBatch` (image grids) gives them."""
        if self.image_grid_thw is not None:
            return dict(image_grid_thw=self.image_grid_thw.to(device, non_blocking=True))
        if self.num_image_tokens is None:
            return {}
        return dict(image_sizes=self.image_sizes, num_image_tokens=self.num_image_tokens.to(device, non_blocking=True))


def _groups():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()


def broadcast_micro_batch(batch, device, with_pixels: bool):
    """Collective over this rank's TP group: the TP rank 0 sends ``batch``, the others receive a
    :class:`MicroBatch` (pixels only when ``with_pixels``). Returns ``batch`` itself on the sender."""
    group, src = _groups()
    sender = torch.distributed.get_rank() == src
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    if sender:
        cu = getattr(batch, "cu_seqlens", None)
        counts = getattr(batch, "num_image_tokens", None)
        grid = getattr(batch, "image_grid_thw", None)
        b, s = batch.tokens.shape
        n, c, h, w = batch.images.shape if grid is None else (*batch.images.shape, 1, 1)
        header.copy_(torch.tensor([b, s, n, c, h, w, int(batch.num_tokens), 0 if cu is None else cu.numel(),
                                   int(getattr(batch, "max_seqlen", 0) or 0), int(with_pixels),
                                   batch.num_image_tiles.numel(), -1 if counts is None else counts.numel(),
                                   -1 if grid is None else grid.shape[0]]))
    torch.distributed.broadcast(header, src=src, group=group)
    b, s, n, c, h, w, num_tokens, n_cu, max_seqlen, pixels, n_tiles, n_anyres, n_grid = header.tolist()
    n_sizes, qwen = max(n_anyres, 0), n_grid >= 0
    n_qwen = 3 * n_grid + 3 * b * s if qwen else 0  # the grids, the positions
    n_int = 2 * b * s + b + n_tiles + n_cu + 3 * n_sizes + n_qwen
    n_float = b * s + (n * c * h * w if pixels else 0)
    if sender:
        anyres = [batch.image_sizes.reshape(-1), batch.num_image_tokens.reshape(-1)] if n_anyres >= 0 else []
        anyres += [batch.image_grid_thw.reshape(-1), batch.position_ids.reshape(-1)] if qwen else []
        ints = torch.cat([batch.tokens.reshape(-1), batch.labels.reshape(-1), batch.row_tokens.reshape(-1),
                          batch.num_image_tiles.reshape(-1)]
                         + ([batch.cu_seqlens.reshape(-1)] if n_cu else []) + anyres).to(device=device,
                                                                                         dtype=torch.int64)
        floats = torch.cat([batch.loss_mask.reshape(-1)] + ([batch.images.reshape(-1)] if pixels else [])).to(
            device=device, dtype=torch.float32)
    else:
        ints = torch.empty(n_int, dtype=torch.int64, device=device)
        floats = torch.empty(n_float, dtype=torch.float32, device=device)
    torch.distributed.broadcast(ints, src=src, group=group)
    torch.distributed.broadcast(floats, src=src, group=group)
    if sender:
        return batch
    # everything but the pixels on the host, as the sender holds it: the step computes the image/text layout from
    # it there (model/host_layout.py) and copies it to the device without waiting; one copy back per micro batch
    ints = ints.cpu()
    loss_mask, images = torch.split(floats, [b * s, n_float - b * s])
    loss_mask = loss_mask.cpu()
    tokens, labels, rows, tiles, cu, sizes, counts, grid, positions = torch.split(
        ints, [b * s, b * s, b, n_tiles, n_cu, 2 * n_sizes, n_sizes, 3 * max(n_grid, 0), n_qwen - 3 * max(n_grid, 0)])
    anyres = n_anyres >= 0
    return MicroBatch(images=(images.view(n, c) if qwen else images.view(n, c, h, w)) if pixels else None,
                      num_image_tiles=tiles.to(torch.int32),
                      image_grid_thw=grid.view(n_grid, 3) if qwen else None,
                      position_ids=positions.view(3, b, s) if qwen else None,
                      tokens=tokens.view(b, s), labels=labels.view(b, s), loss_mask=loss_mask.view(b, s),
                      num_tokens=num_tokens, row_tokens=rows, cu_seqlens=cu.to(torch.int32) if n_cu else None,
                      max_seqlen=max_seqlen if n_cu else None,
                      image_sizes=sizes.view(n_sizes, 2) if anyres else None,
                      num_image_tokens=counts.to(torch.int32) if anyres else None)


def _share_with_middle_stages(batches: list, device) -> list:
    """With middle pipeline stages: the first stage sends each micro batch's ``row_tokens`` (a mixture-of-experts
    model's routing counts only the positions of samples), packed, its ``cu_seqlens`` (their attention), and an M-RoPE
    model's ``position_ids`` ``[3, B, S]`` (every layer's rotary) down the pipeline group (collective over it); middle
    stages get :class:`MicroBatch` objects holding only those."""
    from megatron.core import parallel_state as ps

    group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_first_rank()
    first = ps.is_pipeline_first_stage(ignore_virtual=True)

    def parts_of(b):
        cu, positions = getattr(b, "cu_seqlens", None), getattr(b, "position_ids", None)
        return [b.row_tokens, *([] if cu is None else [cu]), *([] if positions is None else [positions])]

    def lengths_of(b):
        cu, positions = getattr(b, "cu_seqlens", None), getattr(b, "position_ids", None)
        return [b.row_tokens.numel(), 0 if cu is None else cu.numel(), 0 if positions is None else positions.numel()]

    lengths = torch.tensor([lengths_of(b) for b in batches] if first else [[0, 0, 0]] * len(batches),
                           dtype=torch.int64, device=device).reshape(-1, 3)
    torch.distributed.broadcast(lengths, src=src, group=group)
    if first:
        parts = [t.reshape(-1).to(device=device, dtype=torch.int64) for b in batches for t in parts_of(b)]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    else:
        flat = torch.empty(int(lengths.sum()), dtype=torch.int64, device=device)
    torch.distributed.broadcast(flat, src=src, group=group)
    if not needs_data(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()):
        out = []
        for piece, (n_rows, n_cu, n_pos) in zip(torch.split(flat, lengths.sum(1).tolist()), lengths.tolist()):
            rows, cu, positions = torch.split(piece, [n_rows, n_cu, n_pos])
            cu = cu.to(torch.int32)
            out.append(MicroBatch(None, None, None, None, None, row_tokens=rows,
                                  cu_seqlens=cu if n_cu else None,
                                  max_seqlen=int((cu[1:] - cu[:-1]).max()) if n_cu else None,
                                  position_ids=positions.view(3, n_rows, -1) if n_pos else None))
        return out
    return batches


def distribute(batches: list, device) -> list:
    """What every rank's forward step takes, from what the readers hold (collective over the TP group of the
    first/last stage, and over the pipeline group when it has middle stages).

    ``batches``: on a reader (:func:`reads_data`) its micro batches of one global batch, elsewhere a list of as
    many ``None``. Returns the readers' batches unchanged, :class:`MicroBatch` objects on the other TP ranks of
    the first/last stage (pixels on the first stage only), and on middle stages :class:`MicroBatch` objects with
    each micro batch's ``row_tokens`` (and ``cu_seqlens`` when packed, ``position_ids`` for M-RoPE) only."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    out = list(batches)
    if tp > 1 and needs_data(pp_rank, pp):
        out = [broadcast_micro_batch(b, device, with_pixels=pp_rank == 0) for b in out]
    if pp > 2:
        out = _share_with_middle_stages(out, device)
    return out
