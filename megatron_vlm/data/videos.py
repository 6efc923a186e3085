"""Videos for LLaVA-OneVision: the check ``make_wds`` applies, LLaVA-NeXT's frame choice, decoding the chosen
frames through energon, and the pixels of a frame as LLaVA-NeXT trains on them.

- :func:`check_video` (``make_wds``): the bytes must open with PyAV as a video container energon decodes
  (mp4/mov, mkv/webm, avi), hold a video stream with a frame size, at least one frame (packets are demuxed, not
  decoded; a file whose index lists more frames than it holds is truncated), a first frame that decodes, a frame
  rate and a duration. Videos are stored byte for byte, never re-encoded.
- :func:`probe`: frame count, frame rate and size from the container (the mp4 index, else demuxed packets),
  read without decoding frames.
- :func:`frame_indices`: LLaVA-NeXT's ``process_video_with_decord``: one frame every ``round(fps / video_fps)``
  frames from frame 0 (``video_fps=1``: one per second), and when that gives more than ``max_frames`` (32 in the
  OneVision recipes), ``np.linspace(0, T - 1, max_frames, dtype=int)`` instead (which includes the last frame).
  A clip slower than ``video_fps / 2`` takes every frame (LLaVA-NeXT's step would be 0 there).
- :func:`decode_frames`: only the chosen frames, with energon's ``AVDecoder`` seeking to each (``av`` via
  energon's ``av-decode`` extra).
- :func:`frame_pixels`: each frame squashed to the vision encoder's square input with PIL BICUBIC (no anyres
  tiling, padding or crop), rescaled by 1/255 and normalised with the model's image processor's mean/std, by that
  processor's own (PIL) resize/rescale/normalize: what LLaVA-NeXT's SigLIP processor does to every frame. HF's
  torchvision video processor agrees within 1-2 levels on a few pixels; energon's ``video_out_frame_size``
  (a bilinear swscale) is not used.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from megatron_vlm.data.conversation import Reject

DEFAULT_VIDEO_FPS = 1.0
DEFAULT_VIDEO_FRAMES = 32
#: PyAV demuxer name (first of its aliases) -> extension of the tar member (one energon's AV decoder reads)
CONTAINERS = {"mov": "mp4", "matroska": "mkv", "avi": "avi"}
#: tar member extensions of videos (energon's AVWebdatasetDecoder decodes these)
VIDEO_EXTENSIONS = ("mp4", "mkv", "webm", "mov", "avi")


class VideoDecodeError(ValueError):
    """A stored video whose chosen frames do not decode."""


@dataclass(frozen=True)
class VideoInfo:
    frames: int  # frames the container holds (decord's len(VideoReader))
    fps: float  # average frame rate (decord's get_avg_fps)
    width: int
    height: int


def _open(source):
    from megatron.energon.av.av_init import av_open

    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    source.seek(0)
    return av_open(source)


def _count_packets(container, stream) -> int:
    return sum(1 for p in container.demux(stream) if p.pts is not None)


def _fps(stream) -> float | None:
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else None


def _indexed_frames(container, stream) -> int:
    """Frames an mp4/mov index lists (energon seeks these by frame number); 0 for other containers, whose index
    (mkv cues) lists keyframes only."""
    return len(stream.index_entries) if container.format.name.startswith("mov") else 0


def probe(source) -> VideoInfo:
    """Frame count, frame rate and size of a video (bytes or a seekable binary file), without decoding frames.
    The frame count is the mp4/mov index's (what energon seeks by), else the demuxed packets'."""
    with _open(source) as c:
        if not c.streams.video:
            raise VideoDecodeError("no video stream")
        s = c.streams.video[0]
        frames = _indexed_frames(c, s) or _count_packets(c, s)
        fps = _fps(s)
        if not fps:
            raise VideoDecodeError("no frame rate")
        return VideoInfo(frames, fps, int(s.width), int(s.height))


def check_video(data: bytes, what: str = "video") -> tuple[str, bytes]:
    """``make_wds``'s check of one video: ``(extension, data)`` to store, or :class:`Reject` with the reason."""
    import av

    try:
        with _open(data) as c:
            name = c.format.name
            ext = CONTAINERS.get(name.split(",")[0])
            if ext is None:
                raise Reject(f"unreadable {what}: a {name} file, not a video container (mp4/mov, mkv/webm or avi)")
            if not c.streams.video:
                raise Reject(f"unreadable {what}: no video stream"
                             + (" (an audio-only file)" if c.streams.audio else ""))
            s = c.streams.video[0]
            if not (s.width and s.height):
                raise Reject(f"unreadable {what}: no frame size")
            indexed, packets = _indexed_frames(c, s), _count_packets(c, s)
            if packets == 0:
                raise Reject(f"unreadable {what}: no frames")
            if packets < indexed:
                raise Reject(f"unreadable {what}: truncated ({packets} of the {indexed} frames its index lists)")
            c.seek(0)
            if next(iter(c.decode(s)), None) is None:
                raise Reject(f"unreadable {what}: its first frame does not decode")
            if not _fps(s):
                raise Reject(f"unreadable {what}: no frame rate")
            duration = (float(s.duration * s.time_base) if s.duration else
                        c.duration / av.time_base if c.duration else 0.0)
            if not duration > 0:
                raise Reject(f"unreadable {what}: no duration")
    except Reject:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV/FFmpeg raise many types for damaged input; all mean "unreadable"
        raise Reject(f"unreadable {what}: {getattr(e, 'strerror', None) or e}") from None
    return ext, data


def frame_indices(num_frames: int, fps: float, video_fps: float = DEFAULT_VIDEO_FPS,
                  max_frames: int = DEFAULT_VIDEO_FRAMES) -> list[int]:
    """LLaVA-NeXT's frame choice (see the module docstring) for a video of ``num_frames`` frames at ``fps``."""
    import numpy as np

    step = max(1, round(float(fps) / float(video_fps)))
    idx = list(range(0, int(num_frames), step))
    if max_frames and len(idx) > max_frames:
        idx = np.linspace(0, num_frames - 1, max_frames, dtype=int).tolist()
    return idx


def av_decoder(video):
    """An energon ``AVDecoder`` for ``video`` (what energon's sample decoder gives for a video part, or bytes)."""
    from megatron.energon.av import AVDecoder

    return video if isinstance(video, AVDecoder) else AVDecoder(io.BytesIO(bytes(video)))


def decode_frames(video, indices: list[int]):
    """The frames at ``indices`` as uint8 ``[F, 3, H, W]``, decoded by energon seeking to each (not the whole
    file). ``video``: an energon ``AVDecoder`` or the video's bytes."""
    import torch

    dec = av_decoder(video)
    dec.suppress_warnings = True  # mkv/webm seek by time: frame i is the one shown at i / fps
    clips, _ = dec.get_video_clips([(i, i) for i in indices], video_unit="frames")
    if len(clips) != len(indices):
        raise VideoDecodeError(f"{len(clips)} of the {len(indices)} chosen frames decode")
    return torch.cat([c[:1] for c in clips])


def frame_pixels(frames, image_processor, size: int):
    """float32 ``[F, 3, size, size]`` pixel values of uint8 frames ``[F, 3, H, W]`` (see the module docstring)."""
    import torch
    from transformers.image_utils import SizeDict

    ip = image_processor
    out = []
    for f in frames.numpy():
        x = ip.resize(f, SizeDict(height=size, width=size), resample=ip.resample)
        x = ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std)
        out.append(torch.from_numpy(x).to(torch.float32))
    return torch.stack(out) if out else torch.zeros(0, 3, size, size)
