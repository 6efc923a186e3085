"""The suite's rule under ``CI=true`` (tests/conftest.py): a check that cannot run fails instead of skipping.

Each case is a small test file run by pytest's own ``pytester`` in this process, with tests/conftest.py's hooks:
a ``skip`` or ``skipif`` marker, a ``pytest.skip`` at run time, an ``importorskip`` or ``pytest.skip`` at import
time all fail under CI (the last two as collection errors); only ``not_here`` and the ``gpu``/``te`` marker skips
that conftest adds itself pass. Without CI they all skip.
"""

from __future__ import annotations

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

#: Modules whose checks are version-sensitive (conversion, training, checkpoints, mixture of experts, Transformer
#: Engine, the megatron-core compatibility layer, cross-version and Megatron-LM interop, video decoding with the
#: lanes' two PyAVs): both lanes run them, whatever a marker says. A new module is in both lanes until marked.
BOTH_LANES = frozenset({
    "test_anyres_models", "test_anyres_run", "test_checkpoint_integrity", "test_checkpoint_save",
    "test_context_parallel", "test_convert", "test_convert_errors", "test_convert_streaming", "test_cpu_compat", "test_cross_version", "test_eval",
    "test_fault_drill", "test_fusions", "test_launch_run", "test_lean_imports", "test_lm_families",
    "test_mcore_patches", "test_megatron_lm_interop",
    "test_memory", "test_moe", "test_moe_spec", "test_objective", "test_packing_equivalence", "test_packing_resume",
    "test_qwen3_train", "test_remote_storage", "test_schedule", "test_stage1_resume", "test_te",
    "test_te_install", "test_train", "test_train_parallel", "test_train_reference", "test_transformer_impl",
    "test_verify", "test_video_data", "test_video_models", "test_video_run",
})


def test_every_module_is_in_both_lanes_or_marked_with_its_lane_and_reason():
    from tests.conftest import ROOT
    from tests.lanes import LANES, marked_modules

    marks = marked_modules(ROOT / "tests")
    modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    assert BOTH_LANES <= modules, f"BOTH_LANES names modules that do not exist: {sorted(BOTH_LANES - modules)}"
    for module, (lane, reason, covered_by) in marks.items():
        assert lane in LANES, f"{module}: one_lane({lane!r}) names no lane .ci/run runs {LANES}"
        assert len(reason.split()) >= 4, f"{module}: one_lane needs a reason saying why the lanes cannot differ"
        assert module not in BOTH_LANES, f"{module} is version-sensitive (BOTH_LANES): both lanes must run it"
        for other in covered_by:  # the version-sensitive steps of an end-to-end module are held in both lanes
            assert other in modules and other not in marks, f"{module}: covered_by {other}, which is not a module " \
                                                            "both lanes run"
    # every check runs somewhere: a module is marked for one lane, or runs in both
    print(f"\none lane: {sorted(marks)}\nboth lanes: {len(BOTH_LANES)} version-sensitive modules and the rest")


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
    run = (ROOT / ".ci" / "run").read_text()
    assert "make test PYTHON=" in run and ".ci/budget.py check" in run  # each lane's tests are timed and checked


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
