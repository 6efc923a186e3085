"""VLMTaskEncoder parity with HF LLaVA: pixel values, expanded token sequence, loss mask = the answers."""

from __future__ import annotations

import pytest
import torch
from megatron.energon import SkipSample, VQASample

from megatron_vlm.data.sample import ConversationSample
from megatron_vlm.data.task_encoder import VLMBatch, VLMTaskEncoder
from tests.data_fixtures import tiny_llava

from .conversation_helpers import CONVERSATIONS, asst, pil, user

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="the task encoder against HF's processor: transformers, tokenizers and PIL, pinned alike in both "
           "lanes")

FAMILIES = [("llama", "clip"), ("qwen2", "siglip")]


@pytest.fixture(params=FAMILIES, ids=lambda p: "-".join(p))
def encoder(request, tmp_path_factory):
    return VLMTaskEncoder(tiny_llava(tmp_path_factory, *request.param), seq_length=256)


def answer_spans(enc, out) -> list[str]:
    """Decoded label tokens of each contiguous loss_mask == 1 run."""
    mask, labels = out["loss_mask"].bool().tolist(), out["labels"].tolist()
    runs, cur = [], []
    for m, t in zip(mask, labels):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [enc.tokenizer.decode(r) for r in runs]


def expand(tokens: list[int], image_id: int, k: int) -> list[int]:
    out = []
    for t in tokens:
        out += [t] * k if t == image_id else [t]
    return out


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_parity_with_hf_processor(encoder, name):
    messages, n_img = CONVERSATIONS[name]
    images = [pil(i, (45 + 7 * i, 30)) for i in range(n_img)]
    out = encoder.encode_conversation(messages, images)
    proc = encoder.processor  # the same directory's processor, as HF inference loads it
    text = proc.apply_chat_template(messages, tokenize=False)
    hf = proc(text=text, images=images or None, add_special_tokens=False, return_tensors="pt")
    # 1) the sequence with every image token expanded is exactly HF's input_ids
    x = out["tokens"].tolist() + out["labels"][-1:].tolist()
    assert out["labels"][:-1].tolist() == x[1:-1]
    assert expand(x, encoder.image_token_id, encoder.tokens_per_image) == hf["input_ids"][0].tolist()
    assert out["num_tokens"] == len(out["tokens"]) + (encoder.tokens_per_image - 1) * n_img
    # 2) pixel values are HF's, bit for bit
    if n_img:
        assert out["images"].dtype == torch.float32
        assert torch.equal(out["images"], hf["pixel_values"].to(torch.float32))
    else:
        assert tuple(out["images"].shape) == (0, 3, encoder.geometry.height, encoder.geometry.width)
    # 3) unmasked labels decode to exactly the answers (each closed by the eos of its turn)
    answers = [m["content"][0]["text"] for m in messages if m["role"] == "assistant"]
    eos = encoder.tokenizer.eos_token
    spans = answer_spans(encoder, out)
    assert [s.removesuffix(eos) .lstrip(" ") for s in spans] == answers
    assert all(s.endswith(eos) for s in spans)
    # ... and nothing of the prompt is trained on
    assert int(out["loss_mask"].sum()) == sum(
        len(encoder.tokenizer(s, add_special_tokens=False)["input_ids"]) for s in spans)


def test_truncation_never_cuts_an_image(tmp_path_factory):
    enc = VLMTaskEncoder(tiny_llava(tmp_path_factory), seq_length=80)
    k = enc.tokens_per_image  # 16
    long_q = "what colour is the shape ? " * 8
    msgs = [user("<image>\nwhat shape ?"), asst("a square"), user(long_q + "<image>\nand here ?"), asst("red")]
    out = enc.encode_conversation(msgs, [pil(1), pil(2)])
    # the second image does not fit after the long question: text cut before it, its pixels dropped
    assert out["images"].shape[0] == 1
    assert int((out["tokens"] == enc.image_token_id).sum()) == 1
    assert out["num_tokens"] == len(out["tokens"]) + k - 1 <= 80
    assert answer_spans(enc, out)[0].lstrip(" ").removesuffix(enc.tokenizer.eos_token) == "a square"
    # fits exactly: num_tokens == seq_length when there is more text than room
    assert out["num_tokens"] == 80
    full = enc.chat(msgs).ids
    assert out["tokens"].tolist() == full[: len(out["tokens"])]  # a prefix: text cut at the end only


