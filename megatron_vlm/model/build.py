"""Build this rank's megatron-core ``LLaVAModel`` from a :class:`~megatron_vlm.model.spec.VLMSpec`.

Owns: the three TransformerConfigs (language, vision, projector), the layer specs (Transformer Engine or
megatron-core's local layers, as :mod:`megatron_vlm.model.layer_impl` chose: local layers hold no TE module even where
TE is installed; TE layers get ``--deterministic``'s environment and, on CPU, the construction shim of
:mod:`megatron_vlm.runtime.cpu_compat`; FP8 on the language model only, with the recipe checked against the GPU
by :mod:`megatron_vlm.model.fp8`), the pipeline stage placement (vision encoder
and projector on the first stage) and the fixes that make megatron's LLaVA numerically equal to HF LLaVA
(bidirectional ViT attention, ViT cut at ``vision_feature_layer``, no SigLIP post-layernorm, model_type
for the PP schedules). Anyres models (LLaVA-NeXT, OneVision) get
:class:`~megatron_vlm.model.anyres_model.AnyresLLaVAModel`; InternVL gets megatron-core's ``LLaVAModel`` with its pixel
shuffle and InternViT's layers and projector (:mod:`megatron_vlm.model.internvit`); Qwen2.5-VL gets
:class:`~megatron_vlm.model.qwen_vl.QwenVLModel` (its configs here: the ViT's, the merger's, the LM's with
``mrope_section``; local layers only so far, :data:`QWEN_VL_NOT_YET`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_vlm.model.layer_impl import LOCAL_TO_TE_KEYS
from megatron_vlm.model.spec import QWEN_VL_ARCHS, VLMSpec
from megatron_vlm.runtime import mcore_patches


def have_te() -> bool:
    from megatron_vlm.model.layer_impl import te_status

    return te_status()[0]


@dataclass
class ModelOptions:
    """Run-time choices that are not part of the architecture."""

    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism of the language model (megatron_vlm.model.context_parallel)
    cp_comm_type: str | None = None  # Transformer Engine's CP attention: p2p (None), a2a or allgather
    vision_cp_split: bool = True  # with cp > 1: the CP ranks share the vision encoder's tiles (model.vision_share)
    pp_layers: list[int] | None = None  # explicit (uneven) language layers per PP stage
    vpp: int = 1  # virtual pipeline stages (model chunks) per PP rank: megatron-core's interleaved schedule
    seq_length: int = 2048  # combined text + image tokens
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False
    use_te: bool = False  # Transformer Engine layers (--transformer-impl transformer_engine)
    # --attention-backend (megatron_vlm.model.layer_impl.choose_attention): auto, flash, fused, unfused with TE layers;
    # local or sdpa (megatron_vlm.model.sdpa_attention) with local layers; auto resolved for the device when built
    attention_backend: str = "auto"
    fp8: bool = False
    fp8_recipe: str = "delayed"  # megatron-core Fp8Recipe name (see megatron_vlm.model.fp8.RECIPES)
    fp8_format: str = "hybrid"  # e4m3 | hybrid
    init_method_std: float = 0.02
    deterministic: bool = False
    recompute_granularity: str | None = None  # None, "full" or "selective" (language model)
    recompute_method: str | None = None  # "uniform" or "block" with full recompute
    recompute_num_layers: int | None = None
    sequence_parallel: bool = False
    per_token_loss: bool = False  # training: loss summed per token, normalised over the global batch
    perform_initialization: bool = True  # False when weights are loaded right after (conversion)
    fusions: object = None  # megatron_vlm.model.fusions.Fusions (training); None: every fusion off
    # mixture of experts (read only for an MoE spec; Megatron-LM's flags and defaults, see MoEOptions)
    ep: int = 1  # expert-model-parallel size
    etp: int | None = None  # expert-tensor-parallel size (None: tp, as megatron-core)
    moe: "MoEOptions | None" = None


@dataclass
class MoEOptions:
    """Run-time choices of a mixture-of-experts language model (Megatron-LM's ``--moe-*`` flags). The defaults
    compute what HF's model computes: every token reaches its top-k experts (no capacity, no dropping)."""

    aux_loss_coeff: float | None = None  # None: the spec's (HF router_aux_loss_coef)
    # hf (transformers' load_balancing_loss_func, megatron_vlm.training.moe.hf_objective) | aux_loss | seq_aux_loss |
    # global_aux_loss (megatron-core's) | none
    load_balancing_type: str = "hf"
    z_loss_coeff: float | None = None
    token_dispatcher_type: str = "allgather"  # allgather | alltoall
    expert_capacity_factor: float | None = None  # None: no token dropping
    pad_expert_input_to_capacity: bool = False
    grouped_gemm: bool | None = None  # None: on with Transformer Engine layers (TEGroupedMLP), off for local layers
    router_dtype: str | None = None  # None: the parameters' dtype; fp32 / fp64 for the gating GEMM and softmax
    per_layer_logging: bool = False


def _activation(name: str):
    from megatron.core.activations import quick_gelu

    return {
        "quick_gelu": quick_gelu,
        "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
        "gelu": F.gelu,
        "silu": F.silu,
    }[name]


def _common(opts: ModelOptions, part: str) -> dict:
    from megatron_vlm.model.fusions import Fusions

    return dict(
        tensor_model_parallel_size=opts.tp,
        params_dtype=opts.params_dtype,
        bf16=opts.bf16,
        fp16=opts.fp16,
        pipeline_dtype=opts.params_dtype,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **(opts.fusions or Fusions()).config_kwargs(part),
        **_te_attention_backend(opts),
        init_method_std=opts.init_method_std,
        deterministic_mode=opts.deterministic,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=opts.perform_initialization,
    )


def _te_attention_backend(opts: ModelOptions) -> dict:
    """The TransformerConfig's ``attention_backend`` with Transformer Engine layers and an explicit kernel (flash,
    fused or unfused; megatron-core's language model sets TE's ``NVTE_*_ATTN`` switches from it). Otherwise its
    default (auto): local and sdpa attention are layer-spec choices, and megatron-core's ``local`` would switch off
    TE's kernels for every later model of the process."""
    if not opts.use_te or opts.attention_backend in (None, "auto"):
        return {}
    from megatron.core.transformer.enums import AttnBackend

    return dict(attention_backend=AttnBackend[opts.attention_backend])


def aux_loss_coefficient(spec: VLMSpec, moe: MoEOptions) -> float:
    """The load-balancing coefficient of a run: ``--moe-aux-loss-coeff``, else the HF config's
    ``router_aux_loss_coef`` (the spec's)."""
    return spec.moe_aux_loss_coeff if moe.aux_loss_coeff is None else moe.aux_loss_coeff


def _moe_config(spec: VLMSpec, opts: ModelOptions) -> dict:
    """TransformerConfig MoE fields: HF's routing (softmax over all experts, top-k, renormalised when
    ``norm_topk_prob``: megatron's top-k of the logits then softmax over them is the same distribution; without
    renormalisation, megatron's pre-softmax), the per-layer MoE pattern (``moe_layer_freq``) and expert
    parallelism. The ``hf`` load-balancing objective is megatron-vlm's
    (:mod:`megatron_vlm.training.moe.hf_objective`): megatron-core's routers then compute no loss of their own."""
    if not spec.is_moe:
        return {}
    moe = opts.moe or MoEOptions()
    own = moe.load_balancing_type == "hf"
    grouped = opts.use_te if moe.grouped_gemm is None else moe.grouped_gemm
    if grouped and not opts.use_te:
        raise ValueError("--moe-grouped-gemm needs Transformer Engine layers (TEGroupedMLP); drop it with "
                         "--transformer-impl local")
    return dict(
        num_moe_experts=spec.num_moe_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        # every layer MoE: megatron's int form, whose checkpoints stack the layers as Megatron-LM's do (a list
        # pattern saves each layer under its own key)
        moe_layer_freq=1 if len(spec.moe_layers) == spec.num_layers else list(spec.moe_layer_pattern),
        moe_aux_loss_coeff=0.0 if own else aux_loss_coefficient(spec, moe),
        moe_router_load_balancing_type="none" if own else moe.load_balancing_type,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_token_dispatcher_type=moe.token_dispatcher_type,
        moe_expert_capacity_factor=moe.expert_capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_expert_input_to_capacity,
        moe_grouped_gemm=grouped,
        moe_router_dtype=moe.router_dtype,
        moe_per_layer_logging=moe.per_layer_logging,
        expert_model_parallel_size=opts.ep,
        expert_tensor_parallel_size=opts.etp if opts.etp is not None else opts.tp,
    )


def language_config(spec: VLMSpec, opts: ModelOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers = spec.check_parallelism(opts.tp, opts.pp, opts.pp_layers, opts.ep, opts.etp)
    kw = _common(opts, "language")
    if opts.pp > 1 and len(set(layers)) > 1:
        kw.update(num_layers_in_first_pipeline_stage=layers[0], num_layers_in_last_pipeline_stage=layers[-1])
        if opts.vpp > 1 and opts.pp == 2:  # megatron-core's interleaved offset divides by the middle stages: at PP2
            kw.pop("num_layers_in_last_pipeline_stage")  # the last stage is the one "middle" stage, same layers
    kw.update(_interleaving(layers, opts))
    if opts.fp8:  # the language model only: the ViT's 577 (CLIP-L/14-336) tokens are no multiple of 16
        kw.update(fp8=opts.fp8_format, fp8_recipe=opts.fp8_recipe)
        if opts.fp8_recipe == "delayed":
            kw.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        pipeline_model_parallel_size=opts.pp,
        sequence_parallel=opts.sequence_parallel,
        calculate_per_token_loss=opts.per_token_loss,
        **_context_parallel(opts),
        **_recompute(opts),
        **_moe_config(spec, opts),
        **kw,
    )


def _context_parallel(opts: ModelOptions) -> dict:
    """TransformerConfig context-parallel fields of the language model (none at CP1: its defaults)."""
    if opts.cp == 1:
        return {}
    return dict(context_parallel_size=opts.cp, cp_comm_type=opts.cp_comm_type or "p2p")


def _interleaving(layers: list[int], opts: ModelOptions) -> dict:
    """TransformerConfig fields of virtual pipeline parallelism (``opts.vpp`` chunks per rank, checked against the
    layers of every rank): megatron-core's interleaved schedule, with Megatron-LM's default of overlapping its
    point-to-point communication (unbatched sends and receives; Megatron-LM needs that overlap at PP2, where the
    next and the previous rank are one)."""
    from megatron_vlm.model.pipeline_layout import vpp_size

    if opts.vpp == 1:
        return {}
    vpp_size(layers, virtual_stages_per_rank=opts.vpp, uneven=len(set(layers)) > 1)
    return dict(virtual_pipeline_model_parallel_size=opts.vpp, overlap_p2p_comm=True, batch_p2p_comm=False)


def _recompute(opts: ModelOptions) -> dict:
    """TransformerConfig recompute fields (Megatron-LM's --recompute-* flags; full defaults: uniform, 1)."""
    if opts.recompute_granularity is None:
        return {}
    if opts.recompute_granularity == "selective":
        return dict(recompute_granularity="selective")
    return dict(recompute_granularity="full", recompute_method=opts.recompute_method or "uniform",
                recompute_num_layers=opts.recompute_num_layers or 1)


def vision_config(spec: VLMSpec, opts: ModelOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = _common(opts, "vision")
    cfg = TransformerConfig(
        num_layers=spec.vit_num_layers,
        hidden_size=spec.vision_hidden_size,
        ffn_hidden_size=spec.vision_ffn_hidden_size,
        num_attention_heads=spec.vision_num_attention_heads,
        num_query_groups=spec.vision_num_attention_heads,
        kv_channels=spec.vision_hidden_size // spec.vision_num_attention_heads,
        normalization=spec.vision_normalization,
        layernorm_epsilon=spec.vision_norm_epsilon,
        add_bias_linear=True,
        add_qkv_bias=spec.vision_qkv_bias,
        qk_layernorm=spec.vision_qk_layernorm,
        gated_linear_unit=False,
        activation_func=_activation(spec.vision_activation),
        # The ViT lives entirely on the first pipeline stage: with pp>1 here it would build only a part.
        pipeline_model_parallel_size=1,
        **kw,
    )
    cfg.vision_model_type = spec.vision_family
    return cfg


def projection_config(spec: VLMSpec, opts: ModelOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = _common(opts, "projector")
    return TransformerConfig(
        num_layers=1,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,  # unused by the MLP; must divide by tp
        add_bias_linear=spec.projector_bias,
        gated_linear_unit=False,
        activation_func=_activation(spec.projector_activation),
        pipeline_model_parallel_size=1,
        **kw,
    )


class LocalNorm:
    """The language model's norm with local layers: megatron-core's ``WrappedTorchNorm`` (torch's RMSNorm), which
    also runs under sequence parallelism. ``WrappedTorchNorm`` refuses sequence parallelism only because nothing
    marks its weight for the tensor-parallel gradient all-reduce that a norm applied to a sequence shard needs
    (megatron-core's ``finalize_model_grads`` sums the gradients of parameters with ``sequence_parallel=True``,
    which its fused norms set); this builds the same torch norm and marks its parameters so."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


LOCAL_CORE_ATTENTION = "llava-local-core-attention"


def _llava_accepts_local_sequence_parallel(active: bool, core_attention=None):
    """megatron-core's ``LLaVAModel`` asserts, when it is built with sequence or context parallelism, that the
    language layer spec's attention is Transformer Engine's. megatron's local ``DotProductAttention`` runs under
    sequence parallelism as it does in megatron's GPT models (the column-parallel QKV gathers the sequence, the
    row-parallel projection scatters it), and :class:`~megatron_vlm.model.cp_attention.ContextParallelAttention`
    (``core_attention``) under context parallelism, so while ``active`` the check accepts the spec's local core
    attention; the check is the only thing that changes (registry entry ``llava-local-core-attention``, for the
    time of the ``with`` block)."""
    if not active:
        return contextlib.nullcontext()
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return mcore_patches.applied(LOCAL_CORE_ATTENTION, core_attention=core_attention or DotProductAttention)


@mcore_patches.implements(LOCAL_CORE_ATTENTION)
def _local_core_attention(originals: dict, core_attention) -> dict:
    llava = "megatron.core.models.multimodal.llava_model"
    return {f"{llava}:TEDotProductAttention": core_attention, f"{llava}:HAVE_TE": True}


def layer_specs(use_te: bool, qk_layernorm: bool = False, cp: int = 1, attention: str = "local"):
    """(language, vision, projector) layer specs; the ViT attention is bidirectional like CLIP/SigLIP.

    The local language layers use megatron-core's WrappedTorchNorm (torch RMSNorm): its local spec picks apex's
    FusedLayerNorm whenever apex imports, and that refuses RMSNorm. ``qk_layernorm`` (Qwen3): megatron-core's
    per-head RMSNorm of queries and keys (``q_layernorm``/``k_layernorm``, over ``kv_channels``), as HF's
    ``q_norm``/``k_norm``. The language spec is a dense layer's; :func:`moe_layer_spec` makes an MoE layer's.
    ``cp`` > 1 with local layers: the language attention is
    :class:`~megatron_vlm.model.cp_attention.ContextParallelAttention` (TE's attention does CP itself).
    ``attention`` ``sdpa`` with local layers (:func:`~megatron_vlm.model.layer_impl.choose_attention`): the language
    and vision core attention is :class:`~megatron_vlm.model.sdpa_attention.SDPAttention`.
    """
    from megatron.core.models.multimodal import llava_spec
    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLPSubmodules

    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        language = llava_spec.decoder_model_with_transformer_engine_default_spec(qk_layernorm=qk_layernorm)
        vision = vit_layer_specs.get_vit_layer_with_transformer_engine_spec()
        projector = MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        language = llava_spec.decoder_model_with_local_default_spec(qk_layernorm=qk_layernorm)
        vision = vit_layer_specs.get_vit_layer_with_local_spec()
        projector = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    vision = copy.deepcopy(vision)
    vision.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}
    if not use_te:
        language = copy.deepcopy(language)
        language.submodules.input_layernorm = LocalNorm
        language.submodules.pre_mlp_layernorm = LocalNorm
        if qk_layernorm:
            language.submodules.self_attention.submodules.q_layernorm = LocalNorm
            language.submodules.self_attention.submodules.k_layernorm = LocalNorm
        if cp > 1:
            from megatron_vlm.model.cp_attention import ContextParallelAttention

            language.submodules.self_attention.submodules.core_attention = ContextParallelAttention
        elif attention == "sdpa":
            from megatron_vlm.model.sdpa_attention import SDPAttention

            for layer_spec in (language, vision):
                layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention
        # Save local layer norms under the Transformer Engine names, as megatron's GPT local spec does, so
        # a torch_dist checkpoint loads into either spec (convert on CPU, train with TE on GPU).
        for layer_spec in (language, vision):
            layer_spec.submodules.sharded_state_dict_keys_map = dict(LOCAL_TO_TE_KEYS)
    return language, vision, projector


def moe_layer_spec(dense_spec, use_te: bool, num_experts: int, grouped_gemm: bool):
    """A mixture-of-experts language layer: ``dense_spec`` (from :func:`layer_specs`) with megatron-core's
    ``MoELayer`` (router, token dispatcher, experts: ``SequentialMLP`` of local linears, or Transformer Engine's
    ``TEGroupedMLP`` with ``grouped_gemm``) as its MLP. The experts' linears hold no layer norm, so the layer
    gets its own ``pre_mlp_layernorm`` (Transformer Engine's norm, or torch's for local layers), saved under
    that name in both implementations (Megatron-LM's MoE checkpoint key)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = copy.deepcopy(dense_spec)
    spec.submodules.mlp = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=grouped_gemm)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        spec.submodules.pre_mlp_layernorm = TENorm
    else:
        spec.submodules.pre_mlp_layernorm = LocalNorm
        spec.submodules.sharded_state_dict_keys_map = {
            k: v for k, v in LOCAL_TO_TE_KEYS.items() if not k.startswith("pre_mlp_layernorm")}
    return spec


def _language_block(spec: VLMSpec, lang_cfg, dense_spec, use_te: bool, vp_stage: int | None = None):
    """This pipeline stage's language layers (:class:`LanguageBlock`): the dense or MoE spec of each layer it
    builds, by the spec's MoE pattern, and the final norm (torch's for local layers: megatron's block would pick
    apex's FusedLayerNorm, which has no RMSNorm)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(lang_cfg, vp_stage=vp_stage)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = LocalNorm
    layers = [dense_spec] * n
    if spec.is_moe:
        moe_spec = moe_layer_spec(dense_spec, use_te, spec.num_moe_experts, lang_cfg.moe_grouped_gemm)
        offset = get_transformer_layer_offset(lang_cfg, vp_stage=vp_stage)
        layers = [moe_spec if offset + i in set(spec.moe_layers) else dense_spec for i in range(n)]
    return _language_block_class()(layer_specs=layers, layer_norm=final_norm, submodules=dense_spec.submodules)


@functools.lru_cache(maxsize=None)
def _language_block_class():
    """megatron-core's ``TransformerBlockSubmodules`` (a layer spec per layer, and the final norm) that also carries
    one layer's ``submodules``: megatron-core's ``LLaVAModel`` reads ``.submodules.self_attention`` of its language
    layer spec to check the attention under sequence parallelism, a check written for one spec shared by all
    layers."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    @dataclass
    class LanguageBlock(TransformerBlockSubmodules):
        submodules: object = None

    return LanguageBlock


NONDETERMINISTIC_ENV = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"


def te_deterministic_env() -> None:
    """``--deterministic`` with Transformer Engine layers: TE's attention uses only deterministic kernels when
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (read when it is built; megatron-core refuses to build it in
    deterministic mode otherwise). Set it unless the environment says otherwise, which is an error."""
    value = os.environ.setdefault(NONDETERMINISTIC_ENV, "0")
    if value.strip() != "0":
        raise ValueError(f"--deterministic with Transformer Engine layers needs {NONDETERMINISTIC_ENV}=0 (TE's "
                         f"deterministic attention), but the environment sets {NONDETERMINISTIC_ENV}={value}: "
                         "unset it, or drop --deterministic")


def build_chunks(spec: VLMSpec, opts: ModelOptions) -> list:
    """This rank's model chunks, one per virtual pipeline stage (``opts.vpp``; one chunk without VPP): chunk ``c``
    is the LLaVAModel of virtual stage ``c * pp + pp_rank`` (:mod:`megatron_vlm.model.pipeline_layout`), the vision
    encoder and projector on chunk 0 of the first rank, the output layer on the last chunk of the last rank."""
    from megatron.core import parallel_state as ps

    if opts.vpp == 1:
        return [build_model(spec, opts)]
    first, last = ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True)
    return [build_model(spec, opts, pre_process=first and c == 0, post_process=last and c == opts.vpp - 1, vp_stage=c)
            for c in range(opts.vpp)]


def build_model(spec: VLMSpec, opts: ModelOptions, pre_process: bool | None = None, post_process: bool | None = None,
                vp_stage: int | None = None):
    """Build the LLaVAModel chunk of this rank (megatron parallel_state must be initialised); ``vp_stage``: which
    of its chunks with virtual pipeline stages (:func:`build_chunks` builds them all)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import ModelType

    if opts.use_te and not have_te():
        raise RuntimeError("Transformer Engine is not installed: it is required for --fp8 / TE layer specs")
    te_on_cpu = False
    if opts.use_te:
        from megatron_vlm.runtime import cpu_compat

        te_on_cpu = cpu_compat.is_enabled()  # CPU: TE modules construct (their kernels still need a GPU)
        if opts.deterministic:
            te_deterministic_env()
    if opts.fp8:
        from megatron_vlm.model import fp8

        if not opts.use_te:
            raise ValueError("--fp8 needs Transformer Engine layers (--transformer-impl transformer_engine)")
        fp8.check_recipe_runs(opts.fp8_recipe)
    if spec.sliding_window is not None and opts.seq_length > spec.sliding_window:
        raise ValueError(
            f"--seq-length {opts.seq_length} exceeds the model's sliding_window {spec.sliding_window}; "
            "megatron-core's local attention has no sliding window: use a shorter --seq-length"
        )
    if spec.padded_vocab_size % opts.tp:
        raise ValueError(f"padded vocab {spec.padded_vocab_size} is not divisible by tp={opts.tp}")
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=True)
    if spec.is_qwen_vl:
        model = _build_qwen_vl(spec, opts, pre_process, post_process, vp_stage)
        model.model_type = ModelType.encoder_or_decoder
        return model
    attention, _ = attention_backend(opts)
    lang_spec, vit_spec, proj_spec = layer_specs(opts.use_te, spec.qk_layernorm, opts.cp, attention)
    if spec.is_internvl:
        vit_spec, proj_spec = _internvit_specs(spec, vit_spec, opts.use_te)
    lang_cfg = language_config(spec, opts)
    if not opts.use_te or spec.is_moe:
        lang_spec = _language_block(spec, lang_cfg, lang_spec, opts.use_te, vp_stage)
    local_sp = (opts.sequence_parallel or opts.cp > 1) and not opts.use_te
    core_attention = lang_spec.submodules.self_attention.submodules.core_attention
    from megatron_vlm.model.host_layout import HostLayoutLLaVAModel

    cls, extra = HostLayoutLLaVAModel, {}  # megatron-core's LLaVAModel, its image/text layout computed on the host
    if spec.is_internvl:  # megatron-core's InternVL pixel shuffle (2 x 2 patches) before the projector
        extra = dict(pixel_shuffle=True)
    if spec.is_anyres:
        from megatron_vlm.model.anyres_model import AnyresLLaVAModel

        cls, extra = AnyresLLaVAModel, dict(anyres=spec.anyres, video_token_index=spec.video_token_id)
    with contextlib.ExitStack() as patched:  # what megatron-core needs patched while the model is built
        if te_on_cpu:
            patched.enter_context(cpu_compat.te_construction())
        if opts.cp > 1:  # megatron-core's LLaVAModel under CP here: its build and every forward, cp_attention's patches
            from megatron_vlm.model import cp_attention

            cls = cp_attention.under_patches(cls)
            patched.enter_context(cp_attention.patched())
        patched.enter_context(_llava_accepts_local_sequence_parallel(local_sp, core_attention))
        model = _build_llava(cls, spec, opts, lang_cfg, lang_spec, vit_spec, proj_spec, pre_process, post_process,
                             dict(extra, vp_stage=vp_stage) if vp_stage is not None else extra)
    if model.vision_model is not None and spec.vision_family == "siglip":
        # HF LLaVA reads hidden_states[k], which SigLIP's post_layernorm never touches.
        model.vision_model.ln_post = None
    if model.vision_model is not None and not opts.use_te:
        _local_vit_norms(model.vision_model)
    if model.vision_model is not None and opts.cp > 1 and opts.vision_cp_split:
        from megatron_vlm.model import vision_share

        vision_share.share(model.vision_model)
    if spec.is_moe and opts.ep > 1:
        # Expert-parallel ranks exchange their tokens in blocks of one size (megatron-core's all-gather dispatcher),
        # and data-parallel ranks' micro batches differ in length: every micro batch is padded to the full
        # sequence length, as megatron's LLaVAModel pads for pipeline parallelism (the flag it pads by).
        model._language_is_pipeline_parallel = True
    if opts.fusions is not None:  # gradient-accumulation fusion in TE's linears only (without apex)
        opts.fusions.apply_to_te_linears(model)
    model.model_type = ModelType.encoder_or_decoder
    return model


def attention_backend(opts: ModelOptions) -> tuple[str, str]:
    """(backend, why) of ``opts.attention_backend`` for this model's layers, on this process's device (CUDA when
    it is visible): :func:`megatron_vlm.model.layer_impl.choose_attention`."""
    from megatron_vlm.model.layer_impl import choose_attention

    impl = "transformer_engine" if opts.use_te else "local"
    return choose_attention(opts.attention_backend, impl, "cuda" if torch.cuda.is_available() else "cpu", opts.cp)


def _internvit_specs(spec: VLMSpec, vit_spec, use_te: bool):
    """InternVL's ViT layer (layer scales, the 6B variant's q/k norms; with local layers, torch's LayerNorm or
    RMSNorm as the spec's ``vision_normalization`` says) and its LayerNorm-first projector
    (:mod:`megatron_vlm.model.internvit`)."""
    from megatron_vlm.model import internvit

    vit_spec = internvit.vision_layer_spec(vit_spec, spec.vision_qk_layernorm, spec.vision_qkv_bias)
    if not use_te:
        vit_spec.submodules.input_layernorm = LocalNorm
        vit_spec.submodules.pre_mlp_layernorm = LocalNorm
    return vit_spec, internvit.projector_spec(use_te)


#: what this slice of Qwen2.5-VL (issue 64) does not build yet -> the one line refusing it
QWEN_VL_NOT_YET = (
    ("use_te", "Transformer Engine layers"), ("sequence_parallel", "sequence parallelism"),
    ("fp8", "FP8"), ("recompute_granularity", "activation recomputation"),
)


def qwen_vision_config(spec: VLMSpec, opts: ModelOptions):
    """Qwen2.5-VL's ViT: RMSNorm (HF's fixed 1e-6), q/k/v and output biases, SwiGLU MLP with biases, every layer on
    the first pipeline stage; Qwen3-VL's: LayerNorm and a GELU-tanh MLP (not gated) instead."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    qwen3 = spec.is_qwen3_vl
    return TransformerConfig(
        num_layers=spec.vision_num_layers,
        hidden_size=spec.vision_hidden_size,
        ffn_hidden_size=spec.vision_ffn_hidden_size,
        num_attention_heads=spec.vision_num_attention_heads,
        num_query_groups=spec.vision_num_attention_heads,
        kv_channels=spec.vision_hidden_size // spec.vision_num_attention_heads,
        normalization=spec.vision_normalization,
        layernorm_epsilon=spec.vision_norm_epsilon,
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=not qwen3,
        activation_func=_activation(spec.vision_activation),
        pipeline_model_parallel_size=1,
        **_common(opts, "vision"),
    )


def qwen_merger_config(spec: VLMSpec, opts: ModelOptions):
    """The patch merger's MLP: merged width -> merged width (exact GELU) -> the LM's hidden size, with biases."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.projector_input_size,
        num_attention_heads=spec.num_attention_heads,  # unused by the MLP; must divide by tp
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=F.gelu,
        normalization=spec.vision_normalization,  # the merger's ln_q (Qwen3-VL's norm)
        layernorm_epsilon=spec.vision_norm_epsilon,
        pipeline_model_parallel_size=1,
        **_common(opts, "projector"),
    )


def _build_qwen_vl(spec: VLMSpec, opts: ModelOptions, pre_process: bool, post_process: bool,
                   vp_stage: int | None):
    """Qwen2.5-VL's or Qwen3-VL's :class:`~megatron_vlm.model.qwen_vl.QwenVLModel` for this rank: megatron-core's
    local layers (the language layers as for any Qwen2 / Qwen3 LM, with M-RoPE; the ViT's from megatron-core's ViT spec
    with the family's norm and MLP, :mod:`megatron_vlm.model.qwen_vit`)."""
    from megatron_vlm.model import qwen_vit, qwen_vl

    family = QWEN_VL_ARCHS[spec.arch]
    for flag, what in QWEN_VL_NOT_YET:
        if getattr(opts, flag):
            raise ValueError(f"{family} with {what} is not supported yet (issue 64 converts and verifies it with "
                             "megatron-core's local layers); drop that option")
    if spec.is_moe:
        raise ValueError(f"a mixture-of-experts {family} LM is not supported; use a dense one")
    # under CP the language attention is cp_attention's; the ViT runs whole on every CP rank (no vision_share yet)
    lang_spec, vit_spec, _ = layer_specs(False, spec.qk_layernorm, opts.cp, "local")
    lang_cfg = language_config(spec, opts)
    lang_cfg.mrope_section = list(spec.mrope_section)
    lang_spec = _language_block(spec, lang_cfg, lang_spec, False, vp_stage)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    geometry = dict(patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                    spatial_merge_size=spec.spatial_merge_size, window_size=spec.window_size,
                    fullatt_block_indexes=spec.fullatt_block_indexes, rotary_base=spec.vision_rotary_base)
    if spec.is_qwen3_vl:
        geometry.update(patch_bias=True, num_position_embeddings=spec.vision_num_position_embeddings,
                        deepstack_indexes=spec.deepstack_visual_indexes)
    return qwen_vl.model_class()(
        lang_cfg, lang_spec, spec.padded_vocab_size, opts.seq_length, qwen_vision_config(spec, opts),
        qwen_vit.vision_layer_spec(vit_spec, LocalNorm), qwen_merger_config(spec, opts),
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), geometry, spec.image_token_id,
        LocalNorm, pre_process=pre_process, post_process=post_process, tie_word_embeddings=spec.tie_word_embeddings,
        rotary_base=spec.rotary_base, vp_stage=vp_stage, video_token_id=spec.hf_config.get("video_token_id"),
        mrope_interleaved=spec.mrope_interleaved, deepstack_layers=spec.deepstack_layers)


def _build_llava(cls, spec: VLMSpec, opts: ModelOptions, lang_cfg, lang_spec, vit_spec, proj_spec, pre_process: bool,
                 post_process: bool, extra: dict):
    """megatron-core's ``LLaVAModel`` (or ``cls``, a subclass) for this rank."""
    return cls(
        language_transformer_config=lang_cfg,
        language_transformer_layer_spec=lang_spec,
        language_vocab_size=spec.padded_vocab_size,
        language_max_sequence_length=opts.seq_length,
        vision_transformer_config=vision_config(spec, opts),
        vision_transformer_layer_spec=vit_spec,
        drop_vision_class_token=spec.drop_class_token,
        vision_projection_config=projection_config(spec, opts),
        vision_projection_layer_spec=proj_spec,
        vision_projection_type="mlp",
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        language_position_embedding_type="rope",
        language_rotary_base=spec.rotary_base,
        language_rope_scaling=spec.rope_scaling_factor is not None,
        language_rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        pre_process=pre_process,
        post_process=post_process,
        add_encoder=pre_process,
        add_decoder=True,
        img_h=spec.vit_image_size,
        img_w=spec.vit_image_size,
        patch_dim=spec.patch_size,
        image_token_index=spec.image_token_id,
        **extra,
    )


def _local_vit_norms(vit) -> None:
    """Local layers hold no Transformer Engine module: megatron's CLIPViTModel builds ``ln_pre`` (CLIP) and
    ``ln_post`` with TE's norm whenever TE imports, whatever the layer spec (and TE's norm cannot run on CPU).
    They get megatron's torch norm, as without TE."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for name in ("ln_pre", "ln_post"):
        norm = getattr(vit, name, None)
        if norm is not None and type(norm).__module__.startswith("transformer_engine"):
            setattr(vit, name, build_module(WrappedTorchNorm, config=vit.config, hidden_size=vit.visual_hidden_size,
                                            eps=vit.config.layernorm_epsilon))
