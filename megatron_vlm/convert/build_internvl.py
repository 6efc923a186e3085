"""Build an HF InternVL directory (``InternVLForConditionalGeneration``) from an HF causal LM and an InternVL
checkpoint's vision side: ``convert/build_llava.py --arch internvl --text-model LM --vision-model INTERNVL_DIR``.

- **vision**: InternViT from ``INTERNVL_DIR``, an InternVL ``-HF`` checkpoint (model_type ``internvl``: its
  ``vision_tower``, and its ``downsample_ratio`` and ``vision_feature_layer``) or a vision-only one
  (``internvl_vision``); its image processor (GotOcr2's, ``crop_to_patches``) comes along;
- **projector**: the checkpoint's ``multi_modal_projector`` when its output width is the LM's hidden size, otherwise
  (or from a vision-only checkpoint) initialised as HF initialises ``InternVLMultiModalProjector`` (logged);
- **tokens**: the LM's tokenizer with InternVL's ``<img>``, ``</img>``, ``<IMG_CONTEXT>`` (the image token) and
  ``<video>`` as its named extra special tokens (what HF's ``InternVLProcessor`` reads), and a pad token where it has
  none; the LM's chat template taught to render image parts as ``<IMG_CONTEXT>\\n`` and video parts as
  ``<video>\\n`` (:mod:`megatron_vlm.data.chat_template`), as InternVL's templates do;
- **tying**: the top-level ``tie_word_embeddings`` is written explicitly, equal to the LM's (transformers 5 ties by
  the top-level flag, whose default is True);
- the processor files: ``processor_config.json`` (``InternVLProcessor``, ``image_seq_length``) and the video
  processor's config, written by hand (HF's processor class needs torchvision for its video processor).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from megatron_vlm.files.atomic import atomic_dir
from megatron_vlm.model.spec import UnsupportedArchitectureError

log = logging.getLogger(__name__)

IMAGE_TOKEN, START, END, VIDEO_TOKEN = "<IMG_CONTEXT>", "<img>", "</img>", "<video>"
#: the tokenizer's named extra special tokens HF's InternVLProcessor reads
NAMED_TOKENS = {"start_image_token": START, "end_image_token": END, "context_image_token": IMAGE_TOKEN,
                "video_token": VIDEO_TOKEN}
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def read_vision_source(vision_dir: Path):
    """(InternVLVisionConfig, {vision tower tensor: weight}, {projector tensor: weight}, source InternVL config or
    None) of an InternVL checkpoint or a vision-only InternViT one."""
    from transformers import AutoConfig, InternVLVisionConfig

    from megatron_vlm.convert.hf_io import HFReader
    from megatron_vlm.convert.mapping import PROJ, VT

    cfg = AutoConfig.from_pretrained(str(vision_dir))
    reader = HFReader(vision_dir)
    if cfg.model_type == "internvl":
        vit = {n[len(VT):]: reader.get(n) for n in reader.names() if n.startswith(VT)}
        proj = {n[len(PROJ):]: reader.get(n) for n in reader.names() if n.startswith(PROJ)}
        return cfg.vision_config, vit, proj, cfg
    if cfg.model_type == "internvl_vision":
        prefix = "vision_tower." if any(n.startswith("vision_tower.") for n in reader.names()) else ""
        vit = {n[len(prefix):]: reader.get(n) for n in reader.names() if n.startswith(prefix)}
        return InternVLVisionConfig(**cfg.to_dict()), vit, {}, None
    raise UnsupportedArchitectureError(
        f"--arch internvl takes its vision side from an InternVL checkpoint: {vision_dir} has model_type "
        f"{cfg.model_type!r}; give an InternVL -HF directory (model_type internvl, e.g. OpenGVLab/InternVL3_5-1B-HF) "
        "or a vision-only InternViT one (internvl_vision)")


def add_internvl_tokens(tokenizer) -> list[str]:
    """Add InternVL's tokens (and a pad token where missing) as special tokens; return those added."""
    from megatron_vlm.model.tokenizer import DEFAULT_PAD_TOKEN

    vocab = tokenizer.get_vocab()
    added = [t for t in (START, END, IMAGE_TOKEN, VIDEO_TOKEN) if t not in vocab]
    tokenizer.add_special_tokens({"additional_special_tokens": [START, END, IMAGE_TOKEN, VIDEO_TOKEN]},
                                 replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": DEFAULT_PAD_TOKEN})
        added.append(DEFAULT_PAD_TOKEN)
    return added


def image_processor_for(vision_dir: Path, tile: int):
    """The source's GotOcr2 image processor (PIL backend), or GotOcr2's at the tile size with ImageNet mean / std as
    InternVL's conversions write it."""
    from transformers import GotOcr2ImageProcessorPil

    if (vision_dir / "preprocessor_config.json").is_file():
        ip = GotOcr2ImageProcessorPil.from_pretrained(str(vision_dir))
        if dict(ip.size) != {"height": tile, "width": tile}:
            raise ValueError(f"the image processor of {vision_dir} makes {dict(ip.size)} tiles but its vision config "
                             f"takes {tile} px; fix size in its preprocessor_config.json")
        return ip
    log.warning("%s has no image processor config; using GotOcr2's at %d px (ImageNet mean/std)", vision_dir, tile)
    return default_image_processor(tile)


def default_image_processor(tile: int):
    """GotOcr2's image processor as InternVL's conversions write it (ImageNet mean / std, BICUBIC, 1..12 tiles; the
    processor asks for ``crop_to_patches``), at a ``tile``-px tile, PIL backend."""
    from transformers import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, image_mean=IMAGENET_MEAN,
                                    image_std=IMAGENET_STD, do_convert_rgb=True, crop_to_patches=False,
                                    min_patches=1, max_patches=12)


