"""build_llava makes an HF LLaVA directory that transformers loads and generates with."""

import pytest
import torch

from megatron_vlm.model.tokenizer import special_token_ids

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="build_llava writes an HF directory that HF loads and generates with: transformers, tokenizers and "
           "safetensors, pinned alike in both lanes")


@pytest.mark.parametrize("name", ["llama_clip", "qwen2_siglip"])
def test_loads_processes_and_generates(name, hf_models):
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

    d = hf_models[name]
    model = LlavaForConditionalGeneration.from_pretrained(str(d))
    proc = AutoProcessor.from_pretrained(str(d))
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = special_token_ids(tok)
    assert ids.image == model.config.image_token_id and ids.pad is not None
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it ?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    assert text.endswith("ASSISTANT:") and "USER: <image>\n" in text
    inputs = proc(images=Image.new("RGB", (40, 30), (200, 10, 10)), text=text, return_tensors="pt")
    n_img = (inputs["input_ids"] == ids.image).sum().item()
    assert n_img == model.config.image_seq_length == 16
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_full_clip_checkpoint_and_vocab_padding(tmp_path):
    from transformers import LlavaForConditionalGeneration

    from megatron_vlm.convert.build import build_llava
    from tests.support.tiny import make_text_model, make_vision_model

    text = make_text_model(tmp_path / "t", "llama")
    vision = make_vision_model(tmp_path / "v", "clip", full=True)
    out = build_llava(text, vision, tmp_path / "llava", vocab_size_padding=64)
    m = LlavaForConditionalGeneration.from_pretrained(str(out))
    assert m.config.text_config.vocab_size % 64 == 0
    from transformers import CLIPModel

    ref = CLIPModel.from_pretrained(str(vision)).vision_model.state_dict()
    got = {k.removeprefix("vision_model."): v for k, v in m.model.vision_tower.state_dict().items()}
    assert got.keys() == ref.keys()
    for k, v in got.items():
        assert torch.equal(v, ref[k]), k


def test_rejects_unsupported_text_model(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_vlm.convert.build import build_llava
    from megatron_vlm.model.spec import UnsupportedArchitectureError
    from tests.support.tiny import make_vision_model

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "g")
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'; supported: llama, mistral, qwen2"):
        build_llava(tmp_path / "g", make_vision_model(tmp_path / "v"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
