"""Bad model directories and bad data fail fast and clearly.

- A processor without ``patch_size`` (older llava-hf uploads), on which HF's own processor fails, encodes
  exactly like the full processor: image tokens per image come from the model's spec, equal to HF's count.
- An image processor whose output size is not the vision encoder's is refused, naming both sizes.
- A chat template that never renders the image token makes every sample skip: the energon loader (with and
  without worker processes) stops within the bound with the reasons counted, and a 2-rank training launch
  ends with that one line from each rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from megatron.energon import SkipSample
from megatron.energon.errors import FatalSampleError
from PIL import Image

from megatron_vlm.data.conversation import split_placeholders
from megatron_vlm.data.geometry import ImageProcessorMismatchError
from megatron_vlm.data.loader import build_train_loader
from megatron_vlm.data.skips import SkipCounter, TooManySkippedSamples, skip_error_line
from megatron_vlm.data.synthetic import image_array
from megatron_vlm.data.task_encoder import VLMTaskEncoder
from megatron_vlm.model.spec import VLMSpec
from tests.support import forked_cli
from megatron_vlm.training.config import ConfigError, TrainConfig
from tests.data_fixtures import tiny_llava, vqa_dataset, vqa_inputs  # noqa: F401

from .conftest import ROOT

# Both lanes: a training run whose data fails in the ranks ends with the line on every rank after megatron-core has
# set up (the lane guard saw the forked ranks import it).

_KEEP_ALIVE: list = []  # loaders with workers shut down at interpreter exit, not in the test (see test_data_loader)


def variant(src: Path, dst: Path, processor=None, template=None) -> Path:
    """A copy of the LLaVA dir ``src`` (without weights) with its processor config / chat template edited."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    if processor is not None:
        p = dst / "processor_config.json"
        p.write_text(json.dumps(processor(json.loads(p.read_text())), indent=2))
    if template is not None:
        p = dst / "chat_template.jinja"
        p.write_text(template(p.read_text()))
    return dst


def without_patch_size(d: dict) -> dict:
    return {k: v for k, v in d.items()
            if k not in ("patch_size", "num_additional_image_tokens", "vision_feature_select_strategy")}


def no_image_parts(template: str) -> str:
    assert "<image>\n" in template
    return template.replace("<image>\n", "")


