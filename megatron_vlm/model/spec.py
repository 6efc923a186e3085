"""The architecture spec: one dataclass that describes a LLaVA model, and the only place that derives
Megatron configs from an HF config.

``VLMSpec.from_hf(llava_config, tokenizer)`` reads an HF ``LlavaConfig``; ``spec.language_config(...)``,
``spec.vision_config(...)``, ``spec.projection_config(...)`` and ``spec.llava_kwargs()`` give what
megatron-core's ``LLaVAModel`` needs; ``spec.to_hf_config()`` goes back. Qwen2.5-VL (``model_type``
'qwen2_5_vl', :func:`_qwen_vl_spec`) is read from its own config: its windowed ViT with 2-D rotary positions, the
2 x 2 patch merger and the Qwen2 LM with M-RoPE (``mrope_section``); Qwen3-VL ('qwen3_vl', :func:`_qwen3_vl_spec`)
too: its ViT with learned, interpolated position embeddings and no windows, the DeepStack mergers whose features are
added to the first language layers' outputs, and the Qwen3 LM with interleaved M-RoPE. The spec is saved as JSON next
to every Megatron checkpoint (``SPEC_FILE``) so that a checkpoint alone tells what it holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC_FILE = "vlm_spec.json"
SUPPORTED_TEXT = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
#: mixture-of-experts LM families (routed experts, no shared expert) -> how their HF config names the expert settings
MOE_TEXT = ("qwen3_moe", "mixtral")
SUPPORTED_VISION = ("clip", "siglip")  # SigLIP2 fixed-resolution checkpoints are model_type 'siglip'
#: InternVL's own vision encoder (HF model_type 'internvl_vision'): only inside an InternVL model
INTERNVIT = "internvit"
NAFLEX_REFUSAL = ("{where} has model_type 'siglip2' (SigLIP2 NaFlex: patches at each image's own resolution and "
                  "aspect ratio, with a position-embedding resize per image), which LLaVA's fixed-size tiles cannot "
                  "feed; use a fixed-resolution SigLIP2 checkpoint (model_type 'siglip', e.g. "
                  "google/siglip2-so400m-patch14-384)")
# HF model_type -> (config class, model class) in transformers; anyres archs carry grid pinpoints + image_newline.
ARCHS = {
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration"),
    "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration"),
    "llava_onevision": ("LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration"),
    "internvl": ("InternVLConfig", "InternVLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
}
#: the Qwen-VL archs (images at their own size, a patch merger, M-RoPE) -> the family's name in messages
QWEN_VL_ARCHS = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}


def family_name(arch: str | None) -> str:
    """The name of ``arch``'s family in messages: LLaVA (plain, NeXT, OneVision), InternVL, Qwen2.5-VL, Qwen3-VL."""
    return {"internvl": "InternVL", **QWEN_VL_ARCHS}.get(arch, "LLaVA")
#: what a Qwen-VL spec runs beyond conversion and verification (``check_supported``'s ``what`` starting with one),
#: per arch: both train and generate (eval/)
QWEN_VL_RUNS = {"qwen2_5_vl": ("training", "evaluation"), "qwen3_vl": ("training", "evaluation")}
#: what a Qwen-VL spec refuses beyond those (issue 64's slices so far)
QWEN_VL_ONLY_CONVERSION = ("{what} of {family} (model_type '{arch}') is not supported yet: megatron-vlm converts it "
                           "HF <-> Megatron, verifies its logits (convert/hf_to_megatron.py --verify, "
                           "convert/megatron_to_hf.py){more}, nothing more so far")
#: Qwen2.5-VL's own vision encoder (HF model_type 'qwen2_5_vl_vision'): only inside a Qwen2.5-VL model
QWEN_VIT = "qwen2_5_vit"
#: Qwen3-VL's vision encoder (HF 'qwen3_vl_vision'): LayerNorm, GELU-tanh MLP, learned positions, DeepStack taps
QWEN3_VIT = "qwen3_vit"
#: model types of the Qwen-VL family that megatron-vlm does not convert yet -> the one line that refuses each
NOT_YET = {
    "qwen2_vl": "Qwen2-VL (model_type 'qwen2_vl') is not supported yet; megatron-vlm converts Qwen2.5-VL "
                "(model_type 'qwen2_5_vl') and Qwen3-VL (model_type 'qwen3_vl') of the Qwen-VL family",
    "qwen3_vl_moe": "Qwen3-VL-MoE (model_type 'qwen3_vl_moe') is not supported yet; megatron-vlm converts "
                    "Qwen2.5-VL (model_type 'qwen2_5_vl') and dense Qwen3-VL (model_type 'qwen3_vl') of the Qwen-VL "
                    "family",
}
# Llama-3 rope scaling parameters that megatron-core's RotaryEmbedding hard-codes (only `factor` is free).
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedArchitectureError(ValueError):
    pass


class ParallelismError(ValueError):
    pass


