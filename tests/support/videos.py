"""Small video files made with PyAV for tests, the demo and benchmarks (nothing downloaded).

``make_video`` encodes frames whose colours change with the frame index (so a wrong frame choice shows);
``broken_videos`` gives the bad inputs ``make_wds`` must reject: an undecodable file, a container without
frames, an audio-only file, a JPEG named ``.mp4`` and an mp4 cut in half.
"""

from __future__ import annotations

import io

import numpy as np


def frame_array(i: int, width: int, height: int, colour=None) -> np.ndarray:
    """RGB frame ``i``: a colour (``colour`` or one from ``i``) with a bar whose position encodes ``i``."""
    arr = np.empty((height, width, 3), np.uint8)
    arr[:] = colour if colour is not None else ((37 * i) % 256, (91 * i + 60) % 256, (53 * i + 120) % 256)
    x = (3 * i) % max(1, width - 2)
    arr[:, x:x + 2] = (255 - arr[0, 0]).tolist()
    return arr


def make_video(num_frames: int, width: int = 48, height: int = 32, fps=10, codec: str = "mpeg4",
               container: str = "mp4", colour=None, faststart: bool = False) -> bytes:
    """A video of ``num_frames`` frames of ``width`` x ``height`` at ``fps`` (mpeg4 in mp4 takes odd sizes;
    ``container='webm', codec='libvpx'`` gives one that energon seeks by time; ``faststart``: the mp4 index
    before the frames, as streaming sites write them)."""
    import os
    import tempfile

    import av

    with tempfile.TemporaryDirectory() as tmp:  # faststart rewrites the file, so it needs a real one
        path = os.path.join(tmp, f"v.{container}")
        with av.open(path, "w", format=container, options={"movflags": "faststart"} if faststart else {}) as c:
            s = c.add_stream(codec, rate=fps)
            s.width, s.height, s.pix_fmt = width, height, "yuv420p"
            for i in range(num_frames):
                frame = av.VideoFrame.from_ndarray(frame_array(i, width, height, colour), format="rgb24")
                for p in s.encode(frame):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        with open(path, "rb") as f:
            return f.read()


def _no_frames_avi() -> bytes:
    import av

    buf = io.BytesIO()
    c = av.open(buf, "w", format="avi")
    s = c.add_stream("mpeg4", rate=10)
    s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
    c.start_encoding()
    c.close()
    return buf.getvalue()


def _audio_only_mp4() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for p in list(s.encode(frame)) + list(s.encode()):
            c.mux(p)
    return buf.getvalue()


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame_array(0, 24, 16)).save(buf, "JPEG")
    return buf.getvalue()


def broken_videos() -> dict[str, bytes]:
    """name -> bytes of a file named ``.mp4`` that is not a usable video."""
    good = make_video(10, faststart=True)
    return {"undecodable": b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8, "truncated": good[: len(good) // 2],
            "no_frames": _no_frames_avi(), "audio_only": _audio_only_mp4(), "jpeg": _jpeg()}
