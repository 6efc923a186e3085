"""The published InternVL3 / InternVL3.5 ``-HF`` checkpoints' configs, shrunk in size only, around the real Qwen
tokenizer (``../shared/hub``) with InternVL's special tokens; random weights.

None of these checkpoints is stored in ``../shared/hub``; their fields are written out here from their sources:

- the vision config of every InternVL3.5 ``-HF`` checkpoint is one of two InternViTs, ``vit_300m_config`` and
  ``vit_6b_config`` of OpenGVLab's InternVL3.5 custom -> HF conversion script (the one that wrote the
  ``OpenGVLab/InternVL3_5-*-HF`` repos, ViT-6B for 38B / 241B); the same script sets ``image_token_id`` 151671,
  ``image_seq_length`` 256, ``vision_feature_layer`` -1, ``vision_feature_select_strategy`` 'default', writes no
  top-level ``tie_word_embeddings`` (so transformers 5's default, True, applies), copies the original model's
  ``llm_config`` as ``text_config``, gives the tokenizer ``<img>``, ``</img>``, ``<IMG_CONTEXT>`` and ``<video>``
  as its named extra special tokens, and the chat template that renders an image as ``<IMG_CONTEXT>\\n`` and a
  video as ``<video>\\n`` (:data:`CHAT_TEMPLATE`);
- the text configs are the LMs the InternVL3.5 model card names (1B: Qwen3-0.6B, 8B: Qwen3-8B, 30B-A3B:
  Qwen3-30B-A3B) as their published config.json files give them; InternVL3-2B is Qwen2.5-1.5B with the
  151,674-row embedding of InternVL3's tokenizer (transformers' ``convert_internvl_weights_to_hf.py``: the
  Qwen2.5 tokenizer plus ``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ``<quad>``, ``</quad>``, ``<ref>``, ``</ref>``,
  ``<box>``, ``</box>``; ``image_token_id`` 151667);
- the image processor: GotOcr2's (``crop_to_patches``, 1..12 tiles and a thumbnail), ImageNet mean / std, BICUBIC,
  as that script writes it.

Shrunk: hidden sizes, layers, heads, experts and the tile (56 px of 14-px patches: 4 tokens per tile after the pixel
shuffle); vocabularies, token ids, norms, rope, biases, tying and routing stay as published.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_vlm.convert.build_internvl import NAMED_TOKENS, default_image_processor, save_processor_files
from tests.support import hub
from tests.support.hub_models import QWEN3_30B_A3B, copy_token_files
from tests.support.tiny import _randomize_norms

#: InternVL's tokens, in the order InternVL's tokenizers hold them after the LM's own (<IMG_CONTEXT> is the image
#: token: 151667 after Qwen2.5's 151,665 tokens, 151671 after Qwen3's 151,669)
INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>")
#: the -HF chat template (OpenGVLab's conversion script): images as <IMG_CONTEXT>, videos as <video>, each + newline
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}")

#: InternViT-300M-448px (InternVL3 and InternVL3.5 up to 30B-A3B)
VIT_300M = dict(attention_bias=True, attention_dropout=0.0, hidden_act="gelu", hidden_dropout_prob=0.0,
                hidden_size=1024, image_size=[448, 448], initializer_factor=0.1, initializer_range=1e-10,
                intermediate_size=4096, layer_norm_eps=1e-06, layer_scale_init_value=0.1, norm_type="layer_norm",
                num_attention_heads=16, num_channels=3, num_hidden_layers=24, patch_size=[14, 14],
                projection_dropout=0.0, use_absolute_position_embeddings=True, use_mask_token=False,
                use_mean_pooling=True, use_qk_norm=False)
#: InternViT-6B-448px (InternVL3.5-38B, -241B-A28B): RMSNorm, q/k norms over all heads, no q/k/v bias, 25 heads
VIT_6B = dict(VIT_300M, attention_bias=False, hidden_size=3200, intermediate_size=12800, norm_type="rms_norm",
              num_attention_heads=25, num_hidden_layers=45, use_qk_norm=True)
#: shrunk: a 56-px tile (4 x 4 patches of 14 -> 4 tokens after the pixel shuffle), 2 layers of 32 (4 heads of 8)
VIT_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=[56, 56])

#: the LMs (their published config.json fields)
QWEN3_06B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936,
                 hidden_act="silu", attention_bias=False, bos_token_id=151643, eos_token_id=151645)
QWEN3_8B = dict(QWEN3_06B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                tie_word_embeddings=False)
#: Qwen3-30B-A3B as InternVL3.5-30B-A3B carries it (the April release: rope 1e6 over 40,960 positions)
QWEN3_30B_A3B_BASE = dict(QWEN3_30B_A3B, model_type="qwen3_moe", rope_theta=1_000_000.0,
                          max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)
QWEN25_15B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151674,
                  hidden_act="silu", sliding_window=32768, use_sliding_window=False, max_window_layers=21,
                  bos_token_id=151643, eos_token_id=151645)
#: shrunk: hidden 64, 2 layers, 4 heads of 32 with 2 KV heads (MoE: 4 layers, 8 experts of 32, top 2)
TEXT_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
MOE_SMALL = dict(TEXT_SMALL, num_hidden_layers=4, head_dim=32, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32)

#: name -> (text config, its shrink, vision config, tokenizer: 'qwen3' (3.5) or 'qwen25' (InternVL3))
CHECKPOINTS = {
    "InternVL3_5-1B-HF": (QWEN3_06B, dict(TEXT_SMALL, head_dim=32), VIT_300M, "qwen3"),
    "InternVL3_5-8B-HF": (QWEN3_8B, dict(TEXT_SMALL, head_dim=32), VIT_300M, "qwen3"),
    "InternVL3_5-30B-A3B-HF": (QWEN3_30B_A3B_BASE, MOE_SMALL, VIT_300M, "qwen3"),
    "InternVL3-2B-HF": (QWEN25_15B, TEXT_SMALL, VIT_300M, "qwen25"),
    # InternVL3.5-38B's layout (Qwen3-32B is Qwen3-8B's shape, untied) for InternViT-6B
    "InternVL3_5-38B-HF": (QWEN3_8B, dict(TEXT_SMALL, head_dim=32), VIT_6B, "qwen3"),
}


def internvl_tokenizer(out_dir, layout: str = "qwen3"):
    """Qwen3's real tokenizer (Qwen3-4B-Instruct-2507's ``tokenizer_config.json`` over the Qwen2 BPE files it
    shares) with InternVL's tokens: ``layout='qwen3'`` (InternVL3.5): its 151,669 tokens, then
    :data:`INTERNVL_TOKENS` (``<IMG_CONTEXT>`` = 151671) and ``<video>`` (151678); ``'qwen25'`` (InternVL3): the
    151,665 tokens of Qwen2.5 (Qwen3's without the four it added after them), then :data:`INTERNVL_TOKENS`
    (``<IMG_CONTEXT>`` = 151667; 151,674 tokens), its video token Qwen2.5's ``<|video_pad|>``."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    copy_token_files(hub.hub_model_dir(hub.ONEVISION_QWEN2), out, ("vocab.json", "merges.txt"))
    cfg = json.loads((hub.hub_model_dir(hub.QWEN3_4B) / "tokenizer_config.json").read_text())
    if layout == "qwen25":
        cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if int(k) < 151665}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": list(INTERNVL_TOKENS)}, replace_extra_special_tokens=False)
    video = "<|video_pad|>"
    if layout == "qwen3":
        video = "<video>"
        tok.add_tokens([video], special_tokens=True)
    tok = AutoTokenizer.from_pretrained(_save(tok, out), extra_special_tokens={**NAMED_TOKENS, "video_token": video})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _save(tok, out: Path) -> str:
    tok.save_pretrained(str(out))
    return str(out)


