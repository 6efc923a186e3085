"""The ``vpp`` step of bench/gpu.py: the set-up's LLaVA trained through train/run.py at PP2 and at PP2 x VPP2
(megatron-core's interleaved 1F1B schedule) with the language layers split evenly in chunks (:func:`vpp_split`):
equal loss curves, tokens/s and the speed-up; PP2 needs two GPUs (two gloo ranks on CPU)."""

from __future__ import annotations

from pathlib import Path

from .common import curve_diff, mfu
from .training import train_run


def vpp_split(layers: int) -> list[int] | None:
    """Language layers per rank of PP2 that split into two chunks each (even counts, as equal as they come: 12,10 of
    22); None when the model has too few layers (under 4)."""
    first = (layers + 2) // 4 * 2
    rest = layers - first
    return [first, rest] if first >= 2 and rest >= 2 and rest % 2 == 0 else None


def check_vpp(a, work: Path, hf: Path, data: Path, meg: Path) -> list[dict]:
    """The virtual-pipeline rows: the set-up's LLaVA trained at PP2 and at PP2 x VPP2 through train/run.py (two
    ranks), same weights, batches and steps: equal losses and both throughputs."""
    import torch

    impl = "transformer_engine" if "transformer_engine" in a.impls else "local"
    split = vpp_split(a.layers)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 2
    rows = {}
    for vpp in (1, 2):
        label = f"{impl}, PP2" + (" x VPP2" if vpp > 1 else "")
        row = dict(part="vpp", impl=label, dtype=a.precision)
        if gpus < 2 or split is None:
            rows[vpp] = dict(row, ok=None, note="not measured: " + (
                f"PP2 needs 2 GPUs, this machine has {gpus} (NCCL runs one rank per GPU and refuses two ranks on one "
                "device: 'Duplicate GPU detected')" if gpus < 2 else
                f"the set-up's {a.layers} language layers do not make two chunks on each of two ranks"))
            continue
        extra = ("-g", "2", "--pp", "2", "--pp-layers", ",".join(map(str, split)))
        if vpp > 1:
            extra += ("--num-virtual-stages-per-pipeline-rank", str(vpp))
        r = train_run(a, work, hf, data, meg, f"vpp{vpp}_{impl}", impl, a.precision, extra=extra)
        if "error" in r:
            rows[vpp] = dict(row, ok=False, note=r["error"])
            continue
        chunks = ", ".join(f"{n // vpp}" for n in split)
        rows[vpp] = dict(row, loss_first=r["losses"][0], loss_last=r["losses"][-1], losses=r["losses"],
                         tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], s_per_iter=r["s_per_iter"], ok=None,
                         note=f"--pp-layers {','.join(map(str, split))}" + (
                             f", {vpp} chunks per rank of {chunks} layers (interleaved 1F1B)" if vpp > 1 else
                             " (1F1B)") + f"; {a.gbs // a.mbs} micro batches per step")
    plain, inter = rows[1], rows[2]
    if "losses" in plain and "losses" in inter:
        diff = curve_diff(inter["losses"], plain["losses"])
        inter.update(diff=diff, tolerance=a.loss_tolerance, ok=diff <= a.loss_tolerance,
                     speedup=inter["tokens_per_s"] / plain["tokens_per_s"], mfu=mfu(inter))
        plain.update(ok=True, mfu=mfu(plain))
    return [plain, inter]
