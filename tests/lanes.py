"""Which lane runs a test module: both (the default), or one where the lanes cannot differ.

CI runs the suite twice (`.ci/run`): Python 3.11 with megatron-core 0.16 and CPU torch, then Python 3.12 with
megatron-core 0.19, a CUDA build of torch, Transformer Engine and PyAV 19. A module whose checks touch none of
what differs between them -- megatron-core, Transformer Engine, PyAV, torchvision -- runs in one lane only:

    pytestmark = pytest.mark.one_lane("3.11", reason="data preparation: energon, PIL, tokenizers; no megatron-core")

An end-to-end module that runs the version-sensitive code too (the demo, the README's commands) may be marked when
modules that both lanes run hold every version-sensitive step it takes; it names them, and the guard below is off:

    pytestmark = pytest.mark.one_lane("3.11", reason="...", covered_by=("test_train", "test_convert"))

A pytest plugin (registered by tests/conftest.py):

- the other lane deselects the module's tests (they are not skipped, so nothing under ``CI=true`` fails for them;
  the end-of-run summary says how many ran elsewhere);
- in the lane that runs them, importing a version-sensitive package in the test's process while the test itself
  runs fails it (:class:`LaneGuard`): a module marked one-lane that starts to need megatron-core shows up red, not
  quietly checked in one lane. Fixtures that make a test's inputs (a converted checkpoint to refuse, say) may use
  megatron-core: what they make is held in both lanes by the conversion tests. Processes a test starts are not
  watched: their commands are named in the reason.

tests/test_ci_rules.py holds the split to its rules: every module is in both lanes or marked with a lane CI runs and
a reason, and the version-sensitive modules (conversion, training, checkpoints, MoE, TE, cross-version, interop)
are in both.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import pytest

#: The lanes .ci/run runs, in its order.
LANES = ("3.11", "3.12")
LANE = "%d.%d" % sys.version_info[:2]
#: What differs between the lanes (top-level import names): a one-lane test's process must not import these.
VERSION_SENSITIVE = ("megatron.core", "transformer_engine", "transformer_engine_torch", "av", "torchvision")
MARKER = "one_lane"


def marked_modules(tests_dir) -> dict[str, tuple[str, str, tuple]]:
    """module -> (lane, reason, covered_by) of its ``one_lane`` marker, read from the test files' source (not
    imported)."""
    import ast
    from pathlib import Path

    marks = {}
    for path in sorted(Path(tests_dir).glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == MARKER:
                args = [ast.literal_eval(a) for a in node.args]
                kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                marks[path.stem] = (args[0] if args else kwargs.get("lane"), kwargs.get("reason", ""),
                                    tuple(kwargs.get("covered_by", ())))
    return marks


def sensitive(name: str) -> bool:
    return any(name == s or name.startswith(s + ".") for s in VERSION_SENSITIVE)


def module_lane(item) -> str | None:
    """The one lane that runs ``item``'s module, or None for both."""
    mark = item.get_closest_marker(MARKER)
    return None if mark is None else (mark.args[0] if mark.args else mark.kwargs.get("lane"))


def guarded(item) -> bool:
    """Whether ``item`` runs under :class:`LaneGuard`: marked one-lane without ``covered_by``."""
    mark = item.get_closest_marker(MARKER)
    return mark is not None and not mark.kwargs.get("covered_by")


class _Refused(importlib.abc.Loader):
    def __init__(self, guard, name):
        self.guard, self.name = guard, name

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.guard.refused.append(self.name)
        raise ImportError(f"{self.guard.nodeid} is marked one_lane, but imports {self.name}, which differs between "
                          "the lanes: remove the marker (tests/lanes.py) so that both lanes run it")


class LaneGuard(importlib.abc.MetaPathFinder):
    """While a one-lane test runs: its imports of version-sensitive packages fail and are recorded. Modules already
    imported by earlier tests of the worker are hidden for the test's duration, so they are imported anew (and
    refused) rather than found in ``sys.modules``."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.refused: list[str] = []
        self.hidden: dict = {}

    def find_spec(self, name, path=None, target=None):
        if sensitive(name) and importlib.machinery.PathFinder.find_spec(name, path) is not None:
            return importlib.machinery.ModuleSpec(name, _Refused(self, name))  # installed: refused
        return None  # not installed: the import fails as it would without the guard

    def __enter__(self):
        self.hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if sensitive(k)}
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc):
        sys.meta_path.remove(self)
        for k in [k for k in sys.modules if sensitive(k)]:
            del sys.modules[k]  # a half-made module of a refused import
        sys.modules.update(self.hidden)


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}(lane, reason, covered_by=()): runs in that lane only, where the "
                                       "lanes cannot differ (tests/lanes.py); the reason says why")


def pytest_collection_modifyitems(config, items):
    """Deselect the tests of modules marked for the other lane."""
    keep, elsewhere = [], []
    for item in items:
        lane = module_lane(item)
        (keep if lane in (None, LANE) else elsewhere).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = keep
        config._mvlm_other_lane = sorted({i.nodeid.split("::")[0] for i in elsewhere})


def pytest_report_header(config):
    return f"lane: Python {LANE} (one_lane modules of the other lane are deselected, tests/lanes.py)"


def _guarded(item):
    if not guarded(item):
        return (yield)
    with LaneGuard(item.nodeid) as guard:
        result = yield
    if guard.refused:
        raise AssertionError(f"{item.nodeid} is marked one_lane but imported {', '.join(sorted(set(guard.refused)))}"
                             ", which differ between the lanes: remove its one_lane marker (tests/lanes.py)")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    other = getattr(config, "_mvlm_other_lane", [])
    if other:
        terminalreporter.write_line(f"{len(other)} module(s) run in the other lane only (one_lane): "
                                    + ", ".join(m.rsplit("/", 1)[-1].removesuffix(".py") for m in other))
