"""The ``perf`` steps of bench/gpu.py (``bench/gpu_quick.sh --perf``, issue 63 item 6): where a training step's time
goes on the lent GPU, in three parts that each fit one step of bench/gpu_quick.sh:

``perf_profile``  two profiled iterations of our trainer (``--profile --profile-step-start/-end``, torch.profiler,
                  written under the run's folder) and of the HF + SDPA loop (torch.profiler here): each one's
                  Chrome trace into ``$OUT/perf_profiles.tar`` (16 MiB at most: a trace that does not fit is left
                  out and named) and its top-ops table into ``$OUT/perf_top_ops.txt``; the throughput of both after
                  the profiled iterations;
``perf_shapes``   micro batch ``--mbs`` against ``--gbs`` (one micro batch per step: the difference is per-micro-batch
                  host time, ``host_share``), SDPA against local attention (``--attention-backend``), and packed
                  (``--packed-seq-length`` = ``--pack-factor`` x ``--seq-length``) against padded;
``perf_te``       (with Transformer Engine) TE bf16, and FP8 tensorwise and delayed, at the fast shape (micro batch
                  ``--gbs``): tokens/s, MFU, speed-up over TE bf16 and the loss curves within ``--loss-tolerance``.

Each row names the row it is compared with (``ref``); :func:`perf_ratios` fills the speed-ups and the host share
when the results are merged, so rows from different steps (processes) are compared in the one results file. A flag
this checkout's trainer does not have yet is a row "not measured", named in the verdict, not a failed run.
"""

from __future__ import annotations

import argparse
import io
import tarfile
from pathlib import Path

from .common import curve_diff, mfu

#: iterations profiled, and where: right after ``--warmup``; throughput is measured after them
PROFILE_STEPS = 2
#: the files the profile step adds to $OUT (bench/gpu_quick.sh's at most 8 files of at most 16 MiB)
PROFILES = "perf_profiles.tar"
TOP_OPS = "perf_top_ops.txt"
MAX_FILE_BYTES = 16 << 20
#: the parts bench/gpu.py's --only takes for these steps
PARTS = ("perf_profile", "perf_shapes", "perf_te")


def trainer_has(flag: str, choice: str | None = None) -> bool:
    """Whether train/run.py takes ``flag`` (and ``choice`` among its choices): the perf rows use flags of issue 63
    that land separately (--profile, --attention-backend sdpa)."""
    from megatron_vlm.training.config.fields import FIELDS

    for f in FIELDS.values():
        if flag in f.metadata["flags"]:
            return choice is None or choice in (f.metadata.get("choices") or (choice,))
    return False


def profile_window(a) -> tuple[int, int]:
    """(start, end) iterations profiled (Megatron-LM's --profile-step-start/-end: [start, end)), right after the
    warm-up; the run needs ``end + 2`` iterations or more so that throughput is measured after the window."""
    return a.warmup, a.warmup + PROFILE_STEPS


def after_profile(a) -> argparse.Namespace:
    """``a`` with ``iters`` long enough and ``warmup`` past the profiled window (throughput without the profiler)."""
    start, end = profile_window(a)
    return argparse.Namespace(**dict(vars(a), warmup=end + 1, iters=max(a.iters, end + 3)))


def _row(key: str, a, r: dict, ref: str | None, note: str, dtype: str | None = None, mbs: int | None = None) -> dict:
    """A perf row of run summary ``r`` (or its error), compared with row ``ref``; ``mbs`` its micro batch size."""
    base = dict(part="perf", impl=key, dtype=dtype or a.precision, ref=ref, micro_batches=a.gbs // (mbs or a.mbs))
    if "error" in r:
        return dict(base, ok=False, note=r["error"])
    return dict(base, loss_first=r["losses"][0], loss_last=r["losses"][-1], losses=r["losses"],
                tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], s_per_iter=r["s_per_iter"], mfu=mfu(r), ok=None,
                note=note)


def _not_measured(key: str, a, why: str, dtype: str | None = None) -> dict:
    from .results import NOT_MEASURED

    return dict(part="perf", impl=key, dtype=dtype or a.precision, ok=None, note=NOT_MEASURED + why)


def base_impl(a) -> str:
    return "transformer_engine" if "transformer_engine" in a.impls else "local"


def ours_label(a, mbs: int) -> str:
    return f"ours {base_impl(a)}, mbs {mbs}"


