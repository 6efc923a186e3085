"""The core attention of local layers on torch's ``scaled_dot_product_attention`` (``--attention-backend sdpa``).

Owns :class:`SDPAttention`, a megatron-core core attention (the ``core_attention`` submodule of a layer spec: the
language model's causal attention with grouped-query heads, the ViT's bidirectional one): megatron-core's
``DotProductAttention`` with its constructor, and therefore its softmax scale (``1/sqrt(kv_channels)``, or the
given ``softmax_scale``; query-key layer scaling cancels out in megatron's softmax), attention dropout, heads per
tensor-parallel rank and checkpoint entries, and a forward that hands queries, keys and values to torch's fused
kernel (flash or memory-efficient attention on CUDA, torch's fused CPU kernel) instead of building the score
matrix, its fp32 softmax and the two batched GEMMs itself. Grouped-query keys and values go in unexpanded
(``enable_gqa``). Packed sequences ('thd', :mod:`megatron_vlm.data.packing`) attend within their own sample through
a block-diagonal causal mask built on the device from ``cu_seqlens`` (no host sync, one kernel for the pack).

What it refuses at construction, in one line each: megatron's windowed attention and softmax offsets (no
``scaled_dot_product_attention`` equivalent here) and context parallelism (:func:`~megatron_vlm.model.layer_impl.
choose_attention` refuses ``--attention-backend sdpa`` with ``--cp`` before that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _core_attention_base():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def segment_mask(cu_seqlens: torch.Tensor, total: int, causal: bool) -> torch.Tensor:
    """``[total, total]`` boolean, True where query position i may attend key position j of one packed row: both in
    the same ``cu_seqlens`` segment (and j <= i when ``causal``). Positions past ``cu_seqlens[-1]`` form one
    segment of their own. Computed on ``cu_seqlens``' device without reading it on the host."""
    pos = torch.arange(total, device=cu_seqlens.device)
    seg = torch.bucketize(pos, cu_seqlens[1:].to(pos.dtype), right=True)
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    return allowed


class SDPAttention(_core_attention_base()):
    """megatron-core's ``DotProductAttention`` computed by ``torch.nn.functional.scaled_dot_product_attention``
    (see the module docstring). Inputs as megatron's core attention: ``[sq, b, heads, dim]`` queries, ``[sk, b,
    groups, dim]`` keys and values (packed 'thd': ``[t, heads, dim]``); output ``[sq, b, heads x dim]`` (packed:
    ``[t, 1, heads x dim]``). An ``attention_mask`` follows megatron's convention (True: masked out) and replaces
    the causal mask, as in megatron's softmax."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        if config.context_parallel_size != 1:
            raise ValueError(f"--attention-backend sdpa does not run context parallelism (--cp "
                             f"{config.context_parallel_size}); use --attention-backend local or Transformer Engine")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("--attention-backend sdpa has no sliding-window attention; use --attention-backend local")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"--attention-backend sdpa has no softmax offset (softmax_type {config.softmax_type}); "
                             "use --attention-backend local")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        # megatron divides its scale by the layer number under query-key layer scaling and its softmax multiplies
        # the scores by it again (in fp32): the product is the scale applied
        self.scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("--attention-backend sdpa takes no attention bias; use --attention-backend local")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:  # [t, heads, dim] -> one row of the batch
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        causal = self.attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        mask = None
        if attention_mask is not None:
            if packed:
                raise ValueError("packed sdpa attention takes no attention mask: the segments are the mask")
            mask = ~attention_mask  # megatron: True = hidden; torch: True = attended
            causal = False
        elif packed:  # self-attention: the keys' segments are the queries' (megatron-vlm's packs give both the same)
            mask = segment_mask(packed_seq_params.cu_seqlens_q, query.shape[0], causal)
            causal = False
        # [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.scale, enable_gqa=gqa)

        if dropout and not self.config.sequence_parallel:  # as megatron's attention dropout: the model-parallel RNG
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, heads, sq, dim] -> [sq, b, heads x dim]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)
