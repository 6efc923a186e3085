"""The suite's rule under ``CI=true`` (tests/conftest.py): a check that cannot run fails instead of skipping.

Each case is a small test file run by pytest's own ``pytester`` in this process, with tests/conftest.py's hooks:
a ``skip`` or ``skipif`` marker, a ``pytest.skip`` at run time, an ``importorskip`` or ``pytest.skip`` at import
time all fail under CI (the last two as collection errors); only ``not_here`` and the ``gpu``/``te`` marker skips
that conftest adds itself pass. Without CI they all skip.
"""

from __future__ import annotations

import sys

import pytest

pytest_plugins = ["pytester"]

CONFTEST = ("from tests.conftest import (pytest_collection_modifyitems, pytest_make_collect_report,\n"
            "                            pytest_runtest_makereport)\n")
TESTS = '''
import pytest
from tests.conftest import not_here

@pytest.mark.skip(reason="the tool is not installed")
def test_skip_marker():
    pass

@pytest.mark.skipif(True, reason="no files")
def test_skipif_marker():
    pass

def test_skip_at_run_time():
    pytest.skip("cannot check here")

def test_not_here():
    not_here("a CPU shim on a CUDA machine")

@pytest.mark.gpu
def test_gpu_marker():
    pass

def test_passes():
    pass
'''


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_cases=TESTS)
    return pytester


@pytest.mark.parametrize("ci", [True, False])
def test_only_the_listed_skips_pass_under_ci(suite, monkeypatch, ci):
    import torch

    monkeypatch.setenv("CI", "true" if ci else "")
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    outcomes = result.parseoutcomes()
    gpu_skips = 0 if torch.cuda.is_available() else 1
    if ci:
        # a marker's skip happens at set-up, so it counts as an error there; pytest.skip in the test as a failure
        assert (outcomes.get("errors"), outcomes.get("failed")) == (2, 1), outcomes
        assert outcomes.get("skipped") == 1 + gpu_skips and outcomes.get("passed") == 1, outcomes
        text = result.stdout.str()
        for name in ("ERROR test_cases.py::test_skip_marker", "ERROR test_cases.py::test_skipif_marker",
                     "FAILED test_cases.py::test_skip_at_run_time"):
            assert name in text, text
        assert "skipped under CI=true, where every check must run: the tool is not installed" in text
    else:
        assert outcomes.get("skipped") == 4 + gpu_skips and "failed" not in outcomes, outcomes


@pytest.mark.parametrize("skip", ['pytest.importorskip("no_such_module_for_the_ci_rule")',
                                  'pytest.skip("no hub files", allow_module_level=True)'])
def test_a_module_skipped_at_collection_fails_under_ci(pytester, monkeypatch, skip):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_module=f"import pytest\n{skip}\n\ndef test_never_runs():\n    pass\n")
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret != 0 and result.parseoutcomes().get("errors") == 1, result.stdout.str()
    assert "skipped at collection under CI=true" in result.stdout.str()
    monkeypatch.setenv("CI", "")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == 5 or result.parseoutcomes().get("skipped") == 1, result.stdout.str()  # skipped, no error


# -- the lane split (tests/lanes.py) -------------------------------------------------------------------------------

def test_every_module_is_in_both_lanes_or_marked_with_its_lane_and_reason():
    """The split follows the code (tests/lanes.py's ``version_sensitive``), not a hand-kept list: a module that
    imports megatron-core, TE or PyAV, spawns a world or starts an unwatched command that runs megatron-core is never
    marked one-lane, unless it names ``covered_by`` modules that both lanes run, that are version-sensitive
    themselves, and that between them run every command it runs."""
    from tests.conftest import ROOT
    from tests.lanes import LANES, commands_named, marked_modules, version_sensitive

    marks = marked_modules(ROOT / "tests")
    modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    derived = {m: version_sensitive(ROOT / "tests" / f"{m}.py") for m in sorted(modules)}
    # the derivation sees what the review found missing from the hand-kept list, and the hand-kept list
    assert all(derived[m] for m in ("test_internvl", "test_context_parallel", "test_pipeline_layout",
                                    "test_grad_reference", "test_moe", "test_cross_version", "test_video_data")), \
        {m: derived[m] for m in ("test_internvl", "test_context_parallel", "test_pipeline_layout")}
    composite = {"demo/run_demo.py"}
    for module, (lane, reason, covered_by) in marks.items():
        assert lane in LANES, f"{module}: one_lane({lane!r}) names no lane .ci/run runs {LANES}"
        assert len(reason.split()) >= 4, f"{module}: one_lane needs a reason saying why the lanes cannot differ"
        if not covered_by:
            assert not derived[module], f"{module} is version-sensitive ({'; '.join(derived[module])}): both lanes " \
                                        "must run it, or it names the covered_by modules that hold those steps"
            continue
        held = set()
        for other in covered_by:  # the version-sensitive steps of an end-to-end module are held in both lanes
            assert other in modules and other not in marks, f"{module}: covered_by {other}, which is not a module " \
                                                            "both lanes run"
            runs = commands_named(ROOT / "tests" / f"{other}.py")
            assert derived[other] or runs, f"{module}: covered_by {other}, which holds nothing version-sensitive"
            held |= runs
        missing = commands_named(ROOT / "tests" / f"{module}.py") - composite - held
        assert not missing, f"{module} runs {sorted(missing)}, which none of its covered_by {covered_by} runs"
    both = sorted(m for m in modules if derived[m] and m not in marks)
    print(f"\none lane: {sorted(marks)}\nversion-sensitive, both lanes ({len(both)}): {both}")


