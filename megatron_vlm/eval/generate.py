"""Answers from a trained model with HF ``generate``, and the ``eval/generate.py`` command.

:class:`Generator` holds a loaded model (:mod:`.model`) and its prompt encoder (:mod:`.prompts`) and answers
batches of prompts: greedy by default; sampling (``temperature``, ``top_p``, ``top_k``, seeded by ``seed``) when
asked. Generation stops at the model's end tokens (its generation config: the token the chat template closes
answers with) or after ``max_new_tokens``. The answer is the new tokens decoded without special tokens.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from megatron_vlm.eval.model import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class Sampling:
    """How tokens are chosen: greedy unless ``temperature`` > 0, ``top_p`` or ``top_k`` is given."""

    max_new_tokens: int = 64
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return not ((self.temperature or 0) > 0 or self.top_p is not None or self.top_k is not None)

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        return dict(do_sample=True, temperature=self.temperature if self.temperature else 1.0,
                    top_p=self.top_p if self.top_p is not None else 1.0,
                    top_k=self.top_k if self.top_k is not None else 0)


class Generator:
    """A model and its prompt encoder; :meth:`answer` generates for a batch of prompts."""

    def __init__(self, loaded: LoadedModel, sampling: Sampling, video_fps: float = 1.0, video_frames: int = 32):
        from megatron_vlm.eval.prompts import PromptEncoder

        self.loaded = loaded
        self.model = loaded.model
        self.spec = loaded.spec
        self.sampling = sampling
        self.prompts = PromptEncoder(loaded.files_dir, loaded.spec, video_fps, video_frames)
        self.tokenizer = self.prompts.tokenizer
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype

    def encode(self, messages: list[dict], images=(), videos=()):
        """The :class:`~megatron_vlm.eval.prompts.Prompt` of a conversation ending in a user turn."""
        return self.prompts.encode(messages, images, videos)

    def generate_ids(self, prompts: list) -> list[list[int]]:
        """The new token ids of each prompt (end tokens and what follows them removed)."""
        import torch

        from megatron_vlm.eval.prompts import collate

        inputs = collate(prompts, self.prompts.pad_token_id, self.spec.arch, self.spec.image_token_id)
        inputs = {k: (v.to(self.device, self.dtype) if k.startswith("pixel_values") else v.to(self.device))
                  for k, v in inputs.items()}
        gen_cfg = self.model.generation_config
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        if not self.sampling.greedy:
            torch.manual_seed(self.sampling.seed)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.sampling.max_new_tokens,
                                      pad_token_id=self.prompts.pad_token_id, eos_token_id=eos,
                                      **self.sampling.generate_kwargs())
        new = out[:, inputs["input_ids"].shape[1]:].tolist()
        stops = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        result = []
        for row in new:
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            result.append(row[:cut])
        return result

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def answer(self, prompts: list) -> list[str]:
        return [self.decode(ids) for ids in self.generate_ids(prompts)]


def read_images(paths: list[str]) -> list:
    """PIL RGB images of ``--image`` paths (EXIF orientation applied, as make_wds stores images)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    from megatron_vlm.cli import InputError

    out = []
    for p in paths:
        try:
            with Image.open(p) as im:
                out.append(ImageOps.exif_transpose(im).convert("RGB"))
        except FileNotFoundError:
            raise InputError(f"--image {p}: no such file") from None
        except (UnidentifiedImageError, OSError) as e:
            raise InputError(f"--image {p}: not a readable image ({e}); give a JPEG, PNG or another format PIL "
                             "reads") from None
    return out


def read_video(path: str | None) -> list[bytes]:
    """The bytes of ``--video`` after the check make_wds applies to videos."""
    if path is None:
        return []
    from megatron_vlm.cli import InputError
    from megatron_vlm.data.conversation import Reject
    from megatron_vlm.data.videos import check_video

    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"--video {path}: no such file") from None
    try:
        check_video(data, f"--video {path}")
    except Reject as e:
        raise InputError(f"--video {path}: {e}; give an mp4/mov, mkv/webm or avi file with a video stream") from None
    return [data]


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    from megatron_vlm.cli import nonneg_float, nonneg_int, positive_int

    g = p.add_argument_group("generation (greedy unless --temperature > 0, --top-p or --top-k is given)")
    g.add_argument("--max-new-tokens", type=positive_int, default=64, help="most tokens to generate (default 64)")
    g.add_argument("--temperature", type=nonneg_float, default=None,
                   help="sample with this temperature (0: greedy, the default)")
    g.add_argument("--top-p", type=_top_p, default=None, help="sample from the smallest set of tokens whose "
                   "probability reaches P (nucleus sampling)")
    g.add_argument("--top-k", type=positive_int, default=None, help="sample from the K most likely tokens")
    g.add_argument("--seed", type=nonneg_int, default=0, help="random seed of sampling (default 0)")
    g.add_argument("--video-fps", type=float, default=1.0, metavar="N",
                   help="OneVision videos: one frame every round(fps / N) frames, as train/run.py --video-fps")
    g.add_argument("--video-frames", type=positive_int, default=32, metavar="N",
                   help="OneVision videos: at most N frames, as train/run.py --video-frames (default 32)")


def _top_p(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be within (0, 1]")
    return v


def sampling_of(a) -> Sampling:
    return Sampling(a.max_new_tokens, a.temperature, a.top_p, a.top_k, a.seed)


def main(argv=None) -> int:
    """``eval/generate.py``: one answer to ``--prompt`` about ``--image``s / ``--video``, printed on stdout."""
    from megatron_vlm.cli import add_debug_flag, setup_logging
    from megatron_vlm.eval import model as model_mod

    p = argparse.ArgumentParser(allow_abbrev=False, 
        prog="eval/generate.py",
        description="Answer a prompt about images or a video with a trained model (an HF export, or a Megatron "
                    "checkpoint read in memory, or the sharded Megatron model itself with --engine megatron). The "
                    "prompt is rendered with the model's chat template and "
                    "encoded as training encodes samples; the answer is printed.",
        epilog="example: python eval/generate.py --model /ckpt/llava-out --image cat.jpg --prompt 'What is this?'; "
               "python eval/generate.py --megatron-dir /ckpt/run --engine megatron --tp 2 --pp 2 --image cat.jpg "
               "--prompt 'What is this?'")
    model_mod.add_model_flags(p)
    g = p.add_argument_group("prompt")
    g.add_argument("--prompt", required=True, help="the question or instruction (the user's turn)")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image the prompt is about (repeatable; in order, before the text)")
    g.add_argument("--video", default=None, metavar="PATH", help="a video the prompt is about (OneVision models)")
    g.add_argument("--system", default=None, help="a system message before the user's turn")
    add_sampling_flags(p)
    add_debug_flag(p)
    a = p.parse_args(argv)
    model_mod.check_model_flags(p, a)
    setup_logging(a.verbose)
    from megatron_vlm.eval.prompts import user_message

    images = read_images(a.image)
    videos = read_video(a.video)
    messages = ([{"role": "system", "content": [{"type": "text", "text": a.system}]}] if a.system else []) + \
        [user_message(a.prompt, len(images), len(videos))]
    if a.engine == "megatron":
        from megatron_vlm.eval import sharded

        print(sharded.run_on_ranks(a, sampling_of(a), sharded.answer_on_rank, messages, images, videos), flush=True)
        return 0
    loaded = model_mod.load_from_args(a)
    gen = Generator(loaded, sampling_of(a), a.video_fps, a.video_frames)
    prompt = gen.encode(messages, images, videos)
    print(gen.answer([prompt])[0], flush=True)
    return 0
