"""Tiny Hugging Face models and tokenizers built from configs (random weights, no downloads).

Tests, the demo and benchmarks use these to produce real HF directories -- a causal LM directory with its
own trained tokenizer, a vision encoder directory with its image processor -- which then go through the
same user-facing code (``convert/build_llava.py`` and friends) as real hub models.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

TEXT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3_moe", "mixtral")
#: the tiny mixture-of-experts shape: 4 experts, top 2, experts half the dense MLP's size
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
VISION_FAMILIES = ("clip", "siglip")

DEFAULT_CORPUS = [
    "what colour is the shape ? red green blue yellow purple orange white black",
    "what shape is it ? circle square triangle star cross",
    "where is the shape ? left right top bottom centre middle corner",
    "how many shapes are there ? one two three four five zero",
    "the quick brown fox jumps over the lazy dog . a picture of a cat and a dog .",
    "USER: ASSISTANT: SYSTEM: describe the image in one word please answer yes no",
]


def train_tokenizer(out_dir: str | os.PathLike, texts=None, vocab_size: int = 300, family: str = "llama"):
    """Train a byte-level BPE tokenizer on ``texts`` and save it as an HF fast tokenizer in ``out_dir``.

    ``family='qwen2'`` gives a tokenizer without BOS (like Qwen2); others have ``<s>``/``</s>``/``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts or DEFAULT_CORPUS)
    if family == "qwen2":
        specials = {"eos_token": "<|endoftext|>"}
    else:
        specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tok = Tokenizer(models.BPE(unk_token=specials.get("unk_token")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    hf.save_pretrained(str(out_dir))
    return hf


# A ChatML template shaped like Qwen2-Instruct's: a default system turn, string contents, <|im_end|> closing turns.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# An [INST] template shaped like Mistral-7B-Instruct-v0.3's: BOS, '[INST] q[/INST]', ' answer</s>', string contents.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + '[/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
)
# Mistral v0.3's control tokens, which take the ids right after <unk>, <s>, </s> (then [control_N] up to 767).
MISTRAL_CONTROL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]")


def chatml_tokenizer(out_dir: str | os.PathLike, texts=None, vocab_size: int = 300):
    """A Qwen2-Instruct-shaped tokenizer: byte-level BPE without BOS; ``<|endoftext|>``, ``<|im_start|>``,
    ``<|im_end|>`` added after the trained vocabulary as special tokens (the last two as extra special tokens),
    eos ``<|im_end|>``, pad ``<|endoftext|>``, a ChatML chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts or DEFAULT_CORPUS), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return hf


def mistral_tokenizer(out_dir: str | os.PathLike, texts=None, vocab_size: int = 300, controls: int = 768):
    """A Mistral-v0.3-shaped tokenizer: sentencepiece-style BPE (metaspace, byte fallback); ``<unk>``, ``<s>``,
    ``</s>``, the control tokens ``[INST]``, ``[/INST]``, ... and ``[control_N]`` in the first ``controls`` ids
    as special tokens; the ``[INST]`` chat template; no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    named = ["<unk>", "<s>", "</s>", *MISTRAL_CONTROL]
    specials = named + [f"[control_{i}]" for i in range(len(named), controls)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=controls + vocab_size, special_tokens=specials,
                                  initial_alphabet=[f"<0x{i:02X}>" for i in range(256)], show_progress=False)
    tok.train_from_iterator(list(texts or DEFAULT_CORPUS), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 additional_special_tokens=specials[3:])
    hf.chat_template = MISTRAL_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return hf


#: tokenizer styles of :func:`make_text_model`: the plain BPE of :func:`train_tokenizer` and real-shaped ones
TOKENIZER_STYLES = {"plain": None, "chatml": chatml_tokenizer, "mistral_v03": mistral_tokenizer}


