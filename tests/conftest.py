"""Shared fixtures: tiny HF LLaVA directories built from configs (random weights, own tokenizers)."""

import importlib.util
import os
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that wait for work sleep instead of spinning (inherited by every process a test starts, and read
# before torch loads its OpenMP runtime here): `make test` runs two workers whose worlds, commands and in-process
# models share the machine's cores, and a spinning thread burns a core another process needs. The thread counts,
# and so the numbers, are unchanged. Measured on the 2-core CI machine: 6% less CPU for the 3.11 lane (1,745 s against
# 1,866 s of busy CPU, 894 s against 957 s of wall); a one-rank world with two threads set up in 48 s instead of 87.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# megatron-core 0.19's package_info runs `git rev-parse` in its site-packages folder at import, unless this is set:
# a process per import (and one the fast set's process guard refuses when a fast module imports megatron-core first)
os.environ.setdefault("NO_VCS_VERSION", "1")
# train/run.py launches in the tests fork their ranks from the launcher, which the tests fork from a server that
# imported torch, megatron-core and transformers (megatron_vlm/launch/elastic.py): ~6.6 CPU-s less per rank than a
# new interpreter. tests/test_launch_run.py holds the forked start to torchrun's own (exit codes, signals, the ranks'
# environment); a test that needs the interpreter's start (the fault drill's sitecustomize) sets "exec".
os.environ.setdefault("MVLM_RANK_START", "fork")
warnings.filterwarnings("ignore")

# (text family, vision family, build options): the coverage matrix of the conversion tests.
FAMILIES = {
    "llama_clip": ("llama", "clip", {}),  # GQA, Llama-3 rope scaling, CLIP 'default' (drops CLS), layer -2
    "mistral_clip_full": ("mistral", "clip", {"vision_feature_layer": -1, "vision_feature_select_strategy": "full"}),
    "qwen2_siglip": ("qwen2", "siglip", {"vocab_size_padding": 64}),  # qkv bias, tied embeddings, no CLS
}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> path of a tiny HF LLaVA directory made by the real build_llava."""
    from tests.support.tiny import make_tiny_llava

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (text, vision, kw) in FAMILIES.items():
        out[name] = make_tiny_llava(root / name, text, vision, **kw)
    out["llama3_clip"] = make_tiny_llava(root / "llama3_clip", "llama", "clip",
                                         text_overrides={"num_hidden_layers": 3})
    return out


ROOT = Path(__file__).resolve().parent.parent

#: ``make test-fast`` (MVLM_FAST=1, ``-m "not slow"``): the unit-level set, in one process. A test lands there by
#: default; one that starts a process (a spawned world, torchrun, a command run as a subprocess)
#: fails in that set with the fix named: mark it ``@pytest.mark.slow``. ``make test`` runs both sets.
FAST = os.environ.get("MVLM_FAST") == "1"


class _ProcessGuard:
    """While active, starting a process fails the running test (the fast set runs in one process)."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"{self.nodeid} starts a process, which the fast set (make test-fast) does not allow: "
                           "mark the test @pytest.mark.slow (or make it run in this process)")

    def __enter__(self):
        import subprocess

        import torch.multiprocessing

        # a command or torchrun (subprocess), a spawned world (runtime.spawn.run_world -> start_processes); library
        # helpers such as dist_checkpointing's writer processes and loader workers are left alone
        self._saved = [(subprocess.Popen, "_execute_child", subprocess.Popen._execute_child),
                       (torch.multiprocessing, "start_processes", torch.multiprocessing.start_processes)]
        for owner, name, _ in self._saved:
            setattr(owner, name, self._refuse)
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._saved:
            setattr(owner, name, original)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if FAST and item.get_closest_marker("slow") is None:
        with _ProcessGuard(item.nodeid):
            yield
    else:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if FAST and item.get_closest_marker("slow") is None:
        with _ProcessGuard(item.nodeid):
            yield
    else:
        yield


#: The lane that installs Transformer Engine (make venv / tools/install_te.py): there ``te`` tests must run.
TE_LANE = (3, 12)
TE_SKIP = ("Transformer Engine is installed in the Python 3.12 lane only (the 3.11 lane's CPU torch cannot build "
           "it): marked te")
