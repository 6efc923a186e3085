"""The results and the report of bench/gpu.py: the JSON file every step merges its rows into as it comes
(:func:`write_results`, atomic), each training row's ratio to the HF + SDPA loop (``vs_hf``), the table, and
``--report``: the table of a results file with bench/gpu_quick.sh's steps, and the exit code."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .hf_loop import HF_ROW


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each training row's speed-up over the HF + SDPA loop (``vs_hf``), where both were measured: the ``train``
    rows over the ``hf`` step's loop, the ``perf`` rows over the profiled loop of their own step (bench/gpu_steps/
    perf.py, which also fills their speed-ups over the rows they name)."""
    from .perf import perf_ratios

    for part, name in (("train", HF_ROW), ("perf", HF_ROW + ", profiled")):
        ref = next((r for r in rows if r.get("impl") == name and r.get("tokens_per_s")), None)
        for r in rows:
            if ref and r.get("part") == part and r is not ref and r.get("tokens_per_s"):
                r["vs_hf"] = r["tokens_per_s"] / ref["tokens_per_s"]
    return perf_ratios(rows)


def write_results(out: Path, info: dict, rows: list[dict], args: dict | None = None) -> None:
    """Merge ``info`` and ``rows`` into the JSON file ``out`` (made if absent), atomically: every step of
    bench/gpu_quick.sh adds its rows to the one file as soon as it has them."""
    old = json.loads(out.read_text()) if out.is_file() else {"info": {}, "args": {}, "rows": []}
    old["info"].update(info)
    if args:
        old.setdefault("args", {}).update(args)
    old["rows"] = with_ratios(old["rows"] + rows)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(old, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) and v is not None else "-"


def print_table(rows: list[dict], info: dict) -> None:
    print("\n" + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"{'part':7s} {'layers / run':22s} {'dtype':9s} {'max diff':>10s} {'tolerance':>10s} {'ok':>4s} "
          f"{'loss 1st->last':>17s} {'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'speed-up':>8s} {'x HF':>5s}  note")
    for r in rows:
        ok = {True: "yes", False: "NO", None: "-"}[r.get("ok")]
        losses = f"{r['loss_first']:.3f}->{r['loss_last']:.3f}" if "loss_first" in r else "-"
        print(f"{r['part']:7s} {r['impl']:22s} {r['dtype']:9s} {_fmt(r.get('diff'), '10.3g'):>10s} "
              f"{_fmt(r.get('tolerance'), '10.3g'):>10s} {ok:>4s} {losses:>17s} "
              f"{_fmt(r.get('tokens_per_s'), '9.0f'):>9s} "
              f"{_fmt(r.get('tflops'), '8.1f'):>8s} {_fmt(r.get('mfu'), '6.1%'):>6s} "
              f"{_fmt(r.get('speedup'), '8.2f'):>8s} {_fmt(r.get('vs_hf'), '5.2f'):>5s}  {r.get('note', '')}")


#: what bench/gpu_quick.sh's own exit codes of a step mean (timeout's 124 and 137, its skips 125 and 126)
STEP_LABELS = {124: "  TIMED OUT", 137: "  TIMED OUT", 125: "  skipped: no time left", 126: "  skipped: set-up failed"}


#: how a row that holds a check says it could not be run (on this machine: one GPU for a two-rank check, ...)
NOT_MEASURED = "not measured: "


def not_measured(rows: list[dict]) -> list[dict]:
    """The rows whose check could not run here (``ok`` None and a note saying why), as opposed to the reference and
    throughput rows, which hold no check."""
    return [r for r in rows if r.get("ok") is None and str(r.get("note", "")).startswith(NOT_MEASURED)]


def verdict(rows: list[dict]) -> str:
    """The closing line's checks: failed ones, or that all passed, and every row not measured with its reason, so a
    check that did not run is named rather than counted as passed."""
    failed = [r for r in rows if r.get("ok") is False]
    checked = [r for r in rows if r.get("ok") is not None]
    line = f"{len(failed)} check(s) failed" if failed else "all checks passed" if checked else "no check ran"
    skipped = not_measured(rows)
    if skipped:
        line += f"; {len(skipped)} not measured: " + "; ".join(
            f"{r['part']} {r['impl']} ({r['note'][len(NOT_MEASURED):]})" for r in skipped)
    return line


def report(results: Path, steps: Path | None = None) -> int:
    """Print the table of a results file (and the steps of bench/gpu_quick.sh); 1 if a check failed or a step did."""
    if not results.is_file():
        print(f"no results in {results}: no step wrote any")
        data = {"info": {}, "rows": []}
    else:
        data = json.loads(results.read_text())
    print_table(data["rows"], data["info"])
    bad_steps = []
    if steps and steps.is_file():
        print(f"\n{'step':10s} {'rc':>4s} {'seconds':>8s} {'limit':>6s}")
        for line in steps.read_text().splitlines():
            st = json.loads(line)
            label = STEP_LABELS.get(st["rc"], "  failed" if st["rc"] else "")
            print(f"{st['step']:10s} {st['rc']:4d} {st['seconds']:8d} {st['limit']:6d}{label}")
            if st["rc"]:
                bad_steps.append(st["step"])
    failed = [r for r in data["rows"] if r.get("ok") is False]
    checked = [r for r in data["rows"] if r.get("ok") is not None]
    print("\n" + verdict(data["rows"]), end="")
    print(f"; step(s) failed: {', '.join(bad_steps)}" if bad_steps else "")
    return 1 if failed or bad_steps or not checked else 0
