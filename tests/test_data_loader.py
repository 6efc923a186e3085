"""Prepared datasets read back through energon's loaders with VLMTaskEncoder: contents, resumption, DP."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from PIL import Image

from megatron_vlm.data.loader import build_eval_loader, build_train_loader
from megatron_vlm.data.stats import iter_tar_samples
from megatron_vlm.data.task_encoder import VLMTaskEncoder
from tests.data_fixtures import (  # noqa: F401
    chat_dataset,
    chat_inputs,
    llava_dataset,
    llava_inputs,
    tiny_llava,
    vqa_dataset,
    vqa_inputs,
)

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="energon's loaders with the task encoder: energon, transformers and PIL, pinned alike in both lanes")


# energon's savable loader with workers takes ~5 s per worker to shut down (its per-worker command thread
# keeps the worker alive until torch's join timeout); keeping those loaders referenced lets them go at
# interpreter exit instead (daemon workers are terminated at once), which keeps this file fast.
_KEEP_ALIVE: list = []


@pytest.fixture
def encoder(tmp_path_factory):
    return VLMTaskEncoder(tiny_llava(tmp_path_factory), seq_length=256)


def answers_of(enc, batch, b) -> list[str]:
    mask, labels = batch.loss_mask[b].bool().tolist(), batch.labels[b].tolist()
    runs, cur = [], []
    for m, t in zip(mask + [False], labels + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(enc.tokenizer.decode(cur).removesuffix(enc.tokenizer.eos_token).lstrip(" "))
            cur = []
    return runs


def read_all(ds, enc, num_workers=0):
    """key -> (answers, number of images, pixel rows) over the train and val splits, in one pass each."""
    got = {}
    for split in ("train", "val"):
        for batch in build_eval_loader(ds.output, enc, 2, 0, 1, num_workers, split=split):
            offset = 0
            for b, key in enumerate(batch.__key__):
                n = int((batch.tokens[b] == enc.image_token_id).sum())
                assert key not in got
                got[key] = (answers_of(enc, batch, b), n, batch.images[offset:offset + n])
                offset += n
            assert offset == batch.images.shape[0]
    return got


@pytest.mark.parametrize("fmt", ["vqa", "llava", "chat"])
def test_read_back_exact(fmt, encoder, request):
    ds = request.getfixturevalue(f"{fmt}_dataset")
    inputs = request.getfixturevalue(f"{fmt}_inputs")
    if fmt == "vqa":
        expected = [([r["answer"]], 1) for r in inputs["good"]]
    else:
        expected = list(zip(inputs["answers"], inputs["n_images"]))
    got = read_all(ds, encoder)
    assert sorted(got) == inputs["keys"]
    if fmt == "vqa":  # the eval loader's order is deterministic
        again = read_all(ds, encoder)
        assert list(again) == list(got)
    for key, (answers, n_img) in zip(inputs["keys"], expected):
        assert got[key][:2] == (answers, n_img), key
    # pixel values through energon == HF image processor on the stored image bytes
    for shard in sorted(ds.output.glob("*.tar")):
        for key, parts in iter_tar_samples(shard, parts=("jpg", "img0.jpg", "img0.png", "img1.png")):
            imgs = [parts[p] for p in ("jpg", "img0.jpg", "img0.png", "img1.png") if parts.get(p)]
            if imgs:
                pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in imgs]
                ref = encoder.processor.image_processor(images=pil, return_tensors="pt")["pixel_values"]
                assert torch.equal(got[key][2], ref.float())


def _keys_and_tokens(loader_iter, n):
    out = []
    for _ in range(n):
        batch = next(loader_iter)
        out.append((list(batch.__key__), batch.tokens.clone(), batch.images.clone()))
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_save_restore_continues_exactly(vqa_dataset, encoder, num_workers):
    def loader():
        return build_train_loader(vqa_dataset.output, encoder, micro_batch_size=2, dp_rank=0, dp_world_size=1,
                                  num_workers=num_workers, seed=7, shuffle_buffer_size=4,
                                  max_samples_per_sequence=2)

    first = loader()
    it = iter(first)
    _keys_and_tokens(it, 3)
    state = first.save_state_rank()
    expected = _keys_and_tokens(it, 6)
    _KEEP_ALIVE.append((first, it))
    second = loader()
    second.restore_state_rank(state)
    it = iter(second)
    got = _keys_and_tokens(it, 6)
    _KEEP_ALIVE.append((second, it))
    # the restored state matters: a fresh loader (same seed) starts elsewhere
    fresh = loader()
    it = iter(fresh)
    assert [k for k, _, _ in _keys_and_tokens(it, 6)] != [k for k, _, _ in expected]
    _KEEP_ALIVE.append((fresh, it))
    assert [k for k, _, _ in got] == [k for k, _, _ in expected]
    for (_, t1, i1), (_, t2, i2) in zip(got, expected):
        assert torch.equal(t1, t2) and torch.equal(i1, i2)


def test_data_parallel_ranks_disjoint(vqa_dataset, encoder):
    train_keys = set()
    for shard in vqa_dataset.splits["train"]:
        train_keys |= {k for k, _ in iter_tar_samples(vqa_dataset.output / shard, parts=())}
    seen = []
    for rank in range(2):
        ld = build_train_loader(vqa_dataset.output, encoder, 1, rank, 2, 0, seed=3, shuffle_buffer_size=2,
                                max_samples_per_sequence=2)
        it = iter(ld)
        seen.append({k for _ in range(3 * len(train_keys)) for k in next(it).__key__})
    assert seen[0].isdisjoint(seen[1])
    assert seen[0] | seen[1] == train_keys
    assert abs(len(seen[0]) - len(seen[1])) <= 1  # 9 train samples: 5 + 4


def test_crude_dataset_from_interactive_prepare(llava_dataset, encoder, tmp_path):
    """The --no-prepare path with 'Crude sample' chosen in `energon prepare`: the task encoder cooks it."""
    from click.testing import CliRunner
    from megatron.energon.tools.prepare import command as prepare

    crude = tmp_path / "crude"
    crude.mkdir()
    for tar in llava_dataset.output.glob("*.tar"):
        shutil.copy(tar, crude / tar.name)
    res = CliRunner().invoke(prepare, [str(crude), "--non-interactive", "--split-ratio", "2,1,0",
                                       "--sample-type", "CrudeWebdataset", "--no-progress"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    a = {k: v[:2] for k, v in read_all(llava_dataset, encoder).items()}
    b = {}
    for split in ("train", "val"):
        for batch in build_eval_loader(crude, encoder, 2, 0, 1, 0, split=split):
            for i, key in enumerate(batch.__key__):
                b[key] = (answers_of(encoder, batch, i), int((batch.tokens[i] == encoder.image_token_id).sum()))
    assert a == b
