"""InternVL's trainer-against-HF checks on the project's shared references, through one thin layer.

- :func:`global_batches`: the trainer's global batches of an InternVL directory (:func:`~tests.support.
  train_jobs.variable_length_batches`: multi-tile images of four sizes), with a video sample (``Frame1: ...`` lines,
  one tile per frame) in each batch when asked;
- :func:`hf_numbers`: HF's own model on the same batches: losses and gradient norms of AdamW steps
  and the first step's gradient of every tensor in HF's on-disk names
  (:func:`tests.support.hf_reference.train`);
- :func:`trainer_gradients`: a trained job's gradient shards assembled into HF tensors
  (:func:`tests.support.grad_reference.assemble`); :func:`compare` and :func:`assert_steps_match` hold them and the
  run's losses and gradient norms against HF's.

Only these functions call the reference modules, so a change of their interface is met here.
"""

from __future__ import annotations

#: the video of the video samples: 12 frames at 4 fps (LLaVA-NeXT's rule at 1 fps takes 3), 48 x 32 px
VIDEO_FRAMES, VIDEO_FPS = 12, 4
VIDEO_MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens ?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "the colours change"}]}]


def video_sample(encoder, key: str = "video"):
    """One encoded video sample of ``encoder`` (an InternVL task encoder)."""
    from megatron_vlm.data.internvl_encoder import InternVLSample
    from tests.support.videos import make_video

    fields = encoder.encode_conversation(VIDEO_MESSAGES, [], key, [make_video(VIDEO_FRAMES, 48, 32, fps=VIDEO_FPS)])
    return InternVLSample(__key__=key, __restore_key__=(), __subflavors__=None, __sources__=None, **fields)


def global_batches(hf_dir, n: int, video: bool = False) -> list[list]:
    """``n`` global batches of 8 encoded samples (images of four sizes, several tiles each); with ``video`` the
    first sample of each is a video."""
    from tests.support.train_jobs import encoder_for, variable_length_batches

    batches = variable_length_batches(hf_dir, n)
    if video:
        enc = encoder_for(hf_dir)
        for b, gb in enumerate(batches):
            gb[0] = video_sample(enc, f"video-{b}")
    return batches


def hf_numbers(hf_dir, batches: list[list], cfg) -> dict:
    """HF on the trainer's batches: {"loss": [...], "grad_norm": [...]} of AdamW steps over ``batches`` and
    "grads": {HF on-disk name: the first batch's gradient}."""
    from tests.support import hf_reference

    return hf_reference.train(hf_dir, batches, cfg, grads=True)


def trainer_gradients(run: dict, spec, job: dict) -> dict:
    """HF-named full gradients of a ``train_jobs`` run with ``grads=True`` at ``job``'s layout."""
    from tests.support import grad_reference

    return grad_reference.assemble(run["grads"], spec, **run["layout"])


def compare(trainer: dict, hf: dict) -> dict[str, float]:
    """Each tensor's ``|trainer - HF| / |HF|``."""
    from tests.support import grad_reference

    return grad_reference.compare(trainer, hf)


def assert_steps_match(run: dict, ref: dict, rtol: float, norm_rtol: float) -> None:
    """A run's losses and gradient norms against HF's (:func:`tests.support.grad_reference.assert_steps_match`)."""
    from tests.support import grad_reference

    grad_reference.assert_steps_match(run, ref, rtol, norm_rtol)
