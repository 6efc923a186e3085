"""The step timers (megatron_vlm.training.timers) and the profile's files (megatron_vlm.training.profiling), in
this process: phases from marks at each --timing-log-level, the cross-rank forms of --timing-log-option, and a real
torch.profiler profile written within its cap. tests/test_train.py checks both inside a training run."""

from __future__ import annotations

import gzip
import json
import time

import pytest
import torch

from megatron_vlm.training.profiling import gzip_within, write_profile
from megatron_vlm.training.timers import LEVELS, PHASES, StepTimers, describe, over_ranks

pytestmark = pytest.mark.one_lane("3.11", reason="torch's perf_counter marks and CPU profiler: the same in both lanes")


def _iteration(timers: StepTimers, pause: dict[str, float]) -> None:
    timers.begin()
    for phase in PHASES:
        time.sleep(pause.get(phase, 0.0))
        timers.mark(phase)
    timers.end()


@pytest.mark.parametrize("level", [0, 1, 2])
def test_phases_of_an_iteration_at_each_level(level):
    timers = StepTimers(torch.device("cpu"), level)
    pause = {"batch-load": 0.02, "forward-backward": 0.05, "optimizer": 0.01}
    _iteration(timers, pause)
    timers.begin()
    timers.mark("batch-load")
    timers.mark("batch-distribute")
    timers.discard()  # a skipped iteration: no timers
    (first, skipped), = [timers.read()]
    assert skipped is None and timers.read() == []
    assert set(first) == set(LEVELS[level])
    assert first["step"] >= sum(pause.values())
    if level:
        parts = [first[k] for k in ("data-wait", "forward-backward", "optimizer", "loss-reduce")]
        assert sum(parts) == pytest.approx(first["step"], rel=1e-9)  # the phases partition the step
        assert first["forward-backward"] >= 0.05 and first["data-wait"] >= 0.02 and first["optimizer"] >= 0.01
        assert first["loss-reduce"] < first["forward-backward"]  # the unpaused phase, against the longest pause
    if level == 2:
        assert first["data-wait"] == pytest.approx(first["batch-load"] + first["batch-distribute"], rel=1e-9)


def test_over_ranks_forms_and_the_console_text():
    window = {"step": 0.25, "forward-backward": 0.2}
    assert over_ranks(window, "max", "cpu") == window
    assert over_ranks(window, "minmax", "cpu") == {"step": [0.25, 0.25], "forward-backward": [0.2, 0.2]}
    assert over_ranks(window, "all", "cpu") == {"step": [0.25], "forward-backward": [0.2]}
    text = describe({"forward-backward": [0.1, 0.2], "step": [0.25, 0.3]}, "minmax")
    assert text == "time ms (minmax over ranks): step 250.0-300.0, forward-backward 100.0-200.0"


def test_the_profile_is_written_and_cut_to_its_cap(tmp_path):
    """A real profile of a few ops, with the phases as named ranges: the table lists the ops; under a cap smaller
    than the trace, the shortest events go and the table says how many."""
    timers = StepTimers(torch.device("cpu"), 1)
    timers.labels = True
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            timers.begin()
            for phase in PHASES:
                for _ in range(5):
                    x = torch.tanh(x @ x)
                timers.mark(phase)
            timers.end()
    trace, table = write_profile(prof, tmp_path, "full")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::mm", "aten::tanh", "forward-backward", "batch-load"} <= names
    text = table.read_text()
    assert "Top ops by host (CPU) self time" in text and "aten::mm" in text and "Nothing was cut" in text

    raw = tmp_path / "raw.json"
    raw.write_bytes(gzip.decompress(trace.read_bytes()))
    cap = trace.stat().st_size // 3
    note = gzip_within(raw, tmp_path / "cut.json.gz", cap)
    small = tmp_path / "cut.json.gz"
    assert small.stat().st_size <= cap
    kept = json.loads(gzip.decompress(small.read_bytes()))["traceEvents"]
    assert 0 < len(kept) < len(events)
    assert "events shorter than" in note and "were dropped from the trace" in note
    assert gzip_within(raw, tmp_path / "whole.json.gz", trace.stat().st_size) is None  # it fits: nothing cut
