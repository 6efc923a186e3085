"""Qwen2.5-VL's task encoder (:mod:`megatron_vlm.data.qwen_vl_encoder`) held against HF's own processor.

The encoder reads the real hub files of Qwen2.5-VL-7B-Instruct (``../shared/hub``: config, tokenizer, image processor
config, chat template; no weights), as ``task_encoder_for`` picks it for the spec. The references are HF's:

- **the processor** (``Qwen2_5_VLProcessor`` with the hub's PIL image processor, the one the encoder uses; HF's
  processor class needs torchvision for its video half, so the 3.12 lane): for a VQA sample, a two-turn chat with an
  image in each user turn and one message with two images, the encoder's tokens (plus the last label) are the
  processor's ``input_ids`` of ``apply_chat_template`` + ``processor(...)``, token for token (and those of
  ``apply_chat_template(tokenize=True)``); ``pixel_values`` byte for byte and ``image_grid_thw``; the labels are
  -100 except where HF's own renderings say the answer is (the tokens after each turn's generation prompt up to the
  ``<|im_end|>`` that closes it); a batch of three samples equals the processor's right-padded batch;
- **the image processor** (``Qwen2VLImageProcessorPil``, both lanes): pixels and grids byte for byte;
- **M-RoPE**: the batch's ``position_ids`` are HF's ``Qwen2_5_VLModel.get_rope_index`` on the padded batch (a model
  of the hub's config shrunk, on the meta device), padding included; the valid ones also with its attention mask;
- **truncation and skips**: a cut that would fall inside an image drops that image, its pixels and its
  ``<|vision_start|>`` (the kept sample is the untruncated one's prefix, positions included); images that alone
  exceed ``seq_length`` are skipped with the reason;
- **videos** (3.12 lane): a video beside an image against the processor (tokens, grids, ``second_per_grid_ts``,
  the video's pixels within 2 levels, PIL's resize against torchvision's), HF's ``get_rope_index`` with its time
  steps, and the frame choice against the video processor's ``sample_frames``;
- **Qwen3-VL's videos** (3.12 lane): its processor's own frame sampling, timestamps and nested vision tokens;
- **refusals**: a video token without its video is a counted skip; a prompt with a video (generation) one line;
- **Qwen3-VL-8B's hub files** (3.12 lane): the encoder's tokens, pixels, grids and labels against its own processor;
- **the model** (slow): the batch through the training step's ``forward_step`` into ``QwenVLModel`` (the shrunk
  config converted at TP1) gives HF's own model's logits and per-token cross entropy on each sample (1e-4; measured
  7e-6 and 3e-6).
"""

from __future__ import annotations

import importlib.util
import inspect

import numpy as np
import pytest
import torch
from megatron.energon import SkipSample, VQASample
from PIL import Image

from megatron_vlm.data.sample import ConversationSample
from megatron_vlm.model.spec import VLMSpec

from .conftest import not_here

SEQ = 1024
#: (height, width) of the test images: grids 10 x 16, 6 x 4 and 4 x 8 patches (40, 6 and 8 tokens)
SIZES = ((150, 230), (90, 60), (56, 112))
BASE = dict(__restore_key__=(), __subflavors__=None, __sources__=None)


def image(k: int, size=None) -> Image.Image:
    h, w = size or SIZES[k]
    return Image.fromarray(np.random.default_rng(k).integers(0, 255, (h, w, 3), dtype=np.uint8))


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                        for p in parts]}


