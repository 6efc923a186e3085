"""Sequence packing (megatron_vlm.data.packing): the packing arithmetic, energon's packing hooks, and that a packed
row is expanded by megatron-core's LLaVAModel exactly like the separate rows (labels, loss mask, image and text
positions), with ``cu_seqlens`` at the image-expanded sample boundaries. Packed training equal to unpacked
on CPU (local layers, TP/PP/DP, anyres, videos, bf16) is tests/test_packing_equivalence.py; Transformer Engine's
'thd' attention on a GPU is ``test_packed_equals_unpacked_on_gpu`` (marked gpu).
"""

from __future__ import annotations

import pytest
import torch
from megatron.energon import VQASample
from PIL import Image

from megatron_vlm.data.loader import build_train_loader
from megatron_vlm.data.packing import (
    PackingTaskEncoder,
    VLMPackedBatch,
    boundaries,
    check_packing_supported,
    select_packs,
)
from megatron_vlm.data.synthetic import image_array
from tests.data_fixtures import tiny_llava, vqa_dataset, vqa_inputs  # noqa: F401

META = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
QUESTIONS = ["what colour is the shape ?", "describe the picture in a few words please", "what ?"]
ANSWERS = ["red", "a red square on a smooth gradient background", "yes"]


# ---- arithmetic -----------------------------------------------------------------------------------------------
def test_select_packs_first_fit_decreasing():
    assert select_packs([5, 3, 7, 2, 4], [False] * 5, 10) == [[1, 2], [0, 4], [3]]
    # a sample starting with an image token only ever opens a pack (samples may join it after)
    assert select_packs([5, 3, 7, 2, 4], [False, True, False, False, True], 10) == [[2, 3], [0], [4], [1]]
    assert select_packs([4, 4, 2], [False, False, True], 10) == [[0, 1], [2]]
    packs = select_packs([9, 1, 1, 8, 2, 10], [False] * 6, 10)
    assert sorted(i for p in packs for i in p) == list(range(6))  # every sample placed, once
    assert all(sum([9, 1, 1, 8, 2, 10][i] for i in p) <= 10 for p in packs)
    with pytest.raises(ValueError, match="sample 1 has 11 image-expanded positions, more than --packed-seq-length 10"):
        select_packs([3, 11], [False, False], 10)


def test_boundaries_are_image_expanded_and_close_the_padding():
    assert boundaries([3, 4], 10) == [0, 3, 7, 10]
    assert boundaries([3, 7], 10) == [0, 3, 10]  # full pack: no padding segment
    with pytest.raises(ValueError, match="exceeds --packed-seq-length 9"):
        boundaries([3, 7], 9)


