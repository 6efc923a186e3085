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