@dataclass
class VLMSpec:
    # language model
    text_family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    rotary_base: float
    max_position_embeddings: int
    vocab_size: int  # rows of the HF embedding (tokenizer size, plus any padding build_llava added)
    qkv_bias: bool = False
    qk_layernorm: bool = False  # Qwen3: RMSNorm of each query/key head (megatron-core's qk_layernorm)
    tie_word_embeddings: bool = False
    rope_scaling_factor: float | None = None  # Llama-3 scaling (megatron's fixed low/high/original params)
    sliding_window: int | None = None
    make_vocab_size_divisible_by: int = 128
    # mixture of experts (None: a dense LM); see moe_layers for which layers route to experts
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # each expert's intermediate size
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to 1 (HF norm_topk_prob)
    moe_layer_pattern: list[int] | None = None  # per language layer: 1 = MoE, 0 = dense MLP (ffn_hidden_size)
    moe_aux_loss_coeff: float = 0.0  # HF router_aux_loss_coef: the load-balancing coefficient the LM was trained with
    # vision encoder
    vision_family: str = "clip"
    vision_num_layers: int = 24  # layers of the HF vision tower
    vision_hidden_size: int = 1024
    vision_ffn_hidden_size: int = 4096
    vision_num_attention_heads: int = 16
    vision_norm_epsilon: float = 1e-5
    vision_activation: str = "quick_gelu"
    image_size: int = 336
    patch_size: int = 14
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"
    # InternViT (vision_family 'internvit'): its norm, q/k bias, the 6B variant's q/k RMSNorm over all heads
    vision_normalization: str = "LayerNorm"  # or "RMSNorm" (HF norm_type rms_norm)
    vision_qkv_bias: bool = True  # HF attention_bias (CLIP / SigLIP always have it)
    vision_qk_layernorm: bool = False  # HF use_qk_norm
    # projector
    downsample_ratio: float | None = None  # InternVL: pixel shuffle (0.5) before a LayerNorm-first MLP
    projector_bias: bool = True
    projector_activation: str = "gelu"
    # tokens
    image_token: str = "<image>"
    image_token_id: int = -1
    pad_token_id: int | None = None
    # LLaVA-OneVision's video token (HF video_token_index); None: the model takes no videos
    video_token: str | None = None
    video_token_id: int | None = None
    # architecture: "llava" (one tile per image) or an anyres one ("llava_next", "llava_onevision")
    arch: str = "llava"
    image_grid_pinpoints: list[list[int]] | None = None
    vision_aspect_ratio: str | None = None  # OneVision's anyres_max_N
    # Qwen2.5-VL (arch 'qwen2_5_vl'): the LM's M-RoPE sections (temporal, height, width; halves of kv_channels), the
    # ViT's Conv3d patches (temporal_patch_size frames of patch_size^2), the merger's spatial_merge_size^2 patches per
    # token, windows of window_size pixels, the layers of full attention, the ViT's rotary base
    mrope_section: list[int] | None = None
    temporal_patch_size: int | None = None
    spatial_merge_size: int | None = None
    window_size: int | None = None
    fullatt_block_indexes: list[int] | None = None
    vision_rotary_base: float | None = None
    # Qwen3-VL (arch 'qwen3_vl'): M-RoPE's sections interleaved over the frequencies (t, h, w, t, h, w, ...), the ViT's
    # learned position table (a square of this many entries, interpolated to each image's grid), and the ViT layers
    # whose merged outputs (the DeepStack mergers) are added to the outputs of language layers 0, 1, ...
    mrope_interleaved: bool = False
    vision_num_position_embeddings: int | None = None
    deepstack_visual_indexes: list[int] | None = None
    # the HF configs this spec came from (for an exact reconstruction on export)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    # ---- derived geometry -------------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        d = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / d) * d)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the language layers whose MLP is a mixture of experts (none for a dense LM)."""
        if not self.is_moe:
            return []
        pattern = self.moe_layer_pattern or [1] * self.num_layers
        return [i for i, p in enumerate(pattern) if p]

    @property
    def has_dense_layers(self) -> bool:
        return len(self.moe_layers) < self.num_layers

    @property
    def vit_num_layers(self) -> int:
        """Layers the Megatron ViT runs: HF hidden_states[k] is the output of the first k layers."""
        k = self.vision_feature_layer
        return self.vision_num_layers + 1 + k if k < 0 else k

    @property
    def has_class_token(self) -> bool:
        return self.vision_family in ("clip", INTERNVIT)

    @property
    def drop_class_token(self) -> bool:
        return self.has_class_token and self.vision_feature_select_strategy == "default"

    @property
    def is_qwen_vl(self) -> bool:
        """Qwen2.5-VL or Qwen3-VL: images at their own resolution (a variable count of ``<|image_pad|>`` tokens,
        expanded by the processor), Qwen's ViT, the patch merger, M-RoPE."""
        return self.arch in QWEN_VL_ARCHS

    @property
    def is_qwen3_vl(self) -> bool:
        """Qwen3-VL: no ViT windows, learned ViT positions, DeepStack, interleaved M-RoPE, the Qwen3 LM."""
        return self.arch == "qwen3_vl"

    @property
    def deepstack_layers(self) -> int:
        """Language layers (0, 1, ...) to whose outputs DeepStack adds vision features (0: none)."""
        return len(self.deepstack_visual_indexes or ())

    def check_supported(self, what: str) -> None:
        """Refuse ``what`` (evaluation, ...) for a family that megatron-vlm converts but does not run there yet: one
        line naming the family and ``what``. The Qwen-VL families train and generate (:data:`QWEN_VL_RUNS`)."""
        if self.is_qwen_vl and not what.startswith(QWEN_VL_RUNS[self.arch]):
            more = ", trains it on images (train/run.py) and generates (eval/)" if QWEN_VL_RUNS[self.arch] else ""
            raise UnsupportedArchitectureError(QWEN_VL_ONLY_CONVERSION.format(
                what=what, family=QWEN_VL_ARCHS[self.arch], arch=self.arch, more=more))

    @property
    def projector_input_size(self) -> int:
        """Width of the projector's input: the ViT's hidden size (InternVL: x4 after its 2 x 2 pixel shuffle;
        Qwen2.5-VL: x merge^2, the merged patches)."""
        if self.is_qwen_vl:
            return self.vision_hidden_size * self.spatial_merge_size ** 2
        return int(self.vision_hidden_size / (self.downsample_ratio ** 2)) if self.downsample_ratio else \
            self.vision_hidden_size

    @property
    def is_anyres(self) -> bool:
        return self.arch in ("llava_next", "llava_onevision")

    @property
    def is_internvl(self) -> bool:
        """InternVL: dynamic tiles of one size per image (``num_image_tiles``), pixel shuffle, InternViT."""
        return self.arch == "internvl"

    @property
    def anyres(self):
        """The :class:`~megatron_vlm.model.anyres.AnyresGeometry` of an anyres model (None for plain LLaVA)."""
        if not self.is_anyres:
            return None
        from megatron_vlm.model.anyres import AnyresGeometry, parse_vision_aspect_ratio

        max_tiles = parse_vision_aspect_ratio(self.vision_aspect_ratio) if self.arch == "llava_onevision" else None
        return AnyresGeometry(self.image_size, self.patch_size, tuple(tuple(p) for p in self.image_grid_pinpoints),
                              max_tiles)

    @property
    def vit_image_size(self) -> int:
        """The image side megatron's ViT is built with: whole patches only (384 px at patch 14 -> 378), as the
        valid patch convolution of HF's encoders sees a 384-px tile (27 x 27 patches)."""
        return self.image_size // self.patch_size * self.patch_size

    @property
    def media_token_ids(self) -> tuple[int, ...]:
        """The ids that stand for an image or a video in the tokens (one per image / video)."""
        return (self.image_token_id,) + ((self.video_token_id,) if self.video_token_id is not None else ())

    @property
    def num_image_tokens(self) -> int:
        """Image tokens of one tile (plain LLaVA: of one image; InternVL: after the pixel shuffle, HF's
        ``image_seq_length``); anyres counts per image come from ``anyres``."""
        n = (self.image_size // self.patch_size) ** 2
        if self.downsample_ratio:
            return int(n * self.downsample_ratio ** 2)
        return n + (1 if self.has_class_token and not self.drop_class_token else 0)

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg, tokenizer=None, image_token: str | None = None, sources: dict | None = None) -> "VLMSpec":
        """Build from an HF ``LlavaConfig`` / ``LlavaNextConfig`` / ``LlavaOnevisionConfig`` (object or dict).
        The image token id is the config's; with ``tokenizer`` (and the processor's ``image_token``) the image
        token's string and the pad id are read and checked against it (:mod:`megatron_vlm.model.tokenizer`;
        ``sources`` name the files in errors)."""
        arch = cfg.get("model_type", "llava") if isinstance(cfg, dict) else getattr(cfg, "model_type", None)
        if arch in NOT_YET:
            raise UnsupportedArchitectureError(NOT_YET[arch])
        if arch == "qwen2_5_vl":
            return _qwen_vl_spec(cls, cfg, tokenizer, image_token, sources)
        if arch == "qwen3_vl":
            return _qwen3_vl_spec(cls, cfg, tokenizer, image_token, sources)
        if arch not in ARCHS:
            raise UnsupportedArchitectureError(
                f"model_type {arch!r} is not one of {', '.join(ARCHS)}; build a LLaVA directory "
                "first with convert/build_llava.py"
            )
        if isinstance(cfg, dict):
            cfg = hf_config_class(arch)(**{k: v for k, v in cfg.items() if k != "model_type"})
        t, v = cfg.text_config, cfg.vision_config
        if t.model_type not in SUPPORTED_TEXT:
            raise UnsupportedArchitectureError(
                f"language model type {t.model_type!r} is not supported; supported: {', '.join(SUPPORTED_TEXT)}"
            )
        vfam = v.model_type.replace("_vision_model", "")
        if vfam == "siglip2":
            raise UnsupportedArchitectureError(NAFLEX_REFUSAL.format(where="the vision model"))
        internvit = _internvit_settings(cfg, v) if arch == "internvl" else {}
        if internvit:
            vfam = INTERNVIT
        elif vfam not in SUPPORTED_VISION:
            raise UnsupportedArchitectureError(
                f"vision model type {v.model_type!r} is not supported; supported: {', '.join(SUPPORTED_VISION)}"
            )
        if not isinstance(cfg.vision_feature_layer, int):
            raise UnsupportedArchitectureError(
                f"vision_feature_layer={cfg.vision_feature_layer} (a list of layers) is not supported; use one layer"
            )
        if getattr(t, "hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"language hidden_act {t.hidden_act!r} is not supported (silu only)")
        if getattr(t, "mlp_bias", False) or (t.model_type != "qwen2" and getattr(t, "attention_bias", False)):
            raise UnsupportedArchitectureError("language models with MLP/attention output biases are not supported")
        rope = _rope_parameters(t)
        rope_factor = None
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            for k, want in _MCORE_LLAMA3_ROPE.items():
                if float(rope.get(k, want)) != want:
                    raise UnsupportedArchitectureError(
                        f"Llama-3 rope scaling with {k}={rope.get(k)} is not supported by megatron-core "
                        f"(it fixes {k}={want})"
                    )
            rope_factor = float(rope["factor"])
        elif rope_type not in ("default", None):
            raise UnsupportedArchitectureError(f"rope scaling type {rope_type!r} is not supported (default, llama3)")
        sliding = getattr(t, "sliding_window", None)
        if t.model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(t, "use_sliding_window", False):
            sliding = None
        vact = v.hidden_act
        if vact not in ("quick_gelu", "gelu_pytorch_tanh", "gelu"):
            raise UnsupportedArchitectureError(f"vision hidden_act {vact!r} is not supported")
        if cfg.projector_hidden_act != "gelu":
            raise UnsupportedArchitectureError(
                f"projector_hidden_act {cfg.projector_hidden_act!r} is not supported (gelu only)"
            )
        strategy = cfg.vision_feature_select_strategy
        if vfam == "siglip" and strategy != "full":
            raise UnsupportedArchitectureError("SigLIP has no CLS token: vision_feature_select_strategy must be 'full'")
        anyres = {}
        if arch == "internvl":
            anyres = dict(arch=arch)
        elif arch != "llava":
            from megatron_vlm.model.anyres import AnyresGeometry

            AnyresGeometry.from_hf(cfg)  # checks pinpoints and vision_aspect_ratio
            anyres = dict(arch=arch, image_grid_pinpoints=[list(map(int, p)) for p in cfg.image_grid_pinpoints],
                          vision_aspect_ratio=getattr(cfg, "vision_aspect_ratio", None) if arch == "llava_onevision"
                          else None)
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        moe = _moe_settings(t)
        spec = cls(
            text_family=t.model_type,
            **_text_sizes(t, head_dim, rope),
            qkv_bias=t.model_type == "qwen2",
            qk_layernorm=t.model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=_tied(arch, cfg, t),
            rope_scaling_factor=rope_factor,
            sliding_window=sliding,
            vision_family=vfam,
            vision_num_layers=v.num_hidden_layers,
            vision_hidden_size=v.hidden_size,
            vision_ffn_hidden_size=v.intermediate_size,
            vision_num_attention_heads=v.num_attention_heads,
            vision_norm_epsilon=v.layer_norm_eps,
            vision_activation=vact,
            image_size=_square(v.image_size, "vision image_size"),
            patch_size=_square(v.patch_size, "vision patch_size"),
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=strategy,
            projector_bias=bool(getattr(cfg, "multimodal_projector_bias", True)),
            image_token_id=_config_image_token_id(cfg),
            pad_token_id=getattr(cfg, "pad_token_id", None),
            hf_config={k: v for k, v in cfg.to_dict().items() if k != "_name_or_path"},
            **moe,
            **anyres,
            **internvit,
        )
        video_index = getattr(cfg, "video_token_index", None) if arch == "llava_onevision" else None
        if video_index is not None and 0 <= int(video_index) < spec.vocab_size:
            from megatron_vlm.model.tokenizer import DEFAULT_VIDEO_TOKEN

            spec.video_token, spec.video_token_id = DEFAULT_VIDEO_TOKEN, int(video_index)
        if tokenizer is not None:
            from megatron_vlm.model.tokenizer import special_token_ids

            ids = special_token_ids(tokenizer, image_token, spec.image_token_id, **(sources or {}))
            spec.image_token = ids.image_token
            spec.pad_token_id = ids.pad
            if spec.arch != "llava_onevision" or ids.video is None:
                spec.video_token = spec.video_token_id = None  # videos need the tokenizer's <video>
            elif ids.video != video_index:
                raise ValueError(f"tokenizer's '<video>' id {ids.video} != config video_token_index {video_index}; "
                                 "rebuild the model with convert/build_llava.py --arch llava_onevision")
            if len(tokenizer) > spec.vocab_size:
                raise ValueError(
                    f"tokenizer has {len(tokenizer)} tokens but the embedding only {spec.vocab_size} rows; "
                    "rebuild the model with convert/build_llava.py"
                )
        if not 1 <= spec.vit_num_layers <= spec.vision_num_layers:
            raise UnsupportedArchitectureError(
                f"vision_feature_layer={spec.vision_feature_layer} selects {spec.vit_num_layers} of "
                f"{spec.vision_num_layers} vision layers; it must select at least one"
            )
        return spec

    @classmethod
    def from_hf_dir(cls, hf_dir) -> "VLMSpec":
        from transformers import AutoConfig, AutoTokenizer

        from megatron_vlm.model.tokenizer import directory_sources

        hf_dir = Path(hf_dir)
        if not (hf_dir / "config.json").is_file():
            raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
        tok = AutoTokenizer.from_pretrained(str(hf_dir)) if (hf_dir / "tokenizer_config.json").exists() else None
        src = directory_sources(hf_dir)
        image_token = src.pop("image_token")
        src.pop("image_token_id")  # the config's, read by from_hf
        return cls.from_hf(AutoConfig.from_pretrained(str(hf_dir)), tok, image_token, src)

    def to_hf_config(self):
        return hf_config_class(self.arch)(**{k: v for k, v in self.hf_config.items() if k != "model_type"})

    # ---- persistence ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "VLMSpec":
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, directory):
        """Write ``<directory>/vlm_spec.json`` (a local directory or an ``msc://`` URL); returns its path."""
        from megatron_vlm.files import storage

        path = storage.join(directory, SPEC_FILE)
        storage.write_text(path, self.to_json())
        return storage.path(path)

    @classmethod
    def load(cls, directory) -> "VLMSpec":
        from megatron_vlm.files import storage

        path = storage.path(directory) / SPEC_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{directory} has no {SPEC_FILE}; it is not a megatron-vlm checkpoint "
                "(convert one with convert/hf_to_megatron.py)"
            )
        return cls.from_json(path.read_text())

    # ---- parallelism checks -----------------------------------------------------------------------
    def _tp_divides(self) -> tuple[tuple[str, int, str], ...]:
        dense_ffn = (("ffn_hidden_size (intermediate_size)", self.ffn_hidden_size, "language model"),) \
            if self.has_dense_layers else ()
        merger = (("merged patch width (hidden_size x spatial_merge_size^2)", self.projector_input_size,
                   "patch merger"),) if self.is_qwen_vl else ()
        return (
            *merger,
            ("num_attention_heads", self.num_attention_heads, "language model"),
            ("num_query_groups (num_key_value_heads)", self.num_query_groups, "language model"),
            *dense_ffn,
            ("num_attention_heads", self.vision_num_attention_heads, "vision model"),
            ("ffn_hidden_size (intermediate_size)", self.vision_ffn_hidden_size, "vision model"),
            ("hidden_size (projector)", self.hidden_size, "projector"),
            ("padded vocab size", self.padded_vocab_size, "language model"),
        )

    def working_tps(self) -> list[int]:
        """Every tensor-parallel size the shapes allow (each split in :meth:`check_parallelism`), smallest first."""
        return [t for t in range(1, self.num_query_groups + 1) if all(v % t == 0 for _, v, _ in self._tp_divides())]

    def largest_tp(self) -> int:
        """The largest tensor-parallel size the shapes allow (every split in :meth:`check_parallelism`)."""
        return self.working_tps()[-1]

    def check_expert_parallelism(self, ep: int = 1, etp: int | None = None) -> None:
        """Validate expert parallelism (``ep`` experts groups, ``etp`` tensor-parallel size inside an expert)
        against the experts; a dense LM takes only ``ep=1``."""
        if ep < 1 or (etp is not None and etp < 1):
            raise ParallelismError(f"--ep {ep} / --etp {etp} must be >= 1")
        if not self.is_moe:
            if ep > 1 or (etp or 1) > 1:
                raise ParallelismError(f"--ep/--etp apply to mixture-of-experts language models; this {self.text_family} "
                                       "LM is dense: drop --ep/--etp")
            return
        if self.num_moe_experts % ep:
            raise ParallelismError(
                f"--ep {ep} does not divide the {self.num_moe_experts} experts of the language model; choose --ep "
                f"from {[d for d in range(1, self.num_moe_experts + 1) if self.num_moe_experts % d == 0]}")
        if etp is not None and self.moe_ffn_hidden_size % etp:
            raise ParallelismError(
                f"--etp {etp} does not divide each expert's moe_ffn_hidden_size={self.moe_ffn_hidden_size}; choose "
                f"--etp from {_divisors_pow2(self.moe_ffn_hidden_size)}")

    def check_parallelism(self, tp: int, pp: int, pp_layers: list[int] | None = None, ep: int = 1,
                          etp: int | None = None) -> list[int]:
        """Validate TP/PP (and expert parallelism) against the shapes; return the number of language layers per
        PP stage. The expert tensor-parallel size ``etp`` defaults to ``tp``, as in megatron-core."""
        if tp < 1 or pp < 1:
            raise ParallelismError(f"--tp {tp} / --pp {pp} must be >= 1")
        self.check_expert_parallelism(ep, etp if etp is not None else (tp if self.is_moe else None))
        checks = self._tp_divides()
        for name, value, where in checks:
            if name.startswith("num_query_groups") and tp > value:
                raise ParallelismError(
                    f"--tp {tp} is larger than the {value} KV heads (num_key_value_heads) of the language model: "
                    f"megatron-core gives each TP rank whole KV heads; the largest --tp that works is "
                    f"{self.largest_tp()}")
            if value % tp:
                why = ""
                if where == "vision model" and name == "num_attention_heads":  # InternViT-6B: 25 heads
                    why = (f" (its {value} heads split over {[d for d in range(1, value + 1) if value % d == 0]} "
                           "ranks only: megatron-vlm does not pad attention heads to a multiple of the TP size)")
                raise ParallelismError(
                    f"tp={tp} does not divide {name}={value} of {where}{why}; choose --tp from {self.working_tps()}, "
                    "the sizes every part of this model splits over")
        stages = self._pp_stages(pp, pp_layers)
        if stages[0] < self.deepstack_layers:
            raise ParallelismError(
                f"pp={pp} puts {stages[0]} language layers on the first stage, but Qwen3-VL's DeepStack adds vision "
                f"features to layers 0-{self.deepstack_layers - 1}, which must run there with the ViT; use fewer "
                f"stages, or --pp-layers with at least {self.deepstack_layers} on the first")
        return stages

    def _pp_stages(self, pp: int, pp_layers: list[int] | None) -> list[int]:
        """The language layers of each pipeline stage (``pp_layers``, checked, or an even split)."""
        if pp_layers:
            if len(pp_layers) != pp or sum(pp_layers) != self.num_layers or min(pp_layers) < 1:
                raise ParallelismError(
                    f"--pp-layers {','.join(map(str, pp_layers))} must give {pp} positive counts summing to "
                    f"num_layers={self.num_layers}"
                )
            if pp > 2 and len(set(pp_layers[1:-1])) > 1:
                raise ParallelismError(
                    f"--pp-layers {','.join(map(str, pp_layers))}: megatron-core allows only the first and last "
                    "stage to differ; middle stages need the same count"
                )
            return list(pp_layers)
        if self.num_layers % pp:
            raise ParallelismError(
                f"pp={pp} does not divide num_layers={self.num_layers} of language model; choose --pp from "
                f"{[d for d in range(1, self.num_layers + 1) if self.num_layers % d == 0]} or give an uneven "
                "split with --pp-layers"
            )
        return [self.num_layers // pp] * pp


def _moe_settings(t) -> dict:
    """The VLMSpec fields of a mixture-of-experts HF text config (Qwen3-MoE, Mixtral); {} for a dense LM. A layout
    the mapping cannot express is refused, naming the setting."""
    if t.model_type not in MOE_TEXT:
        return {}
    if t.model_type == "qwen3_moe":
        experts, ffn = int(t.num_experts), int(t.moe_intermediate_size)
        step = int(getattr(t, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(t, "mlp_only_layers", None) or [])
        bad = sorted(i for i in dense if not 0 <= i < t.num_hidden_layers)
        if bad:
            raise UnsupportedArchitectureError(f"mlp_only_layers {bad} are not layers of a {t.num_hidden_layers}-layer "
                                               "language model; fix the config")
        pattern = [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(t.num_hidden_layers)]
        norm_topk = bool(getattr(t, "norm_topk_prob", False))
    else:  # mixtral: every layer routes; the experts' size is intermediate_size; top-k always renormalised
        experts, ffn = int(t.num_local_experts), int(t.intermediate_size)
        pattern = [1] * t.num_hidden_layers
        norm_topk = True
        jitter = float(getattr(t, "router_jitter_noise", 0.0) or 0.0)
        if jitter:
            raise UnsupportedArchitectureError(
                f"router_jitter_noise={jitter}: HF Mixtral multiplies the experts' input by the noise too, which "
                "megatron-core's router jitter does not; set router_jitter_noise to 0 in config.json")
    topk = int(t.num_experts_per_tok)
    if experts < 1 or not 1 <= topk <= experts:
        raise UnsupportedArchitectureError(f"num_experts_per_tok={topk} must be between 1 and the {experts} experts")
    if not any(pattern):
        return {}
    return dict(num_moe_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=topk, moe_norm_topk_prob=norm_topk,
                moe_layer_pattern=pattern, moe_aux_loss_coeff=float(getattr(t, "router_aux_loss_coef", 0.0) or 0.0))



def _text_sizes(t, head_dim: int, rope: dict) -> dict:
    """The language model's sizes of the HF text config ``t`` (``rope``: its rope parameters), as every family's spec
    takes them."""
    return dict(num_layers=t.num_hidden_layers, hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
                num_attention_heads=t.num_attention_heads,
                num_query_groups=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
                kv_channels=head_dim, norm_epsilon=t.rms_norm_eps,
                rotary_base=float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))),
                max_position_embeddings=t.max_position_embeddings, vocab_size=t.vocab_size)


