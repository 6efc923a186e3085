"""Random-weight models around the REAL hub tokenizers, processors and chat templates (``../shared/hub``).

Tests build these to meet what users convert: the files that carry tokens (``tokenizer.json``,
``tokenizer.model``, ``vocab.json`` + ``merges.txt``, ``tokenizer_config.json``, processor configs, chat
templates) are the hub's, read from :func:`tests.support.hub.hub_model_dir` at run time into a
temporary directory; the configs are the hub's shrunk only in their sizes (hidden size, layers, heads), with
the real vocabulary size, and the weights are random. Nothing here is copied into the repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.support import hub
from tests.support.tiny import _randomize_norms

#: files that carry a hub model's tokens, processor and chat template (copied verbatim when present)
TOKEN_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "processor_config.json", "preprocessor_config.json")
#: the size every text model here is shrunk to (vocabulary and geometry stay real)
SMALL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
SMALL_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)


def copy_token_files(src: Path, dst: Path, names=TOKEN_FILES) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _save_random_lm(cfg, out_dir: Path, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize_norms(model, seed)
    model.save_pretrained(str(out_dir))


def vicuna_text_model(out_dir, seed: int = 0) -> Path:
    """lmsys/vicuna-7b-v1.5's config (vocab 32000, no GQA) shrunk, with its sentencepiece ``tokenizer.model``
    only (no ``tokenizer.json``): the LM of LLaVA-1.5."""
    from transformers import LlamaConfig

    src, out = hub.hub_model_dir(hub.VICUNA_15), Path(out_dir)
    copy_token_files(src, out, ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                                "generation_config.json"))
    cfg = LlamaConfig.from_pretrained(str(src))
    cfg.update({**SMALL_TEXT, "num_key_value_heads": 4})
    _save_random_lm(cfg, out, seed)
    return out


def qwen2_text_model(out_dir, seed: int = 0) -> Path:
    """A Qwen2-7B-Instruct-shaped LM on the real Qwen2 vocabulary: lmms-lab's OneVision copy of vocab.json,
    merges.txt and tokenizer_config.json (151,643 BPE tokens + ``<|endoftext|>``, ``<|im_start|>``,
    ``<|im_end|>`` and ``<image>`` = 151646, ChatML template), the config's 152,064 embedding rows, untied."""
    from transformers import Qwen2Config

    src, out = hub.hub_model_dir(hub.ONEVISION_QWEN2), Path(out_dir)
    copy_token_files(src, out, ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
                                "added_tokens.json"))
    real = json.loads((src / "config.json").read_text())
    cfg = Qwen2Config(vocab_size=real["vocab_size"], rms_norm_eps=real["rms_norm_eps"], rope_theta=real["rope_theta"],
                      max_position_embeddings=real["max_position_embeddings"], tie_word_embeddings=False,
                      bos_token_id=real["bos_token_id"], eos_token_id=real["eos_token_id"], **SMALL_TEXT)
    _save_random_lm(cfg, out, seed)
    return out


def siglip_vision_model(out_dir, image_size: int | None = None, patch_size: int | None = None, seed: int = 1) -> Path:
    """google/siglip-so400m-patch14-384's vision config shrunk (optionally to a smaller tile), with its image
    processor (resized to ``image_size`` when given)."""
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    src, out = hub.hub_model_dir(hub.SIGLIP_SO400M), Path(out_dir)
    vcfg = SiglipVisionConfig(**json.loads((src / "config.json").read_text())["vision_config"])
    vcfg.update({**SMALL_VISION, **({"image_size": image_size} if image_size else {}),
                 **({"patch_size": patch_size} if patch_size else {})})
    torch.manual_seed(seed)
    model = SiglipVisionModel(vcfg)
    _randomize_norms(model, seed)
    model.save_pretrained(str(out))
    proc = SiglipImageProcessorPil.from_pretrained(str(src))
    if image_size:
        proc.size = {"height": image_size, "width": image_size}
    proc.save_pretrained(str(out))
    return out