def test_skips(tmp_path_factory):
    enc = VLMTaskEncoder(tiny_llava(tmp_path_factory), seq_length=20)
    with pytest.raises(SkipSample):  # two images need 32 > 20 positions
        enc.encode_conversation([user("<image>\n<image>\nq"), asst("a")], [pil(1), pil(2)])
    with pytest.raises(SkipSample):  # the answer lies beyond seq_length
        enc.encode_conversation([user("<image>\n" + "what colour is the shape ? " * 4), asst("red")], [pil(1)])
    with pytest.raises(SkipSample):  # placeholder count does not match images
        enc.encode_conversation([user("<image>\nq"), asst("a")], [])
    assert sum(enc.skipped.values()) == 3


def test_samples_and_batch(tmp_path_factory):
    enc = VLMTaskEncoder(tiny_llava(tmp_path_factory), seq_length=256)
    base = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    vqa = VQASample(__key__="a", image=pil(3), context="what colour ?", answers="red", answer_weights=None, **base)
    conv = ConversationSample(__key__="b", images=[pil(4), pil(5)], messages=CONVERSATIONS["two_images"][0], **base)
    text = ConversationSample(__key__="c", images=[], messages=CONVERSATIONS["text_only"][0], **base)
    encoded = [enc.encode_sample(s) for s in (vqa, conv, text)]
    batch = enc.batch(encoded)
    assert isinstance(batch, VLMBatch) and batch.__key__ == ["a", "b", "c"]
    B, S = batch.tokens.shape
    lengths = [len(e.tokens) for e in encoded]
    assert (B, S) == (3, max(lengths))
    assert batch.tokens.dtype == batch.labels.dtype == torch.int64 and batch.loss_mask.dtype == torch.float32
    assert batch.images.shape == (3, 3, 32, 32) and batch.num_image_tiles.tolist() == [1, 1, 1]
    assert batch.num_image_tiles.dtype == torch.int32
    for b, e in enumerate(encoded):
        n = lengths[b]
        assert torch.equal(batch.tokens[b, :n], e.tokens) and torch.equal(batch.loss_mask[b, :n], e.loss_mask)
        assert (batch.tokens[b, n:] == enc.pad_token_id).all() and (batch.loss_mask[b, n:] == 0).all()
    assert int((batch.tokens == enc.image_token_id).sum()) == 3
    assert batch.num_tokens == sum(e.num_tokens for e in encoded)
    only_text = enc.batch([encoded[2]])
    assert only_text.images.shape == (0, 3, 32, 32) and only_text.num_image_tiles.shape == (0,)


def test_tensor_images_from_default_decoder_give_same_pixels(tmp_path_factory):
    """Energon's default decoder yields float CHW tensors; they map back to the exact same pixel values."""
    import numpy as np

    enc = VLMTaskEncoder(tiny_llava(tmp_path_factory), seq_length=256)
    im = pil(7)
    as_tensor = torch.from_numpy(np.asarray(im)).permute(2, 0, 1).float() / 255
    assert torch.equal(enc.pixel_values([as_tensor]), enc.pixel_values([im]))


def test_custom_image_and_pad_ids(tmp_path_factory):
    hf = tiny_llava(tmp_path_factory)
    ref = VLMTaskEncoder(hf, seq_length=256)
    enc = VLMTaskEncoder(hf, seq_length=256, image_token_id=-200, pad_token_id=0)
    messages, _ = CONVERSATIONS["two_images"]
    a = ref.encode_conversation(messages, [pil(1), pil(2)])
    b = enc.encode_conversation(messages, [pil(1), pil(2)])
    is_img = a["tokens"] == ref.image_token_id
    assert int(is_img.sum()) == 2 and (b["tokens"][is_img] == -200).all()
    assert torch.equal(a["tokens"][~is_img], b["tokens"][~is_img]) and torch.equal(a["loss_mask"], b["loss_mask"])
    base = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    long = ConversationSample(__key__="l", images=[pil(1), pil(2)], messages=messages, **base)
    short = ConversationSample(__key__="s", images=[], messages=[user("hi"), asst("yes")], **base)
    batch = enc.batch([enc.encode_sample(long), enc.encode_sample(short)])
    n = len(enc.encode_sample(short).tokens)
    assert (batch.tokens[1, n:] == 0).all() and (batch.labels[1, n:] == 0).all()
    assert int((batch.tokens == -200).sum()) == 2
