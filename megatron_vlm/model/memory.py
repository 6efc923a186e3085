"""Memory per GPU of a training run, estimated before launch: weights, gradients, optimizer state, activations.

Arithmetic on the spec (``vlm_spec.json``) and the run's settings, no torch: the launcher's ``--dry-run``
prints it (:func:`format_estimate`) and warns when it exceeds the device's memory or ``--gpu-memory-gb``.

**Parameters per rank** are counted tensor by tensor as megatron-core lays them out: the language model's
layers split over pipeline stages (``--pp-layers``), each linear's weight (and column-parallel bias) split over
TP, norms and row-parallel biases whole on every TP rank; the embedding (padded vocabulary x hidden) on the first
stage, the output layer on the last (and the embedding's copy there when tied and PP > 1, as megatron-core keeps
one for the shared weight); the vision encoder (its ``vision_feature_layer`` layers) and the projector on the
first stage, split over TP as the language model's layers are. :func:`language_mlp_params` and
:func:`language_mlp_activations` are the one place for a layer's MLP (dense SwiGLU now; experts and expert
parallelism extend them there).

**Bytes per parameter** follow megatron-core's mixed-precision training: weights in the compute dtype (bf16/fp16
2 B, fp32 4 B); for trainable parameters, fp32 gradient buffers (4 B, DDP's ``grad_reduce_in_fp32``) and the
optimizer's fp32 main parameters (4 B; none in fp32 training, where the parameters are the main ones) and Adam's
two moments (8 B). ``--dist-optim`` shards the optimizer state (main parameters and moments) over the DP ranks;
the gradient buffer stays whole (with context parallelism over DP x CP ranks). Frozen parameters cost their
weights only.

**Activations** are what autograd keeps for the backward pass of the micro batches in flight (1F1B: the first
pipeline stage holds ``min(PP, micro batches per step)`` of them; with virtual pipeline stages, megatron-core's
interleaved schedule runs chunk passes in the order :func:`interleaved_order` gives, and a rank holds the most at
the peak of that order: the first rank about ``1 + (PP - 1) / (PP x VPP)`` times the plain schedule's layers), per language-model layer in the compute dtype:
the inputs of the two norms and of the QKV and FC1 GEMMs (replicated over TP, split by ``--sequence-parallel``),
and Q/K/V, the attention output, FC1's output and the SwiGLU output (split over TP) -- Korthikanti et al.'s
accounting for a GQA/SwiGLU layer. Attention without a fused kernel (megatron's local layers) also keeps the
score and probability matrices (``2 x heads x S^2`` per sample, split over TP); Transformer Engine's fused
attention and torch's ``scaled_dot_product_attention`` (``--attention-backend sdpa``) keep none: the estimate
follows the attention the run's ranks will choose (:func:`attention_keeps_no_scores`).
``--recompute-granularity selective`` drops those matrices; ``full`` keeps only each
recomputed layer's input (plus one layer's activations while it is recomputed). The last stage adds the fp32
logits and their softmax (``2 x 4 B x S x padded vocab / TP``); a trained vision encoder adds its layers' share
for up to one image feature per position. With packing, a micro batch is one ``--packed-seq-length`` row.
Context parallelism (``--cp``) splits the language model's positions: each rank keeps ``S / CP`` of them (layers,
logits), and megatron's local attention also the whole sequence's keys and values and ``S / CP x S`` scores per
head; the projector runs on every image on every CP rank, and the vision encoder on the rank's share of the tiles
(``--vision-cp-split``, the default: ~1/CP of them; :mod:`megatron_vlm.model.vision_share`) or on all of them. The
distributed optimizer shards over DP x CP ranks (megatron-core's group).

Not counted: the CUDA context, NCCL and cuBLAS workspaces and the allocator's fragmentation (typically 1-3 GB on
a GPU): leave that margin. The estimate of weights, gradients and optimizer state is checked against what the
built model and optimizer allocate (tests); activations are the formula's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_vlm.model.vision_share import tiles_per_rank

GIB = 2 ** 30


@dataclass(frozen=True)
class Layout:
    """The settings the estimate reads (a subset of the training config)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: the language model's positions of a sequence split over CP ranks
    ep: int = 1  # expert parallelism of a mixture-of-experts LM
    etp: int | None = None  # expert tensor parallelism (None: tp)
    pp_layers: tuple[int, ...] | None = None
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank: the interleaved schedule
    micro_batch_size: int = 1
    grad_accum: int = 1
    seq_length: int = 2048  # positions of one micro batch row the language model sees (packed: the pack)
    precision: str = "bf16"
    dist_optim: bool = False
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    fused_attention: bool = True  # Transformer Engine's attention and sdpa keep no S x S matrices
    trained: tuple[bool, bool, bool] = (False, True, True)  # vision encoder, projector, language model
    vision_cp_split: bool = True  # with cp > 1: each CP rank encodes ~1/CP of the tiles (model.vision_share)

    @classmethod
    def of_config(cls, cfg, fused_attention: bool | None = None, spec=None) -> "Layout":
        """The run's layout (``spec``: the model, which the number of virtual pipeline stages depends on)."""
        parts = cfg.trained_parts
        if fused_attention is None:
            fused_attention = attention_keeps_no_scores(cfg)
        vpp = cfg.vpp_size(spec) if spec is not None and getattr(cfg, "virtual_pipeline", False) else 1
        return cls(tp=cfg.tp, pp=cfg.pp, dp=max(cfg.dp, 1), cp=cfg.cp, ep=cfg.ep, etp=cfg.etp,
                   pp_layers=tuple(cfg.pp_layers) if cfg.pp_layers else None, vpp=vpp,
                   micro_batch_size=cfg.micro_batch_size or 1, grad_accum=max(cfg.grad_accum, 1),
                   seq_length=cfg.lm_seq_length, precision=cfg.precision or "bf16", dist_optim=bool(cfg.dist_optim),
                   sequence_parallel=bool(cfg.sequence_parallel), recompute_granularity=cfg.recompute_granularity,
                   recompute_method=cfg.recompute_method, recompute_num_layers=cfg.recompute_num_layers,
                   fused_attention=fused_attention,
                   trained=(parts["vision"], parts["projector"], parts["language"]),
                   vision_cp_split=bool(getattr(cfg, "vision_cp_split", True)))

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The data-parallel size of the experts: a stage's TP x CP x DP ranks over EP x ETP (what the distributed
        optimizer shards expert state over)."""
        return max(1, self.tp * self.cp * self.dp // (self.ep * self.expert_tp))

    @property
    def optimizer_shards(self) -> int:
        """The ranks the distributed optimizer shards dense state over: megatron-core's DP x CP group."""
        return self.dp * self.cp


