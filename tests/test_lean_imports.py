"""megatron_vlm.runtime.lean_imports: which optional libraries a rank marks as not installed, and when."""

import importlib
import json
import subprocess
import sys

import pytest

from megatron_vlm.runtime.lean_imports import TRANSFORMER_ENGINE, WANDB, skip_unused, unused

from .conftest import ROOT

NAMES = ("megatron.core", TRANSFORMER_ENGINE, WANDB)


def test_what_a_rank_does_not_use():
    assert unused("cpu", wandb=False) == [TRANSFORMER_ENGINE, WANDB]
    assert unused("cpu", wandb=True) == [TRANSFORMER_ENGINE]
    assert unused("cuda", wandb=False) == [WANDB]
    assert unused("cuda", wandb=True) == []


@pytest.fixture
def before_megatron_core():
    """This process as a rank sees it before megatron-core's import; restored afterwards."""
    from megatron_vlm.runtime import lean_imports, mcore_patches

    saved = {n: sys.modules[n] for n in NAMES if n in sys.modules}
    for n in NAMES:
        sys.modules.pop(n, None)
    yield
    for entry in lean_imports.ENTRIES.values():  # the registry takes its markers back (what it recorded: absent)
        mcore_patches.undo(entry)
    for n in NAMES:
        sys.modules.pop(n, None)
    sys.modules.update(saved)


def test_marked_libraries_fail_to_import_as_if_not_installed(before_megatron_core):
    from megatron_vlm.runtime import lean_imports, mcore_patches

    assert skip_unused("cpu", wandb=False) == [TRANSFORMER_ENGINE, WANDB]
    for name in (TRANSFORMER_ENGINE, WANDB):
        with pytest.raises(ImportError):  # what megatron-core's ``try: import ... except ImportError`` catches
            importlib.import_module(name)
        assert mcore_patches.is_active(lean_imports.ENTRIES[name])  # changes what megatron-core sees: registered


def test_a_library_already_imported_is_kept(before_megatron_core):
    sys.modules[WANDB] = wandb = type(sys)("wandb")
    assert skip_unused("cpu", wandb=False) == [TRANSFORMER_ENGINE]
    assert sys.modules[WANDB] is wandb


def test_nothing_is_marked_once_megatron_core_is_imported():
    import megatron.core  # noqa: F401

    before = {n: sys.modules.get(n, "absent") for n in (TRANSFORMER_ENGINE, WANDB)}
    assert skip_unused("cpu", wandb=False) == []
    assert {n: sys.modules.get(n, "absent") for n in (TRANSFORMER_ENGINE, WANDB)} == before


# The rank entry point, run up to its skip_unused call: what it marks, with the real modules it imports first.
ENTRY_PROBE = """
import json, sys
import megatron_vlm.runtime.lean_imports as lean_imports
from tests.conftest import script
real = lean_imports.skip_unused
def probe(device, wandb):
    print(json.dumps({"megatron.core": "megatron.core" in sys.modules, "marked": real(device, wandb)}))
    sys.exit(0)
lean_imports.skip_unused = probe
script("train/pretrain_vlm.py").main(sys.argv[1:])
"""


@pytest.mark.slow
def test_the_rank_entry_marks_them_before_anything_imports_megatron_core(tmp_path):
    """train/pretrain_vlm.py imports the trainer, then skips: a module-level megatron-core import anywhere on that
    path (the trainer, the config, the runtime) would make the skip a silent no-op."""
    argv = ["--device", "cpu", "--data-path", str(tmp_path / "data"), "--tokenizer-load-dir", str(tmp_path / "tok"),
            "--megatron-load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "out"),
            "--train-iters", "2", "--seq-length", "64", "--image-token-id", "5", "--pad-token-id", "0"]
    done = subprocess.run([sys.executable, "-c", ENTRY_PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"megatron.core": False,
                                                                 "marked": [TRANSFORMER_ENGINE, WANDB]}


def test_a_converter_marks_wandb_alone(before_megatron_core):
    from megatron_vlm.runtime.lean_imports import mark_not_installed

    assert mark_not_installed([WANDB]) == [WANDB]
    assert sys.modules[WANDB] is None and TRANSFORMER_ENGINE not in sys.modules
    with pytest.raises(ImportError):
        importlib.import_module(WANDB)
    sys.modules["megatron.core"] = type(sys)("megatron.core")
    assert mark_not_installed([TRANSFORMER_ENGINE]) == []
