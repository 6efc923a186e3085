"""Training curves from ``metrics.jsonl``, and the ``eval/plot.py`` command.

One figure of four panels against iteration: loss (training, and validation as dashed markers), learning rate,
grad norm and real tokens/s (the ``tokens`` of an iteration, its image-expanded positions without padding,
over the wall-clock time since the previous iteration's record). Several runs share the figure, one colour
each, named by their directory. A resumed run's records of iterations it trained again (after a crash between
two checkpoints) are read last-wins, so each iteration appears once; the first iteration after a (re)start has
no tokens/s (its time includes the start-up). When a run answered held-out samples during training
(``--eval-generate-interval``: ``eval_exact`` / ``eval_vqa`` records), a fifth panel shows that accuracy in percent,
exact match solid and VQA-normalised dashed. Skipped iterations (``--skip-train-iteration-range``, fp16
overflows) are left out of loss and grad norm.

The trainer calls :func:`write_run_figure` at the end of a run (the rank that writes ``metrics.jsonl``), which
draws ``<run dir>/loss.png`` and never fails the run.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
RUN_FIGURE = "loss.png"


def read_metrics(path) -> dict[str, dict[int, float]]:
    """``{"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "eval_exact", "eval_vqa"}`` -> {iteration: value}
    of a metrics.jsonl (or of the run directory holding one). Unparsable lines (a record cut by a crash) are
    skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    series: dict[str, dict[int, float]] = {k: {} for k in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s",
                                                           "eval_exact", "eval_vqa")}
    prev_time, prev_iter = None, None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            r = json.loads(line)
            it = int(r["iteration"])
        except (ValueError, KeyError, TypeError):
            continue
        if "val_loss" in r:
            if r["val_loss"] is not None:
                series["val_loss"][it] = float(r["val_loss"])
            continue
        if "eval_exact" in r:  # held-out answers (in percent); not an iteration's record
            for k in ("eval_exact", "eval_vqa"):
                if r.get(k) is not None:
                    series[k][it] = 100.0 * float(r[k])
            continue
        restarted = prev_iter is not None and it <= prev_iter  # a resume trains these iterations again
        if restarted:
            for s in series.values():
                for k in [k for k in s if k >= it]:
                    del s[k]
        if r.get("lr") is not None:
            series["lr"][it] = float(r["lr"])
        if not r.get("skipped"):
            if r.get("loss") is not None:
                series["loss"][it] = float(r["loss"])
            if r.get("grad_norm") is not None:
                series["grad_norm"][it] = float(r["grad_norm"])
        t = r.get("time")
        if t is not None and prev_time is not None and not restarted and prev_iter == it - 1 and t > prev_time \
                and r.get("tokens"):
            series["tokens_per_s"][it] = float(r["tokens"]) / (t - prev_time)
        prev_time, prev_iter = t, it
    return series


PANELS = (("loss", "loss (per assistant token)", True), ("lr", "learning rate", False),
          ("grad_norm", "grad norm", True), ("tokens_per_s", "real tokens/s", False))
ACCURACY = ("eval_exact", "held-out accuracy % (exact; VQA-normalised dashed)", False)


def panels(data: list[dict]) -> tuple:
    """The panels of a figure of runs ``data`` (:func:`read_metrics`): the four, and the accuracy when any run
    answered held-out samples."""
    return PANELS + ((ACCURACY,) if any(d["eval_exact"] for d in data) else ())


def plot_runs(runs: list, output, labels: list[str] | None = None) -> Path:
    """Draw the runs' curves into ``output`` (PNG, or any format matplotlib writes from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_vlm.files.atomic import atomic_write_bytes

    data = [read_metrics(r) for r in runs]
    labels = labels or [_label(r) for r in runs]
    shown = panels(data)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7)) if len(shown) == 4 else plt.subplots(2, 3, figsize=(16, 7))
    for ax in axes.flat[len(shown):]:
        ax.axis("off")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, title, log_y), ax in zip(shown, axes.flat):
        drawn = False
        for i, (series, label) in enumerate(zip(data, labels)):
            c = colours[i % len(colours)]
            pts = sorted(series[key].items())
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, lw=1.2, label=label)
                drawn = True
            if key == "eval_exact" and series["eval_vqa"]:
                v = sorted(series["eval_vqa"].items())
                ax.plot([p[0] for p in v], [p[1] for p in v], color=c, ls="--", marker="o", ms=3)
            if key == "loss" and series["val_loss"]:
                v = sorted(series["val_loss"].items())
                ax.plot([p[0] for p in v], [p[1] for p in v], color=c, ls="--", marker="o", ms=3,
                        label=f"{label} (validation)")
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("iteration")
        if log_y and drawn and all(v > 0 for s in data for v in list(s[key].values()) +
                                   (list(s["val_loss"].values()) if key == "loss" else [])):
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    output = Path(output)
    fig.savefig(buf, format=(output.suffix.lstrip(".") or "png"), dpi=100)
    plt.close(fig)
    atomic_write_bytes(output, buf.getvalue())
    return output


def _label(run) -> str:
    p = Path(run)
    return p.parent.name if p.name == METRICS else p.name


def write_run_figure(run_dir) -> Path | None:
    """``<run_dir>/loss.png`` from its metrics.jsonl, at the end of a training run; a failure is logged as a
    warning (the run's outcome never depends on a figure)."""
    try:
        if not (Path(run_dir) / METRICS).is_file():
            return None
        out = plot_runs([run_dir], Path(run_dir) / RUN_FIGURE)
        log.info("training curves: %s (eval/plot.py draws several runs together)", out)
        return out
    except Exception as e:  # noqa: BLE001 - a figure must never fail the run
        log.warning("could not draw the training curves into %s: %s: %s", run_dir, type(e).__name__, e)
        return None


def main(argv=None) -> int:
    """``eval/plot.py RUN_DIR... [--output loss.png]``."""
    from megatron_vlm.cli import InputError, add_debug_flag, setup_logging

    p = argparse.ArgumentParser(allow_abbrev=False, 
        prog="eval/plot.py",
        description="Draw loss (and validation loss), learning rate, grad norm and real tokens/s (and the held-out "
                    "accuracy of --eval-generate-interval, when a run has it) against iteration from the "
                    "metrics.jsonl of one or more training runs, on one figure (one colour per run).",
        epilog="example: python eval/plot.py /ckpt/runs/stage1 /ckpt/runs/stage2 --output curves.png")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="a training run directory (<save-dir>/<name>, or its --log-dir) or a metrics.jsonl")
    p.add_argument("--output", default=RUN_FIGURE, help=f"the figure to write (default {RUN_FIGURE}; the suffix "
                   "picks the format: .png, .svg, .pdf)")
    p.add_argument("--label", action="append", default=None,
                   help="a legend name per run, in order (default: the run directories' names)")
    add_debug_flag(p)
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    if a.label is not None and len(a.label) != len(a.runs):
        p.error(f"--label given {len(a.label)} times for {len(a.runs)} runs; give one per run or none")
    for r in a.runs:
        path = Path(r) / METRICS if Path(r).is_dir() else Path(r)
        if not path.is_file():
            raise InputError(f"{r}: no {METRICS} there; give a training run directory (<save-dir>/<name>, or its "
                             "--log-dir) or a metrics.jsonl file")
    out = plot_runs(a.runs, a.output, a.label)
    print(f"wrote {out}")
    return 0