# ---- parameters ------------------------------------------------------------------------------------------
@dataclass
class Params:
    """Parameter counts of one rank, by part."""

    vision: int = 0
    projector: int = 0
    language: int = 0  # the experts of a mixture-of-experts LM included
    experts: int = 0  # of ``language``: the experts this rank holds (their optimizer state shards apart)

    @property
    def total(self) -> int:
        return self.vision + self.projector + self.language

    def trainable(self, trained: tuple[bool, bool, bool]) -> int:
        return sum(n for n, t in zip((self.vision, self.projector, self.language), trained) if t)


def attention_keeps_no_scores(cfg, te_imports: bool | None = None) -> bool:
    """Whether the run's core attention keeps no ``S x S`` score matrices (:attr:`Layout.fused_attention`): the
    layers and attention its ranks will choose (:func:`megatron_vlm.model.layer_impl.planned`; ``te_imports``: whether
    Transformer Engine imports where it trains, None: not asked)."""
    from megatron_vlm.model import layer_impl

    impl, attention = layer_impl.planned(cfg.transformer_impl, cfg.attention_backend, cfg.device, cfg.cp, te_imports)
    return layer_impl.keeps_no_scores(impl, attention)


def language_attention_params(spec, tp: int) -> int:
    """One language layer's attention on one TP rank: QKV (+ bias), output projection, q/k norms, input norm."""
    h, d = spec.hidden_size, spec.kv_channels
    qkv_out = (spec.num_attention_heads + 2 * spec.num_query_groups) * d
    n = h * qkv_out // tp + (qkv_out // tp if spec.qkv_bias else 0)
    n += spec.num_attention_heads * d * h // tp
    n += 2 * d if spec.qk_layernorm else 0
    return n + h  # input RMSNorm


