"""megatron_vlm.runtime.gc_freeze.preload: a command's imports run with the cyclic collector paused, then frozen."""

import gc
import sys

import pytest

from megatron_vlm.runtime.gc_freeze import preload

PROBE = "import gc\nCOLLECTOR_ON = gc.isenabled()\nBIG = [[i] for i in range(20000)]\n"


@pytest.fixture
def probe_modules(tmp_path, monkeypatch):
    (tmp_path / "mvlm_probe_ok.py").write_text(PROBE)
    (tmp_path / "mvlm_probe_bad.py").write_text(PROBE + "raise RuntimeError('probe')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("mvlm_probe_ok", "mvlm_probe_bad"):
        sys.modules.pop(name, None)
    gc.enable()
    gc.freeze()  # as conftest left the worker (a test unfreezes)


def test_imports_run_paused_then_their_objects_are_frozen(probe_modules):
    gc.enable()
    frozen = gc.get_freeze_count()
    preload(["mvlm_probe_ok"])
    probe = sys.modules["mvlm_probe_ok"]
    assert probe.COLLECTOR_ON is False
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(probe.BIG)  # the module's objects left the collected generations
    gc.unfreeze()
    preload(["mvlm_probe_ok", "gc"])  # all imported already (a test process, a forked rank): nothing frozen
    assert gc.get_freeze_count() == 0


def test_the_collector_comes_back_after_a_failed_import_and_stays_off_if_it_was(probe_modules):
    gc.enable()
    with pytest.raises(RuntimeError, match="probe"):
        preload(["mvlm_probe_bad"])
    assert gc.isenabled()
    gc.disable()
    preload(["mvlm_probe_ok"])
    assert not gc.isenabled()
