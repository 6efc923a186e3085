"""Qwen2.5-VL's and Qwen3-VL's vision encoders and patch mergers on megatron-core's building blocks, tensor-parallel.

What HF's ``Qwen2_5_VisionTransformerPretrainedModel`` computes, here:

- :class:`QwenViT`: the Conv3d patch embedding (``temporal_patch_size`` frames of ``patch_size`` x ``patch_size``
  pixels per patch, no bias; torch's ``Conv3d``, replicated over TP as megatron's CLIP ViT keeps its ``conv1``), then
  megatron-core's ``TransformerBlock`` of ``TransformerLayer`` s (RMSNorm, bidirectional attention with q/k/v and
  output biases, a SwiGLU MLP with biases) run layer by layer, each with its own attention mask: the layers of
  ``fullatt_block_indexes`` attend within each image, the others within each window of ``window_size`` pixels.
  The patches are put in window order first and stay in it (HF's ``window_index``); the 2-D rotary positions are
  megatron-core's ``RotaryEmbedding`` frequencies (over half a head) of each patch's row and column, laid out as HF's
  ``[h, w, h, w]`` angles, which megatron-core's attention applies (its ``apply_rotary_pos_emb``, rotate-half).
- :class:`QwenMerger`: HF's ``merger``: an RMSNorm of each patch (``ln_q``), each ``spatial_merge_size``^2 patches
  side by side, then megatron-core's ``MultimodalProjector`` MLP (column-parallel ``linear_fc1``, exact GELU,
  row-parallel ``linear_fc2``, biases); the merged tokens go back from window order to image order.

Qwen3-VL's ``Qwen3VLVisionModel`` is the same skeleton with other parts: the Conv3d has a bias; a learned square
table of positions (``pos_embed``), resampled bilinearly to each image's grid, is added to the patch embeddings; the
layers use LayerNorm and a GELU-tanh MLP (not gated), and attend within each image (no windows, the patches stay in
the processor's order); the merger's norm is a LayerNorm; and the outputs of the ``deepstack_visual_indexes`` layers
are returned too, for their own mergers (``QwenMerger.deepstack``, whose norm comes after the 2 x 2 shuffle), whose
features :class:`~megatron_vlm.model.qwen_vl.QwenVLModel` adds to the first language layers' outputs.

The geometry (patch positions, window order, the images' and windows' boundaries, the position table's taps and
weights) is transformers' own (``transformers.vision_utils``: ``get_vision_position_ids``,
``get_vision_window_index``, ``get_vision_cu_seqlens``, ``get_vision_interpolation_indices_and_weights``), computed
on the host from ``image_grid_thw``.
"""

from __future__ import annotations

