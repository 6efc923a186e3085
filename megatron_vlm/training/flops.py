"""Model FLOPs of a training step and model FLOPs utilisation (MFU).

``StepFlops(spec, train_vit, train_projector, train_lm)`` counts the matrix-multiply FLOPs (2 per
multiply-add) that one optimizer step needs for a given number of samples, sequence tokens and images:

- vision encoder per image: patch convolution, then per ViT layer (``spec.vit_num_layers``, i.e. the layers
  Megatron runs up to ``vision_feature_layer``) QKV, attention scores and values over all patches (+ class
  token), output projection and the two-matrix MLP;
- projector per image: ``linear_fc1`` and ``linear_fc2`` on the image tokens the language model receives;
- language model per token: QKV (grouped-query), attention over the sample's length (counted in full, as
  in the usual MFU convention, not halved for the causal mask), output projection, the gated MLP, and the
  output layer over the true vocabulary. A mixture-of-experts layer counts its router and the top-k experts each
  token runs (the active parameters), not every expert.

Backward: a trained part computes weight gradients (1x its weight matmuls) and activation gradients (1x its
weight matmuls, 2x its attention matmuls), except the gradient of its own input where nothing before it trains
(the patch convolution's input is the image; the projector's after a frozen vision encoder); a frozen part that
gradients still pass through (the frozen language model of stage 1, on the way to the projector) computes
activation gradients only; a frozen part with nothing trained before it (the frozen vision encoder) has no
backward. Attention counts each sample over its own length: the step gives the sum of the squared sample lengths
(``squares``: a row's real positions, a pack's sample segments), never ``--seq-length`` or a row's padding; without
it the batch mean length stands in, which under-counts attention for uneven lengths.

``peak_flops(device)`` is the dense bf16 peak of known NVIDIA GPUs (FP8 doubles it); unknown devices
(and CPUs) have none, so MFU is only reported where the peak is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_vlm.model.spec import VLMSpec

# Dense (no sparsity) bf16 tensor-core peak per GPU, FLOP/s; matched against torch.cuda.get_device_name.
PEAK_BF16 = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM / HBM3
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


@dataclass(frozen=True)
class PartFlops:
    """Forward FLOPs of a part: weight matmuls (``entry``: those of its first matmul, on the part's input) and
    attention (activation x activation) matmuls."""

    weights: float
    attention: float
    entry: float = 0.0

    def step(self, trained: bool, grads_pass: bool) -> float:
        """Forward + backward; ``grads_pass``: a part before this one trains, so this part's input needs its
        gradient."""
        fwd = self.weights + self.attention
        if not trained and not grads_pass:
            return fwd
        activation_grads = self.weights - (0 if grads_pass else self.entry) + 2 * self.attention
        return fwd + activation_grads + (self.weights if trained else 0)


def _attention_block(tokens: float, pairs: float, hidden: int, q_dim: int, kv_dim: int, out_dim: int) -> PartFlops:
    """QKV + output projection (weights) and scores + values (attention) for ``tokens`` tokens whose sequences
    hold ``pairs`` (query, key) pairs in all: the sum of their squared lengths."""
    weights = 2 * tokens * hidden * (q_dim + 2 * kv_dim) + 2 * tokens * q_dim * out_dim
    attention = 2 * 2 * pairs * q_dim
    return PartFlops(weights, attention)


class StepFlops:
    """FLOPs of one training step of a LLaVA ``spec`` with the given parts trained; see the module docstring."""

    def __init__(self, spec: VLMSpec, train_vit: bool, train_projector: bool, train_lm: bool):
        self.spec = spec
        self.train = (train_vit, train_projector, train_lm)

    def vision(self, images: float) -> PartFlops:
        s = self.spec
        patches = (s.image_size // s.patch_size) ** 2
        seq = patches + (1 if s.has_class_token else 0)
        h, f = s.vision_hidden_size, s.vision_ffn_hidden_size
        conv = 2 * images * patches * 3 * s.patch_size**2 * h
        layer = _attention_block(images * seq, images * seq * seq, h, h, h, h)
        mlp = 2 * images * seq * 2 * h * f
        n = s.vit_num_layers
        return PartFlops(conv + n * (layer.weights + mlp), n * layer.attention, entry=conv)

    def projector(self, images: float) -> PartFlops:
        s = self.spec
        tokens = images * s.num_image_tokens
        fc1 = 2 * tokens * s.projector_input_size * s.hidden_size
        return PartFlops(fc1 + 2 * tokens * s.hidden_size * s.hidden_size, 0.0, entry=fc1)

    def language(self, samples: float, tokens: float, squares: float | None = None) -> PartFlops:
        """``squares``: the sum of the samples' squared lengths (attention's work); None: ``samples`` samples of
        the mean length."""
        s = self.spec
        pairs = squares if squares is not None else tokens * (tokens / max(samples, 1))
        q_dim, kv_dim = s.num_attention_heads * s.kv_channels, s.num_query_groups * s.kv_channels
        layer = _attention_block(tokens, pairs, s.hidden_size, q_dim, kv_dim, s.hidden_size)
        n_moe = len(s.moe_layers)
        dense = 2 * tokens * 3 * s.hidden_size * s.ffn_hidden_size  # gate, up, down
        moe = 2 * tokens * (s.hidden_size * s.num_moe_experts + s.moe_router_topk * 3 * s.hidden_size
                            * s.moe_ffn_hidden_size) if n_moe else 0.0  # router + the experts a token runs
        logits = 2 * tokens * s.hidden_size * s.vocab_size
        n = s.num_layers
        qkv = 2 * tokens * s.hidden_size * (q_dim + 2 * kv_dim)
        mlps = (n - n_moe) * dense + n_moe * moe
        return PartFlops(n * layer.weights + mlps + logits, n * layer.attention, entry=qkv)

    def __call__(self, samples: float, tokens: float, images: float, squares: float | None = None) -> float:
        """FLOPs of forward + backward for ``samples`` samples of ``tokens`` tokens in all (image tokens
        included) holding ``images`` images (images or anyres tiles, each its patches); ``squares``: the sum of the
        samples' squared lengths (:meth:`language`)."""
        parts = (self.vision(images), self.projector(images), self.language(samples, tokens, squares))
        total, upstream_trained = 0.0, False
        for part, trained in zip(parts, self.train):
            total += part.step(trained, grads_pass=upstream_trained)
            upstream_trained = upstream_trained or trained
        return total


def peak_flops(device, fp8: bool = False) -> float | None:
    """Peak dense FLOP/s of one ``device`` (a torch.device), or None where it is not known (CPUs included)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16:
        if key in name:
            return peak * (2 if fp8 else 1)
    return None