def llava15_model(out_dir, image_size: int | None = None, seed: int = 0) -> Path:
    """llava-hf/llava-1.5-7b-hf as users convert it: its config shrunk (vocab 32064, image token 32000, pad
    32001, CLIP at patch 14, layer -2), random weights, and its tokenizer, processor and chat template files
    verbatim (the template closes no assistant turn with an end token). ``image_size`` shrinks the 336-px tile
    (576 image tokens) and the image processor's resize and crop with it."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    src, out = hub.hub_model_dir(hub.LLAVA_15), Path(out_dir)
    copy_token_files(src, out, TOKEN_FILES + ("generation_config.json",))
    cfg = LlavaConfig.from_pretrained(str(src))
    cfg.text_config.update({**SMALL_TEXT, "num_key_value_heads": 4})
    cfg.vision_config.update(SMALL_VISION)
    if image_size:
        cfg.vision_config.image_size = image_size
        cfg.image_seq_length = (image_size // cfg.vision_config.patch_size) ** 2
        pre = json.loads((out / "preprocessor_config.json").read_text())
        pre["size"], pre["crop_size"] = {"shortest_edge": image_size}, {"height": image_size, "width": image_size}
        (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32)
    _randomize_norms(model, seed)
    model.save_pretrained(str(out))
    return out


#: Qwen3 shrunk: head_dim stays independent of hidden/heads (4 heads of 32 in a hidden size of 64; Qwen3-4B has 32
#: heads of 128 in 2560)
QWEN3_SMALL = dict(SMALL_TEXT, head_dim=32)


def qwen3_text_model(out_dir, seed: int = 0, tie_word_embeddings: bool | None = None, **overrides) -> Path:
    """Qwen/Qwen3-4B-Instruct-2507's config shrunk in size only (hidden 64, 4 heads of ``head_dim`` 32, 2 KV heads,
    2 layers; q/k RMSNorm per head, rope_theta 5e6, 151,936 embedding rows, tied embeddings), with its
    ``tokenizer_config.json`` (thinking chat template, 26 added tokens) over the Qwen2 ``vocab.json`` and
    ``merges.txt`` it shares (from lmms-lab's OneVision folder): 151,669 tokens. ``tie_word_embeddings=False``
    gives the 8B-and-up layout (a separate ``lm_head``)."""
    from transformers import Qwen3Config

    src, out = hub.hub_model_dir(hub.QWEN3_4B), Path(out_dir)
    copy_token_files(hub.hub_model_dir(hub.ONEVISION_QWEN2), out, ("vocab.json", "merges.txt"))
    copy_token_files(src, out, ("tokenizer_config.json",))
    real = json.loads((src / "config.json").read_text())
    real.update(QWEN3_SMALL)
    if tie_word_embeddings is not None:
        real["tie_word_embeddings"] = tie_word_embeddings
    real.update(overrides)
    cfg = Qwen3Config(**{k: v for k, v in real.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                                     "transformers_version")})
    _save_random_lm(cfg, out, seed)
    return out


#: Qwen/Qwen3-30B-A3B-Instruct-2507's config as published (the LM of the 30B-A3B OneVision-1.5 / InternVL3.5 /
#: Qwen3-VL variants); no file of it is stored in ../shared/hub, so its values are written out here
QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     intermediate_size=6144, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     rope_theta=10_000_000.0, router_aux_loss_coef=0.001, output_router_logits=False,
                     tie_word_embeddings=False, vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=262144,
                     hidden_act="silu", attention_bias=False)
#: shrunk in size only: hidden 64, 4 layers, 4 heads of 32 with 2 KV heads, 8 experts of 32 (top 2)
QWEN3_MOE_SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128)


def qwen3_moe_text_model(out_dir, seed: int = 0, **overrides) -> Path:
    """Qwen3-30B-A3B-Instruct-2507's config (:data:`QWEN3_30B_A3B`) shrunk in size only (:data:`QWEN3_MOE_SMALL`;
    routing, norms, rope, untied 151,936-row embeddings as published) around Qwen3's real tokenizer (the
    ``tokenizer_config.json`` of Qwen3-4B-Instruct-2507, whose tokenizer the 30B-A3B model shares, over the Qwen2
    ``vocab.json``/``merges.txt``: 151,669 tokens)."""
    from transformers import Qwen3MoeConfig

    out = Path(out_dir)
    copy_token_files(hub.hub_model_dir(hub.ONEVISION_QWEN2), out, ("vocab.json", "merges.txt"))
    copy_token_files(hub.hub_model_dir(hub.QWEN3_4B), out, ("tokenizer_config.json",))
    cfg = Qwen3MoeConfig(**{**QWEN3_30B_A3B, **QWEN3_MOE_SMALL, **overrides})
    _save_random_lm(cfg, out, seed)
    return out
