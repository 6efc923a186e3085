"""InternViT and InternVL's projector on megatron-core's building blocks, tensor-parallel.

megatron-core ships InternViT's frame: ``CLIPViTModel(model_subtype="internvit")`` (a biased patch convolution, a
class token, absolute position embeddings for the checkpoint's grid, no pre/post norm), ``LLaVAModel``'s
``pixel_shuffle`` (InternVL's 2 x 2 patch merge, "version 2", the same operations as HF's) and its projector's
4x wider input. What it does not ship, and this module adds on its layers:

- :class:`InternViTLayer`: megatron-core's ``TransformerLayer`` with InternViT's per-layer scales ``ls1``/``ls2``
  (HF ``lambda_1``/``lambda_2``, Megatron-LM's names) applied to the attention and MLP outputs before their residual
  adds (megatron's own bias-dropout-add does the add);
- :class:`CrossHeadRMSNorm`: the 6B variant's q/k norms (HF ``use_qk_norm``): one RMSNorm over ALL heads of the
  query (key), where megatron-core's ``qk_layernorm`` normalises each head. Under tensor parallelism each rank holds
  some heads, so the sum of squares is all-reduced over the TP group (forward and backward) and the weight is split
  with the heads. The weights are parameters of the attention as ``q_norm_weight``/``k_norm_weight``, not of its
  ``q_layernorm``/``k_layernorm`` modules: megatron-core's ``finalize_model_grads`` sums over TP ranks the gradient of
  every parameter named ``*q_layernorm*`` whenever the language model has q/k norms (megatron's per-head norms hold
  the whole weight on every rank), which would add up different heads' shards here;
- :class:`LayerNormColumnParallelLinear`: the projector's ``LayerNorm -> Linear`` for local layers, saved under
  Transformer Engine's ``TELayerNormColumnParallelLinear`` names (``layer_norm_weight``/``layer_norm_bias``), which
  the Transformer Engine spec uses directly.

:func:`vision_layer_spec` and :func:`projector_spec` turn megatron-core's ViT / MLP specs into InternViT's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

#: HF's ``InternVLVisionRMSNorm`` of the q/k norms is built with its default epsilon, whatever ``layer_norm_eps`` says
QK_NORM_EPS = 1e-6


def _layer_scaled(bda, layer, name: str):
    """megatron's bias-dropout-add factory ``bda(training, fused)`` with the output scaled by ``layer.<name>``
    before the residual add: ``residual + dropout(scale * (x + bias))``."""

    def make(training, fused):
        inner = bda(training, fused)

        def apply(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return inner((x * getattr(layer, name), None), residual, prob)

        return apply

    return make


def _layer_class():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class InternViTLayer(TransformerLayer):
        """``TransformerLayer`` with InternViT's layer scales ``ls1`` (attention) and ``ls2`` (MLP), replicated over
        tensor-parallel ranks (they scale the full hidden state after the row-parallel reductions)."""

        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            for name in ("ls1", "ls2"):
                self.register_parameter(name, torch.nn.Parameter(torch.ones(config.hidden_size,
                                                                            dtype=config.params_dtype)))
            self.self_attn_bda = _layer_scaled(self.self_attn_bda, self, "ls1")
            self.mlp_bda = _layer_scaled(self.mlp_bda, self, "ls2")
            attention = self.self_attention
            self.qk_norms = [x for x in "qk" if isinstance(getattr(attention, f"{x}_layernorm", None), CrossHeadRMSNorm)]
            for x in self.qk_norms:  # see the module docstring: not under the q/k_layernorm modules' names
                attention.register_parameter(f"{x}_norm_weight", getattr(attention, f"{x}_layernorm").weight)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
            """megatron's, with the q/k norm weights split along dim 0 over TP ranks (with the heads)."""
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            if self.qk_norms:
                from megatron.core import parallel_state as ps
                from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

                names = [f"{x}_norm_weight" for x in self.qk_norms]
                state = {n: getattr(self.self_attention, n) for n in names}
                dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
                out.update(make_sharded_tensors_for_checkpoint(
                    state, f"{prefix}self_attention.", {n: 0 for n in names}, sharded_offsets,
                    tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=dp_cp))
            return out

    return InternViTLayer


_CLASSES: dict = {}