def language_mlp_params(spec, tp: int, moe: bool = False, ep: int = 1, etp: int | None = None) -> int:
    """One language layer's MLP on one TP rank (SwiGLU: FC1 holds gate and up; no biases) and its pre-norm; for a
    mixture-of-experts layer (``moe``) the router (replicated) and this rank's experts (``experts / ep`` of them,
    each split over ``etp``, default ``tp``): see :func:`language_expert_params`."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    if moe:
        return spec.num_moe_experts * h + h + language_expert_params(spec, tp, ep, etp)
    return h * 2 * f // tp + f * h // tp + h


def language_expert_params(spec, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """The experts one rank holds in one mixture-of-experts layer."""
    h, f, t = spec.hidden_size, spec.moe_ffn_hidden_size, tp if etp is None else etp
    return spec.num_moe_experts // ep * (3 * h * f // t)


def language_mlp_activations(spec, layout: Layout, moe: bool = False) -> float:
    """Elements per position that a language layer's MLP keeps for its backward pass on one TP rank, beyond its
    input (counted with the layer's): FC1's output (gate and up) and the SwiGLU output. A mixture-of-experts layer
    keeps them for each of a token's top-k experts (a balanced router sends a rank as many tokens as it has), the
    permuted inputs and the router's probabilities."""
    if moe:
        f, k = spec.moe_ffn_hidden_size, spec.moe_router_topk
        return k * (3 * f / layout.expert_tp + spec.hidden_size) + spec.num_moe_experts
    f = spec.ffn_hidden_size
    return (2 * f + f) / layout.tp


def language_layer_params(spec, tp: int, moe: bool = False, ep: int = 1, etp: int | None = None) -> int:
    return language_attention_params(spec, tp) + language_mlp_params(spec, tp, moe, ep, etp)


def stage_layers(spec, layout: Layout, stage: int) -> list[int]:
    """The language layers (global indices) of pipeline stage ``stage`` (with virtual pipeline stages, those of all
    its model chunks: not contiguous)."""
    from megatron_vlm.model.pipeline_layout import chunk_layer_ranges

    return [i for a, b in chunk_layer_ranges(layers_per_stage(spec, layout), layout.vpp)[stage] for i in range(a, b)]


def qwen_vit_params(spec, tp: int) -> int:
    """Qwen2.5-VL's ViT (:mod:`megatron_vlm.model.qwen_vit`) on one TP rank: every layer (q/k/v and output biases,
    SwiGLU MLP with biases, two RMSNorms) and the Conv3d patches, no position embedding (2-D rotary). Qwen3-VL's:
    a GELU MLP (not gated) and LayerNorms (a bias each), the Conv3d's bias and the learned position table."""
    vh, vf = spec.vision_hidden_size, spec.vision_ffn_hidden_size
    layer = 3 * vh * vh // tp + 3 * vh // tp + vh * vh // tp + vh  # QKV + bias, proj + bias
    if spec.is_qwen3_vl:
        layer += vh * vf // tp + vf // tp + vf * vh // tp + vh + 4 * vh  # fc1 + bias, fc2 + bias, two LayerNorms
        return spec.vision_num_layers * layer + 3 * spec.temporal_patch_size * spec.patch_size ** 2 * vh + vh + \
            spec.vision_num_position_embeddings * vh
    layer += 2 * vh * vf // tp + 2 * vf // tp + vf * vh // tp + vh  # gate/up + biases, down + bias
    layer += 2 * vh  # two RMSNorms
    return spec.vision_num_layers * layer + 3 * spec.temporal_patch_size * spec.patch_size ** 2 * vh


def vision_params(spec, tp: int) -> int:
    """The ViT as megatron builds it (``vision_feature_layer`` layers) on one TP rank."""
    if spec.is_qwen_vl:
        return qwen_vit_params(spec, tp)
    vh, vf = spec.vision_hidden_size, spec.vision_ffn_hidden_size
    qkv_bias = 3 * vh // tp if spec.vision_qkv_bias else 0
    layer = 3 * vh * vh // tp + qkv_bias + vh * vh // tp + vh  # QKV (+ bias), proj (+ bias)
    layer += vh * vf // tp + vf // tp + vf * vh // tp + vh  # FC1 (+ bias), FC2 (+ bias)
    layer += 2 * (2 if spec.vision_normalization == "LayerNorm" else 1) * vh  # two norms (weight, LayerNorm's bias)
    if spec.vision_family == "internvit":
        layer += 2 * vh + (2 * vh // tp if spec.vision_qk_layernorm else 0)  # layer scales; the 6B's q/k norms
    patches = (spec.image_size // spec.patch_size) ** 2
    clip = spec.vision_family == "clip"
    n = spec.vit_num_layers * layer
    n += 3 * spec.patch_size ** 2 * vh + (0 if clip else vh)  # patch convolution (SigLIP's, InternViT's: a bias)
    n += (patches + (1 if spec.has_class_token else 0)) * vh  # position embedding
    if spec.has_class_token:
        n += vh + (2 * vh if clip else 0)  # class token, CLIP's ln_pre
    return n  # (SigLIP's post_layernorm is not in megatron's ViT: LLaVA reads features before it)


def projector_params(spec, tp: int) -> int:
    vh, h = spec.projector_input_size, spec.hidden_size
    if spec.is_qwen3_vl:  # the merger and each DeepStack merger: a LayerNorm (after the shuffle for DeepStack's)
        mlp = vh * vh // tp + vh // tp + vh * h // tp + h
        return 2 * spec.vision_hidden_size + mlp + spec.deepstack_layers * (2 * vh + mlp)
    if spec.is_qwen_vl:  # the patch merger: ln_q, merged width -> merged width -> hidden, biases
        return spec.vision_hidden_size + vh * vh // tp + vh // tp + vh * h // tp + h
    bias = spec.projector_bias
    n = vh * h // tp + (h // tp if bias else 0) + h * h // tp + (h if bias else 0)
    n += 2 * vh if spec.is_internvl else 0  # InternVL's LayerNorm before linear_fc1
    return n + (h if spec.is_anyres else 0)  # image_newline


def layers_per_stage(spec, layout: Layout) -> list[int]:
    if layout.pp_layers:
        return list(layout.pp_layers)
    return [spec.num_layers // layout.pp] * layout.pp if spec.num_layers % layout.pp == 0 else \
        [math.ceil(spec.num_layers / layout.pp)] * layout.pp


def stage_params(spec, layout: Layout, stage: int) -> Params:
    tp, pp = layout.tp, layout.pp
    p = Params()
    moe = set(spec.moe_layers)
    layers = stage_layers(spec, layout, stage)
    p.language = sum(language_layer_params(spec, tp, i in moe, layout.ep, layout.etp) for i in layers)
    p.experts = sum(language_expert_params(spec, tp, layout.ep, layout.etp) for i in layers if i in moe)
    emb = spec.padded_vocab_size * spec.hidden_size // tp
    if stage == 0:
        p.language += emb
        p.vision = vision_params(spec, tp)
        p.projector = projector_params(spec, tp)
    if stage == pp - 1:
        p.language += spec.hidden_size  # final norm
        if not spec.tie_word_embeddings or pp > 1:
            p.language += emb  # the output layer (tied and PP > 1: the embedding's copy on the last stage)
    return p


# ---- the estimate ----------------------------------------------------------------------------------------
@dataclass
class StageEstimate:
    stage: int
    params: Params
    trainable: int
    weights: int  # bytes
    gradients: int
    optimizer: int
    activations: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def _layer_activation_bytes(spec, layout: Layout, s: int, b: int, moe: bool = False) -> int:
    """What one language layer keeps for its backward pass, for ``b`` rows of ``s`` positions, on one TP rank
    (with context parallelism: its ``s / cp`` positions; megatron's local attention also keeps the whole
    sequence's keys and values, all-gathered, and ``s / cp x s`` scores per head)."""
    t, e, cp = layout.tp, layout.dtype_bytes, layout.cp
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.kv_channels
    qkv = (spec.num_attention_heads + 2 * spec.num_query_groups) * d
    replicated = 4 * h  # inputs of the two norms, of QKV and of FC1
    split = qkv + spec.num_attention_heads * d  # Q/K/V, attention output
    per_pos = (replicated / t if layout.sequence_parallel else replicated) + split / t
    per_pos += language_mlp_activations(spec, layout, moe)
    mine = s // cp
    out = mine * b * per_pos * e
    if not layout.fused_attention:
        if layout.recompute_granularity != "selective":
            out += 2 * spec.num_attention_heads / t * mine * s * b * e  # scores and probabilities
        if cp > 1:
            out += 2 * spec.num_query_groups * d / t * s * b * e  # the gathered keys and values
    return int(out)


def _activation_bytes(spec, layout: Layout, stage: int) -> tuple[int, str]:
    s, b, t, e = layout.seq_length, layout.micro_batch_size, layout.tp, layout.dtype_bytes
    n_layers = layers_per_stage(spec, layout)[stage]
    moe = set(spec.moe_layers)
    kinds = [i in moe for i in stage_layers(spec, layout, stage)] or [False]
    layer = sum(_layer_activation_bytes(spec, layout, s, b, k) for k in kinds) // len(kinds)  # a mean layer
    mine = s // layout.cp  # the language model's positions on this rank
    layer_input = mine * b * spec.hidden_size * e // (t if layout.sequence_parallel else 1)
    vision_trains = layout.trained[0]  # a frozen language model still keeps its activations: stage 1's gradient
    # reaches the projector through it

    def layers_part(n: int) -> tuple[int, str]:
        """What ``n`` layers keep for one micro batch (recomputation per pipeline stage or model chunk)."""
        if layout.recompute_granularity == "full":
            k = min(layout.recompute_num_layers or 1, n)
            if (layout.recompute_method or "uniform") == "uniform":
                kept = n * layer_input + k * layer  # chunks of k layers keep their input; one chunk is redone
            else:  # block: the first k layers keep their inputs, the rest everything
                kept = k * layer_input + (n - k) * layer + (layer if k else 0)
            return kept, f"full recompute ({layout.recompute_method or 'uniform'}, {k} layer(s))"
        return n * layer, "selective recompute" if layout.recompute_granularity == "selective" else "no recompute"

    logits = 2 * 4 * mine * b * spec.padded_vocab_size // t  # fp32 logits and their softmax
    # the projector runs on every image before the CP split; the vision encoder on this rank's share of the tiles
    # (--vision-cp-split: ~1/CP of them), or on all of them
    first = s * b * (spec.vision_hidden_size + 2 * spec.hidden_size) * e  # projector input, FC1, GELU
    vision_positions = tiles_per_rank(s * b, layout.cp, layout.vision_cp_split and not spec.is_qwen_vl)  # Qwen: whole
    if vision_trains:
        vlayer = vision_positions * (4 * spec.vision_hidden_size + 3 * spec.vision_hidden_size
                                     + 2 * spec.vision_ffn_hidden_size // t) * e
        first += spec.vit_num_layers * vlayer
    stage_input = mine * b * spec.hidden_size * e  # the embedding output / the stage's input
    share = (f", the vision encoder on {vision_positions} of {s * b} tile positions" if vision_trains and stage == 0
             else "")
    split = f" ({mine} on this rank, CP={layout.cp}{share})" if layout.cp > 1 else ""
    if layout.vpp > 1 and layout.pp > 1:
        vpp = layout.vpp
        kept, what = layers_part(n_layers // vpp)
        chunk = [kept + stage_input + (first if stage == 0 and c == 0 else 0)
                 + (logits if stage == layout.pp - 1 and c == vpp - 1 else 0) for c in range(vpp)]
        peak, passes = interleaved_peak(layout.pp, vpp, layout.grad_accum, stage, chunk)
        return int(peak), (f"micro batch {b} x {s} positions{split}, up to {passes} chunk passes in flight "
                           f"({vpp} chunks of {n_layers // vpp} layer(s): the interleaved schedule), {what}")
    in_flight = min(layout.pp - stage, layout.grad_accum) if layout.pp > 1 else 1
    per_mb, what = layers_part(n_layers)
    per_mb += stage_input
    if stage == layout.pp - 1:
        per_mb += logits
    if stage == 0:
        per_mb += first
    return int(per_mb * in_flight), f"micro batch {b} x {s} positions{split}, {in_flight} in flight, {what}"


def interleaved_order(pp: int, vpp: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """The passes pipeline rank ``rank`` runs in one step of megatron-core's interleaved 1F1B schedule, in order:
    ``("F" or "B", micro batch, chunk)``. Micro batches go in groups of ``pp`` (megatron-core's default
    ``microbatch_group_size_per_vp_stage``), through every chunk in turn; backward passes take the chunks in reverse;
    a rank runs ``2 (pp - rank - 1) + (vpp - 1) pp`` forward passes before its first backward (the warm-up), then
    alternates one forward and one backward, then finishes the backward passes."""
    table = []
    for start in range(0, micro_batches, pp):
        group = range(start, micro_batches if start + pp >= micro_batches else start + pp)
        table += [(mb, c) for c in range(vpp) for mb in group]
    total = len(table)
    warmup = min(total, 2 * (pp - rank - 1) + (vpp - 1) * pp)
    order = [("F", *table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(("F", *table[warmup + k]))
        order.append(("B", table[k][0], vpp - 1 - table[k][1]))
    order += [("B", table[k][0], vpp - 1 - table[k][1]) for k in range(total - warmup, total)]
    return order


def interleaved_peak(pp: int, vpp: int, micro_batches: int, rank: int, chunk_bytes: list[int]) -> tuple[int, int]:
    """(bytes, passes): the most activation memory rank ``rank`` holds at once in :func:`interleaved_order`, each
    forward pass of chunk ``c`` keeping ``chunk_bytes[c]`` until its backward pass, and the passes then in flight."""
    held = peak = passes = 0
    live: set = set()
    for kind, mb, c in interleaved_order(pp, vpp, micro_batches, rank):
        if kind == "F":
            live.add((mb, c))
            held += chunk_bytes[c]
            if held > peak:
                peak, passes = held, len(live)
        else:
            live.discard((mb, c))
            held -= chunk_bytes[c]
    return peak, passes


def estimate(spec, layout: Layout) -> list[StageEstimate]:
    """The estimate of every pipeline stage (each TP rank of a stage holds the same)."""
    out = []
    e = layout.dtype_bytes
    for stage in range(layout.pp):
        p = stage_params(spec, layout, stage)
        trainable = p.trainable(layout.trained)
        main = 0 if layout.precision == "fp32" else 4  # fp32 main parameters (fp32 training: the parameters)
        experts = p.experts if layout.trained[2] else 0
        dense, opt_experts = (trainable - experts) * (main + 8), experts * (main + 8)
        notes = []
        if layout.dist_optim:
            dense, opt_experts = -(-dense // layout.optimizer_shards), -(-opt_experts // layout.expert_dp)
            notes.append(f"optimizer state sharded over {_shards(layout)}"
                         + (f" (experts' over their DP={layout.expert_dp})" if experts else ""))
        opt = dense + opt_experts
        act, what = _activation_bytes(spec, layout, stage)
        notes.append(what)
        out.append(StageEstimate(stage, p, trainable, p.total * e, trainable * 4, opt, act, notes))
    return out


def _shards(layout: Layout) -> str:
    return f"DP={layout.dp}" if layout.cp == 1 else f"DP x CP={layout.optimizer_shards}"


def format_estimate(stages: list[StageEstimate], layout: Layout, limit_gib: float | None, limit_source: str) -> list[str]:
    """Lines for ``--dry-run``: the stage that needs the most, by part, and the verdict against ``limit_gib``."""
    worst = max(stages, key=lambda s: s.total)

    def gib(x):
        return f"{x / GIB:8.2f} GiB"

    def count(n):
        return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"

    dtype = layout.precision
    lines = [
        f"memory per GPU (estimate; pipeline stage {worst.stage} of {layout.pp} needs the most; TP={layout.tp} "
        f"PP={layout.pp}" + (f" VPP={layout.vpp}" if layout.vpp > 1 else "")
        + (f" CP={layout.cp}" if layout.cp > 1 else "") + f" DP={layout.dp}"
        + (f" EP={layout.ep} ETP={layout.expert_tp}" if worst.params.experts else "")
        + ")",
        f"  weights          {gib(worst.weights)}  ({count(worst.params.total)} parameters on this rank, {dtype})",
        f"  gradients        {gib(worst.gradients)}  (fp32 buffers of the {count(worst.trainable)} trainable)",
        f"  optimizer state  {gib(worst.optimizer)}  ("
        + ("Adam moments" if layout.precision == "fp32" else "fp32 main parameters + Adam moments")
        + (f", sharded over {_shards(layout)}" + (f" (experts: {layout.expert_dp})" if worst.params.experts else "")
           + " by --dist-optim" if layout.dist_optim else ", whole on every DP rank") + ")",
        f"  activations      {gib(worst.activations)}  ({worst.notes[-1]})",
        f"  total            {gib(worst.total)}"
        + (f"  of {limit_gib:g} GiB ({limit_source})" if limit_gib else ""),
    ]
    if len(stages) > 1:
        lines.append("  per stage: " + ", ".join(f"{s.stage}: {s.total / GIB:.1f} GiB" for s in stages))
    lines.append("  (not counted: CUDA context, NCCL/cuBLAS workspaces and fragmentation, typically 1-3 GB)")
    return lines


def over_limit(stages: list[StageEstimate], limit_gib: float | None) -> bool:
    return bool(limit_gib) and max(s.total for s in stages) > limit_gib * GIB
