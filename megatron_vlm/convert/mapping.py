"""Name and tensor-layout rules between HF LLaVA and megatron-core's LLaVAModel, and TP/PP split/merge.

One ``Rule`` per Megatron tensor (tables below, one per family: llama-like text, CLIP/SigLIP vision,
projector). A rule names the HF tensor(s) it is made of, how they are combined (``kind``) and how the
result is split across tensor-parallel ranks (``split``):

- ``copy``: the same tensor; ``qkv``: q/k/v fused per query group ``[q heads of g; k_g; v_g]`` for each g
  (``qkv_packed``: the same from one HF tensor ``[q; k; v]``, Qwen2.5-VL's ViT ``attn.qkv``);
  ``gated``: SwiGLU ``[gate; up]``; ``vocab``: embedding/output rows padded to the padded vocab
  (trimmed on export); ``class_token``: ``[h] <-> [1, 1, h]``; ``unbatch``: ``[1, n, h] <-> [n, h]`` (InternViT's
  position embeddings).
- ``column`` (dim 0), ``row`` (dim 1), ``replicated``; ``gated`` tensors are split as
  ``cat(gate.chunk(tp)[r], up.chunk(tp)[r])`` per rank.

Mixture-of-experts layers (Qwen3-MoE, Mixtral: :data:`MOE_HF_NAMES`, one row per family) have a router
(``mlp.router.weight``, replicated) and one rule per expert and linear (``expert`` set): an expert lives on one
expert-parallel rank (:func:`ep_rank_of`), under its local index there (:func:`local_name`), and is split over
the expert tensor-parallel size (:func:`split_size`), which megatron-core sets apart from the attention's TP.

Megatron names here are those of a TP=1/PP=1 model's ``state_dict`` with the local layer spec and global
layer numbers ("full" names); ``local_name`` renumbers language layers for a pipeline stage. HF names are
the transformers-5 on-disk names (``canonical_hf_name`` reads other layouts; Qwen2.5-VL's are the hub's
``model.*`` / ``visual.*`` / ``lm_head.weight``, which transformers 5 writes too, :data:`QWEN_LM`; Qwen3-VL's the
hub's ``model.language_model.*`` / ``model.visual.*``, :data:`QWEN3_LM`). Tensors of the
HF model that the Megatron model does not hold (vision layers after ``vision_feature_layer``, post layernorms, SigLIP's
pooling head) are "extra": they travel with the checkpoint so the exported model is complete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_vlm.model.spec import VLMSpec


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"  # copy | qkv | qkv_packed | gated | vocab | class_token | unbatch
    split: str = "replicated"  # column | row | replicated | gated
    placement: str = "first"  # first | last | layer
    layer: int | None = None  # global language layer (placement == "layer")
    heads: int = 0  # qkv: attention heads
    groups: int = 0  # qkv: query groups
    head_dim: int = 0
    expert: int | None = None  # the global expert index of an expert's tensor (MoE layers)


LM = "language_model.model."
VT = "vision_tower."
PROJ = "multi_modal_projector."
LM_HEAD = "language_model.lm_head.weight"

# Layouts transformers has written over time -> the transformers-5 on-disk layout.
_HF_PREFIXES = [
    ("model.language_model.", LM),
    ("model.vision_tower.", VT),
    ("model.multi_modal_projector.", PROJ),
    ("lm_head.weight", LM_HEAD),
    ("language_model.model.", LM),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("vision_tower.vision_model.", VT),
    ("model.image_newline", "image_newline"),
]


# Qwen2.5-VL: the hub's (and transformers 5's on-disk) names; transformers 4.5x wrote the in-memory layout
QWEN_LM = "model."
QWEN_VT = "visual."
QWEN_LM_HEAD = "lm_head.weight"
_QWEN_HF_PREFIXES = [("model.language_model.", QWEN_LM), ("model.visual.", QWEN_VT)]
# Qwen3-VL: the hub's names, which transformers 4.57 and 5 write alike
QWEN3_LM = "model.language_model."
QWEN3_VT = "model.visual."


def hf_prefixes(spec: VLMSpec) -> tuple[str, str, str]:
    """(language model, vision model, output layer) HF prefixes of ``spec``'s family."""
    if spec.is_qwen3_vl:
        return QWEN3_LM, QWEN3_VT, QWEN_LM_HEAD
    if spec.is_qwen_vl:
        return QWEN_LM, QWEN_VT, QWEN_LM_HEAD
    return LM, VT, LM_HEAD


