"""Which megatron-core runs here, which wrote a checkpoint, and whether this one can read it.

megatron-vlm supports two lanes, chosen by the Python version (``setup.cfg``, ``constraints/pyXY.txt``):

- Python 3.11: megatron-core 0.16 (the newest release for 3.11);
- Python 3.12: megatron-core 0.19 (NGC PyTorch / NeMo containers, the GPU machines).

Their torch_dist checkpoints differ in one place: 0.16 keeps the common (non-tensor) state in ``common.pt``;
0.17 and newer put it into the ``.distcp`` files and write no ``common.pt``. 0.19 reads both, 0.16 reads only
its own (it fails with "Common file .../common.pt does not exist"). Every checkpoint megatron-vlm writes
records the versions that wrote it (``ckpt_meta.json`` ``versions``, from :func:`writer_stamp`);
:func:`check_readable` turns the unreadable case into an error that names the writer and what to install.

This module knows versions and the two torch_dist formats only; it imports nothing of megatron-vlm's checkpoint
layout (:mod:`megatron_vlm.checkpoint.layout` depends on it, not the other way).
"""

from __future__ import annotations

import importlib.metadata as md
import sys

#: (python (major, minor) from, megatron-core requirement) per lane, newest first; matches setup.cfg
LANES = (((3, 12), "megatron-core>=0.19.2,<0.20"), ((3, 10), "megatron-core>=0.16,<0.17"))
#: the first megatron-core release whose torch_dist checkpoints have no common.pt
NO_COMMON_PT_SINCE = (0, 17)
COMMON_FILE = "common.pt"
DIST_METADATA = "metadata.json"


#: the lane's megatron-core from which the experts' optimizer state is kept apart when --etp differs from --tp at
#: --ep 1 (megatron-core 0.16 keeps it apart only at --ep > 1): see :func:`experts_optimizer_apart`
EXPERTS_APART_AT_ETP_SINCE = (0, 19)


#: the lane's megatron-core whose inference wrappers take an inference context (0.16's take an
#: InferenceWrapperConfig, and the context as a keyword): see :func:`inference_wrapper_takes_context`
INFERENCE_CONTEXT_WRAPPERS_SINCE = (0, 19)


class CheckpointVersionError(RuntimeError):
    """A checkpoint written by a megatron-core this one cannot read; the message says what to install."""


