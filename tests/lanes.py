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

  Commands the test forks (:mod:`tests.support.forked_cli`, the suite's way to run ``python SCRIPT.py``) are watched
  too: the guard's environment variable reaches them, the forked command refuses those imports as well and records
  them, and the test fails naming them.

Which modules must run in both lanes is derived from the code, not kept by hand (:func:`version_sensitive`): every
test module that imports megatron-core, Transformer Engine, PyAV or torchvision (itself, through the
``tests.support`` modules it imports, or through the top-level imports of the ``megatron_vlm`` modules it imports),
that spawns a gloo world (``megatron_vlm.runtime.spawn.run_world``, directly or through ``tests.support``), or that
starts a command whose run reaches megatron-core (:data:`MCORE_COMMANDS`) as a process the guard does not watch.
What is left -- an import inside a function of the library, a forked command -- the guard sees when it happens.
tests/test_ci_rules.py holds the split to it: a derived module is never marked one-lane unless it names ``covered_by``
modules, each of which both lanes run, and which between them run every such command it runs.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

import pytest

#: The lanes .ci/run runs, in its order.
LANES = ("3.11", "3.12")
LANE = "%d.%d" % sys.version_info[:2]
#: What differs between the lanes (top-level import names): a one-lane test's process must not import these.
VERSION_SENSITIVE = ("megatron.core", "transformer_engine", "transformer_engine_torch", "av", "torchvision")
MARKER = "one_lane"
#: set while a guarded test runs: the file where the commands it forks record the imports they were refused
GUARD_ENV = "MVLM_LANE_GUARD"
ROOT = Path(__file__).resolve().parent.parent
#: the command scripts whose run reaches megatron-core (their ranks, conversion or model loading), as a test names
#: them in the arguments of the call that runs them; ``train/run.py --dry-run`` stops before, so it is not counted
MCORE_COMMANDS = ("train/run.py", "train/pretrain_vlm.py", "convert/hf_to_megatron.py", "convert/megatron_to_hf.py",
                  "demo/run_demo.py", "eval/generate.py", "eval/evaluate.py")
#: functions that start a world of ranks (megatron_vlm.runtime.spawn)
WORLD_STARTERS = ("run_world",)


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
        import tempfile

        self.hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if sensitive(k)}
        sys.meta_path.insert(0, self)
        fd, self.log = tempfile.mkstemp(prefix="lane-guard-", suffix=".log")
        os.close(fd)
        self.saved_env = os.environ.get(GUARD_ENV)
        os.environ[GUARD_ENV] = self.log  # the commands the test forks refuse the same imports (child_guard)
        return self

    def __exit__(self, *exc):
        sys.meta_path.remove(self)
        for k in [k for k in sys.modules if sensitive(k)]:
            del sys.modules[k]  # a half-made module of a refused import
        sys.modules.update(self.hidden)
        if self.saved_env is None:
            os.environ.pop(GUARD_ENV, None)
        else:
            os.environ[GUARD_ENV] = self.saved_env
        with open(self.log) as f:
            self.refused += [f"{line.strip()} (in a forked command)" for line in f if line.strip()]
        os.unlink(self.log)


class _ChildGuard(LaneGuard):
    """The guard inside a forked command: refusals are appended to the test's log (its process cannot tell the test
    otherwise), and stay installed until the command's process ends."""

    def __init__(self, log: str):
        super().__init__("a command forked by a one_lane test")
        self.log = log

    def find_spec(self, name, path=None, target=None):
        spec = super().find_spec(name, path, target)
        if spec is not None:
            with open(self.log, "a") as f:
                f.write(name + "\n")
        return spec


def child_guard() -> None:
    """Called first in a command the tests fork (tests/support/forked_cli.py): under a guarded test, refuse and
    record the version-sensitive imports there too."""
    log = os.environ.get(GUARD_ENV)
    if log:
        guard = _ChildGuard(log)
        guard.hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if sensitive(k)}
        sys.meta_path.insert(0, guard)


