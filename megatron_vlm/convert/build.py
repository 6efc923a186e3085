"""Build an HF ``LlavaForConditionalGeneration`` directory from an HF causal LM and an HF vision encoder (InternVL:
:mod:`megatron_vlm.convert.build_internvl`).

The result loads with ``LlavaForConditionalGeneration.from_pretrained`` and ``AutoProcessor.from_pretrained``:
safetensors weights, a tokenizer with the image token (and a pad token), the vision encoder's image
processor, and a chat template (:mod:`megatron_vlm.data.chat_template`: the LM's own, rendering image parts as the
image token, unless asked otherwise). The embedding keeps the LM's rows, or grows to a multiple of 64 when the
added tokens do not fit (:func:`megatron_vlm.model.tokenizer.embedding_rows`).

``arch='llava_onevision'`` (or ``'llava_next'``) builds the anyres model instead: grid pinpoints (by default
OneVision's 1x1..6x6 tiles), ``image_newline``, OneVision's ``vision_aspect_ratio`` (anyres_max_N), and the
model's own image processor (the PIL one: HF's OneVision processor class needs torchvision for videos, so the
directory holds the image processor and the tokenizer, not a processor). OneVision also gets the ``<video>``
token (``video_token_index``), a chat template that renders video parts as it, and the
``video_preprocessor_config.json`` that HF's OneVision conversion writes (frames at the tile size, the image
processor's mean/std), so that a user with torchvision loads HF's video processor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from megatron_vlm.convert.assemble import assemble
from megatron_vlm.files.atomic import atomic_dir
from megatron_vlm.data.chat_template import choose_chat_template
from megatron_vlm.model.spec import NAFLEX_REFUSAL, SUPPORTED_TEXT, SUPPORTED_VISION, UnsupportedArchitectureError
from megatron_vlm.model.tokenizer import (DEFAULT_IMAGE_TOKEN, DEFAULT_VIDEO_TOKEN, DEFAULT_VOCAB_PADDING,
                                          add_vlm_tokens, embedding_rows)

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"

log = logging.getLogger(__name__)


def _vision_family(vision_dir: Path) -> str:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(vision_dir))
    family = cfg.model_type.replace("_vision_model", "")
    if family == "siglip2":
        raise UnsupportedArchitectureError(NAFLEX_REFUSAL.format(where=f"vision model {vision_dir}"))
    if family not in SUPPORTED_VISION:
        raise UnsupportedArchitectureError(
            f"vision model {vision_dir} has model_type {cfg.model_type!r}; supported: "
            f"{', '.join(SUPPORTED_VISION)} (vision-only or full dual-encoder checkpoints)"
        )
    return family


def _load_vision(vision_dir: Path, family: str, dtype):
    from transformers import CLIPVisionModel, SiglipVisionModel

    cls = {"clip": CLIPVisionModel, "siglip": SiglipVisionModel}[family]
    return cls.from_pretrained(str(vision_dir), dtype=dtype)


def _load_image_processor(vision_dir: Path, vision_config):
    from transformers import AutoImageProcessor, CLIPImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(vision_dir))
    except (OSError, ValueError):
        size = vision_config.image_size
        log.warning("%s has no image processor config; using CLIPImageProcessor at %d px", vision_dir, size)
        return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def build_llava(
    text_model,
    vision_model,
    save_dir,
    vocab_size_padding: int | None = None,
    vision_feature_layer: int | None = None,
    vision_feature_select_strategy: str | None = None,
    image_token: str = DEFAULT_IMAGE_TOKEN,
    projector_bias: bool = True,
    dtype: str = "auto",
    seed: int = 0,
    overwrite: bool = False,
    arch: str = "llava",
    grid_pinpoints: list[list[int]] | None = None,
    vision_aspect_ratio: str = "anyres_max_9",
    max_grid: int = 6,
    chat_template: str = "keep",
) -> Path:
    """Assemble and save the LLaVA directory; returns ``save_dir``.

    ``vision_feature_layer`` defaults to -2 (InternVL: the vision checkpoint's). ``arch='internvl'`` builds an
    InternVL directory from an InternVL checkpoint's vision side (:mod:`megatron_vlm.convert.build_internvl`).
    ``vision_feature_select_strategy`` defaults to 'default' (drop CLS) for CLIP and 'full' for SigLIP.
    ``arch`` llava_next / llava_onevision: ``grid_pinpoints`` default to every rows x cols tiling up to
    ``max_grid`` x ``max_grid`` tiles of the vision encoder's image size. ``chat_template``: ``keep`` (the LM's
    own, adapted to image parts), ``llava`` or a Jinja file
    (:func:`~megatron_vlm.data.chat_template.choose_chat_template`). ``vocab_size_padding``: see
    :func:`~megatron_vlm.model.tokenizer.embedding_rows`.
    """
    from megatron_vlm.model.spec import ARCHS

    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    if arch == "qwen2_5_vl":
        raise ValueError("--arch qwen2_5_vl: a Qwen2.5-VL model is not assembled from an LM and a vision encoder; "
                         "convert its own checkpoint with convert/hf_to_megatron.py")
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    text_dir, vision_dir, save_dir = Path(text_model), Path(vision_model), Path(save_dir)
    for what, d in (("--text-model", text_dir), ("--vision-model", vision_dir)):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"{what} {d} is not a Hugging Face model directory (no config.json)")
    text_cfg = AutoConfig.from_pretrained(str(text_dir))
    if text_cfg.model_type not in SUPPORTED_TEXT:
        raise UnsupportedArchitectureError(
            f"text model {text_dir} has model_type {text_cfg.model_type!r}; supported: {', '.join(SUPPORTED_TEXT)}"
        )
    torch_dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if arch == "internvl":
        from megatron_vlm.convert.build_internvl import build_internvl, read_vision_source

        read_vision_source(vision_dir)  # an InternVL checkpoint, before the LM is loaded
        log.info("loading text model %s", text_dir)
        lm = AutoModelForCausalLM.from_pretrained(str(text_dir), dtype=torch_dtype or "auto")
        return build_internvl(lm, text_dir, vision_dir, save_dir, vocab_size_padding=vocab_size_padding,
                              vision_feature_layer=vision_feature_layer, chat_template=chat_template, seed=seed,
                              overwrite=overwrite)
    if vision_feature_layer is None:
        vision_feature_layer = -2
    family = _vision_family(vision_dir)
    if vision_feature_select_strategy is None:
        vision_feature_select_strategy = "default" if family == "clip" else "full"
    if family == "siglip" and vision_feature_select_strategy == "default":
        raise ValueError("SigLIP has no CLS token: use --vision-feature-select-strategy full")

    log.info("loading text model %s", text_dir)
    lm = AutoModelForCausalLM.from_pretrained(str(text_dir), dtype=torch_dtype or "auto")
    log.info("loading vision model %s (%s)", vision_dir, family)
    vit = _load_vision(vision_dir, family, torch_dtype or lm.dtype)
    num_layers = vit.config.num_hidden_layers
    if not -(num_layers + 1) <= vision_feature_layer < num_layers + 1:
        raise ValueError(
            f"--vision-feature-layer {vision_feature_layer} is out of range for a vision model with "
            f"{num_layers} layers (valid: -{num_layers + 1}..{num_layers})"
        )

    tokenizer = AutoTokenizer.from_pretrained(str(text_dir))
    n_lm = len(tokenizer)
    video_token = DEFAULT_VIDEO_TOKEN if arch == "llava_onevision" else None
    added = add_vlm_tokens(tokenizer, image_token, video_token)
    chosen = choose_chat_template(tokenizer, chat_template, image_token, what=f"--text-model {text_dir}",
                                  video_token=video_token)
    tokenizer.chat_template = chosen.template
    log.info("chat template: %s", chosen.note)
    vocab = len(tokenizer)
    lm_rows = lm.get_input_embeddings().weight.shape[0]
    padded = embedding_rows(lm_rows, vocab, vocab_size_padding)
    log.info("vocabulary: %d tokens (%d of the LM%s); embedding rows %d -> %d (%s)", vocab, n_lm,
             f" + {', '.join(added)}" if added else "", lm_rows, padded,
             "the LM's, which hold the tokenizer" if padded == lm_rows else
             f"grown to a multiple of {vocab_size_padding or DEFAULT_VOCAB_PADDING}")
    torch.manual_seed(seed)
    if padded != lm_rows:
        lm.resize_token_embeddings(padded, pad_to_multiple_of=None)

    image_processor = _load_image_processor(vision_dir, vit.config)
    patches = (vit.config.image_size // vit.config.patch_size) ** 2
    has_cls = family == "clip"
    image_seq_length = patches + (1 if has_cls and vision_feature_select_strategy == "full" else 0)
    text_config = lm.config
    if arch != "llava":
        return _build_anyres(arch, lm, vit, tokenizer, image_token, image_processor, save_dir, family,
                             vision_feature_layer,
                             vision_feature_select_strategy, projector_bias, grid_pinpoints, vision_aspect_ratio,
                             max_grid, seed, overwrite)
    config = LlavaConfig(
        vision_config=vit.config.to_dict(),
        text_config=text_config.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids(image_token),
        projector_hidden_act="gelu",
        vision_feature_select_strategy=vision_feature_select_strategy,
        vision_feature_layer=vision_feature_layer,
        image_seq_length=image_seq_length,
        multimodal_projector_bias=projector_bias,
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
    )
    model = assemble(LlavaForConditionalGeneration, config, lm, vit, tokenizer, seed)

    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=vit.config.patch_size,
        vision_feature_select_strategy=vision_feature_select_strategy,
        chat_template=tokenizer.chat_template,
        image_token=image_token,
        num_additional_image_tokens=1 if has_cls else 0,
    )
    with atomic_dir(save_dir, overwrite=overwrite, what="--save-dir") as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        processor.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    log.info("saved LLaVA (%s + %s, %d tokens, %d embedding rows, image token %r = %d) to %s", text_cfg.model_type,
             family, vocab, padded, image_token, config.image_token_id, save_dir)
    return save_dir


def _build_anyres(arch, lm, vit, tokenizer, image_token, base_processor, save_dir, family, vision_feature_layer,
                  vision_feature_select_strategy, projector_bias, grid_pinpoints, vision_aspect_ratio, max_grid,
                  seed, overwrite) -> Path:
    import transformers

    from megatron_vlm.model.anyres import AnyresGeometry, parse_vision_aspect_ratio
    from megatron_vlm.model.spec import ARCHS

    tile = vit.config.image_size
    if grid_pinpoints is None:
        grid_pinpoints = [[tile * r, tile * c] for r in range(1, max_grid + 1) for c in range(1, max_grid + 1)]
    AnyresGeometry(tile, vit.config.patch_size, tuple(map(tuple, grid_pinpoints)))  # checks the pinpoints
    text_config = lm.config
    kw = dict(
        vision_config=vit.config.to_dict(),
        text_config=text_config.to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids(image_token),
        projector_hidden_act="gelu",
        vision_feature_select_strategy=vision_feature_select_strategy,
        vision_feature_layer=vision_feature_layer,
        image_grid_pinpoints=grid_pinpoints,
        multimodal_projector_bias=projector_bias,
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
    )
    proc_kw = dict(size={"height": tile, "width": tile}, image_grid_pinpoints=grid_pinpoints,
                   image_mean=list(base_processor.image_mean), image_std=list(base_processor.image_std))
    if arch == "llava_onevision":
        parse_vision_aspect_ratio(vision_aspect_ratio)
        kw["vision_aspect_ratio"] = vision_aspect_ratio
        kw["video_token_index"] = tokenizer.convert_tokens_to_ids(DEFAULT_VIDEO_TOKEN)
        image_processor = transformers.LlavaOnevisionImageProcessorPil(**proc_kw)
    else:
        image_processor = transformers.LlavaNextImageProcessorPil(**proc_kw, crop_size={"height": tile, "width": tile})
    config = getattr(transformers, ARCHS[arch][0])(**kw)
    model = assemble(getattr(transformers, ARCHS[arch][1]), config, lm, vit, tokenizer, seed)
    with atomic_dir(save_dir, overwrite=overwrite, what="--save-dir") as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        image_processor.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if arch == "llava_onevision":
            (tmp / VIDEO_PROCESSOR_FILE).write_text(json.dumps(video_processor_config(image_processor), indent=2,
                                                               sort_keys=True) + "\n")
        (tmp / PROCESSOR_FILE).write_text(json.dumps(anyres_processor_config(
            arch, image_token, vision_feature_select_strategy, tile, vit.config.patch_size, family,
            vision_aspect_ratio), indent=2,
            sort_keys=True) + "\n")
    log.info("saved %s (%s + %s, %d grid pinpoints, %d tokens, %d embedding rows, image token %r = %d) to %s", arch,
             text_config.model_type, family, len(grid_pinpoints), len(tokenizer), text_config.vocab_size, image_token,
             config.image_token_id, save_dir)
    return save_dir


def anyres_processor_config(arch: str, image_token: str, strategy: str, tile: int, patch: int, family: str,
                            vision_aspect_ratio: str | None = None) -> dict:
    """HF's ``LlavaOnevisionProcessor`` / ``LlavaNextProcessor`` settings as HF's conversions write them
    (``processor_config.json``): without them ``AutoProcessor`` builds the processor with no image-token count and
    cannot expand an image or a video. Written by hand because the OneVision class needs torchvision."""
    if arch == "llava_onevision":
        return {"processor_class": "LlavaOnevisionProcessor", "image_token": image_token,
                "video_token": DEFAULT_VIDEO_TOKEN, "num_image_tokens": (tile // patch) ** 2,
                "vision_feature_select_strategy": strategy, "vision_aspect_ratio": vision_aspect_ratio}
    return {"processor_class": "LlavaNextProcessor", "image_token": image_token, "patch_size": patch,
            "num_additional_image_tokens": 1 if family == "clip" else 0, "vision_feature_select_strategy": strategy}


def video_processor_config(image_processor) -> dict:
    """HF's ``LlavaOnevisionVideoProcessor`` settings as its ``save_pretrained`` writes them, for frames as
    the training data gives them (:mod:`megatron_vlm.data.videos`): resized to the tile size with BICUBIC,
    rescaled, normalised with ``image_processor``'s mean/std. HF's OneVision conversion builds it from the
    vision encoder's processor the same way; written by hand because the class needs torchvision."""
    size = dict(image_processor.size)
    return {
        "video_processor_type": "LlavaOnevisionVideoProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": int(size["height"]), "width": int(size["width"])},
        "default_to_square": False,
        "resample": int(image_processor.resample),
        "do_center_crop": None,
        "crop_size": None,
        "do_rescale": True,
        "rescale_factor": float(image_processor.rescale_factor),
        "do_normalize": True,
        "image_mean": [float(x) for x in image_processor.image_mean],
        "image_std": [float(x) for x in image_processor.image_std],
        "do_sample_frames": False,
    }
