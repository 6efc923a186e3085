"""The published Qwen2.5-VL-7B-Instruct config (``../shared/hub/Qwen__Qwen2.5-VL-7B-Instruct``), shrunk in size
only, around its real tokenizer, processor config and chat template; random weights.

Shrunk: the LM to 2 layers of hidden 128 (4 heads of 32, 2 KV heads; M-RoPE sections scaled with the head: 4/6/6
over half of its 32), the ViT to 4 layers of hidden 64 (4 heads of 16), full attention in layers 1 and 3 (the
published model: the last of every 8); the vocabulary (152,064 rows over the tokenizer's 151,665), token ids, patch,
temporal patch, merge, window size (112 px), norms and rope bases stay as published. The hub's config is flat (its text fields at the
top), as transformers reads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.support import hub

QWEN25_VL_7B = "Qwen__Qwen2.5-VL-7B-Instruct"
TEXT_SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
MROPE_SMALL = [4, 6, 6]  # the published [16, 24, 24] (halves of a 128-dim head), for a 32-dim head
VISION_SMALL = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=128,
                    fullatt_block_indexes=[1, 3])
TOKEN_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "preprocessor_config.json",
               "chat_template.json", "generation_config.json")


def small_config(**text_overrides) -> dict:
    """The hub's config.json, shrunk (:data:`TEXT_SMALL`, :data:`VISION_SMALL`)."""
    cfg = json.loads((hub.hub_model_dir(QWEN25_VL_7B) / "config.json").read_text())
    cfg.update(TEXT_SMALL, **text_overrides)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], mrope_section=MROPE_SMALL)
    cfg["vision_config"] = dict(cfg["vision_config"], **VISION_SMALL)
    return cfg


def randomize(model, seed: int) -> None:
    """Non-trivial values everywhere: norms around 1, biases, and every matrix at a standard deviation of 0.1 (HF's
    0.02 leaves attention near uniform, where a wrong rotary layout, window or mask would hardly show)."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # biases and matrices
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _hf_model(out_dir, hub_name: str, fields: dict, seed: int) -> Path:
    """An HF directory of config ``fields`` (written as given) with random fp32 weights of the class its
    ``model_type`` names, and the tokenizer, processor config and chat template of hub model ``hub_name`` beside it."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = hub.hub_model_dir(hub_name)
    for name in TOKEN_FILES:
        shutil.copyfile(src / name, out / name)
    (out / "config.json").write_text(json.dumps(fields, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(out))).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(str(out))  # the hub's on-disk names
    (out / "config.json").write_text(json.dumps(fields, indent=2))  # as published (Qwen2.5-VL's flat), shrunk
    return out


def qwen_vl_hf_model(out_dir, seed: int = 0, **text_overrides) -> Path:
    """An HF Qwen2.5-VL directory of the shrunk 7B config with random weights (fp32), the hub's tokenizer,
    processor config and chat template beside it; config.json as published (flat), shrunk; names ``model.*``,
    ``visual.*``, ``lm_head.weight``."""
    return _hf_model(out_dir, QWEN25_VL_7B, small_config(**text_overrides), seed)


QWEN3_VL_8B = "Qwen__Qwen3-VL-8B-Instruct"
#: Qwen3-VL-8B shrunk: the LM to 6 layers of hidden 128 (4 heads of 32, 2 KV heads; the interleaved M-RoPE sections
#: scaled with the head, 6/5/5 over half of its 32 as the published 24/20/20 over 64), the ViT to 4 layers of hidden
#: 64 (4 heads of 16) with three DeepStack taps (the published model taps three of 27 layers, 8/16/24), so that PP2
#: keeps the three DeepStack layers on the first stage; patch 16, temporal patch 2, merge 2, the 48 x 48 position
#: table, the vocabulary, token ids, norms and rope bases stay as published
QWEN3_TEXT_SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32)
QWEN3_MROPE_SMALL = [6, 5, 5]
QWEN3_VISION_SMALL = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=128,
                          deepstack_visual_indexes=[0, 1, 2])


def qwen3_small_config(**vision_overrides) -> dict:
    """The hub's Qwen3-VL-8B config.json (nested text and vision configs), shrunk (:data:`QWEN3_TEXT_SMALL`,
    :data:`QWEN3_VISION_SMALL`)."""
    cfg = json.loads((hub.hub_model_dir(QWEN3_VL_8B) / "config.json").read_text())
    text = dict(cfg["text_config"], **QWEN3_TEXT_SMALL)
    text["rope_scaling"] = dict(text["rope_scaling"], mrope_section=QWEN3_MROPE_SMALL)
    cfg["text_config"] = text
    cfg["vision_config"] = dict(cfg["vision_config"], **QWEN3_VISION_SMALL, **vision_overrides)
    return cfg


def qwen3_vl_hf_model(out_dir, seed: int = 0, **vision_overrides) -> Path:
    """An HF Qwen3-VL directory of the shrunk 8B config with random weights (fp32), the hub's tokenizer, processor
    config and chat template beside it; config.json as published, shrunk; names ``model.language_model.*``,
    ``model.visual.*``, ``lm_head.weight``."""
    return _hf_model(out_dir, QWEN3_VL_8B, qwen3_small_config(**vision_overrides), seed)


def logit_diffs(jobs: list[dict]) -> list[float] | None:
    """Per-rank job of tests/test_qwen_vl.py: each job {megatron_dir, tp, pp, batch, ref_file, vocab, control?} loads
    the checkpoint at (tp, pp) and returns, on rank 0, the max |logit diff| against HF's logits in ``ref_file``.
    ``control``: ``"flat"`` feeds 1-D positions instead of M-RoPE; ``"no_windows"`` gives every ViT layer full
    attention; Qwen3-VL's ``"no_deepstack"`` adds no DeepStack features, ``"sectioned"`` lays M-RoPE out in
    megatron-core's three blocks instead of interleaving it (all must fail)."""
    from megatron.core import parallel_state as ps

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.verify import max_logit_diff, megatron_forward_logits
    from tests.support.worlds import _model_for

    out = []
    for job in jobs:
        batch = job["batch"]
        model = _model_for(ckpt.resolve_iteration_dir(job["megatron_dir"]), job["tp"], job["pp"],
                           batch.combined_length)
        control = job.get("control")
        if control == "flat":
            batch = batch.flat_positions()
        elif control == "no_windows" and model.vision_model is not None:
            model.vision_model.full_attention = set(range(len(model.vision_model.decoder.layers)))
        elif control == "no_deepstack" and model.vision_model is not None:
            model.vision_model.deepstack_indexes = []  # no DeepStack features: the LM's layers get none
        elif control == "sectioned":  # megatron-core's own M-RoPE layout (three blocks), not Qwen3-VL's interleaving
            from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

            model.language_model.rotary_pos_emb.__class__ = MultimodalRotaryEmbedding
        logits = megatron_forward_logits(model, batch)
        mine = None
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            ref = torch.load(job["ref_file"], mmap=True)
            mine = max_logit_diff(ref, logits[:, : ref.shape[1]], job["vocab"], batch)
        del model, logits
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        out.append(next(g for g in gathered if g is not None))
    return out if torch.distributed.get_rank() == 0 else None