def asst(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


#: name -> (messages, images)
CONVERSATIONS = {
    "vqa": ([user(None, "what colour is the shape ?"), asst("red")], [0]),
    "two_turns": ([user(None, "what is this ?"), asst("a cat"), user(None, "and this one ?"),
                   asst("a dog on a mat")], [0, 1]),
    "two_images_one_message": ([user(None, "which is brighter ?", None), asst("the second one")], [2, 0]),
}


@pytest.fixture(scope="module")
def hub_dir():
    from tests.support import hub
    from tests.support.qwen_vl_models import QWEN25_VL_7B

    return hub.hub_model_dir(QWEN25_VL_7B)


@pytest.fixture(scope="module")
def spec(hub_dir):
    return VLMSpec.from_hf_dir(hub_dir)


@pytest.fixture(scope="module")
def enc(spec, hub_dir):
    from megatron_vlm.data.anyres_encoder import task_encoder_for

    return task_encoder_for(spec, hub_dir, SEQ)


@pytest.fixture(scope="module")
def processor(hub_dir):
    """HF's ``Qwen2_5_VLProcessor`` of the hub files with the PIL image processor (the encoder's)."""
    if importlib.util.find_spec("torchvision") is None:
        not_here("HF's Qwen2_5_VLProcessor needs torchvision (its video processor): the 3.11 lane's CPU torch has "
                 "none (the 3.12 lane runs this check)")
    from transformers import AutoProcessor, Qwen2VLImageProcessorPil

    return AutoProcessor.from_pretrained(str(hub_dir), image_processor=Qwen2VLImageProcessorPil.from_pretrained(
        str(hub_dir)))


@pytest.fixture(scope="module")
def rope_host(spec):
    """HF's ``Qwen2_5_VLModel`` of the hub's config shrunk (tests/support/qwen_vl_models.small_config), on the meta
    device: its ``get_rope_index`` reads the config only."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from tests.support.qwen_vl_models import small_config

    with torch.device("meta"):
        return Qwen2_5_VLModel(Qwen2_5_VLConfig(**{k: v for k, v in small_config().items() if k != "model_type"}))


def hf_rope(host, tokens, grid, image_id, attention_mask=None) -> torch.Tensor:
    positions, _ = host.get_rope_index(tokens, mm_token_type_ids=(tokens == image_id).to(torch.int32),
                                       image_grid_thw=grid, attention_mask=attention_mask)
    return positions


def hf_inputs(processor, messages, images, **kwargs):
    text = processor.apply_chat_template(messages, **kwargs)
    return processor(text=[text], images=images or None, return_tensors="pt")


def full_ids(out) -> list[int]:
    """The conversation the encoder kept: its tokens and the last label."""
    return out["tokens"].tolist() + out["labels"][-1:].tolist()


def encoded(enc, name):
    messages, which = CONVERSATIONS[name]
    images = [image(k) for k in which]
    return messages, images, enc.encode_conversation(messages, images, key=name)


def test_task_encoder_for_picks_it(enc):
    from megatron_vlm.data.qwen_vl_encoder import QwenVLTaskEncoder

    assert type(enc) is QwenVLTaskEncoder
    assert (enc.image_token_id, enc.pad_token_id, enc.vision_start_id) == (151655, 151643, 151652)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_tokens_pixels_and_grids_equal_the_processors(enc, processor, name):
    """Tokens + last label = the processor's ``input_ids``; pixels byte for byte; the grids."""
    messages, images, out = encoded(enc, name)
    hf = hf_inputs(processor, messages, images)
    assert full_ids(out) == hf["input_ids"][0].tolist()
    assert out["images"].dtype == hf["pixel_values"].dtype == torch.float32
    assert out["images"].numpy().tobytes() == hf["pixel_values"].numpy().tobytes()
    assert torch.equal(out["image_grid_thw"], hf["image_grid_thw"])
    assert out["num_tokens"] == len(out["tokens"])
    tokens_per_image = (hf["image_grid_thw"].prod(-1) // 4).tolist()
    assert enc.image_tokens(images) == tokens_per_image
    assert int((out["tokens"] == enc.image_token_id).sum()) == sum(tokens_per_image)


def test_apply_chat_template_tokenized_gives_the_same_ids(enc, processor):
    """HF's one-call path (images inside the messages, ``tokenize=True``) gives the same ids and pixels."""
    messages, images, out = encoded(enc, "two_images_one_message")
    it = iter(images)
    with_images = [dict(m, content=[dict(p, image=next(it)) if p["type"] == "image" else p for p in m["content"]])
                   for m in messages]
    hf = processor.apply_chat_template(with_images, tokenize=True, return_dict=True, return_tensors="pt")
    assert full_ids(out) == hf["input_ids"][0].tolist()
    assert torch.equal(out["images"], hf["pixel_values"]) and torch.equal(out["image_grid_thw"], hf["image_grid_thw"])


def answer_positions(processor, messages, images, ids: list[int]) -> set[int]:
    """Positions of ``ids`` (the processor's, whole conversation) that HF's renderings make the answers: after each
    assistant turn's generation prompt (as the processor encodes it) up to the ``<|im_end|>`` that closes it."""
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = set()
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        seen = sum(p["type"] == "image" for turn in messages[:i] for p in turn["content"])
        prompt = hf_inputs(processor, messages[:i], images[:seen], add_generation_prompt=True)["input_ids"][0].tolist()
        assert ids[:len(prompt)] == prompt
        out |= set(range(len(prompt), ids.index(im_end, len(prompt)) + 1))
    return out


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_labels_are_the_answers_and_nothing_else(enc, processor, name):
    """HF-style labels (-100 off the loss mask) are -100 except at the answers (each ``answer<|im_end|>``)."""
    messages, images, out = encoded(enc, name)
    ids = hf_inputs(processor, messages, images)["input_ids"][0].tolist()
    answers = answer_positions(processor, messages, images, ids)
    want = [ids[j + 1] if j + 1 in answers else -100 for j in range(len(ids) - 1)]
    mine = torch.where(out["loss_mask"].bool(), out["labels"], torch.full_like(out["labels"], -100))
    assert mine.tolist() == want
    assert enc.tokenizer.decode(out["labels"][out["loss_mask"].bool()]) == "".join(
        p["text"] + "<|im_end|>" for m in messages if m["role"] == "assistant" for p in m["content"])


def test_pixels_equal_the_image_processor(enc, hub_dir):
    """Both lanes: pixel values byte for byte and grids of HF's ``Qwen2VLImageProcessorPil`` (the hub's config)."""
    from transformers import Qwen2VLImageProcessorPil

    images = [image(k) for k in (0, 1, 2)]
    hf = Qwen2VLImageProcessorPil.from_pretrained(str(hub_dir))(images=images, return_tensors="pt")
    mine = enc.image_inputs(images)
    assert mine["images"].numpy().tobytes() == hf["pixel_values"].numpy().tobytes()
    assert mine["image_grid_thw"].tolist() == hf["image_grid_thw"].tolist() == [[1, 10, 16], [1, 6, 4], [1, 4, 8]]
    assert enc.image_tokens(images) == [40, 6, 8]


def samples():
    """A VQA sample, a two-turn chat with two images and a text-only chat, as energon hands them over."""
    vqa = VQASample(__key__="vqa", image=image(1), context="what colour is the shape ?", answers="red",
                    answer_weights=None, **BASE)
    messages, which = CONVERSATIONS["two_turns"]
    chat = ConversationSample(__key__="chat", images=[image(k) for k in which], messages=messages, **BASE)
    text = ConversationSample(__key__="text", images=[], messages=[user("say yes"), asst("yes")], **BASE)
    return [vqa, chat, text]


@pytest.fixture(scope="module")
def batch(enc):
    parts = [enc.encode_sample(s) for s in samples()]
    return parts, enc.batch(parts)


def test_batch_pads_right_and_concatenates_in_token_order(enc, batch):
    from megatron_vlm.data.qwen_vl_encoder import QwenVLBatch

    parts, b = batch
    lengths = [len(p.tokens) for p in parts]
    assert isinstance(b, QwenVLBatch) and b.__key__ == ["vqa", "chat", "text"] and len(set(lengths)) == 3
    assert b.tokens.shape == (3, max(lengths)) and b.position_ids.shape == (3, 3, max(lengths))
    for row, (p, n) in enumerate(zip(parts, lengths)):
        assert torch.equal(b.tokens[row, :n], p.tokens) and torch.equal(b.labels[row, :n], p.labels)
        assert (b.tokens[row, n:] == enc.pad_token_id).all() and (b.loss_mask[row, n:] == 0).all()
    assert torch.equal(b.images, torch.cat([p.images for p in parts]))
    assert b.image_grid_thw.tolist() == [[1, 6, 4], [1, 10, 16], [1, 6, 4]] and b.num_image_tiles.tolist() == [1] * 3
    assert b.num_tokens == sum(lengths) and b.row_tokens.tolist() == lengths


def test_a_short_batch_is_filled_with_text_rows(enc, batch):
    """The trainer's filling of a partial last micro batch (``pad_micro_batch``, for pipeline stages' fixed shapes):
    rows of text with no loss, no image token and counting positions; the images, grids and real rows unchanged."""
    from megatron_vlm.training.step import pad_micro_batch

    _, b = batch
    full = pad_micro_batch(b, 5, enc.spec.media_token_ids)
    assert full.tokens.shape == (5, b.tokens.shape[1]) and full.position_ids.shape == (3, 5, b.tokens.shape[1])
    assert torch.equal(full.tokens[:3], b.tokens) and torch.equal(full.position_ids[:, :3], b.position_ids)
    assert (full.loss_mask[3:] == 0).all() and not bool(torch.isin(full.tokens[3:], torch.tensor(
        enc.spec.media_token_ids)).any()) and full.row_tokens.tolist() == b.row_tokens.tolist() + [0, 0]
    assert torch.equal(full.position_ids[:, 3:], torch.arange(b.tokens.shape[1]).expand(3, 2, -1))
    assert torch.equal(full.images, b.images) and torch.equal(full.image_grid_thw, b.image_grid_thw)
    assert pad_micro_batch(b, 3, enc.spec.media_token_ids) is b


def test_batch_positions_are_get_rope_index(enc, batch, rope_host):
    """The padded batch's positions are HF's ``get_rope_index`` on it (padding counts on as text); the valid ones
    are also its positions with the attention mask."""
    parts, b = batch
    assert torch.equal(b.position_ids, hf_rope(rope_host, b.tokens, b.image_grid_thw, enc.image_token_id))
    lengths = torch.tensor([len(p.tokens) for p in parts])
    mask = (torch.arange(b.tokens.shape[1])[None] < lengths[:, None]).to(torch.int64)
    masked = hf_rope(rope_host, b.tokens, b.image_grid_thw, enc.image_token_id, attention_mask=mask)
    assert torch.equal(b.position_ids[:, mask.bool()], masked[:, mask.bool()])
    assert not torch.equal(b.position_ids[0], b.position_ids[1])  # the images' rows and columns: 3-D positions


def test_batch_equals_the_processors_padded_batch(enc, batch, processor):
    """The processor's right-padded batch of the same samples: its rows are our rows (+ the last labels), its pixels
    and grids ours; its own ``get_rope_index`` positions (attention mask) equal ours where it attends."""
    from megatron_vlm.data.sample import conversation_of

    parts, b = batch
    convs = [conversation_of(s) for s in samples()]
    texts = [processor.apply_chat_template(m) for m, _ in convs]
    hf = processor(text=texts, images=[im for _, ims in convs for im in ims], padding=True, padding_side="right",
                   return_tensors="pt")
    for row, p in enumerate(parts):
        n = len(p.tokens)
        assert hf["input_ids"][row, :n + 1].tolist() == p.tokens.tolist() + p.labels[-1:].tolist()
        assert int(hf["attention_mask"][row].sum()) == n + 1
    assert b.images.numpy().tobytes() == hf["pixel_values"].numpy().tobytes()
    assert torch.equal(b.image_grid_thw, hf["image_grid_thw"])


def test_truncation_never_cuts_an_image_and_too_long_is_skipped(enc, spec, hub_dir, rope_host):
    """``seq_length`` ending inside the second image of a two-turn chat keeps the first turn: the untruncated
    sample's prefix up to that image's ``<|vision_start|>`` (tokens, labels, mask, positions), the first image's
    pixels only. Images that alone exceed ``seq_length`` are a counted skip with the reason."""
    from megatron_vlm.data.anyres_encoder import task_encoder_for

    messages, images, full = encoded(enc, "two_turns")
    ids = full["tokens"].tolist()
    first_pads = ids.index(enc.image_token_id) + 40
    cut = ids.index(enc.vision_start_id, first_pads)  # the second image's <|vision_start|>
    short = task_encoder_for(spec, hub_dir, cut + 3)  # room for <|vision_start|> and 2 of its 6 image tokens
    out = short.encode_conversation(messages, images, key="cut")
    assert len(out["tokens"]) == cut and int(out["loss_mask"].sum()) > 0
    for k in ("tokens", "labels", "loss_mask"):
        assert torch.equal(out[k], full[k][:cut]), k
    assert torch.equal(out["position_ids"], full["position_ids"][:, :cut])
    assert torch.equal(out["position_ids"][:, None], hf_rope(rope_host, out["tokens"][None], out["image_grid_thw"],
                                                             enc.image_token_id))
    assert out["image_grid_thw"].tolist() == [[1, 10, 16]] and torch.equal(out["images"], full["images"][:160])
    big = image(3, (300, 400))  # 22 x 28 patches: 154 tokens
    with pytest.raises(SkipSample):
        short.encode_conversation(CONVERSATIONS["vqa"][0], [big], key="big")
    reason = f"1 images need 154 > seq_length {cut + 3} tokens"
    assert short.skipped[reason] == 1, dict(short.skipped)


def test_a_video_equals_the_processors(enc, processor, rope_host):
    """A message with a video and an image (a 20-frame 4 fps clip, 48 x 32: 4 frames at --video-fps 0.5, two
    temporal patches 2.5 s apart): the encoder's tokens + last label are the processor's ``input_ids`` (its video
    processor given the same frames and their metadata), the image's pixels byte for byte, the video's within 2 of 255 levels (PIL's
    resize against torchvision's), the grids and ``second_per_grid_ts``; the sample holds both in token order, and
    its positions are HF's ``get_rope_index`` with the video's time steps (not those of HF's default 1 s a step).
    The frame choice is the video
    processor's ``sample_frames`` at that fps."""
    from transformers.video_utils import VideoMetadata

    from megatron_vlm.data import videos as vid
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.data.qwen_vl_encoder import qwen_frame_indices
    from tests.support.videos import make_video

    enc2 = task_encoder_for(enc.spec, enc.hf_dir, SEQ, video_fps=0.5)
    clip = make_video(20, 48, 32, fps=4)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens ? and here"},
                                             {"type": "image"}]}, asst("it rains")]
    out = enc2.encode_conversation(messages, [image(1)], key="v", videos=[clip])
    plan = enc2.video_plan(clip)
    indices, info = plan["indices"], plan["info"]
    assert indices == [0, 5, 10, 15]
    meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, frames_indices=indices)
    hf = processor(text=[processor.apply_chat_template(messages)], images=[image(1)],
                   videos=[vid.decode_frames(clip, indices)], return_tensors="pt",
                   videos_kwargs=dict(video_metadata=[meta], do_sample_frames=False, cap_pixels_per_frame=False))
    assert full_ids(out) == hf["input_ids"][0].tolist()
    assert out["image_grid_thw"].tolist() == hf["video_grid_thw"].tolist() + hf["image_grid_thw"].tolist()
    assert out["second_per_grid_ts"].tolist() == [hf["second_per_grid_ts"][0].item(), 0.0]
    n = int(hf["video_grid_thw"].prod())
    levels = 2 / 255 / min(processor.video_processor.image_std)
    assert (out["images"][:n] - hf["pixel_values_videos"]).abs().max().item() < levels
    assert out["images"][n:].numpy().tobytes() == hf["pixel_values"].numpy().tobytes()
    tokens = out["tokens"][None]
    want, _ = rope_host.get_rope_index(tokens, mm_token_type_ids=hf["mm_token_type_ids"][:, :tokens.shape[1]],
                                       image_grid_thw=hf["image_grid_thw"], video_grid_thw=hf["video_grid_thw"],
                                       second_per_grid_ts=hf["second_per_grid_ts"])
    assert torch.equal(out["position_ids"], want[:, 0]) and hf["second_per_grid_ts"].tolist() == [2.5]
    one_second, _ = rope_host.get_rope_index(tokens, mm_token_type_ids=hf["mm_token_type_ids"][:, :tokens.shape[1]],
                                             image_grid_thw=hf["image_grid_thw"], video_grid_thw=hf["video_grid_thw"])
    assert not torch.equal(out["position_ids"], one_second[:, 0])  # the video's time steps count
    for frames, fps, want_fps, most in ((9, 4, 2.0, 32), (100, 30, 1.0, 32), (3, 10, 2.0, 32), (1000, 25, 2.0, 16),
                                        (57, 7.5, 1.3, 768)):
        theirs = processor.video_processor.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps),
                                                         fps=want_fps, max_frames=most)
        assert qwen_frame_indices(frames, fps, want_fps, most, 2) == theirs.tolist(), (frames, fps)