import torch


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class PatchEmbed(torch.nn.Module):
    """HF's ``Qwen2_5_VisionPatchEmbed`` (no bias) / ``Qwen3VLVisionPatchEmbed`` (a bias): each row of
    ``pixel_values`` (channels x frames x patch x patch) through a Conv3d whose kernel is the whole patch, i.e. one
    linear map of the row."""

    def __init__(self, in_channels: int, temporal: int, patch: int, hidden: int, dtype: torch.dtype,
                 bias: bool = False):
        super().__init__()
        self.shape = (in_channels, temporal, patch, patch)
        kernel = (temporal, patch, patch)
        self.proj = torch.nn.Conv3d(in_channels, hidden, kernel_size=kernel, stride=kernel, bias=bias, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.reshape(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).reshape(x.shape[0], -1)


def block_mask(cu_seqlens: torch.Tensor, n: int, device) -> torch.Tensor:
    """``[1, 1, n, n]`` attention mask (True: masked, megatron's convention) that keeps each position to its own
    segment of ``cu_seqlens`` (an image, or a window)."""
    seg = torch.zeros(n, dtype=torch.long)
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        seg[a:b] = i
    seg = seg.to(device)
    return (seg[:, None] != seg[None, :])[None, None]


def geometry(grid_thw: torch.Tensor, merge: int, window_size: int | None, patch: int):
    """transformers' own vision geometry of ``grid_thw`` (``[images, 3]``: t, h, w in patches): each patch's (row,
    column) ``[n, 2]``, the window order of the merged patches, and the boundaries of images and of windows in that
    order (``window_size`` None, Qwen3-VL: no windows, the processor's order, each image one window)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    grid = grid_thw.cpu()
    positions = get_vision_position_ids(grid, merge)
    cu_images = get_vision_cu_seqlens(grid)
    if window_size is None:
        return positions, torch.arange(positions.shape[0] // merge ** 2), cu_images, cu_images
    window_index, cu_windows = get_vision_window_index(grid, spatial_merge_size=merge, window_size=window_size,
                                                       patch_size=patch)
    return positions, window_index, cu_images, cu_windows


def position_taps(grid_thw: torch.Tensor, side: int, merge: int):
    """transformers' bilinear resampling of a ``side`` x ``side`` position table to each image's grid (corners
    aligned, the patches in merge-block order, as HF's Qwen3-VL ViT): the table rows ``[n, 4]`` and weights ``[n, 4]``
    of each patch."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    return get_vision_interpolation_indices_and_weights(grid_thw.cpu(), num_grid_per_side=side, mode="bilinear",
                                                        align_corners=True, spatial_merge_size=merge)


def _vit_class():
    MegatronModule = _megatron_module()

    class QwenViT(MegatronModule):
        """Qwen2.5-VL's / Qwen3-VL's ViT (see the module docstring). ``forward(pixel_values, grid_thw)`` returns the
        last layer's hidden states ``[patches, hidden]`` in window order, the window order of the merged patches, and
        the hidden states after each of ``deepstack_indexes``' layers (in layer order, as ``(merger, states)``: the
        DeepStack merger that takes them is their place in ``deepstack_indexes``)."""

        def __init__(self, config, layer_spec, *, patch_size: int, temporal_patch_size: int, spatial_merge_size: int,
                     window_size: int | None, fullatt_block_indexes, rotary_base: float, in_channels: int = 3,
                     patch_bias: bool = False, num_position_embeddings: int | None = None, deepstack_indexes=()):
            super().__init__(config=config)
            import math

            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
            from megatron.core.transformer.transformer_block import TransformerBlock

            self.patch_size, self.merge, self.window_size = patch_size, spatial_merge_size, window_size
            self.full_attention = set(fullatt_block_indexes or ())
            self.deepstack_indexes = list(deepstack_indexes or ())
            self.patch_embed = PatchEmbed(in_channels, temporal_patch_size, patch_size, config.hidden_size,
                                          config.params_dtype, bias=patch_bias)
            self.pos_embed, self.position_side = None, 0
            if num_position_embeddings:  # Qwen3-VL: a learned square table, resampled to each image
                self.position_side = math.isqrt(num_position_embeddings)
                self.pos_embed = torch.nn.Embedding(num_position_embeddings, config.hidden_size,
                                                    dtype=config.params_dtype)
            head_dim = config.hidden_size // config.num_attention_heads
            # HF's axial rope: the frequencies of a rope over half a head, for rows and for columns
            self.rotary = RotaryEmbedding(kv_channels=head_dim // 2, rotary_percent=1.0, rotary_base=rotary_base,
                                          use_cpu_initialization=True)
            self.decoder = TransformerBlock(config=config, spec=layer_spec, post_layer_norm=False, pre_process=True,
                                            post_process=False)
            self.input_tensor = None

        def set_input_tensor(self, input_tensor) -> None:
            self.input_tensor = input_tensor

        def rotary_angles(self, positions: torch.Tensor, device) -> torch.Tensor:
            """``[n, 1, 1, head dim]``: HF's angles ``[h, w, h, w]`` of each patch's (row, column)."""
            inv_freq = self.rotary.inv_freq.to(device=device, dtype=torch.float32)
            angles = (positions.to(device)[..., None].float() * inv_freq).flatten(1)  # [n, head dim / 2]
            return torch.cat([angles, angles], dim=-1)[:, None, None, :]

        def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
            positions, window_index, cu_images, cu_windows = geometry(grid_thw, self.merge, self.window_size,
                                                                      self.patch_size)
            x = self.patch_embed(pixel_values)
            n, unit = x.shape[0], self.merge ** 2
            if positions.shape[0] != n:
                raise ValueError(f"image_grid_thw {grid_thw.tolist()} gives {positions.shape[0]} patches but "
                                 f"pixel_values has {n} rows; pass the processor's pixel_values and image_grid_thw")
            if self.pos_embed is not None:
                rows, weights = position_taps(grid_thw, self.position_side, self.merge)
                table = self.pos_embed(rows.to(x.device))  # [n, 4, hidden]
                x = x + (table * weights.to(device=x.device, dtype=table.dtype)[..., None]).sum(1).to(x.dtype)
            order = window_index.to(x.device)

            def windowed(t):
                return t.reshape(n // unit, unit, *t.shape[1:])[order].reshape(t.shape)

            x = windowed(x)[:, None, :]  # [s, b=1, h]
            rope = windowed(self.rotary_angles(positions, x.device))
            masks = {True: block_mask(cu_images, n, x.device)}
            masks[False] = masks[True] if self.window_size is None else block_mask(cu_windows, n, x.device)
            taps = []
            for i, layer in enumerate(self.decoder.layers):
                x, _ = layer(hidden_states=x, attention_mask=masks[i in self.full_attention], rotary_pos_emb=rope)
                if i in self.deepstack_indexes:
                    taps.append((self.deepstack_indexes.index(i), x[:, 0]))
            return x[:, 0], window_index, taps

    return QwenViT


def _merger_class():
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.transformer.module import MegatronModule

    class Mergers(MegatronModule):
        """The DeepStack mergers, children ``0``, ``1``, ...: a ``MegatronModule`` (not a ``ModuleList``), so that
        megatron-core's ``sharded_state_dict`` reaches each merger's tensor-parallel linears."""

        def __init__(self, config, mergers):
            super().__init__(config=config)
            for i, merger in enumerate(mergers):
                self.add_module(str(i), merger)

        def __getitem__(self, i: int):
            return self._modules[str(i)]

    class QwenMerger(MultimodalProjector):
        """HF's ``Qwen2_5_VLPatchMerger`` / ``Qwen3VLVisionPatchMerger``: ``ln_q`` (HF's ``ln_q`` / ``norm``) of each
        patch, ``merge``^2 patches side by side, megatron-core's projector MLP (``input_size`` = merged width); tokens
        back in image order. ``postshuffle``: the norm after the shuffle, over the merged width (Qwen3-VL's DeepStack
        mergers). ``deepstack`` such mergers are built beside it (``self.deepstack``)."""

        def __init__(self, config, submodules, input_size: int, norm, vision_hidden_size: int, eps: float,
                     postshuffle: bool = False, deepstack: int = 0):
            super().__init__(config=config, submodules=submodules, projector_type="mlp", input_size=input_size)
            self.postshuffle = postshuffle
            self.ln_q = norm(config, input_size if postshuffle else vision_hidden_size, eps=eps)
            self.input_size = input_size
            self.deepstack = Mergers(config, [
                QwenMerger(config, submodules, input_size, norm, vision_hidden_size, eps, postshuffle=True)
                for _ in range(deepstack)]) if deepstack else None

        def forward(self, hidden_states: torch.Tensor, window_index: torch.Tensor | None = None):
            if self.postshuffle:
                x = self.ln_q(hidden_states.reshape(-1, 1, self.input_size))
            else:
                x = self.ln_q(hidden_states).reshape(-1, 1, self.input_size)  # [tokens, b=1, merged width]
            x = super().forward(x)[:, 0]
            if window_index is not None:
                x = x[torch.argsort(window_index.to(x.device))]
            return x

    return QwenMerger


_CLASSES: dict = {}


def vit_class():
    """The :class:`QwenViT` class (made once, after megatron-core is importable)."""
    if "vit" not in _CLASSES:
        _CLASSES["vit"] = _vit_class()
    return _CLASSES["vit"]


def merger_class():
    """The :class:`QwenMerger` class (made once, after megatron-core is importable)."""
    if "merger" not in _CLASSES:
        _CLASSES["merger"] = _merger_class()
    return _CLASSES["merger"]


def vision_layer_spec(vit_spec, norm):
    """Qwen's ViT layer from megatron-core's local ViT layer spec (bidirectional; a mask passed at each call):
    ``norm`` (torch's RMSNorm, Qwen2.5-VL, or LayerNorm, Qwen3-VL, from the config) before the attention and the MLP;
    the MLP's SwiGLU or GELU comes from the config (``gated_linear_unit``, ``activation_func``)."""
    import copy

    spec = copy.deepcopy(vit_spec)
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    return spec