@contextmanager
def deadline(seconds: int):
    def fire(signum, frame):
        raise TimeoutError(f"nothing stopped the loader within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def pil(seed, size=(45, 30)):
    return Image.fromarray(image_array(size, seed))


MESSAGES = [{"role": "user", "content": split_placeholders("<image>\nwhat colour is it ?")},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]


@pytest.mark.parametrize("families", [("llama", "clip"), ("qwen2", "siglip")], ids=lambda p: "-".join(p))
def test_processor_without_patch_size_encodes_like_hf(families, tmp_path_factory, tmp_path):
    from transformers import AutoProcessor

    full = tiny_llava(tmp_path_factory, *families)
    old = variant(full, tmp_path / "old", processor=without_patch_size)
    image = pil(1)
    # HF's own processor cannot expand the image token without patch_size (the defect users hit)
    with pytest.raises(TypeError):
        AutoProcessor.from_pretrained(str(old))(text="<image>", images=[image])
    proc = AutoProcessor.from_pretrained(str(full), backend="pil")  # the image pipeline training uses
    hf = proc(text=proc.image_token, images=[image], add_special_tokens=False, return_tensors="pt")
    hf_tokens = int((hf["input_ids"][0] == proc.tokenizer.convert_tokens_to_ids(proc.image_token)).sum())
    spec = VLMSpec.from_hf_dir(full)
    enc, ref = VLMTaskEncoder(old, seq_length=256), VLMTaskEncoder(full, seq_length=256, spec=spec)
    assert enc.tokens_per_image == ref.tokens_per_image == spec.num_image_tokens == hf_tokens == 16
    assert (enc.geometry.height, enc.geometry.width) == tuple(hf["pixel_values"].shape[-2:]) == (32, 32)
    a, b = enc.encode_conversation(MESSAGES, [image]), ref.encode_conversation(MESSAGES, [image])
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key
    assert torch.equal(a["images"], hf["pixel_values"].to(torch.float32))


def test_image_processor_size_mismatch_is_refused(tmp_path_factory, tmp_path):
    full = tiny_llava(tmp_path_factory)

    def crop48(d):
        d["image_processor"].update(crop_size={"height": 48, "width": 48}, size={"shortest_edge": 48})
        return d

    def no_crop(d):
        d["image_processor"]["do_center_crop"] = False
        return d

    bad = variant(full, tmp_path / "crop48", processor=crop48)
    with pytest.raises(ImageProcessorMismatchError) as e:
        VLMTaskEncoder(bad, seq_length=256)
    msg = str(e.value)
    assert f"the image processor in {bad} produces 3x48x48 pixel values" in msg
    assert "crop_size {'height': 48, 'width': 48}" in msg
    assert "the model's vision encoder takes 3x32x32" in msg
    assert f"set crop_size (and size) to 32 in {bad / 'processor_config.json'}" in msg
    # resizing the short side without a crop gives 42x32 from the 64x48 probe image: not square, refused
    uncropped = variant(full, tmp_path / "nocrop", processor=no_crop)
    with pytest.raises(ImageProcessorMismatchError, match=r"produces 3x32x42 pixel values .* takes 3x32x32"):
        VLMTaskEncoder(uncropped, seq_length=256)
    # a tokenizer directory without the model's config.json cannot say what an image becomes
    (uncropped / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{uncropped} has no config.json: the image size and image tokens"):
        VLMTaskEncoder(uncropped, seq_length=256)


def test_skip_counter_counts_consecutive_reasons():
    c = SkipCounter(5, hints={"x": "fix x", "y": "fix y"})
    for reason in ("a", "a"):
        with pytest.raises(SkipSample):
            c.skip("k", "x", reason)
    c.kept()  # a kept sample ends the run of skips
    for reason, kind in [("b", "y"), ("c", "x"), ("b", "y"), ("c", "x")]:
        with pytest.raises(SkipSample):
            c.skip("k", kind, reason)
    with pytest.raises(TooManySkippedSamples) as e:
        c.skip("k", "y", "b")
    line = "stopped after 5 consecutive skipped samples: 3 x 'b', 2 x 'c'; fix y; fix x"
    assert str(e.value) == line and skip_error_line(e.value) == line
    assert dict(c.total) == {"a": 2, "b": 3, "c": 2}
    # four reasons: the two least frequent are summed
    c = SkipCounter(7)
    for reason in "ppqqrs":
        with pytest.raises(SkipSample):
            c.skip("k", "?", reason)
    with pytest.raises(TooManySkippedSamples) as e:
        c.skip("k", "?", "t")
    assert str(e.value) == ("stopped after 7 consecutive skipped samples: 2 x 'p', 2 x 'q', 1 x 'r', "
                            "and 2 more for 2 other reasons")
    with pytest.raises(ValueError, match="must be >= 1"):
        SkipCounter(0)


def test_flag_default_and_range():
    req = ["--data-path", "d", "--tokenizer-load-dir", "t", "--megatron-load-dir", "m", "--train-iters", "9"]
    assert TrainConfig.from_args(req).max_consecutive_skipped_samples == 1000
    assert TrainConfig.from_args([*req, "--max-consecutive-skipped-samples", "7"]).max_consecutive_skipped_samples == 7
    with pytest.raises(ConfigError, match="--max-consecutive-skipped-samples 0: must be at least 1"):
        TrainConfig.from_args([*req, "--max-consecutive-skipped-samples", "0"])


@pytest.fixture
def no_image_template(tmp_path_factory):
    d = tmp_path_factory.mktemp("guard") / "no_image_template"
    return variant(tiny_llava(tmp_path_factory), d, template=no_image_parts)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_every_sample_skipped_stops_with_counted_reasons(num_workers, no_image_template, vqa_dataset):  # noqa: F811
    enc = VLMTaskEncoder(no_image_template, seq_length=256, max_consecutive_skips=30)
    loader = build_train_loader(vqa_dataset.output, enc, 2, 0, 1, num_workers, seed=0)
    _KEEP_ALIVE.append(loader)
    t0 = time.time()
    with deadline(60), pytest.raises(FatalSampleError) as e:
        next(iter(loader))
    assert time.time() - t0 < 30
    assert skip_error_line(e.value) == (
        "stopped after 30 consecutive skipped samples: 30 x '0 image tokens but 1 images'; check the chat "
        f"template in {no_image_template}: it must render every image part of a message as '<image>', once per "
        "image")
    if num_workers:  # it crossed the worker process as text: the traceback torch carries over
        assert "Caught FatalSampleError in DataLoader worker process 0" in str(e.value)


@pytest.mark.slow
def test_training_run_ends_with_the_line_on_every_rank(no_image_template, vqa_dataset, tmp_path):  # noqa: F811
    """-g 2 on CPU: both ranks print the one line and the launcher exits non-zero (no hang, no worker traceback)."""
    ids = VLMSpec.from_hf_dir(no_image_template)
    argv = ["--device", "cpu", "-g", "2", "--init", "--tokenizer-load-dir", str(no_image_template),
            "--data-path", str(vqa_dataset.output), "--save-dir", str(tmp_path), "--name", "run", "--no-save",
            "--micro-batch-size", "2", "--seq-length", "64", "--num-workers", "1", "--train-iters", "2",
            "--image-token-id", str(ids.image_token_id), "--pad-token-id", str(ids.pad_token_id),
            "--max-consecutive-skipped-samples", "20"]
    p = forked_cli.run([sys.executable, "train/run.py", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = (f"error: stopped after 20 consecutive skipped samples: 20 x '0 image tokens but 1 images'; check the "
            f"chat template in {no_image_template}: it must render every image part of a message as '<image>', "
            "once per image")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert lines.count(line) == 2, p.stderr[-3000:]
    assert "TooManySkippedSamples" not in p.stderr and "DataLoader worker" not in p.stderr
    assert lines[-1] == "[train/run.py] training exited with code 1"