def test_a_video_token_without_its_video_is_skipped_and_bad_frame_settings_refused(enc):
    """The ``<|video_pad|>`` token in the text with no video: a counted skip with the reason; --video-frames below
    the temporal patch: one line naming it."""
    from megatron_vlm.data.anyres_encoder import task_encoder_for

    messages = [user(None, "what is <|vision_start|><|video_pad|><|vision_end|> ?"), asst("rain")]
    with pytest.raises(SkipSample):
        enc.encode_conversation(messages, [image(0)], key="stray")
    assert enc.skipped["1 video tokens but 0 videos"] >= 1, dict(enc.skipped)
    with pytest.raises(ValueError) as e:
        task_encoder_for(enc.spec, enc.hf_dir, SEQ, video_frames=1)
    assert "\n" not in str(e.value) and "--video-frames 1" in str(e.value) and "at least 2" in str(e.value)


def test_a_prompt_with_a_video_is_refused_in_one_line(spec, hub_dir):
    """eval/generate.py's prompts (:class:`~megatron_vlm.eval.prompts.PromptEncoder`) take images only: a Qwen2.5-VL
    prompt with a video stops in one line naming it."""
    from megatron_vlm.data.task_encoder import VideoNotSupportedError
    from megatron_vlm.eval.prompts import PromptEncoder, user_message

    with pytest.raises(VideoNotSupportedError) as e:
        PromptEncoder(hub_dir, spec).encode([user_message("what happens ?", videos=1)], videos=[b"\x00" * 16])
    assert "\n" not in str(e.value) and str(e.value).startswith("the prompt has 1 video(s): generation from "
                                                                 "Qwen2.5-VL videos is not supported yet"), str(e.value)