def canonical_hf_name(name: str, arch: str | None = None) -> str:
    """The name rules use for the on-disk tensor ``name`` of an HF model of ``arch`` (its config's model_type)."""
    if arch == "qwen3_vl":
        return name
    for old, new in (_QWEN_HF_PREFIXES if arch == "qwen2_5_vl" else _HF_PREFIXES):
        if name.startswith(old):
            name = new + name[len(old):]
    return name


# HF on-disk names of an MoE layer's router and expert ``{j}``'s SwiGLU linears, per family (relative to the layer).
MOE_HF_NAMES = {
    "qwen3_moe": dict(router="mlp.gate.weight", gate="mlp.experts.{j}.gate_proj.weight",
                      up="mlp.experts.{j}.up_proj.weight", down="mlp.experts.{j}.down_proj.weight"),
    "mixtral": dict(router="block_sparse_moe.gate.weight", gate="block_sparse_moe.experts.{j}.w1.weight",
                    up="block_sparse_moe.experts.{j}.w3.weight", down="block_sparse_moe.experts.{j}.w2.weight"),
}


def _moe_mlp_rules(spec: VLMSpec, m: str, h: str, at: dict) -> list[Rule]:
    """Router and experts of the MoE layer with Megatron prefix ``m`` and HF prefix ``h``."""
    names = MOE_HF_NAMES[spec.text_family]
    rules = [Rule(m + "mlp.router.weight", (h + names["router"],), **at)]
    for j in range(spec.num_moe_experts):
        e = f"{m}mlp.experts.local_experts.{j}."
        rules += [
            Rule(e + "linear_fc1.weight", (h + names["gate"].format(j=j), h + names["up"].format(j=j)),
                 "gated", "gated", expert=j, **at),
            Rule(e + "linear_fc2.weight", (h + names["down"].format(j=j),), split="row", expert=j, **at),
        ]
    return rules


def _language_rules(spec: VLMSpec) -> list[Rule]:
    lm, _, head = hf_prefixes(spec)
    rules = [
        Rule("language_model.embedding.word_embeddings.weight", (lm + "embed_tokens.weight",), "vocab", "column"),
        Rule("language_model.decoder.final_layernorm.weight", (lm + "norm.weight",), placement="last"),
    ]
    if not spec.tie_word_embeddings:
        rules.append(Rule("language_model.output_layer.weight", (head,), "vocab", "column", placement="last"))
    qkv = dict(heads=spec.num_attention_heads, groups=spec.num_query_groups, head_dim=spec.kv_channels)
    moe_layers = set(spec.moe_layers)
    for i in range(spec.num_layers):
        m, h = f"language_model.decoder.layers.{i}.", f"{lm}layers.{i}."
        at = dict(placement="layer", layer=i)
        rules += [
            Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), **at),
            Rule(m + "self_attention.linear_qkv.weight",
                 tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"), "qkv", "column", **at, **qkv),
            Rule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), split="row", **at),
            Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), **at),
        ]
        if i in moe_layers:
            rules += _moe_mlp_rules(spec, m, h, at)
        else:
            rules += [
                Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                     "gated", "gated", **at),
                Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), split="row", **at),
            ]
        if spec.qk_layernorm:  # Qwen3: RMSNorm over each head's kv_channels, shared by all heads
            rules += [Rule(m + f"self_attention.{x}_layernorm.weight", (h + f"self_attn.{x}_norm.weight",), **at)
                      for x in "qk"]
        if spec.qkv_bias:
            rules.append(Rule(m + "self_attention.linear_qkv.bias",
                              tuple(h + f"self_attn.{x}_proj.bias" for x in "qkv"), "qkv", "column", **at, **qkv))
    return rules