def randomize_internvl(model, seed: int) -> None:
    """Non-trivial values where HF initialises constants (InternViT's layer scales 0.1, position embeddings and class
    token zeros; norms and biases), so that a mapping mistake on them changes logits; and InternViT's weights at a
    standard deviation of 0.1: the published ``initializer_range`` (1e-10) leaves its attention uniform (q.k ~ 0),
    where a wrong q/k/v layout or q/k norm would not show."""
    _randomize_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lambda_1", "lambda_2")) or "position_embeddings" in name or "cls_token" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "vision_tower" in name and name.endswith("weight") and p.dim() > 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def internvl_hf_model(out_dir, name: str = "InternVL3_5-1B-HF", seed: int = 0, **text_overrides) -> Path:
    """An HF InternVL directory shaped as published checkpoint ``name`` (:data:`CHECKPOINTS`), shrunk in size only,
    random weights; its config.json has the published fields (no top-level ``tie_word_embeddings``), and an untied
    LM's checkpoint holds its own ``lm_head`` (transformers 5 then loads it untied, as the published ones)."""
    from transformers import AutoConfig, InternVLConfig, InternVLForConditionalGeneration

    text, small, vision, layout = CHECKPOINTS[name]
    out = Path(out_dir)
    tok = internvl_tokenizer(out, layout)
    text = {**text, **small, **text_overrides}
    tile = VIT_SMALL["image_size"][0]
    side = tile // vision["patch_size"][0]
    fields = dict(architectures=["InternVLForConditionalGeneration"], downsample_ratio=0.5,
                  image_seq_length=side * side // 4, image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
                  model_type="internvl", projector_hidden_act="gelu", text_config=text,
                  vision_config=dict(vision, **VIT_SMALL, model_type="internvl_vision"), vision_feature_layer=-1,
                  vision_feature_select_strategy="default")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(fields, indent=2))
    cfg = AutoConfig.from_pretrained(str(out))
    assert isinstance(cfg, InternVLConfig) and cfg.tie_word_embeddings  # transformers 5's top-level default
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg).to(torch.float32)
    if not text["tie_word_embeddings"]:  # the published untied checkpoints hold a distinct lm_head
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.02)
        model.config.tie_word_embeddings = False  # so that save_pretrained writes it
    randomize_internvl(model, seed)
    model.save_pretrained(str(out))  # HF's on-disk names (experts one by one)
    (out / "config.json").write_text(json.dumps(fields, indent=2))  # as published, not as transformers re-writes it
    save_processor_files(out, default_image_processor(tile), tok, fields["image_seq_length"])
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