def test_a_qwen3_vl_video_equals_its_processors(qwen3_hub):
    """Qwen3-VL-8B's hub files: a video (25 frames at 10 fps, 33 x 21) beside an image. The encoder takes the frames
    its video processor's own sampling takes at --video-fps 1 (HF given the whole clip and its metadata), and its
    tokens + last label are the processor's ``input_ids``: each temporal patch as ``<t seconds>`` and its own
    ``<|vision_start|>`` ... ``<|vision_end|>`` inside the template's; the image's pixels byte for byte, the video's
    within 2 levels, the grids in token order."""
    from transformers.video_utils import VideoMetadata

    from megatron_vlm.data import videos as vid
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from tests.support.videos import make_video

    enc3, processor = qwen3_hub
    enc = task_encoder_for(enc3.spec, enc3.hf_dir, SEQ, video_fps=1.0)
    clip = make_video(25, 33, 21, fps=10)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens ? and here"},
                                             {"type": "image"}]}, asst("it rains")]
    out = enc.encode_conversation(messages, [image(1)], key="v", videos=[clip])
    hf = processor(text=[processor.apply_chat_template(messages)], images=[image(1)],
                   videos=[vid.decode_frames(clip, list(range(25)))], return_tensors="pt",
                   videos_kwargs=dict(video_metadata=[VideoMetadata(total_num_frames=25, fps=10.0)], fps=1.0,
                                      cap_pixels_per_frame=False))
    ids = hf["input_ids"][0].tolist()
    assert full_ids(out) == ids
    text = processor.tokenizer.decode(ids)
    assert "<|vision_start|><0.4 seconds><|vision_start|><|video_pad|><|video_pad|><|vision_end|><2.0 seconds>" in text
    assert out["image_grid_thw"].tolist() == hf["video_grid_thw"].tolist() + hf["image_grid_thw"].tolist()
    n = int(hf["video_grid_thw"].prod())
    levels = 2 / 255 / min(processor.video_processor.image_std)
    assert (out["images"][:n] - hf["pixel_values_videos"]).abs().max().item() < levels
    assert out["images"][n:].numpy().tobytes() == hf["pixel_values"].numpy().tobytes()