def _known_modules() -> dict[str, Path]:
    out = {}
    for base in ("megatron_vlm", "tests/support"):
        for p in sorted((ROOT / base).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The dotted names ``path`` imports (``from a import b`` gives ``a`` and ``a.b``): every import, or only those
    at module level."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = node.module or ""
            if node.level:  # relative: the tests package's helpers (tests/ and tests/support/ only use these)
                here = ".".join(path.resolve().relative_to(ROOT).parent.parts)
                base = ".".join(x for x in (here.rsplit(".", node.level - 1)[0] if node.level > 1 else here, base)
                                if x)
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def _called_names(path: Path) -> set[str]:
    """The names of the functions ``path`` calls (``f(...)``, ``x.f(...)``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def commands_run(path: Path) -> set[str]:
    """The :data:`MCORE_COMMANDS` that ``path`` starts as processes the lane guard does not watch: a call of
    ``subprocess``'s (``subprocess.run``, ``Popen``, ...) with the script among its arguments (a list of
    arguments, an f-string, a path joined with ``/``), unless ``--dry-run`` is among them. Commands forked with
    :mod:`tests.support.forked_cli` are watched (:func:`child_guard`) and commands called in the test's process by
    the in-process guard, so neither is counted here."""
    unwatched = {"run", "Popen", "check_output", "check_call", "call"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        f = getattr(node, "func", None)
        if not (isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and f.attr in unwatched
                and isinstance(f.value, ast.Name) and f.value.id == "subprocess"):
            continue
        strings = [n.value for arg in list(node.args) + [k.value for k in node.keywords] for n in ast.walk(arg)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if "--dry-run" in strings:
            continue
        joined = [s.strip("/") for s in strings]
        for cmd in MCORE_COMMANDS:
            head, _, script = cmd.partition("/")
            if cmd in joined or any(s.endswith("/" + cmd) for s in joined) or (head in joined and script in joined):
                found.add(cmd)
    return found


def _named(path: Path, scripts) -> set[str]:
    """The ``scripts`` (repository paths) that ``path``'s code names in a string (an argument list, an f-string, a
    path joined with ``/``, a constant), docstrings and calls with ``--dry-run`` among their arguments left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    dry = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            inner = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
            if any(n.value == "--dry-run" for n in inner):
                dry |= {id(n) for n in inner}
    strings = [n.value.strip("/") for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docstrings and id(n) not in dry]
    found = set()
    for cmd in scripts:
        head, _, script = cmd.partition("/")
        if cmd in strings or any(s.endswith("/" + cmd) for s in strings) or (head in strings and script in strings):
            found.add(cmd)
    return found


def commands_named(test_path) -> set[str]:
    """Every :data:`MCORE_COMMANDS` a test module runs in any way (forked, started, or its ``main`` called), as
    named in its code, in that of the helper modules of tests/ it imports (``train_helpers``, ...), and in the demo
    and benchmark scripts it names (which run the commands themselves), with the modules of bench/ those import
    (bench/gpu.py's steps, ``bench.gpu_steps``): what its ``covered_by`` modules must run too. Shared fixtures
    (conftest) and tests/support are left out: every module has them."""
    scripts = [ROOT / "demo" / "run_demo.py", *(ROOT / "bench").glob("*.py")]
    composite = sorted(str(p.relative_to(ROOT)) for p in scripts)
    helpers = {f"tests.{p.stem}": p for p in (ROOT / "tests").glob("*.py")
               if not p.stem.startswith("test_") and p.stem not in ("conftest", "lanes")}
    for p in sorted((ROOT / "bench").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        helpers[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    found, seen, stack = set(), set(), [Path(test_path)]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        found |= _named(path, MCORE_COMMANDS)
        stack += [ROOT / s for s in _named(path, composite)]
        stack += [helpers[n] for n in _imports(path, top_level_only=False) if n in helpers]
    return found


def version_sensitive(test_path) -> list[str]:
    """Why a test module must run in both lanes (empty: it need not): see the module docstring."""
    known = _known_modules()

    def resolve(name):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    test_path = Path(test_path)
    reasons: list[str] = []
    seen: set[str] = set()
    # (module, its path, whether all its imports count): the test module and tests.support -- every import;
    # megatron_vlm -- the top-level ones (what its functions import inside is the in-process guard's to see)
    stack: list[tuple[str, Path, bool]] = [("the module", test_path, True)]
    while stack:
        name, path, everything = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        names = _imports(path, top_level_only=not everything)
        for n in sorted(names):
            if sensitive(n):
                reasons.append(f"imports {n.split('.')[0] if not n.startswith('megatron.') else 'megatron.core'}"
                               + ("" if name == "the module" else f" (through {name})"))
        if everything and set(WORLD_STARTERS) & _called_names(path) and "run_world" in path.read_text():
            reasons.append("spawns a world" + ("" if name == "the module" else f" (through {name})"))
        for n in names:
            r = resolve(n)
            if r and r not in seen:
                stack.append((r, known[r], r.startswith("tests.")))
    reasons += [f"runs {cmd}" for cmd in sorted(commands_run(test_path))]
    return sorted(set(reasons))


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