def _internvit_rules(spec: VLMSpec) -> list[Rule]:
    """InternViT (HF ``InternVLVisionModel``) -> megatron-core's ``CLIPViTModel(model_subtype='internvit')`` with
    :class:`~megatron_vlm.model.internvit.InternViTLayer` layers: layer scales ``lambda_1``/``lambda_2`` ->
    ``ls1``/``ls2`` (replicated), the 6B variant's q/k norms over all heads split with the heads (column)."""
    e, v = VT + "embeddings.", "vision_model."
    rules = [
        Rule(v + "conv1.weight", (e + "patch_embeddings.projection.weight",)),
        Rule(v + "conv1.bias", (e + "patch_embeddings.projection.bias",)),
        Rule(v + "class_token", (e + "cls_token",)),
        Rule(v + "position_embeddings.weight", (e + "position_embeddings",), "unbatch"),
    ]
    heads = spec.vision_num_attention_heads
    qkv = dict(heads=heads, groups=heads, head_dim=spec.vision_hidden_size // heads)
    norms = ("weight", "bias") if spec.vision_normalization == "LayerNorm" else ("weight",)
    for i in range(spec.vit_num_layers):
        m, h = f"{v}decoder.layers.{i}.", f"{VT}encoder.layer.{i}."
        rules += [Rule(m + "ls1", (h + "lambda_1",)), Rule(m + "ls2", (h + "lambda_2",))]
        rules += [Rule(m + f"input_layernorm.{p}", (h + f"layernorm_before.{p}",)) for p in norms]
        rules += [Rule(m + f"pre_mlp_layernorm.{p}", (h + f"layernorm_after.{p}",)) for p in norms]
        for p in ("weight", "bias") if spec.vision_qkv_bias else ("weight",):
            rules.append(Rule(m + f"self_attention.linear_qkv.{p}",
                              tuple(h + f"attention.{x}_proj.{p}" for x in "qkv"), "qkv", "column", **qkv))
        if spec.vision_qk_layernorm:
            rules += [Rule(m + f"self_attention.{x}_norm_weight", (h + f"attention.{x}_norm.weight",),
                           split="column") for x in "qk"]
        for p in ("weight", "bias"):
            row = "row" if p == "weight" else "replicated"
            rules += [
                Rule(m + f"self_attention.linear_proj.{p}", (h + f"attention.projection_layer.{p}",), split=row),
                Rule(m + f"mlp.linear_fc1.{p}", (h + f"mlp.fc1.{p}",), split="column"),
                Rule(m + f"mlp.linear_fc2.{p}", (h + f"mlp.fc2.{p}",), split=row),
            ]
    return rules


def _qwen_vit_rules(spec: VLMSpec) -> list[Rule]:
    """Qwen2.5-VL's ViT (HF ``visual``) -> :class:`~megatron_vlm.model.qwen_vit.QwenViT` and the merger
    (:class:`~megatron_vlm.model.qwen_vit.QwenMerger`): the Conv3d patch embedding replicated, the fused ``attn.qkv``
    re-laid per head and split with the heads, the SwiGLU MLP's gate/up (and their biases) split per TP rank."""
    v = "vision_model."
    rules = [Rule(v + "patch_embed.proj.weight", (QWEN_VT + "patch_embed.proj.weight",))]
    heads = spec.vision_num_attention_heads
    qkv = dict(heads=heads, groups=heads, head_dim=spec.vision_hidden_size // heads)
    for i in range(spec.vision_num_layers):
        m, h = f"{v}decoder.layers.{i}.", f"{QWEN_VT}blocks.{i}."
        rules += [
            Rule(m + "input_layernorm.weight", (h + "norm1.weight",)),
            Rule(m + "pre_mlp_layernorm.weight", (h + "norm2.weight",)),
        ]
        for p in ("weight", "bias"):
            row = "row" if p == "weight" else "replicated"
            rules += [
                Rule(m + f"self_attention.linear_qkv.{p}", (h + f"attn.qkv.{p}",), "qkv_packed", "column", **qkv),
                Rule(m + f"self_attention.linear_proj.{p}", (h + f"attn.proj.{p}",), split=row),
                Rule(m + f"mlp.linear_fc1.{p}", (h + f"mlp.gate_proj.{p}", h + f"mlp.up_proj.{p}"), "gated", "gated"),
                Rule(m + f"mlp.linear_fc2.{p}", (h + f"mlp.down_proj.{p}",), split=row),
            ]
    g, pr = QWEN_VT + "merger.", "vision_projection."
    rules += [
        Rule(pr + "ln_q.weight", (g + "ln_q.weight",)),
        Rule(pr + "encoder.linear_fc1.weight", (g + "mlp.0.weight",), split="column"),
        Rule(pr + "encoder.linear_fc1.bias", (g + "mlp.0.bias",), split="column"),
        Rule(pr + "encoder.linear_fc2.weight", (g + "mlp.2.weight",), split="row"),
        Rule(pr + "encoder.linear_fc2.bias", (g + "mlp.2.bias",)),
    ]
    return rules


def _merger_rules(pr: str, g: str, norm: str) -> list[Rule]:
    """A Qwen3-VL merger (HF prefix ``g``: ``norm``, ``linear_fc1``, exact GELU, ``linear_fc2``) ->
    :class:`~megatron_vlm.model.qwen_vit.QwenMerger` at Megatron prefix ``pr``: its norm replicated, fc1 column- and
    fc2 row-parallel."""
    rules = [Rule(pr + f"ln_q.{p}", (g + f"{norm}.{p}",)) for p in ("weight", "bias")]
    for p in ("weight", "bias"):
        rules += [Rule(pr + f"encoder.linear_fc1.{p}", (g + f"linear_fc1.{p}",), split="column"),
                  Rule(pr + f"encoder.linear_fc2.{p}", (g + f"linear_fc2.{p}",),
                       split="row" if p == "weight" else "replicated")]
    return rules


def _qwen3_vit_rules(spec: VLMSpec) -> list[Rule]:
    """Qwen3-VL's ViT (HF ``model.visual``) -> :class:`~megatron_vlm.model.qwen_vit.QwenViT`: the Conv3d patch
    embedding (with its bias) and the learned position table replicated, LayerNorms, the fused ``attn.qkv`` re-laid per
    head, the GELU MLP split over TP; the merger and each DeepStack merger (``deepstack_merger_list.k``, whose norm
    comes after the 2 x 2 shuffle) -> ``vision_projection`` and ``vision_projection.deepstack.k``."""
    v, vt = "vision_model.", QWEN3_VT
    rules = [Rule(v + f"patch_embed.proj.{p}", (vt + f"patch_embed.proj.{p}",)) for p in ("weight", "bias")]
    rules.append(Rule(v + "pos_embed.weight", (vt + "pos_embed.weight",)))
    heads = spec.vision_num_attention_heads
    qkv = dict(heads=heads, groups=heads, head_dim=spec.vision_hidden_size // heads)
    for i in range(spec.vision_num_layers):
        m, h = f"{v}decoder.layers.{i}.", f"{vt}blocks.{i}."
        for p in ("weight", "bias"):
            row = "row" if p == "weight" else "replicated"
            rules += [
                Rule(m + f"input_layernorm.{p}", (h + f"norm1.{p}",)),
                Rule(m + f"pre_mlp_layernorm.{p}", (h + f"norm2.{p}",)),
                Rule(m + f"self_attention.linear_qkv.{p}", (h + f"attn.qkv.{p}",), "qkv_packed", "column", **qkv),
                Rule(m + f"self_attention.linear_proj.{p}", (h + f"attn.proj.{p}",), split=row),
                Rule(m + f"mlp.linear_fc1.{p}", (h + f"mlp.linear_fc1.{p}",), split="column"),
                Rule(m + f"mlp.linear_fc2.{p}", (h + f"mlp.linear_fc2.{p}",), split=row),
            ]
    rules += _merger_rules("vision_projection.", vt + "merger.", "norm")
    for k in range(spec.deepstack_layers):
        rules += _merger_rules(f"vision_projection.deepstack.{k}.", vt + f"deepstack_merger_list.{k}.", "norm")
    return rules


def _vision_rules(spec: VLMSpec) -> list[Rule]:
    if spec.vision_family == "internvit":
        return _internvit_rules(spec)
    if spec.is_qwen3_vl:
        return _qwen3_vit_rules(spec)
    if spec.is_qwen_vl:
        return _qwen_vit_rules(spec)
    e, v = VT + "embeddings.", "vision_model."
    rules = [
        Rule(v + "conv1.weight", (e + "patch_embedding.weight",)),
        Rule(v + "position_embeddings.weight", (e + "position_embedding.weight",)),
    ]
    if spec.vision_family == "clip":
        rules += [
            Rule(v + "class_token", (e + "class_embedding",), "class_token"),
            Rule(v + "ln_pre.weight", (VT + "pre_layrnorm.weight",)),
            Rule(v + "ln_pre.bias", (VT + "pre_layrnorm.bias",)),
        ]
    else:
        rules.append(Rule(v + "conv1.bias", (e + "patch_embedding.bias",)))
    heads = spec.vision_num_attention_heads
    qkv = dict(heads=heads, groups=heads, head_dim=spec.vision_hidden_size // heads)
    for i in range(spec.vit_num_layers):
        m, h = f"{v}decoder.layers.{i}.", f"{VT}encoder.layers.{i}."
        for p in ("weight", "bias"):
            rules += [
                Rule(m + f"input_layernorm.{p}", (h + f"layer_norm1.{p}",)),
                Rule(m + f"self_attention.linear_qkv.{p}",
                     tuple(h + f"self_attn.{x}_proj.{p}" for x in "qkv"), "qkv", "column", **qkv),
                Rule(m + f"self_attention.linear_proj.{p}", (h + f"self_attn.out_proj.{p}",),
                     split="row" if p == "weight" else "replicated"),
                Rule(m + f"pre_mlp_layernorm.{p}", (h + f"layer_norm2.{p}",)),
                Rule(m + f"mlp.linear_fc1.{p}", (h + f"mlp.fc1.{p}",), split="column"),
                Rule(m + f"mlp.linear_fc2.{p}", (h + f"mlp.fc2.{p}",), split="row" if p == "weight" else "replicated"),
            ]
    return rules


def _projector_rules(spec: VLMSpec) -> list[Rule]:
    if spec.is_qwen_vl:
        return []  # the patch merger's rules are the ViT's (_qwen_vit_rules)
    m = "vision_projection.encoder."
    rules = [
        Rule(m + "linear_fc1.weight", (PROJ + "linear_1.weight",), split="column"),
        Rule(m + "linear_fc2.weight", (PROJ + "linear_2.weight",), split="row"),
    ]
    if spec.projector_bias:
        rules += [
            Rule(m + "linear_fc1.bias", (PROJ + "linear_1.bias",), split="column"),
            Rule(m + "linear_fc2.bias", (PROJ + "linear_2.bias",)),
        ]
    if spec.is_internvl:  # InternVL: a LayerNorm of the pixel-shuffled features first, fused into linear_fc1
        rules += [Rule(m + f"linear_fc1.layer_norm_{p}", (PROJ + f"layer_norm.{p}",)) for p in ("weight", "bias")]
    return rules


def _anyres_rules(spec: VLMSpec) -> list[Rule]:
    """LLaVA-NeXT / OneVision: the row-end embedding, replicated on the first stage."""
    return [Rule("image_newline", ("image_newline",))] if spec.is_anyres else []


def rules(spec: VLMSpec) -> list[Rule]:
    """Every tensor of the full Megatron LLaVAModel, with its HF source and layout rules."""
    return _language_rules(spec) + _vision_rules(spec) + _projector_rules(spec) + _anyres_rules(spec)


def extra_hf_names(spec: VLMSpec, hf_names) -> list[str]:
    """HF tensors that no rule consumes (they travel next to the Megatron weights)."""
    used = {h for r in rules(spec) for h in r.hf}
    if spec.tie_word_embeddings:
        used.add(hf_prefixes(spec)[2])
    return sorted(n for n in hf_names if n not in used)


# ---- HF <-> full Megatron tensors -------------------------------------------------------------------
def to_mcore(rule: Rule, hf: list[torch.Tensor], spec: VLMSpec) -> torch.Tensor:
    if rule.kind == "copy":
        return hf[0]
    if rule.kind == "class_token":
        return hf[0].reshape(1, 1, -1)
    if rule.kind == "unbatch":
        return hf[0].reshape(hf[0].shape[1:])
    if rule.kind == "vocab":
        t = hf[0]
        pad = spec.padded_vocab_size - t.shape[0]
        if pad < 0:
            raise ValueError(f"{rule.hf[0]} has {t.shape[0]} rows, more than the padded vocab {spec.padded_vocab_size}")
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    if rule.kind == "gated":
        return torch.cat(hf, dim=0)
    if rule.kind in ("qkv", "qkv_packed"):
        q, k, v = hf if rule.kind == "qkv" else hf[0].chunk(3, dim=0)
        g, hd = rule.groups, rule.head_dim
        per = rule.heads // g
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(g, per * hd, *tail), k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1)
        return fused.reshape(-1, *tail)
    raise ValueError(rule.kind)


def to_hf(rule: Rule, full: torch.Tensor, spec: VLMSpec) -> list[torch.Tensor]:
    if rule.kind == "copy":
        return [full]
    if rule.kind == "class_token":
        return [full.reshape(-1)]
    if rule.kind == "unbatch":
        return [full.reshape(1, *full.shape)]
    if rule.kind == "vocab":
        return [full[: spec.vocab_size]]
    if rule.kind == "gated":
        return list(full.chunk(2, dim=0))
    if rule.kind in ("qkv", "qkv_packed"):
        g, hd = rule.groups, rule.head_dim
        per = rule.heads // g
        tail = full.shape[1:]
        grouped = full.reshape(g, (per + 2) * hd, *tail)
        q, k, v = grouped.split([per * hd, hd, hd], dim=1)
        out = [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]
        return out if rule.kind == "qkv" else [torch.cat(out, dim=0)]
    raise ValueError(rule.kind)


# ---- tensor and expert parallel --------------------------------------------------------------------------
def split_size(rule: Rule, tp: int, etp: int | None = None) -> int:
    """The tensor-parallel size ``rule``'s tensor is split over: the expert TP size (default ``tp``) for an
    expert's linear, ``tp`` otherwise."""
    return (tp if etp is None else etp) if rule.expert is not None else tp


def ep_rank_of(rule: Rule, spec: VLMSpec, ep: int) -> int | None:
    """The expert-parallel rank holding ``rule``'s expert (experts are dealt out in contiguous blocks, as
    megatron-core does); None for a tensor every EP rank holds."""
    if rule.expert is None:
        return None
    return rule.expert // (spec.num_moe_experts // ep)



def tp_shard(rule: Rule, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if tp == 1 or rule.split == "replicated":
        return full
    if rule.split == "column":
        return full.chunk(tp, dim=0)[rank]
    if rule.split == "row":
        return full.chunk(tp, dim=1)[rank]
    if rule.split == "gated":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    raise ValueError(rule.split)


def tp_merge(rule: Rule, shards: list[torch.Tensor]) -> torch.Tensor:
    if len(shards) == 1 or rule.split == "replicated":
        return shards[0]
    if rule.split == "column":
        return torch.cat(shards, dim=0)
    if rule.split == "row":
        return torch.cat(shards, dim=1)
    if rule.split == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(rule.split)


# ---- pipeline parallel -------------------------------------------------------------------------------
_LAYER = re.compile(r"^language_model\.decoder\.layers\.(\d+)\.")


def stages_of(rule: Rule, spec: VLMSpec, layers_per_stage: list[int]) -> list[int]:
    """The PP stages that hold ``rule``'s tensor (the output layer of tied embeddings lives on the last)."""
    pp = len(layers_per_stage)
    if rule.placement == "first":
        stages = [0]
        if rule.kind == "vocab" and spec.tie_word_embeddings and pp > 1:
            stages.append(pp - 1)  # megatron keeps a copy of tied embeddings as the last stage's output layer
        return stages
    if rule.placement == "last":
        return [pp - 1]
    start = 0
    for s, n in enumerate(layers_per_stage):
        if start <= rule.layer < start + n:
            return [s]
        start += n
    raise ValueError(f"layer {rule.layer} is beyond {sum(layers_per_stage)} layers")


_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def local_name(rule: Rule, stage: int, layers_per_stage: list[int], experts_per_rank: int | None = None) -> str:
    """The name of ``rule``'s tensor in the state dict of pipeline stage ``stage`` (and, for an expert's tensor
    with ``experts_per_rank`` experts on each expert-parallel rank, under its local index there)."""
    if rule.placement == "layer":
        offset = sum(layers_per_stage[:stage])
        name = _LAYER.sub(f"language_model.decoder.layers.{rule.layer - offset}.", rule.mcore)
        if rule.expert is not None and experts_per_rank:
            name = _EXPERT.sub(f".local_experts.{rule.expert % experts_per_rank}.", name)
        return name
    if rule.kind == "vocab" and stage > 0 and rule.placement == "first":
        return "language_model.output_layer.weight"  # tied copy on the last stage
    return rule.mcore