def _tied(arch: str, cfg, text_config) -> bool:
    """Whether the HF model ties ``lm_head`` to the embedding. LLaVA configs: either config's flag. InternVL: the
    top-level ``tie_word_embeddings`` defaults to True (transformers 5 ties by it) while the published -HF
    checkpoints were written by transformers 4.5x, which tied by the text config's flag and saved no top-level one;
    an untied text config's checkpoint carries its own ``lm_head`` (which transformers 5 then loads untied, the two
    tensors differing). So InternVL ties only where both flags say so."""
    top = bool(getattr(cfg, "tie_word_embeddings", False))
    text = bool(getattr(text_config, "tie_word_embeddings", False))
    return (top and text) if arch == "internvl" else (top or text)


def _square(value, what: str) -> int:
    """An image / patch size given as an int or an (h, w) pair (InternViT's) of a square."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise UnsupportedArchitectureError(f"{what} {list(value)} is not square; megatron-core's ViT takes "
                                               "square tiles: use an equal height and width")
        value = value[0]
    return int(value)


def _internvit_settings(cfg, v) -> dict:
    """The VLMSpec fields of an InternVL config's InternViT and projector; what megatron-core's ViT cannot build
    (or HF's InternVL cannot run) is refused in one line naming the setting."""
    if v.model_type != "internvl_vision":
        raise UnsupportedArchitectureError(f"an InternVL model's vision model type {v.model_type!r} is not "
                                           "supported; InternVL takes its InternViT (model_type internvl_vision)")
    ratio = float(cfg.downsample_ratio)
    if ratio != 0.5:
        raise UnsupportedArchitectureError(f"downsample_ratio={ratio} is not supported: megatron-core's pixel "
                                           "shuffle merges 2 x 2 patches (downsample_ratio 0.5)")
    if cfg.vision_feature_select_strategy != "default":
        raise UnsupportedArchitectureError("InternVL drops the CLS token before its pixel shuffle: "
                                           "vision_feature_select_strategy must be 'default'")
    if not getattr(v, "use_absolute_position_embeddings", True):
        raise UnsupportedArchitectureError("InternViT without absolute position embeddings is not supported; set "
                                           "use_absolute_position_embeddings to true")
    if cfg.vision_feature_layer == -1 and not getattr(v, "use_mean_pooling", True):
        raise UnsupportedArchitectureError("InternViT with use_mean_pooling=false puts a final LayerNorm on the last "
                                           "layer, which megatron-core's ViT does not have; use "
                                           "vision_feature_layer -2 or use_mean_pooling true")
    norm = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}.get(v.norm_type)
    if norm is None:
        raise UnsupportedArchitectureError(f"InternViT norm_type {v.norm_type!r} is not supported (layer_norm, "
                                           "rms_norm)")
    side = _square(v.image_size, "vision image_size") // _square(v.patch_size, "vision patch_size")
    if side % 2:
        raise UnsupportedArchitectureError(f"InternViT's {side} x {side} patches do not pair up for the pixel "
                                           "shuffle; use an image_size of an even number of patches")
    seq = getattr(cfg, "image_seq_length", None)
    if seq is not None and int(seq) != side * side // 4:
        raise UnsupportedArchitectureError(f"image_seq_length={seq} but {side} x {side} patches pixel-shuffled give "
                                           f"{side * side // 4} tokens per tile; set image_seq_length to "
                                           f"{side * side // 4}")
    return dict(vision_normalization=norm, vision_qkv_bias=bool(v.attention_bias),
                vision_qk_layernorm=bool(v.use_qk_norm), downsample_ratio=ratio)