def test_packing_runs_with_every_layer_implementation():
    """Packing is accepted on CPU and with local layers (megatron's local attention per 'thd' segment, installed
    by check_packing_supported); the remaining checks name the flag and the fix."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_vlm.runtime import mcore_patches
    from megatron_vlm.training.config import ConfigError, TrainConfig

    check_packing_supported("local", "cpu")
    # megatron's local attention learns 'thd': its forward is the registry's entry's
    assert mcore_patches.held().get(f"{DotProductAttention.__module__}:DotProductAttention.forward") == \
        "packed-local-attention"
    check_packing_supported("transformer_engine", "cuda")
    req = ["--data-path", "/d", "--tokenizer-load-dir", "/t", "--init", "--train-iters", "2", "--seq-length", "512"]
    c = TrainConfig.from_args([*req, "--device", "cuda", "--packing-buffer-size", "64", "--packed-seq-length", "2048"])
    assert (c.micro_batch_size, c.packed_seq_length, c.lm_seq_length, c.seq_length) == (1, 2048, 2048, 512)
    c = TrainConfig.from_args([*req, "--device", "cuda", "--packing-buffer-size", "64"])
    assert c.packed_seq_length == c.lm_seq_length == 512
    assert TrainConfig.from_args([*req, "--device", "cuda"]).lm_seq_length == 512
    assert TrainConfig.from_args([*req, "--device", "cpu", "--packing-buffer-size", "8"]).packing
    assert TrainConfig.from_args([*req, "--device", "cuda", "--transformer-impl", "local", "--packing-buffer-size",
                                  "8"]).packing
    for argv, msg in [
        (["--device", "cuda", "--packed-seq-length", "1024"], "--packed-seq-length only applies with "
                                                              "--packing-buffer-size"),
        (["--device", "cuda", "--packing-buffer-size", "8", "--micro-batch-size", "4"], "use --micro-batch-size 1"),
        (["--device", "cuda", "--packing-buffer-size", "8", "--packed-seq-length", "256"], "use --packed-seq-length "
                                                                                          "512 or more"),
        (["--device", "cuda", "--packing-buffer-size", "8", "--packed-seq-length", "1000", "--fp8"],
         "multiple of 16; use --packed-seq-length 1008"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            TrainConfig.from_args([*req, *argv])


def test_local_attention_splits_the_row_at_cu_seqlens():
    from megatron_vlm.runtime.cpu_compat import segments

    assert segments(torch.tensor([0, 3, 7, 10]), 10) == [(0, 3), (3, 7), (7, 10)]
    assert segments(torch.tensor([0, 3, 3, 10]), 10) == [(0, 3), (3, 10)]  # an empty segment is no window
    with pytest.raises(ValueError, match="do not split the packed row of 12 positions"):
        segments(torch.tensor([0, 3, 10]), 12)


# ---- the hooks on real encoded samples --------------------------------------------------------------------------
def _encoded(enc, n):
    return [enc.encode_sample(VQASample(__key__=f"s{i}", image=Image.fromarray(image_array((40, 30), i)),
                                        context=QUESTIONS[i % 3], answers=ANSWERS[i % 3], answer_weights=None,
                                        **META)) for i in range(n)]


@pytest.fixture(scope="module")
def packer(tmp_path_factory):
    return PackingTaskEncoder(tiny_llava(tmp_path_factory), seq_length=64, packed_seq_length=96)


def test_pack_and_batch(packer):
    samples = _encoded(packer, 5)
    k = packer.tokens_per_image
    assert [s.num_tokens for s in samples] == [len(s.tokens) + k - 1 for s in samples]
    packs = packer.select_samples_to_pack(samples)
    assert sorted(s.__key__ for p in packs for s in p) == [f"s{i}" for i in range(5)]
    for pack in packs:
        b = packer.batch([packer.pack_selected_samples(pack)])
        assert isinstance(b, VLMPackedBatch) and b.tokens.shape[0] == 1
        lengths = [s.num_tokens for s in pack]
        assert b.cu_seqlens.tolist() == boundaries(lengths, 96) and b.cu_seqlens[-1] == 96
        assert b.num_samples == len(pack) and b.num_tokens == sum(lengths)
        # image-expanded length of the row is exactly the pack length: text + (k - 1) per image
        n_img = int((b.tokens == packer.image_token_id).sum())
        assert b.tokens.shape[1] + (k - 1) * n_img == 96 == b.tokens.shape[1] + (k - 1) * b.images.shape[0]
        # each sample's tokens, labels and loss mask in order, then padding with no loss
        n = sum(len(s.tokens) for s in pack)
        assert torch.equal(b.tokens[0, :n], torch.cat([s.tokens for s in pack]))
        assert torch.equal(b.labels[0, :n], torch.cat([s.labels for s in pack]))
        assert torch.equal(b.loss_mask[0, :n], torch.cat([s.loss_mask for s in pack]))
        assert (b.tokens[0, n:] == packer.pad_token_id).all() and b.loss_mask[0, n:].sum() == 0
        assert torch.equal(b.images, torch.cat([s.images for s in pack]))
        assert b.max_seqlen == max(y - x for x, y in zip(b.cu_seqlens.tolist(), b.cu_seqlens.tolist()[1:]))
    with pytest.raises(ValueError, match="use --micro-batch-size 1"):
        packer.batch([packer.pack_selected_samples(packs[0])] * 2)


def test_context_parallel_pads_each_sample_inside_its_segment(tmp_path_factory, packer):
    """With context parallelism (sample_multiple 2 x CP) each sample of a pack is followed by pad tokens up to a
    multiple of it, inside its own cu_seqlens segment (loss mask 0), so megatron-core and Transformer Engine can
    split every sample over the CP ranks; the real tokens, labels and counts are the unpadded pack's."""
    cp4 = PackingTaskEncoder(tiny_llava(tmp_path_factory), seq_length=64, packed_seq_length=96, sample_multiple=8)
    samples = _encoded(packer, 5)
    k = packer.tokens_per_image
    for pack in cp4.select_samples_to_pack(samples):
        b = cp4.batch([cp4.pack_selected_samples(pack)])
        padded = [-(-s.num_tokens // 8) * 8 for s in pack]
        assert b.cu_seqlens.tolist() == boundaries(padded, 96) and all(c % 8 == 0 for c in b.cu_seqlens.tolist())
        assert b.num_tokens == sum(s.num_tokens for s in pack) and b.num_samples == len(pack)
        n_img = int((b.tokens == cp4.image_token_id).sum())
        assert b.tokens.shape[1] + (k - 1) * n_img == 96
        at = 0
        for s, width in zip(pack, padded):
            n, pad = len(s.tokens), width - s.num_tokens
            assert torch.equal(b.tokens[0, at:at + n], s.tokens) and torch.equal(b.labels[0, at:at + n], s.labels)
            assert torch.equal(b.loss_mask[0, at:at + n], s.loss_mask)
            assert (b.tokens[0, at + n:at + n + pad] == cp4.pad_token_id).all()
            assert b.loss_mask[0, at + n:at + n + pad].sum() == 0
            at += n + pad
    with pytest.raises(ValueError, match="must be a multiple of 8"):
        PackingTaskEncoder(tiny_llava(tmp_path_factory), seq_length=64, packed_seq_length=100, sample_multiple=8)


def test_anyres_packs_keep_each_items_tiles_and_counts(tmp_path_factory):
    """OneVision (anyres tiles, videos): a pack concatenates each item's tiles, size, tile and token counts in token
    order, and its cu_seqlens are the image-expanded sample lengths; a sample starting with its video opens a pack."""
    from megatron_vlm.data.packing import AnyresPackedBatch, packing_task_encoder_for
    from megatron_vlm.model.spec import VLMSpec
    from tests.support.packing_check import _as_samples, sample_sets
    from tests.support.tiny import make_tiny_onevision

    hf = make_tiny_onevision(tmp_path_factory.mktemp("ov_pack") / "ov")
    enc = packing_task_encoder_for(VLMSpec.from_hf_dir(hf), hf, 128, 256)
    samples = _as_samples(enc, sample_sets(enc)["mixed"])
    packs = enc.select_samples_to_pack(samples)
    assert sorted(s.__key__ for p in packs for s in p) == sorted(s.__key__ for s in samples) and len(packs) < 6
    assert [p[0].__key__ for p in packs if "s3" in [s.__key__ for s in p]] == ["s3"]  # image-first opens its pack
    for pack in packs:
        b = enc.batch([enc.pack_selected_samples(pack)])
        assert isinstance(b, AnyresPackedBatch) and b.cu_seqlens.tolist() == boundaries([s.num_tokens for s in pack],
                                                                                         256)
        for k in ("images", "image_sizes", "num_image_tiles", "num_image_tokens"):
            assert torch.equal(getattr(b, k), torch.cat([getattr(s, k) for s in pack]))
        # image-expanded length: text positions + image tokens - one token per item
        assert b.tokens.shape[1] - b.num_image_tokens.numel() + int(b.num_image_tokens.sum()) == 256


def test_a_sample_longer_than_a_pack_is_a_counted_skip(packer):
    samples = _encoded(packer, 3)
    long = _with_tokens(samples[1], samples[1].tokens)
    long.num_tokens = packer.packed_seq_length + 1
    before = packer.skips.total["longer than --packed-seq-length"]
    packs = packer.select_samples_to_pack([samples[0], long, samples[2]])
    assert sorted(s.__key__ for p in packs for s in p) == ["s0", "s2"]
    assert packer.skips.total["longer than --packed-seq-length"] == before + 1


def test_logged_throughput_counts_real_tokens_and_padding():
    from types import SimpleNamespace

    from megatron_vlm.training.metrics import packing_numbers

    cfg = SimpleNamespace(packing=True, global_batch_size=4, packed_seq_length=100)
    assert packing_numbers(cfg, samples=10, tokens=300) == {"positions": 400, "padding_fraction": 0.25,
                                                            "samples_per_pack": 2.5}
    assert packing_numbers(cfg, 0, 0) is None  # an iteration skipped by --skip-train-iteration-range
    assert packing_numbers(SimpleNamespace(packing=False), 10, 300) is None


def test_truncation_never_packs_a_partial_image(tmp_path_factory):
    """A conversation whose second image would cross --seq-length keeps its first image whole and loses the
    second (text cut before it, pixels dropped); the pack counts exactly the image positions that remain."""
    from tests.conversation_helpers import asst, pil, user

    enc = PackingTaskEncoder(tiny_llava(tmp_path_factory), seq_length=80, packed_seq_length=96)
    k = enc.tokens_per_image
    long_q = "what colour is the shape ? " * 8
    msgs = [user("<image>\nwhat shape ?"), asst("a square"), user(long_q + "<image>\nand here ?"), asst("red")]
    cut = VLMSample_from(enc, "cut", enc.encode_conversation(msgs, [pil(1), pil(2)]))
    short = VLMSample_from(enc, "short", enc.encode_conversation([user("<image>\nwhat ?"), asst("red")], [pil(3)]))
    assert cut.images.shape[0] == 1 and cut.num_tokens == 80  # one whole image, the text up to the limit
    packs = enc.select_samples_to_pack([short, cut])
    assert [[s.__key__ for s in p] for p in packs] == [["cut"], ["short"]]  # 80 + short > 96: two packs
    b = enc.batch([enc.pack_selected_samples(packs[0])])
    assert b.cu_seqlens.tolist() == [0, 80, 96]
    assert b.images.shape[0] == int((b.tokens == enc.image_token_id).sum()) == 1
    assert b.tokens.shape[1] + (k - 1) == 96


def VLMSample_from(enc, key, fields):  # noqa: N802 (reads like the constructor it wraps)
    from megatron_vlm.data.task_encoder import VLMSample

    return VLMSample(__key__=key, **META, **fields)


# ---- megatron-core's LLaVAModel expands a packed row like the separate rows --------------------------------------
def _expand(model, tokens, labels, loss_mask, first_image: int):
    """(source of each position, labels, loss mask) after LLaVAModel._preprocess_data: a text position holds its
    token id, an image position -(1 + global patch index), so rows can be compared position by position."""
    n = int((tokens == model.image_token_index).sum())
    k = model.img_seq_len
    text = tokens.clamp(min=0).float()[..., None]  # [B, S, 1]
    patches = -(1 + first_image * k + torch.arange(n * k, dtype=torch.float32)).view(n, k, 1).permute(1, 0, 2)
    emb, lab, lm = model._preprocess_data(patches, text, tokens, loss_mask, labels, False, None,
                                          model.image_token_index, torch.ones(n, dtype=torch.int32))
    return emb[:, :, 0].T, lab, lm  # [B, S'] each


def test_packed_row_is_expanded_like_separate_rows(tmp_path_factory, packer):
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world

    samples = _encoded(packer, 3)
    with single_process_world("cpu"):
        model = build_model(packer.spec, ModelOptions(seq_length=4096, perform_initialization=False))
        k = model.img_seq_len
        assert k == packer.tokens_per_image
        sep, first = [], 0
        for s in samples:
            sep.append(_expand(model, s.tokens[None], s.labels[None], s.loss_mask[None], first))
            first += s.images.shape[0]
        b = _wide(packer, samples).batch([packer.pack_selected_samples(samples)])
        emb, lab, lm = _expand(model, b.tokens, b.labels, b.loss_mask, 0)
        cu = b.cu_seqlens.tolist()
        for i, (e, l_, m) in enumerate(sep):
            a, z = cu[i], cu[i + 1]
            assert z - a == e.shape[1] == samples[i].num_tokens  # the boundaries are image-expanded positions
            assert torch.equal(emb[:, a:z], e) and torch.equal(lab[:, a:z], l_) and torch.equal(lm[:, a:z], m)
        assert lm[:, cu[len(samples)]:].sum() == 0  # padding segment: no loss
        # negative control: a sample that starts with the image token, packed second, would take the previous
        # sample's last label position out of the loss (megatron masks the text position before an image)
        img_first = samples[1].tokens.clone()
        img_first[0] = model.image_token_index
        mask0 = samples[0].loss_mask.clone()
        mask0[-1] = 1  # a sample whose last label counts
        _, _, lm_alone = _expand(model, samples[0].tokens[None], samples[0].labels[None], mask0[None], 0)
        row = torch.cat([samples[0].tokens, img_first])[None]
        labels = torch.cat([samples[0].labels, samples[1].labels])[None]
        mask = torch.cat([mask0, samples[1].loss_mask])[None]
        n0 = samples[0].num_tokens
        _, _, lm_bad = _expand(model, row, labels, mask, 0)
        assert lm_alone[0, n0 - 1] == 1 and lm_bad[0, n0 - 1] == 0
        assert packer.select_samples_to_pack([samples[0], _with_tokens(samples[1], img_first)])[0][0].__key__ == "s1"


def _with_tokens(sample, tokens):
    return type(sample).derive_from(sample, images=sample.images, tokens=tokens, labels=sample.labels,
                                    loss_mask=sample.loss_mask, num_tokens=sample.num_tokens)


def _wide(packer, samples):
    """A copy of ``packer`` whose packs hold all of ``samples``."""
    import copy

    wide = copy.copy(packer)
    wide.packed_seq_length = sum(s.num_tokens for s in samples) + 8
    return wide


# ---- energon's packing in the loader, and its saved position --------------------------------------------------
def test_energon_loader_packs_and_resumes(vqa_dataset, tmp_path_factory):  # noqa: F811
    enc = PackingTaskEncoder(tiny_llava(tmp_path_factory), seq_length=64, packed_seq_length=128)

    def loader():
        return build_train_loader(vqa_dataset.output, enc, micro_batch_size=1, dp_rank=0, dp_world_size=1,
                                  num_workers=0, seed=7, shuffle_buffer_size=4, max_samples_per_sequence=2,
                                  packing_buffer_size=6)

    def take(it, n):
        out = []
        for _ in range(n):
            b = next(it)
            assert isinstance(b, VLMPackedBatch) and b.cu_seqlens[-1] == 128
            k = enc.tokens_per_image
            assert b.tokens.shape[1] + (k - 1) * b.images.shape[0] == 128
            assert b.images.shape[0] == int((b.tokens == enc.image_token_id).sum())
            out.append((b.__key__, b.tokens.clone(), b.cu_seqlens.tolist()))
        return out

    first = loader()
    it = iter(first)
    head = take(it, 2)
    assert max(b[2].__len__() for b in head) > 3  # several samples per pack
    state = first.save_state_rank()
    expected = take(it, 3)
    second = loader()
    second.restore_state_rank(state)
    got = take(iter(second), 3)
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert all(torch.equal(g[1], e[1]) and g[2] == e[2] for g, e in zip(got, expected))


# ---- on a GPU with Transformer Engine --------------------------------------------------------------------------
@pytest.mark.gpu
def test_packed_equals_unpacked_on_gpu(tmp_path_factory):
    """The same samples packed into one 'thd' row and as separate rows: per-sample logits within the bf16
    yardstick, per-sample losses within 1%, the same loss positions (tests.support.packing_check)."""
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.packing_check import packed_vs_unpacked

    hf = tiny_llava(tmp_path_factory)
    meg = convert_hf_to_megatron(hf, tmp_path_factory.mktemp("packing_gpu") / "m")
    r = packed_vs_unpacked(meg, hf)
    assert r["ok"], r
