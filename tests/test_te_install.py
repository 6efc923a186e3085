"""tools/install_te.py, the Transformer Engine install of the 3.12 lane (run by ``make venv``): where the torch
extension's wheel comes from (cache, verified seed, source build) and the one-line errors when it cannot be built.
The real install is exercised by ``make venv PYTHON=python3.12``, and by tests/test_te.py, which needs it."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from tests.conftest import ROOT, not_here


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("install_te", ROOT / "tools" / "install_te.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["install_te"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


inst = _load()
LANE = inst.Target("2.13.0+cu130", "13.0", "cp312")
WHEEL = "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl"


def test_seed_is_used_only_for_its_torch_and_python_and_hash(tmp_path):
    fake = tmp_path / WHEEL
    fake.write_bytes(b"not the seed")
    assert inst.seed_wheel(tmp_path, LANE) == (
        None, f"{fake} does not have the pinned sha256 {inst.SEEDS['2.20.2', '2.13.0+cu130', 'cp312'][:12]}...: "
              "not used")
    assert inst.seed_wheel(tmp_path, inst.Target("2.12.0+cu130", "13.0", "cp312")) == (
        None, "no seed is known for torch 2.12.0+cu130, cp312")
    assert inst.seed_wheel(tmp_path / "absent", LANE) == (None, f"no seed wheel in {tmp_path / 'absent'}")
    pinned = inst.SEEDS["2.20.2", "2.13.0+cu130", "cp312"]
    inst.SEEDS["2.20.2", "2.13.0+cu130", "cp312"] = hashlib.sha256(b"not the seed").hexdigest()
    try:
        assert inst.seed_wheel(tmp_path, LANE) == (fake, "")
    finally:
        inst.SEEDS["2.20.2", "2.13.0+cu130", "cp312"] = pinned


def test_the_shared_seed_matches_its_pin():
    seed = ROOT.parent / "shared" / "wheels" / WHEEL
    if not seed.is_file():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{seed} is absent; under CI the seed of the 3.12 lane's TE wheel cache is required")
        pytest.skip(f"{seed} is absent (a user's clone: the install builds TE from source)")
    assert inst.seed_wheel(seed.parent, LANE) == (seed, "")


def test_cache_is_keyed_by_torch_and_python(tmp_path, monkeypatch):
    monkeypatch.setenv("MVLM_WHEEL_CACHE", str(tmp_path / "cache"))
    cache = inst.cache_root() / LANE.key
    assert cache == tmp_path / "cache" / "2.13.0+cu130-cp312"
    src = tmp_path / WHEEL
    src.write_bytes(b"wheel")
    assert inst.cached_wheel(cache, LANE) is None
    assert inst.put_in_cache(src, cache) == cache / WHEEL
    assert (cache / WHEEL).stat().st_mode & 0o777 == 0o644  # readable by every user of a shared cache
    assert inst.cached_wheel(cache, LANE) == cache / WHEEL
    assert inst.cached_wheel(cache, inst.Target("2.13.0+cu130", "13.0", "cp313")) is None
    assert sorted(p.name for p in cache.iterdir()) == [WHEEL]  # no temporary file left


def test_a_build_that_cannot_work_says_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(inst.InstallError, match=r"^torch 2.13.0\+cpu is a CPU build: Transformer Engine's torch "
                                                r"extension needs a CUDA build of torch"):
        inst.toolchain(inst.Target("2.13.0+cpu", None, "cp311"))
    with pytest.raises(inst.InstallError, match=r"uses CUDA 12.4, for which no TE build is set up here \(known: "
                                                r"13.0\)"):
        inst.toolchain(inst.Target("2.6.0+cu124", "12.4", "cp312"))
    (tmp_path / "nvidia" / "cu13" / "include" / "crt").mkdir(parents=True)
    (tmp_path / "nvidia" / "cu13" / "include" / "crt" / "host_config.h").write_text("")
    assert inst.missing_cuda_headers([tmp_path]) == ["nv/target"]
    (tmp_path / "nvidia" / "cu13" / "include" / "nv").mkdir()
    (tmp_path / "nvidia" / "cu13" / "include" / "nv" / "target").write_text("")
    assert inst.missing_cuda_headers([tmp_path]) == []
    # the source build stops before compiling: headers missing after the pip installs, or no compiler
    monkeypatch.setattr(inst, "pip", lambda *a, **k: None)
    monkeypatch.setattr(inst, "site_dirs", lambda: [tmp_path / "empty"])
    monkeypatch.setattr(inst, "missing_build_prerequisites", lambda: [])
    with pytest.raises(inst.InstallError, match=r"^cannot build Transformer Engine's torch extension: the CUDA "
                                                r"headers crt/host_config.h, nv/target are missing under .*/empty/"
                                                r"nvidia/\*/include; install nvidia-cuda-nvcc==13.0.88 "
                                                r"nvidia-cuda-cccl==13.0.85$"):
        inst.build(LANE, tmp_path / "cache", None, 1)
    monkeypatch.undo()
    monkeypatch.setattr(inst.shutil, "which", lambda name: None)
    assert inst.missing_build_prerequisites()[0] == "a C++ compiler (g++: apt-get install g++)"


def test_the_cpu_torch_lane_is_refused_in_one_line(capsys):
    import torch

    if torch.version.cuda is not None:
        not_here("this torch is a CUDA build (the 3.12 lane)")
    assert inst.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: torch {torch.__version__} is a CPU build"), err