def save_processor_files(out: Path, image_processor, tokenizer, image_seq_length: int) -> None:
    """The processor files of an InternVL directory: the image processor, the tokenizer (chat template included),
    ``processor_config.json`` and the video processor's config (frames at the tile size, BICUBIC, the image
    processor's mean / std; HF's ``InternVLVideoProcessor`` settings)."""
    image_processor.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "InternVLProcessor", "image_seq_length": int(image_seq_length)}, indent=2) + "\n")
    size = dict(image_processor.size)
    (out / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "InternVLVideoProcessor", "do_convert_rgb": True, "do_resize": True,
        "size": {"height": int(size["height"]), "width": int(size["width"])}, "resample": 3, "do_rescale": True,
        "rescale_factor": float(image_processor.rescale_factor), "do_normalize": True,
        "image_mean": [float(x) for x in image_processor.image_mean],
        "image_std": [float(x) for x in image_processor.image_std], "do_sample_frames": False,
        "initial_shift": True}, indent=2) + "\n")


def named_tokenizer(tokenizer, where: Path, chat_template: str):
    """``tokenizer`` reloaded with InternVL's named extra special tokens and ``chat_template`` (saved in ``where``)."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(where))
    named = AutoTokenizer.from_pretrained(str(where), extra_special_tokens=NAMED_TOKENS)
    named.chat_template = chat_template
    return named


def build_internvl(lm, text_dir: Path, vision_dir: Path, save_dir: Path, *, vocab_size_padding=None,
                   vision_feature_layer: int | None = None, chat_template: str = "keep", seed: int = 0,
                   overwrite: bool = False) -> Path:
    """The InternVL directory of ``lm`` (a loaded HF causal LM from ``text_dir``) and ``vision_dir``'s InternViT (see
    the module docstring); returns ``save_dir``."""
    from transformers import AutoTokenizer, InternVLConfig, InternVLForConditionalGeneration, InternVLVisionModel

    from megatron_vlm.data.chat_template import choose_chat_template
    from megatron_vlm.convert.assemble import assemble
    from megatron_vlm.model.spec import _internvit_settings, _square
    from megatron_vlm.model.tokenizer import embedding_rows

    vcfg, vit_state, proj_state, source = read_vision_source(vision_dir)
    ratio = float(source.downsample_ratio) if source is not None else 0.5
    layer = vision_feature_layer if vision_feature_layer is not None else \
        (source.vision_feature_layer if source is not None else -1)
    if not -(vcfg.num_hidden_layers + 1) <= layer < vcfg.num_hidden_layers + 1:
        raise ValueError(f"--vision-feature-layer {layer} is out of range for a vision model with "
                         f"{vcfg.num_hidden_layers} layers (valid: -{vcfg.num_hidden_layers + 1}..{vcfg.num_hidden_layers})")
    tile = _square(vcfg.image_size, "vision image_size")
    side = tile // _square(vcfg.patch_size, "vision patch_size")
    seq = int(side * side * ratio * ratio)
    tokenizer = AutoTokenizer.from_pretrained(str(text_dir))
    n_lm = len(tokenizer)
    added = add_internvl_tokens(tokenizer)
    chosen = choose_chat_template(tokenizer, chat_template, IMAGE_TOKEN, what=f"--text-model {text_dir}",
                                  video_token=VIDEO_TOKEN)
    log.info("chat template: %s", chosen.note)
    lm_rows = lm.get_input_embeddings().weight.shape[0]
    rows = embedding_rows(lm_rows, len(tokenizer), vocab_size_padding)
    log.info("vocabulary: %d tokens (%d of the LM + %s); embedding rows %d -> %d", len(tokenizer), n_lm,
             ", ".join(added) or "nothing", lm_rows, rows)
    torch.manual_seed(seed)
    if rows != lm_rows:
        lm.resize_token_embeddings(rows, pad_to_multiple_of=None)
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    config = InternVLConfig(vision_config=vcfg.to_dict(), text_config=lm.config.to_dict(),
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), image_seq_length=seq,
                            downsample_ratio=ratio, projector_hidden_act="gelu", vision_feature_layer=layer,
                            vision_feature_select_strategy="default", tie_word_embeddings=tied)
    _internvit_settings(config, config.vision_config)  # what megatron cannot build is refused before anything is made
    vit = InternVLVisionModel(config.vision_config).to(lm.dtype)
    vit.load_state_dict({k: v.to(lm.dtype) for k, v in vit_state.items()})
    model = assemble(InternVLForConditionalGeneration, config, lm, vit, tokenizer, seed)
    projector = model.model.multi_modal_projector
    want = {k: tuple(v.shape) for k, v in projector.state_dict().items()}
    if proj_state and {k: tuple(v.shape) for k, v in proj_state.items()} == want:
        projector.load_state_dict({k: v.to(lm.dtype) for k, v in proj_state.items()})
        log.info("projector: %s's (its width matches the LM's %d)", vision_dir, lm.config.hidden_size)
    else:
        log.info("projector: initialised as HF initialises it (seed %d): %s", seed,
                 "the vision checkpoint has none" if not proj_state else
                 f"{vision_dir}'s projects to {source.text_config.hidden_size}, the LM takes {lm.config.hidden_size}")
    ip = image_processor_for(vision_dir, tile)
    with atomic_dir(save_dir, overwrite=overwrite, what="--save-dir") as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        save_processor_files(tmp, ip, named_tokenizer(tokenizer, tmp, chosen.template), seq)
    log.info("saved InternVL (%s + InternViT, %d tokens, %d embedding rows, image token %r = %d, %d tokens per tile) "
             "to %s", lm.config.model_type, len(tokenizer), rows, IMAGE_TOKEN, config.image_token_id, seq, save_dir)
    return save_dir