def _parse(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def installed() -> str:
    """The megatron-core version of this environment, e.g. ``'0.16.1'``."""
    return md.version("megatron-core")


def writes_common_file(version: str | None = None) -> bool:
    """Whether megatron-core ``version`` (default: this one) writes ``common.pt`` in torch_dist checkpoints."""
    return _parse(version or installed()) < NO_COMMON_PT_SINCE


def inference_wrapper_takes_context(version: str | None = None) -> bool:
    """Whether megatron-core ``version``'s model inference wrappers are built as ``(model, inference_context)``
    (0.19) rather than ``(model, InferenceWrapperConfig, inference_context=...)`` (0.16)."""
    return _parse(version or installed()) >= INFERENCE_CONTEXT_WRAPPERS_SINCE


def lane_requirement(python: tuple[int, int] | None = None) -> str:
    """The megatron-core requirement of the lane for ``python`` (default: this interpreter)."""
    python = python or sys.version_info[:2]
    for since, req in LANES:
        if python >= since:
            return req
    raise RuntimeError(f"Python {python[0]}.{python[1]} is not supported; use Python 3.11 or 3.12")


def experts_optimizer_apart(ep: int, etp: int, tp: int, version: str | None = None) -> bool:
    """Whether megatron-core ``version`` (default: this one) keeps the experts' optimizer state in an optimizer of
    its own (saved under ``chained_1.`` keys) at this layout: 0.16 when EP > 1 (the experts' parameters are then
    reduced over the expert-data-parallel group); 0.19 also when the expert tensor-parallel size differs from TP."""
    return ep > 1 or (etp != tp and _parse(version or installed()) >= EXPERTS_APART_AT_ETP_SINCE)


def expert_optimizer_rule(version: str | None = None) -> str:
    """:func:`experts_optimizer_apart` in words, for messages."""
    v = version or installed()
    if _parse(v) >= EXPERTS_APART_AT_ETP_SINCE:
        return f"megatron-core {v} keeps it apart when --ep > 1 or --etp differs from --tp"
    return f"megatron-core {v} keeps it apart when --ep > 1 (whatever --etp)"


def expert_layout_problem(ep: int, etp: int, tp: int, version: str | None = None) -> str | None:
    """Why megatron-core ``version`` (default: this one) cannot train a mixture-of-experts model's experts at this
    layout, or None. megatron-core 0.16 at --ep 1 with --etp differing from --tp keeps the experts' parameters with
    the dense ones and sums their gradients over the data-parallel ranks only, while under sequence parallelism each
    tensor-parallel rank's experts saw other positions: the experts' gradients miss the other TP ranks' share
    (measured against HF: wrong by ~100%, tests/test_moe.py). 0.19 reduces them over the expert-data-parallel
    ranks there."""
    v = version or installed()
    if ep == 1 and etp != tp and _parse(v) < EXPERTS_APART_AT_ETP_SINCE:
        return (f"--etp {etp} with --tp {tp} at --ep 1: megatron-core {v} sums the experts' gradients over the "
                "data-parallel ranks only at this layout, while each tensor-parallel rank's experts see other "
                f"tokens, so the experts would train wrong; use --etp {tp} (or leave it out), --ep > 1, or the "
                f"Python 3.12 lane ({LANES[0][1]})")
    return None


def writer_stamp() -> dict[str, str]:
    """What ``ckpt_meta.json`` records about the software that wrote a checkpoint."""
    import torch

    stamp = {"megatron_core": installed(), "torch": torch.__version__.split("+")[0],
             "python": "%d.%d" % sys.version_info[:2]}
    try:
        stamp["megatron_vlm"] = md.version("megatron-vlm")
    except md.PackageNotFoundError:
        pass
    return stamp


def unreadable(iter_dir) -> bool:
    """Whether ``iter_dir`` holds a torch_dist checkpoint in the newer format (no ``common.pt``) that this
    megatron-core cannot read. Legacy and non-checkpoint directories are readable."""
    if not writes_common_file():
        return False  # 0.17+ reads both formats
    from megatron_vlm.files import storage

    d = storage.path(iter_dir)
    return (d / DIST_METADATA).is_file() and not (d / COMMON_FILE).is_file()


def check_readable(iter_dir, written_by: str | None = None) -> None:
    """Raise :class:`CheckpointVersionError` if :func:`unreadable` (``iter_dir``). ``written_by`` is the
    writer's megatron-core version when the checkpoint records it (the caller reads it: the metadata file is
    :mod:`megatron_vlm.checkpoint.layout`'s); without it the message explains the format alone."""
    if not unreadable(iter_dir):
        return
    who = f"megatron-core {written_by}" if written_by else "megatron-core 0.17 or newer (it has no common.pt)"
    raise CheckpointVersionError(
        f"{iter_dir} was written by {who}, whose torch_dist format megatron-core {installed()} cannot read "
        f"(0.16 needs {COMMON_FILE}). Read it with Python 3.12 and {LANES[0][1]} (`make venv PYTHON=python3.12`, "
        f"or pip install '{LANES[0][1]}'). To bring the weights back to megatron-core 0.16, export them to HF "
        "with convert/megatron_to_hf.py under 0.19 and convert that with convert/hf_to_megatron.py under 0.16. "
        "Checkpoints move freely the other way (0.16 -> 0.19).")


def describe(versions: dict | None) -> str:
    """``'megatron-core 0.16.1, torch 2.13.0'`` for a recorded stamp ('' when the checkpoint has none)."""
    if not versions:
        return ""
    names = (("megatron_core", "megatron-core"), ("torch", "torch"), ("megatron_vlm", "megatron-vlm"))
    return ", ".join(f"{label} {versions[k]}" for k, label in names if k in versions)


def has_integrity_manifest() -> bool:
    """Whether this megatron-core writes and checks its own integrity manifest: ``dist_checkpointing.save`` and
    ``load`` with ``verify_integrity=True`` (0.19: the SHA-256 of every file of the checkpoint directory, in
    ``integrity.json``, hashed and checked on rank 0)."""
    import inspect

    from megatron.core import dist_checkpointing

    return "verify_integrity" in inspect.signature(dist_checkpointing.save).parameters
