"""An HF VLM from its parts: a config, the LM's and the vision tower's weights, the tokenizer's special tokens.

Shared by the LLaVA / LLaVA-NeXT / OneVision build (:mod:`megatron_vlm.convert.build`) and the InternVL one
(:mod:`megatron_vlm.convert.build_internvl`).
"""

from __future__ import annotations

import torch


def assemble(model_cls, config, lm, vit, tokenizer, seed: int):
    """An HF ``model_cls`` (LLaVA, LLaVA-NeXT or OneVision) from ``config`` holding ``lm``'s and ``vit``'s weights
    (the projector, and ``image_newline`` where the architecture has one, initialised from ``seed``), with the
    tokenizer's special tokens in its config and generation config."""
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = model_cls(config).to(lm.dtype)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    if not config.tie_word_embeddings:
        model.lm_head.load_state_dict(lm.lm_head.state_dict())
    else:
        model.tie_weights()
    model.model.vision_tower.load_state_dict(vit.state_dict())
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.eos_token_id = stop_token_ids(tokenizer)
    if tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    return model


def stop_token_ids(tokenizer) -> int | list[int]:
    """What ``generate`` stops at: the eos, and the token the chat template closes answers with if another
    (Llama-3's ``<|eot_id|>`` with a base tokenizer's ``<|end_of_text|>``)."""
    from megatron_vlm.data.chat_tokens import ChatTokenizer

    eos = tokenizer.eos_token_id
    if not getattr(tokenizer, "is_fast", False):  # the closing token is found with a fast tokenizer's offsets
        return eos
    closing = ChatTokenizer(tokenizer).closing_token
    cid = tokenizer.convert_tokens_to_ids(closing) if closing else None
    return eos if cid is None or cid == eos else [eos, cid]