def test_the_derivation_sees_imports_worlds_and_unwatched_commands(tmp_path):
    from tests.lanes import version_sensitive

    cases = {
        "pure": "import json\n",
        "direct": "def test():\n    import megatron.core\n",
        "through_support": "from tests.support.worlds import logits_jobs\n",
        "through_library": "from megatron_vlm.model.anyres_model import AnyresLLaVAModel\n",
        "command": "import subprocess, sys\nsubprocess.run([sys.executable, 'convert/hf_to_megatron.py'])\n",
        "dry_run": "import subprocess, sys\nsubprocess.run([sys.executable, 'train/run.py', '--dry-run'])\n",
        "lazy_library": "from megatron_vlm.runtime import mcore_version\n",  # imports megatron-core in a function
    }
    got = {}
    for name, src in cases.items():
        (tmp_path / f"test_{name}.py").write_text(src)
        got[name] = bool(version_sensitive(tmp_path / f"test_{name}.py"))
    assert got == {"pure": False, "direct": True, "through_support": True, "through_library": True, "command": True,
                   "dry_run": False, "lazy_library": False}, got


def test_the_commands_a_benchmark_runs_are_followed_into_the_modules_it_imports():
    """bench/gpu.py starts train/run.py and convert/hf_to_megatron.py from its steps (bench/gpu_steps/, via
    bench/train.py's set-up): a test module that names the script runs those commands, and its ``covered_by`` modules
    must hold them."""
    from tests.conftest import ROOT
    from tests.lanes import commands_named

    runs = commands_named(ROOT / "tests" / "test_bench_gpu.py")
    assert {"train/run.py", "convert/hf_to_megatron.py"} <= runs, runs


FORKED_CASE = '''
import sys
import pytest
from tests.support import forked_cli

pytestmark = pytest.mark.one_lane(LANE, reason="a case of the lane rule's own test")

def test_forks_a_command(tmp_path):
    script = tmp_path / "cmd.py"
    script.write_text("import megatron.core\\n")
    forked_cli.run([sys.executable, str(script)], capture_output=True)
'''


def test_a_command_forked_by_a_one_lane_test_is_watched_too(megatron_imported, pytester):
    """The guard reaches the commands a one-lane test forks: their import of megatron-core fails the test."""
    from tests.lanes import LANE

    pytester.makeconftest('pytest_plugins = ["tests.lanes"]\n')
    pytester.makepyfile(test_forked_case=FORKED_CASE.replace("LANE,", repr(LANE) + ","))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    assert result.parseoutcomes().get("failed") == 1, result.stdout.str()
    assert "megatron.core (in a forked command)" in result.stdout.str()


LANE_CASES = '''
import pytest

pytestmark = pytest.mark.one_lane(LANE, reason="a case of the lane rule's own test")

def test_pure():
    import json
    assert json.loads("1") == 1

def test_imports_megatron():
    import megatron.core  # noqa: F401
'''


@pytest.fixture(scope="module")
def megatron_imported():
    """megatron-core imported before pytester's snapshot of ``sys.modules`` (which would drop it afterwards, and
    torch's collectives cannot be imported twice): the guard must hide what an earlier test imported."""
    import megatron.core  # noqa: F401


@pytest.mark.parametrize("here", [True, False])
def test_a_one_lane_module_runs_in_its_lane_only_and_may_not_import_megatron(megatron_imported, pytester, here):
    """In its lane a marked module runs, and its import of megatron-core fails (also when an earlier test of the
    worker imported it); in the other lane it is deselected, not skipped."""
    from tests.lanes import LANE, LANES

    lane = LANE if here else next(x for x in LANES if x != LANE)
    pytester.makeconftest('pytest_plugins = ["tests.lanes"]\n')
    pytester.makepyfile(test_lane_cases=LANE_CASES.replace("LANE,", repr(lane) + ","))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    outcomes = result.parseoutcomes()
    if here:
        assert (outcomes.get("passed"), outcomes.get("failed")) == (1, 1), outcomes
        assert "is marked one_lane, but imports megatron.core" in result.stdout.str()
    else:
        assert outcomes.get("deselected") == 2 and "passed" not in outcomes and "skipped" not in outcomes, outcomes
    assert "megatron.core" in __import__("sys").modules  # the guard gave back what it hid