def text_config(family: str = "llama", vocab_size: int = 300, **overrides):
    """A tiny config of ``family`` (GQA; Llama-3 rope scaling for llama; qkv bias + tied embeddings for qwen2;
    qwen3_moe and mixtral: :data:`TINY_MOE` experts, q/k norms and its own ``head_dim`` for qwen3_moe)."""
    from transformers import AutoConfig

    if family not in TEXT_FAMILIES:
        raise ValueError(f"unknown text family {family!r}; choose from {TEXT_FAMILIES}")
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    if family == "llama":
        kw.update(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    elif family == "mistral":
        kw.update(sliding_window=None, rms_norm_eps=1e-6)
    elif family == "qwen2":
        kw.update(tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
    elif family == "qwen3_moe":
        kw.update(TINY_MOE, head_dim=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  rope_theta=1000000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.001)
    elif family == "mixtral":
        kw.update(num_local_experts=TINY_MOE["num_experts"], num_experts_per_tok=TINY_MOE["num_experts_per_tok"],
                  intermediate_size=TINY_MOE["moe_intermediate_size"], sliding_window=None, rms_norm_eps=1e-5,
                  router_aux_loss_coef=0.02)
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def make_text_model(out_dir, family: str = "llama", texts=None, seed: int = 0, tokenizer: str = "plain",
                    vocab_rows: int | None = None, **overrides) -> Path:
    """Save a tiny random causal LM of ``family`` with its own trained tokenizer in ``out_dir``.

    ``tokenizer``: a style of :data:`TOKENIZER_STYLES`; ``vocab_rows``: embedding rows (default: the tokenizer's
    length; real LMs often have more, e.g. Qwen2's 152064 for 151646 tokens)."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    make = TOKENIZER_STYLES[tokenizer]
    tok = train_tokenizer(out_dir, texts=texts, family=family) if make is None else make(out_dir, texts=texts)
    cfg = text_config(family, vocab_size=vocab_rows or len(tok), **overrides)
    if tok.bos_token_id is not None:
        cfg.bos_token_id = tok.bos_token_id
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize_norms(model, seed)
    model.save_pretrained(str(out_dir))
    return out_dir


def vision_config(family: str = "clip", **overrides):
    from transformers import CLIPVisionConfig, SiglipVisionConfig

    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        layer_norm_eps=1e-5,
    )
    kw.update(overrides)
    if family == "clip":
        kw.setdefault("projection_dim", 32)
        return CLIPVisionConfig(**kw)
    if family == "siglip":
        kw.setdefault("layer_norm_eps", 1e-6)
        return SiglipVisionConfig(**kw)
    raise ValueError(f"unknown vision family {family!r}; choose from {VISION_FAMILIES}")


def make_vision_model(out_dir, family: str = "clip", full: bool = False, seed: int = 1, **overrides) -> Path:
    """Save a tiny random vision encoder (vision-only, or the full dual encoder with ``full``) + image processor."""
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPVisionModel,
        SiglipConfig,
        SiglipImageProcessor,
        SiglipModel,
        SiglipVisionModel,
    )

    out_dir = Path(out_dir)
    vcfg = vision_config(family, **overrides)
    torch.manual_seed(seed)
    if family == "clip":
        if full:
            cfg = CLIPConfig(
                vision_config=vcfg.to_dict(),
                text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, vocab_size=99, projection_dim=32),
                projection_dim=32,
            )
            model = CLIPModel(cfg)
        else:
            model = CLIPVisionModel(vcfg)
        proc = CLIPImageProcessor(
            size={"shortest_edge": vcfg.image_size},
            crop_size={"height": vcfg.image_size, "width": vcfg.image_size},
        )
    else:
        if full:
            cfg = SiglipConfig(
                vision_config=vcfg.to_dict(),
                text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, vocab_size=99),
            )
            model = SiglipModel(cfg)
        else:
            model = SiglipVisionModel(vcfg)
        proc = SiglipImageProcessor(size={"height": vcfg.image_size, "width": vcfg.image_size})
    _randomize_norms(model, seed)
    model.save_pretrained(str(out_dir))
    proc.save_pretrained(str(out_dir))
    return out_dir


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Give norms and biases non-trivial values so that a mapping mistake on them changes logits."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or "layer_norm" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def make_tiny_llava(
    out_dir,
    text_family: str = "llama",
    vision_family: str = "clip",
    work_dir=None,
    texts=None,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    **build_kwargs,
) -> Path:
    """Build a tiny HF LLaVA directory via the real ``build_llava`` (the function behind convert/build_llava.py)."""
    from megatron_vlm.convert.build import build_llava

    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir else out_dir.parent / (out_dir.name + "_parts")
    text_dir = make_text_model(work / f"text_{text_family}", text_family, texts=texts, **(text_overrides or {}))
    vision_dir = make_vision_model(work / f"vision_{vision_family}", vision_family, **(vision_overrides or {}))
    build_llava(text_dir, vision_dir, out_dir, **build_kwargs)
    return out_dir


def make_tiny_onevision(out_dir, text_family: str = "qwen2", vision_family: str = "siglip", work_dir=None,
                        arch: str = "llava_onevision", texts=None, vision_overrides: dict | None = None,
                        **build_kwargs) -> Path:
    """A tiny OneVision-style model (or ``arch='llava_next'``) through the real ``build_llava``: 20-px tiles at
    patch 6 (a valid convolution of 3 x 3 patches with 2 px left over, as 384 px at patch 14), grids up to
    3 x 3 tiles, ``anyres_max_2`` so that large images are downsampled, features of the last layer."""
    build_kwargs.setdefault("max_grid", 3)
    if arch == "llava_onevision":
        build_kwargs.setdefault("vision_aspect_ratio", "anyres_max_2")
    build_kwargs.setdefault("vision_feature_layer", -1)
    return make_tiny_llava(out_dir, text_family, vision_family, work_dir=work_dir, texts=texts,
                           vision_overrides=vision_overrides or {"image_size": 20, "patch_size": 6}, arch=arch,
                           **build_kwargs)
