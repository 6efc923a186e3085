"""Each test module's wall time in a run of the suite: printed at its end, kept for the docs' table.

A pytest plugin (registered by tests/conftest.py). The controller (or the only process, without pytest-xdist)
adds up every phase of every test of a module -- set-up, call, tear-down, as pytest's ``--durations`` reports them
-- so a module's time includes its fixtures and the worlds it spawns. At the end of the run it

- prints the ten slowest modules of this lane (CI shows them where a slow test lands), and
- writes ``.suite-times/py3XX.json`` (``MVLM_SUITE_TIMES`` overrides the path; ignored by git):
  ``{"lane": "3.11", "modules": {"test_foo": seconds, ...}, "wall": seconds, "passed": bool}``.

``python tools/suite_times.py`` turns the lanes' files into the table in docs/development.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANE = "%d.%d" % sys.version_info[:2]
#: how many modules the end-of-run summary names
SHOWN = 10


def times_path() -> Path:
    """Where this lane's run writes its module times."""
    return Path(os.environ.get("MVLM_SUITE_TIMES") or ROOT / ".suite-times" / f"py{LANE.replace('.', '')}.json")


def module_of(nodeid: str) -> str:
    """``tests/test_foo.py::test_bar[x]`` -> ``test_foo``."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


class ModuleTimes:
    """Adds up the phases' durations per module (pytest's own measurement, the ``--durations`` numbers)."""

    def __init__(self, config):
        self.config = config
        self.seconds: dict[str, float] = {}
        self.start = time.monotonic()

    def pytest_runtest_logreport(self, report):
        self.seconds[module_of(report.nodeid)] = self.seconds.get(module_of(report.nodeid), 0.0) + report.duration

    def slowest(self, n: int | None = None) -> list[tuple[str, float]]:
        ranked = sorted(self.seconds.items(), key=lambda kv: (-kv[1], kv[0]))
        return ranked if n is None else ranked[:n]

    def pytest_terminal_summary(self, terminalreporter, exitstatus):
        if not self.seconds:
            return
        wall = time.monotonic() - self.start
        tr = terminalreporter
        tr.section(f"the {min(SHOWN, len(self.seconds))} slowest modules of the Python {LANE} lane "
                   f"(seconds: set-up + call + tear-down of their tests)")
        for name, secs in self.slowest(SHOWN):
            tr.write_line(f"{secs:8.1f}  {name}")
        tr.write_line(f"{sum(self.seconds.values()):8.1f}  all {len(self.seconds)} modules "
                      f"({wall:.0f} s of wall on {self._workers()} worker(s))")
        if not self.whole_suite():
            return  # a partial run does not replace the lane's record
        path = times_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"lane": LANE, "wall": round(wall, 1), "passed": exitstatus == 0,
                  "workers": self._workers(), "when": time.strftime("%Y-%m-%d"),
                  "modules": {k: round(v, 1) for k, v in self.slowest()}}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
        tr.write_line(f"module times written to {path}")

    def whole_suite(self) -> bool:
        """The run took the suite's own test paths (no file, ``-k`` or ``-m`` of its own): ``make test``."""
        import pytest

        opt = self.config.option
        return (self.config.args_source == pytest.Config.ArgsSource.TESTPATHS and not opt.collectonly
                and not getattr(opt, "keyword", "") and not getattr(opt, "markexpr", ""))

    def _workers(self) -> int:
        return int(getattr(self.config.option, "numprocesses", 0) or 1)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or the only process), not an xdist worker
        config.pluginmanager.register(ModuleTimes(config), "mvlm-module-times")