def internvit_layer_class():
    """The :class:`InternViTLayer` class (made once, after megatron-core is importable)."""
    if "layer" not in _CLASSES:
        _CLASSES["layer"] = _layer_class()
    return _CLASSES["layer"]


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) over the tensor-parallel group in the forward AND the backward: every rank's normalised heads
    depend on every rank's sum of squares."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class CrossHeadRMSNorm(torch.nn.Module):
    """HF InternViT-6B's q/k norm: RMSNorm over the whole projection (all heads), in fp32, ``weight * x.to(dtype)``
    as HF's ``InternVLVisionRMSNorm``. Built by megatron's ``SelfAttention`` as its ``q_layernorm``/``k_layernorm``
    (it passes one head's size, which this norm does not use); takes ``[s, b, heads on this rank, head dim]``."""

    def __init__(self, config, hidden_size: int = 0, eps: float = QK_NORM_EPS, **kwargs):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.tp = ps.get_tensor_model_parallel_world_size()
        self.group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.full_size = config.hidden_size  # InternViT: heads x head dim == hidden size
        weight = torch.nn.Parameter(torch.ones(self.full_size // self.tp, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=0, stride=1)
        object.__setattr__(self, "weight", weight)  # held, not registered: the attention registers it
        self.eps = QK_NORM_EPS

    def forward(self, x):
        dtype, shape = x.dtype, x.shape
        x32 = x.reshape(*shape[:-2], -1).float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        if self.group is not None:
            squares = _SumOverTP.apply(squares, self.group)
        y = x32 * torch.rsqrt(squares / self.full_size + self.eps)
        return (self.weight * y.to(dtype)).reshape(shape)


def _layer_norm_linear_class():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """A LayerNorm (affine, ``config.layernorm_epsilon``) of the full input, then megatron's
        ``ColumnParallelLinear``; the norm's parameters are replicated and saved as Transformer Engine's
        ``layer_norm_weight``/``layer_norm_bias``."""

        def __init__(self, input_size, output_size, *args, config, **kwargs):
            super().__init__(input_size, output_size, *args, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            self.layer_norm_eps = config.layernorm_epsilon

        def forward(self, input_, *args, **kwargs):
            normed = F.layer_norm(input_, (input_.shape[-1],), self.layer_norm_weight, self.layer_norm_bias,
                                  self.layer_norm_eps)
            return super().forward(normed, *args, **kwargs)

    return LayerNormColumnParallelLinear


def layer_norm_linear_class():
    if "ln_linear" not in _CLASSES:
        _CLASSES["ln_linear"] = _layer_norm_linear_class()
    return _CLASSES["ln_linear"]


def _without_bias(linear_cls):
    """``linear_cls`` built without a bias whatever it is asked for: megatron's ``SelfAttention`` gives ``linear_qkv``
    a bias whenever the other linears have one (``add_bias_linear``), the 6B variant's q/k/v have none."""
    key = ("no_bias", linear_cls)
    if key not in _CLASSES:
        def __init__(self, *args, bias=True, **kwargs):
            linear_cls.__init__(self, *args, bias=False, **kwargs)

        _CLASSES[key] = type(f"{linear_cls.__name__}WithoutBias", (linear_cls,), {"__init__": __init__})
    return _CLASSES[key]


def vision_layer_spec(vit_spec, qk_layernorm: bool, qkv_bias: bool = True):
    """InternViT's layer spec from megatron-core's ViT layer spec (local or Transformer Engine, bidirectional):
    :class:`InternViTLayer`, the 6B variant's :class:`CrossHeadRMSNorm` q/k norms and its q/k/v without bias."""
    spec = copy.deepcopy(vit_spec)
    spec.module = internvit_layer_class()
    attention = spec.submodules.self_attention.submodules
    if not qkv_bias:
        attention.linear_qkv = _without_bias(attention.linear_qkv)
    if qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = CrossHeadRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = CrossHeadRMSNorm
    return spec


def projector_spec(use_te: bool):
    """InternVL's projector MLP: ``LayerNorm -> linear_fc1 -> GELU -> linear_fc2``, the norm fused into fc1 (Transformer
    Engine's ``TELayerNormColumnParallelLinear``, or :class:`LayerNormColumnParallelLinear`)."""
    from megatron.core.transformer.mlp import MLPSubmodules

    if use_te:
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear

        return MLPSubmodules(linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear)
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    return MLPSubmodules(linear_fc1=layer_norm_linear_class(), linear_fc2=RowParallelLinear)