#: HF's Qwen2.5-VL ViT builds its RMSNorms (norm1, norm2, the merger's ln_q) with this epsilon; its config has none
QWEN_VIT_NORM_EPS = 1e-6
#: the image token Qwen2.5-VL's processor expands (one per merged patch)
QWEN_IMAGE_TOKEN = "<|image_pad|>"


def _qwen_vl_spec(cls, cfg, tokenizer=None, image_token: str | None = None, sources: dict | None = None) -> "VLMSpec":
    """The spec of an HF ``Qwen2_5_VLConfig`` (object or dict; the hub's flat 7B config too, which transformers reads
    into ``text_config``). What megatron-vlm cannot build is refused in one line naming the setting."""
    if isinstance(cfg, dict):
        cfg = hf_config_class("qwen2_5_vl")(**{k: v for k, v in cfg.items() if k != "model_type"})
    t, v = cfg.text_config, cfg.vision_config
    if getattr(t, "hidden_act", "silu") != "silu" or getattr(v, "hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"Qwen2.5-VL with hidden_act {t.hidden_act!r} (language) / "
                                           f"{v.hidden_act!r} (vision) is not supported (silu only)")
    if getattr(t, "use_sliding_window", False):
        raise UnsupportedArchitectureError("Qwen2.5-VL with use_sliding_window true is not supported: "
                                           "megatron-core's local attention has no sliding window; set it to false")
    common = _qwen_common("Qwen2.5-VL", cfg, t.hidden_size // t.num_attention_heads, None, ("default", "mrope"))
    merge, patch = common["spatial_merge_size"], common["patch_size"]
    if int(v.window_size) < merge * patch:
        raise UnsupportedArchitectureError(f"vision window_size {v.window_size} is smaller than one merged patch "
                                           f"({merge * patch} px); use a multiple of {merge * patch}")
    full = sorted(int(i) for i in (v.fullatt_block_indexes or []))
    if any(not 0 <= i < v.depth for i in full):
        raise UnsupportedArchitectureError(f"fullatt_block_indexes {full} are not layers of the {v.depth}-layer "
                                           "vision model; fix the config")
    spec = cls(text_family="qwen2", qkv_bias=True, vision_family=QWEN_VIT, vision_activation="silu",
               vision_normalization="RMSNorm", arch="qwen2_5_vl", window_size=int(v.window_size),
               fullatt_block_indexes=full, **common)
    return _qwen_tokens(spec, tokenizer, image_token, sources)


def _qwen_common(family: str, cfg, head_dim: int, default_section, rope_types) -> dict:
    """The checks and the spec fields that Qwen2.5-VL and Qwen3-VL share (the LM's sizes, M-RoPE's sections, the
    ViT's sizes and patches, the image token); ``default_section``: the sections transformers takes when the config
    names none (None: they are required)."""
    t, v = cfg.text_config, cfg.vision_config
    rope = _rope_parameters(t)
    section = rope.get("mrope_section") or default_section
    if not section or len(section) != 3 or 2 * sum(section) != head_dim:
        raise UnsupportedArchitectureError(f"{family}'s rope mrope_section {section} must give 3 sections whose sum "
                                           f"is half the head dim ({head_dim // 2}); fix rope_scaling in config.json")
    if rope.get("rope_type", "default") not in rope_types:
        raise UnsupportedArchitectureError(f"{family} with rope scaling type {rope.get('rope_type')!r} is not "
                                           "supported (default M-RoPE only)")
    if v.out_hidden_size != t.hidden_size:
        raise UnsupportedArchitectureError(f"the vision out_hidden_size {v.out_hidden_size} differs from the language "
                                           f"hidden_size {t.hidden_size}; set out_hidden_size to {t.hidden_size}")
    vhead = v.hidden_size // v.num_heads
    if v.hidden_size % v.num_heads or vhead % 4:
        raise UnsupportedArchitectureError(f"vision hidden_size {v.hidden_size} over {v.num_heads} heads: the 2-D "
                                           "rotary positions need a head dim that is a multiple of 4")
    merge, patch = int(v.spatial_merge_size), int(v.patch_size)
    vision_rope = dict(getattr(v, "rope_parameters", None) or {})
    return dict(
        **_text_sizes(t, head_dim, rope),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        vision_num_layers=v.depth, vision_hidden_size=v.hidden_size, vision_ffn_hidden_size=v.intermediate_size,
        vision_num_attention_heads=v.num_heads, vision_norm_epsilon=QWEN_VIT_NORM_EPS,
        image_size=patch * merge,  # images come at their own size, in whole merged patches of this side
        patch_size=patch, vision_feature_layer=-1, vision_feature_select_strategy="full", projector_activation="gelu",
        image_token=QWEN_IMAGE_TOKEN, image_token_id=_config_image_token_id(cfg),
        pad_token_id=getattr(t, "pad_token_id", None), mrope_section=[int(x) for x in section],
        temporal_patch_size=int(v.temporal_patch_size), spatial_merge_size=merge,
        vision_rotary_base=float(vision_rope.get("rope_theta", 10000.0)),
        hf_config={k: x for k, x in cfg.to_dict().items() if k != "_name_or_path"},
    )


def _qwen_tokens(spec: "VLMSpec", tokenizer, image_token: str | None, sources: dict | None) -> "VLMSpec":
    """A Qwen-VL spec with its image token's string and the pad id read from ``tokenizer`` (when given) and checked
    against the config's image token id."""
    if tokenizer is not None:
        from megatron_vlm.model.tokenizer import special_token_ids

        ids = special_token_ids(tokenizer, image_token or QWEN_IMAGE_TOKEN, spec.image_token_id, **(sources or {}))
        spec.image_token, spec.pad_token_id = ids.image_token, ids.pad
        if len(tokenizer) > spec.vocab_size:
            raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the embedding only {spec.vocab_size} rows; "
                             "use the tokenizer of this model")
    return spec