@pytest.fixture(scope="module")
def qwen3_hub():
    """(the encoder, HF's ``Qwen3VLProcessor`` with the encoder's PIL image processor) of the hub's Qwen3-VL-8B
    files."""
    from transformers import AutoProcessor, Qwen2VLImageProcessorPil

    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from tests.support import hub
    from tests.support.qwen_vl_models import QWEN3_VL_8B

    where = hub.hub_model_dir(QWEN3_VL_8B)
    enc = task_encoder_for(VLMSpec.from_hf_dir(where), where, SEQ)
    if importlib.util.find_spec("torchvision") is None:
        not_here("HF's Qwen3VLProcessor needs torchvision (its video processor): the 3.11 lane's CPU torch has none "
                 "(the 3.12 lane runs this check)")
    return enc, AutoProcessor.from_pretrained(str(where), image_processor=Qwen2VLImageProcessorPil.from_pretrained(
        str(where)))


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_qwen3_vl_samples_equal_its_processors(qwen3_hub, name):
    """Qwen3-VL-8B's hub files (patch 16, its chat template): the encoder's tokens + last label are its processor's
    ``input_ids``, pixels byte for byte, the grids; labels -100 except at the answers HF's renderings give."""
    enc, processor = qwen3_hub
    messages, images, out = encoded(enc, name)
    hf = hf_inputs(processor, messages, images)
    ids = hf["input_ids"][0].tolist()
    assert full_ids(out) == ids
    assert out["images"].numpy().tobytes() == hf["pixel_values"].numpy().tobytes()
    assert torch.equal(out["image_grid_thw"], hf["image_grid_thw"])
    answers = answer_positions(processor, messages, images, ids)
    mine = torch.where(out["loss_mask"].bool(), out["labels"], torch.full_like(out["labels"], -100))
    assert mine.tolist() == [ids[j + 1] if j + 1 in answers else -100 for j in range(len(ids) - 1)]