# ---- perf_profile -------------------------------------------------------------------------------------------
def trainer_profile(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """(Chrome traces, top-ops tables) the trainer's --profile wrote under its run folder
    (``profile/rankR_iterA-B.trace.json.gz`` and ``....top.txt``, megatron_vlm/training/profiling.py)."""
    files = sorted(p for p in run_dir.rglob("*") if p.is_file())
    traces = [p for p in files if ".json" in p.name and "trace" in p.name]
    tables = [p for p in files if p.suffix == ".txt" and any(w in p.name for w in ("top", "profile", "ops"))]
    return traces, tables


def pack_profiles(out: Path, traces: dict[str, bytes], tables: dict[str, str]) -> list[str]:
    """Write the traces (gzip'd, one tar) and the tables (one text file) into ``out``; a trace that would take the
    archive over 16 MiB is left out, smallest first kept. Returns the names left out."""
    left_out, kept = [], {}
    budget = MAX_FILE_BYTES - (64 << 10)
    import gzip

    for name, data in sorted(traces.items(), key=lambda kv: len(kv[1])):
        done = data[:2] == b"\x1f\x8b"  # the trainer's --profile writes its trace gzip'd already
        packed = data if done else gzip.compress(data, 6)
        if sum(map(len, kept.values())) + len(packed) > budget:
            left_out.append(name)
            continue
        kept[name if done else name + ".gz"] = packed
    with tarfile.open(out / PROFILES, "w") as tar:
        for name, data in kept.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with open(out / TOP_OPS, "w") as f:
        for name, text in tables.items():
            f.write(f"==== {name}\n{text.rstrip()}\n\n")
        for name in left_out:
            f.write(f"==== {name}: trace left out of {PROFILES} (over {MAX_FILE_BYTES >> 20} MiB with the others)\n")
    return left_out


def check_perf_profile(a, work: Path, hf: Path, data: Path, meg: Path) -> list[dict]:
    """Two profiled iterations of ours (train/run.py --profile) and of the HF + SDPA loop, their traces and tables
    into $OUT, and both rows' throughput after the profiled window."""
    from .hf_loop import HF_ROW, hf_loop
    from .training import train_run

    b = after_profile(a)
    start, end = profile_window(a)
    traces: dict[str, bytes] = {}
    tables: dict[str, str] = {}
    rows = []
    ours = ours_label(a, a.mbs)
    name = f"perf_ours_mbs{a.mbs}"
    profiled = trainer_has("--profile")
    flags = ("--profile", "--profile-step-start", str(start), "--profile-step-end", str(end)) if profiled else ()
    # the comparisons' reference row: profiled where the trainer can be, else the same run unprofiled
    r = train_run(b, work, hf, data, meg, name, base_impl(a), a.precision, extra=flags)
    row = _row(ours, a, r, None, (f"--profile-step-start {start} --profile-step-end {end}; " if profiled else
                                  "not profiled; ") + f"throughput over iterations {b.warmup + 1}-{b.iters}")
    if not profiled:
        rows += [row, _not_measured(ours + ", profile", a, "train/run.py has no --profile yet (issue 63 item 1)")]
    else:
        if "error" not in r:
            tr, tb = trainer_profile(work / "runs" / name)
            traces.update({f"ours_{p.name}": p.read_bytes() for p in tr})
            tables.update({f"ours: {p.name}": p.read_text(errors="replace") for p in tb})
            if not tr:
                row.update(ok=False, note=row["note"] + f"; --profile wrote no trace under runs/{name}")
            else:
                row["ok"] = True
        rows.append(row)
    try:
        r = hf_loop(b, hf, data, profile=(start, end))
    except Exception as e:  # report and go on
        r = {"error": f"{type(e).__name__}: {e}"[:300]}
    row = _row(HF_ROW + ", profiled", a, r, None, f"torch.profiler over iterations {start + 1}-{end}")
    if "error" not in r:
        traces["hf_trace.json"] = r.pop("trace")
        tables["HF + SDPA loop"] = r.pop("table")
        row["ok"] = True
    rows.append(row)
    if a.out_dir:
        left = pack_profiles(Path(a.out_dir), traces, tables)
        for rw in rows:
            if left and rw.get("ok"):
                rw["note"] += f"; left out of {PROFILES}: {', '.join(left)}"
    return rows


# ---- perf_shapes ----------------------------------------------------------------------------------------------
def check_perf_shapes(a, work: Path, hf: Path, data: Path, meg: Path) -> list[dict]:
    """Micro batch --gbs against --mbs (the host's share), SDPA against local attention, packed against padded."""
    from .packing import packing_flags
    from .training import train_run

    impl = base_impl(a)
    small, big = ours_label(a, a.mbs), ours_label(a, a.gbs)
    rows = []
    r = train_run(a, work, hf, data, meg, f"perf_mbs{a.gbs}", impl, a.precision,
                  extra=("--micro-batch-size", str(a.gbs)))
    rows.append(_row(big, a, r, small, f"one micro batch of {a.gbs} per step against {a.gbs // a.mbs} of {a.mbs}",
                     mbs=a.gbs))
    sdpa = f"ours sdpa, mbs {a.mbs}"
    if not trainer_has("--attention-backend", "sdpa"):
        # megatron-core's local attention is the local layers' only one: the reference row is the SDPA row's
        if impl != "local":
            r = train_run(a, work, hf, data, meg, f"perf_mbs{a.mbs}_local", "local", a.precision)
            rows.append(_row(f"ours local, mbs {a.mbs}", a, r, None, "local layers, megatron-core's local attention"))
        rows.append(_not_measured(sdpa, a, "train/run.py has no --attention-backend sdpa yet (issue 63 item 3)"))
    else:  # both named: where sdpa is the local layers' default on CUDA, the baseline rows are sdpa already
        local = f"ours local attention, mbs {a.mbs}"
        r = train_run(a, work, hf, data, meg, f"perf_mbs{a.mbs}_local", "local", a.precision,
                      extra=("--attention-backend", "local"))
        rows.append(_row(local, a, r, None, "local layers, --attention-backend local (megatron-core's own)"))
        r = train_run(a, work, hf, data, meg, "perf_sdpa", "local", a.precision, extra=("--attention-backend", "sdpa"))
        row = _row(sdpa, a, r, local, "local layers, --attention-backend sdpa (torch's scaled_dot_product_attention)")
        if "error" not in r and "losses" in rows[-1]:  # the same model and batches: the same losses
            row.update(diff=curve_diff(r["losses"], rows[-1]["losses"]), tolerance=a.loss_tolerance)
            row["ok"] = row["diff"] <= a.loss_tolerance
        rows.append(row)
    r = train_run(a, work, hf, data, meg, "perf_packed", impl, a.precision, extra=packing_flags(a))
    rows.append(_row(f"ours {impl}, packed", a, r, small, "packed: " + " ".join(packing_flags(a))))
    return rows


# ---- perf_te ----------------------------------------------------------------------------------------------------
def check_perf_te(a, work: Path, hf: Path, data: Path, meg: Path) -> list[dict]:
    """TE bf16 and FP8 (``--recipes``, default tensorwise and delayed) at the fast shape (micro batch --gbs)."""
    from .training import runnable_recipes, train_run

    fast = ("--micro-batch-size", str(a.gbs))
    bf16 = f"TE bf16, mbs {a.gbs}"
    if "transformer_engine" not in a.impls:
        return [_not_measured(bf16, a, "Transformer Engine rows need --te (a kit with te/)")]
    # perf_shapes' micro-batch-16 row is this run when it used TE layers: its losses are in the results file
    earlier = earlier_row(a, ours_label(a, a.gbs)) if base_impl(a) == "transformer_engine" else None
    if earlier:
        bf16, base, rows = earlier["impl"], {"losses": earlier["losses"]}, []
    else:
        base = train_run(a, work, hf, data, meg, f"perf_te_mbs{a.gbs}", "transformer_engine", a.precision, extra=fast)
        rows = [_row(bf16, a, base, None, "Transformer Engine layers, bf16, the fast shape", mbs=a.gbs)]
    expected = set(runnable_recipes())
    for recipe in a.recipes or ("tensorwise", "delayed"):
        key = f"TE FP8 {recipe}, mbs {a.gbs}"
        r = train_run(a, work, hf, data, meg, f"perf_fp8_{recipe}", "transformer_engine", "bf16", recipe, extra=fast)
        row = _row(key, a, r, bf16, f"--fp8 --fp8-recipe {recipe}", dtype="fp8+bf16", mbs=a.gbs)
        if "error" in r and recipe not in expected:
            row.update(ok=None, note="refused as expected: " + r["error"])
        elif "error" not in r and "error" not in base:
            diff = curve_diff(r["losses"], base["losses"])
            row.update(diff=diff, tolerance=a.loss_tolerance, ok=diff <= a.loss_tolerance)
        rows.append(row)
    return rows


def earlier_row(a, impl: str) -> dict | None:
    """The row ``impl`` with its losses that an earlier step wrote into the results file (``--out``), if any."""
    import json

    if not a.out or not Path(a.out).is_file():
        return None
    rows = json.loads(Path(a.out).read_text()).get("rows", [])
    return next((r for r in rows if r.get("part") == "perf" and r.get("impl") == impl and r.get("losses")), None)


# ---- the ratios, once every step's rows are in one file ------------------------------------------------------------
def perf_ratios(rows: list[dict]) -> list[dict]:
    """Each perf row's speed-up over its ``ref`` row; for the one-micro-batch row, the host's share of the
    reference's step: with the global batch fixed, a step of n micro batches costs n x h of per-micro-batch time
    (launches, host work) on top of the same arithmetic, so h = (t_n - t_1) / (n - 1) and the share is n h / t_n."""
    perf = {r["impl"]: r for r in rows if r.get("part") == "perf"}
    for r in perf.values():
        ref = perf.get(r.get("ref") or "")
        if not ref or not r.get("tokens_per_s") or not ref.get("tokens_per_s"):
            continue
        r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"]
        n_ref, n = ref.get("micro_batches"), r.get("micro_batches")
        if n == 1 and n_ref and n_ref > 1 and ref.get("s_per_iter") and r.get("s_per_iter") and "packed" not in \
                r["impl"] and r["dtype"] == ref["dtype"]:
            h = (ref["s_per_iter"] - r["s_per_iter"]) / (n_ref - 1)
            r["host_share"] = n_ref * h / ref["s_per_iter"]
            if "host share" not in r["note"]:
                r["note"] += (f"; host share of the {n_ref}-micro-batch step ~{r['host_share']:.0%} (per micro batch "
                              f"{h * 1e3:.0f} ms)")
    return rows