#: the activations of Qwen3-VL's ViT MLP that megatron-vlm builds (model/build.py's ``_activation``)
QWEN3_VIT_ACTIVATIONS = ("gelu_pytorch_tanh",)
#: the M-RoPE sections transformers' Qwen3-VL rotary takes when the config names none
QWEN3_MROPE_SECTION = [24, 20, 20]


def _qwen3_vl_spec(cls, cfg, tokenizer=None, image_token: str | None = None, sources: dict | None = None) -> "VLMSpec":
    """The spec of an HF ``Qwen3VLConfig`` (object or dict): the Qwen3 LM (q/k RMSNorm per head, no biases) with
    M-RoPE interleaved over the frequencies (transformers' ``Qwen3VLTextRotaryEmbedding`` interleaves whatever
    ``mrope_interleaved`` says), the ViT without windows, its learned position table and the DeepStack taps. What
    megatron-vlm cannot build is refused in one line naming the setting."""
    if isinstance(cfg, dict):
        cfg = hf_config_class("qwen3_vl")(**{k: v for k, v in cfg.items() if k != "model_type"})
    t, v = cfg.text_config, cfg.vision_config
    if getattr(t, "hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"Qwen3-VL with language hidden_act {t.hidden_act!r} is not supported "
                                           "(silu only)")
    if v.hidden_act not in QWEN3_VIT_ACTIVATIONS:
        raise UnsupportedArchitectureError(f"Qwen3-VL with vision hidden_act {v.hidden_act!r} is not supported "
                                           f"({', '.join(QWEN3_VIT_ACTIVATIONS)} only)")
    if getattr(t, "attention_bias", False):
        raise UnsupportedArchitectureError("Qwen3-VL with attention_bias true (biases on q/k/v and the output "
                                           "projection) is not supported; the published models have none")
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    common = _qwen_common("Qwen3-VL", cfg, head_dim, QWEN3_MROPE_SECTION, ("default",))
    side = math.isqrt(int(v.num_position_embeddings))
    if side * side != int(v.num_position_embeddings):
        raise UnsupportedArchitectureError(f"vision num_position_embeddings {v.num_position_embeddings} is not a "
                                           "square; the learned positions are a square grid")
    deepstack = [int(i) for i in (v.deepstack_visual_indexes or [])]
    if len(set(deepstack)) != len(deepstack) or any(not 0 <= i < v.depth for i in deepstack) or \
            len(deepstack) > t.num_hidden_layers:
        raise UnsupportedArchitectureError(f"deepstack_visual_indexes {deepstack} must be distinct layers of the "
                                           f"{v.depth}-layer vision model, at most one per language layer "
                                           f"({t.num_hidden_layers}); fix the config")
    spec = cls(text_family="qwen3", qk_layernorm=True, vision_family=QWEN3_VIT, vision_activation=v.hidden_act,
               vision_normalization="LayerNorm", arch="qwen3_vl", mrope_interleaved=True,
               vision_num_position_embeddings=int(v.num_position_embeddings), deepstack_visual_indexes=deepstack,
               **common)
    return _qwen_tokens(spec, tokenizer, image_token, sources)


def _config_image_token_id(cfg) -> int:
    from megatron_vlm.model.tokenizer import config_image_token_id

    tid = config_image_token_id(cfg)
    if tid is None:
        raise UnsupportedArchitectureError("the model config has no image_token_index / image_token_id")
    return tid


def hf_config_class(arch: str):
    import transformers

    return getattr(transformers, ARCHS[arch][0])


def _divisors_pow2(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16) if n % d == 0]


def _rope_parameters(text_config) -> dict:
    """HF rope settings as one dict (transformers 5 ``rope_parameters`` or 4.x ``rope_scaling``)."""
    params = dict(getattr(text_config, "rope_parameters", None) or {})
    scaling = getattr(text_config, "rope_scaling", None)
    if scaling:
        params.update(scaling)
    if "rope_theta" not in params and hasattr(text_config, "rope_theta"):
        params["rope_theta"] = text_config.rope_theta
    return params