@pytest.mark.slow
def test_megatron_model_on_a_batch_equals_hf(tmp_path):
    """End to end: the batch (a VQA sample, a two-turn chat with two images, a text-only chat) fed to
    ``QwenVLModel`` as the training step feeds it (``forward_step``: the positional inputs, the positions among them,
    and ``model_kwargs``, checked against the forward's signature; the hub's config shrunk, random weights, converted
    at TP1) gives HF's own model's logits on each sample alone, HF computing its M-RoPE
    positions from ``mm_token_type_ids`` (1e-4, fp32), and with the labels HF's per-token cross entropy at the loss
    mask."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.convert.verify import load_hf_model
    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.training.step import forward_step
    from tests.support.qwen_vl_models import qwen_vl_hf_model
    from tests.support.worlds import _model_for

    src = qwen_vl_hf_model(tmp_path / "hf")
    spec = VLMSpec.from_hf_dir(src)
    enc = task_encoder_for(spec, src, SEQ)
    parts = [enc.encode_sample(s) for s in samples()]
    b = enc.batch(parts)
    hf = load_hf_model(src)
    with single_process_world(), torch.no_grad():
        meg = _model_for(ckpt.resolve_iteration_dir(convert_hf_to_megatron(src, tmp_path / "meg")), 1, 1,
                         b.tokens.shape[1])
        kwargs = b.model_kwargs(torch.device("cpu"))
        params = inspect.signature(type(meg).forward).parameters
        assert set(kwargs) == {"image_grid_thw"} and set(kwargs) <= set(params)
        logits, _ = meg(b.images, b.tokens, b.position_ids, None, None, None, **kwargs)
        loss, loss_func = forward_step(torch.device("cpu"), iter([b]), meg)  # the training step's own call
        loss_mask = loss_func.args[0]
    first, diffs, ce = 0, [], []
    for row, p in enumerate(parts):
        n, rows = len(p.tokens), int(p.image_grid_thw.prod(-1).sum())
        ids = p.tokens[None]
        with torch.no_grad():
            ref = hf(input_ids=ids, pixel_values=b.images[first:first + rows] if rows else None,
                     image_grid_thw=p.image_grid_thw if rows else None,
                     mm_token_type_ids=(ids == spec.image_token_id).to(torch.int32)).logits[0]
        first += rows
        diffs.append((ref - logits[row, :n, :spec.vocab_size]).abs().max().item())
        want = torch.nn.functional.cross_entropy(ref, p.labels, reduction="none")
        m = p.loss_mask.bool()
        ce.append((want[m] - loss[row, :n][m]).abs().max().item())
    print(f"\nQwen2.5-VL batch through model_kwargs: max |logit diff| per sample {diffs}, loss {ce}")
    assert max(diffs) < 1e-4 and max(ce) < 1e-4 and torch.equal(loss_mask, b.loss_mask)