GPU_SKIP = "needs a CUDA GPU (marked gpu); none is visible here"


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where no CUDA GPU is visible (CI, developer machines), and tests marked ``te``
    outside the Transformer Engine lane (in that lane a missing TE fails them: see :func:`require_te`)."""
    import sys

    import torch

    skips = []
    if not torch.cuda.is_available():
        skips.append(("gpu", pytest.mark.skip(reason=GPU_SKIP)))
    if sys.version_info[:2] < TE_LANE:
        skips.append(("te", pytest.mark.skip(reason=TE_SKIP)))
    for item in items:
        for marker, skip in skips:
            if item.get_closest_marker(marker) is not None:  # not item.keywords: it holds directory names too
                item.add_marker(skip)
    _heavy_modules_first(items)


#: The longest modules, longest first: each module's wall time in a whole-suite run, the larger of the two lanes'
#: (`.suite-times/py3XX.json`, 2026-11-28: test_moe ~430 s, test_internvl ~320 s, test_lm_families ~320 s, ...,
#: test_launch_dryrun ~7 s). A scheduling hint only: a module not listed comes after these, by its count of slow
#: tests.
LONGEST_MODULES = ("test_moe", "test_internvl", "test_lm_families", "test_bench_gpu", "test_train_reference",
                   "test_qwen3_train", "test_real_models", "test_train", "test_demo", "test_stage1_resume",
                   "test_train_parallel", "test_packing_resume", "test_convert", "test_convert_streaming",
                   "test_fault_drill", "test_memory", "test_te", "test_anyres_run", "test_remote_storage",
                   "test_packing_equivalence", "test_megatron_lm_interop", "test_anyres_models", "test_newcomer",
                   "test_eval", "test_bad_inputs", "test_video_run", "test_data_loader", "test_video_data",
                   "test_data_convert", "test_tokens", "test_verify", "test_launch_run", "test_data_guard",
                   "test_dcp_index", "test_launch_dryrun")


def _heavy_modules_first(items) -> None:
    """Order whole modules longest first (:data:`LONGEST_MODULES`, then by their count of slow tests; stable
    otherwise). ``make test`` runs two pytest-xdist workers that take modules in this order (``--dist loadscope``,
    so a module's fixtures are built once; ``--no-loadscope-reorder``, or xdist would sort modules by their count of
    tests and start the one-test demo last): starting the long ones first keeps one worker from finishing its last
    long module alone while the other idles."""
    slow: dict[str, int] = {}
    for item in items:
        slow.setdefault(item.module.__name__, 0)
        slow[item.module.__name__] += item.get_closest_marker("slow") is not None
    rank = {name: i for i, name in enumerate(slow)}
    longest = {name: i for i, name in enumerate(LONGEST_MODULES)}

    def key(it):
        name = it.module.__name__
        return (longest.get(name.rsplit(".", 1)[-1], len(longest)), -slow[name], rank[name])

    items.sort(key=key)


def pytest_configure(config):
    """The suite's own plugins: each module's time (tests/suite_times.py) and the lane split (tests/lanes.py)."""
    from tests import lanes, suite_times

    for plugin in (suite_times, lanes):
        if not config.pluginmanager.is_registered(plugin):
            config.pluginmanager.register(plugin, f"mvlm-{plugin.__name__.rsplit('.', 1)[-1]}")


def pytest_collection_finish(session):
    """The imported libraries and the collected tests live until the worker exits: later garbage collections
    skip them (megatron_vlm.runtime.gc_freeze)."""
    from megatron_vlm.runtime.gc_freeze import freeze_long_lived

    freeze_long_lived()


def pytest_sessionfinish(session, exitstatus):
    from megatron_vlm.runtime.gc_freeze import freeze_long_lived

    freeze_long_lived()  # the worker ends: no final full collection over every object it made


#: The prefix of a skip that is not a missing check but a test that does not apply to this machine or lane (a CPU
#: shim on a CUDA machine, a CPU-torch refusal in the CUDA-torch lane): :func:`not_here`. Under ``CI=true`` every
#: other skip is a failure (:func:`pytest_runtest_makereport`, :func:`pytest_make_collect_report`), beside the
#: ``gpu`` and ``te`` marker skips above (:data:`ALLOWED_SKIPS`: those exact reasons, not any marker's).
NOT_HERE = "does not apply here: "
ALLOWED_SKIPS = (GPU_SKIP, TE_SKIP)


def ci() -> bool:
    """Whether this is a CI run (``CI=true``, set by .ci/run), read when asked."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


CI = ci()


def skip_allowed(reason: str) -> bool:
    """A skip that passes under CI: :func:`not_here`, or one of :data:`ALLOWED_SKIPS`."""
    reason = reason.strip().removeprefix("Skipped: ")
    return reason.startswith(NOT_HERE) or reason in ALLOWED_SKIPS


def _reason(longrepr) -> str:
    return (str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)).strip().removeprefix("Skipped: ")


def not_here(why: str):
    """Skip a test that does not apply on this machine or lane (allowed under CI, unlike other skips)."""
    pytest.skip(NOT_HERE + why)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``CI=true`` a test that skips because it could not do its check fails instead: a missing tool, file
    or capability must show as red, not as a quiet skip. Allowed: the ``gpu`` marker's skip (no GPU on CI), the
    ``te`` marker's outside the Transformer Engine lane, and :func:`not_here`; any other ``skip``/``skipif``
    marker, ``pytest.skip`` or ``importorskip`` fails."""
    outcome = yield
    report = outcome.get_result()
    if not hasattr(report, "wasxfail"):
        _fail_skip_under_ci(report, "skipped under CI=true")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same rule at collection: a module that skips as it is imported (``pytest.importorskip``, a module-level
    ``pytest.skip``) fails under ``CI=true`` instead of vanishing from the run (a collection error: the run stops)."""
    outcome = yield
    _fail_skip_under_ci(outcome.get_result(), f"{collector.nodeid}: skipped at collection under CI=true")


def _fail_skip_under_ci(report, what: str) -> None:
    """Turn ``report``'s skip into a failure under ``CI=true`` unless its reason is an allowed one."""
    if not ci() or not report.skipped:
        return
    reason = _reason(report.longrepr)
    if skip_allowed(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"{what}, where every check must run: {reason}"


def require_te() -> None:
    """In the Transformer Engine lane a missing or broken TE is a failure, not a skip: CI must show the TE
    tests ran."""
    from megatron_vlm.model.layer_impl import te_status

    ok, why = te_status()
    if not ok:
        pytest.fail(f"Transformer Engine does not import in the Python {TE_LANE[0]}.{TE_LANE[1]} lane ({why}); "
                    "install it with `make venv PYTHON=python3.12` (tools/install_te.py)", pytrace=False)


def script(relpath: str):
    """Import a command-line script (e.g. convert/hf_to_megatron.py) as a module to call its main()."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
