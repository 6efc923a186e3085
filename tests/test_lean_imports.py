"""megatron_vlm.runtime.lean_imports: which optional libraries a rank marks as not installed, and when."""

import importlib
import sys

import pytest

from megatron_vlm.runtime.lean_imports import TRANSFORMER_ENGINE, WANDB, skip_unused, unused

NAMES = ("megatron.core", TRANSFORMER_ENGINE, WANDB)


def test_what_a_rank_does_not_use():
    assert unused("cpu", wandb=False) == [TRANSFORMER_ENGINE, WANDB]
    assert unused("cpu", wandb=True) == [TRANSFORMER_ENGINE]
    assert unused("cuda", wandb=False) == [WANDB]
    assert unused("cuda", wandb=True) == []


@pytest.fixture
def before_megatron_core():
    """This process as a rank sees it before megatron-core's import; restored afterwards."""
    saved = {n: sys.modules[n] for n in NAMES if n in sys.modules}
    for n in NAMES:
        sys.modules.pop(n, None)
    yield
    for n in NAMES:
        sys.modules.pop(n, None)
    sys.modules.update(saved)


def test_marked_libraries_fail_to_import_as_if_not_installed(before_megatron_core):
    assert skip_unused("cpu", wandb=False) == [TRANSFORMER_ENGINE, WANDB]
    for name in (TRANSFORMER_ENGINE, WANDB):
        with pytest.raises(ImportError):  # what megatron-core's ``try: import ... except ImportError`` catches
            importlib.import_module(name)


def test_a_library_already_imported_is_kept(before_megatron_core):
    sys.modules[WANDB] = wandb = type(sys)("wandb")
    assert skip_unused("cpu", wandb=False) == [TRANSFORMER_ENGINE]
    assert sys.modules[WANDB] is wandb


def test_nothing_is_marked_once_megatron_core_is_imported():
    import megatron.core  # noqa: F401

    before = {n: sys.modules.get(n, "absent") for n in (TRANSFORMER_ENGINE, WANDB)}
    assert skip_unused("cpu", wandb=False) == []
    assert {n: sys.modules.get(n, "absent") for n in (TRANSFORMER_ENGINE, WANDB)} == before