# -- the CI budget (.ci/budget.py) ---------------------------------------------------------------------------------

def _budget():
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("ci_budget", ROOT / ".ci" / "budget.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_budget_is_one_number_that_the_docs_and_ci_use():
    from tests.conftest import ROOT

    budget = _budget()
    doc = (ROOT / "docs" / "development.md").read_text()
    assert f"within {budget.LANE_BUDGET_MIN} minutes of an idle 2-core machine" in doc, \
        "docs/development.md#the-ci-budget must state .ci/budget.py's LANE_BUDGET_MIN"
    run = _ci_run_code()
    assert "make test PYTHON=" in run and ".ci/budget.py check" in run  # each lane's tests are timed and checked


def _ci_run_code() -> str:
    """.ci/run's commands: its lines without comments (a line commented out does not run)."""
    import shlex

    from tests.conftest import ROOT

    code = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote inside a heredoc line: keep the line as it is
            words = [line] if not line.lstrip().startswith("#") else []
        if words:
            code.append(" ".join(words))
    return "\n".join(code)


@pytest.mark.slow  # runs .ci/run's check_lane in bash
def test_ci_runs_each_lane_on_its_pinned_python_and_checks_that_it_is_that_lane():
    """Lane 1 on python3.11 (not whatever python3 is), lane 2 on python3.12, and after each install the lane's venv
    must report the Python and megatron-core it is named for: a commented-out line does not count."""
    import re
    import subprocess
    import sys
    from importlib.metadata import version

    from tests.conftest import ROOT
    from tests.lanes import LANE, LANES

    run = _ci_run_code()
    lanes = re.findall(r"^lane (\d) .* (\S+) (3\.1\d) (0\.\d+)$", run, re.M)
    assert [(n, py, m) for n, _, py, m in lanes] == [("1", "3.11", "0.16"), ("2", "3.12", "0.19")], lanes
    assert re.search(r"\bpy311=\$\(\.ci/find-python python3\.11\)", run), "lane 1's Python must be pinned"
    assert re.search(r"^check_lane \S+ \$want_py \$want_mcore$", run, re.M), "each lane checks itself"
    assert "make test PYTHON=$py" in run and "make venv PYTHON=$py" in run  # (quotes are gone in _ci_run_code)
    # the check itself: this lane passes as itself and fails as the other one
    body = re.search(r"^check_lane\(\) \{.*?^\}", (ROOT / ".ci" / "run").read_text(), re.M | re.S).group(0)
    mine = ".".join(version("megatron-core").split(".")[:2])
    other = next(x for x in LANES if x != LANE)

    def check(py, mcore):
        return subprocess.run(["bash", "-c", f"{body}\ncheck_lane {sys.executable} {py} {mcore}"],
                              capture_output=True, text=True)

    ok, wrong = check(LANE, mine), check(other, mine)
    assert ok.returncode == 0 and f"megatron-core {version('megatron-core')}" in ok.stdout, ok.stderr
    assert wrong.returncode != 0 and f"the lane for Python {other}" in wrong.stderr, wrong.stdout


@pytest.mark.slow  # times the torch probe in the lane's interpreter
def test_a_lane_over_its_budget_fails_naming_the_fix_and_a_slow_machine_gets_more_time():
    budget = _budget()
    limit = budget.LANE_BUDGET_MIN * 60
    assert budget.check("3.11", limit - 1, 1.0) is None
    why = budget.check("3.11", limit + 60, 1.0)
    assert why and f"over the CI budget of {budget.LANE_BUDGET_MIN:.1f} min" in why and "LANE_BUDGET_MIN" in why
    assert budget.check("3.11", limit * 1.2, 1.3) is None  # a machine 30% slower than the reference
    assert budget.check("3.11", limit * 1.4, 1.3) is not None
    t, slow = budget.slowness(runs=1)
    assert t > 0 and slow >= 1.0  # never tighter than the number
    # the torch probe, in this lane's interpreter (as .ci/run passes the lane's venv); a missing one reads as None
    t, slow = budget.torch_slowness(sys.executable)
    assert t > 0 and slow >= 1.0
    assert budget.torch_slowness("/nonexistent/python") is None
