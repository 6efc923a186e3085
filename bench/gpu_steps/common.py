"""What every step of bench/gpu.py shares: the project root, how the set-up's conversion and the training runs are
started (:func:`run_command`), the model and run sizes (:data:`FULL`; :data:`TINY` with ``--tiny``), bench/train.py
as a module, the set-up (HF LLaVA, energon data, converted checkpoint), the versions line of the results, and the two
measures the training rows use (:func:`curve_diff`, :func:`mfu`)."""

from __future__ import annotations

import importlib.util
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
#: How the set-up's conversion and each training run are started: ``subprocess.run``; the test passes
#: tests.support.forked_cli.run (bench/gpu.py main's ``run_command``): the same commands, without importing torch again.
_RUN = {"command": subprocess.run}

FULL = dict(hidden=2048, layers=22, vision_hidden=1024, vision_layers=24, image_size=336, samples=512,
            mbs=4, gbs=16, seq_length=1024, iters=50, warmup=10, lr=1e-4,
            moe_layers=8, experts=8, topk=2, expert_ffn=1408)
TINY = dict(hidden=128, layers=4, vision_hidden=128, vision_layers=2, image_size=56, samples=8,
            mbs=2, gbs=4, seq_length=128, iters=3, warmup=1, lr=1e-4,
            moe_layers=2, experts=4, topk=2, expert_ffn=64)


def use_run_command(run) -> None:
    """Start the set-up's conversion and the training runs with ``run`` (``subprocess.run``'s signature)."""
    _RUN["command"] = run


def run_command(*args, **kwargs):
    """``subprocess.run`` (or what :func:`use_run_command` was given) of ``args``."""
    return _RUN["command"](*args, **kwargs)


def train_bench():
    """bench/train.py as a module: its model/data set-up and throughput summary are reused here."""
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- set-up ----------------------------------------------------------------------------------------------
def build_inputs(a, work: Path) -> tuple[Path, Path, Path]:
    """(HF LLaVA dir, energon dataset, converted Megatron checkpoint at TP=1) with random weights: bench/train.py's
    set-up (Llama-like LM, CLIP ViT with patch 14, one image and a one-word answer per sample)."""
    return train_bench().build_inputs(a, work, run_command=run_command)


def versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"}
    for dist in ("megatron-core", "megatron-energon", "transformers", "transformer_engine", "transformer_engine_cu13",
                 "transformer_engine_torch"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


# ---- what the training rows measure --------------------------------------------------------------------------
def curve_diff(x: list[float], ref: list[float]) -> float:
    """Largest relative per-iteration difference of two loss curves."""
    return max(abs(p - q) / abs(q) for p, q in zip(x, ref))


def mfu(row: dict) -> float | None:
    """Model FLOPs utilisation of a training row on this GPU (None where its peak is not known)."""
    import torch

    from megatron_vlm.training.flops import peak_flops

    peak = peak_flops(torch.device("cuda"), row.get("fp8", False)) if torch.cuda.is_available() else None
    return row["tflops"] * 1e12 / peak if peak and "tflops" in row else None
