#!/usr/bin/env python3
"""Install Transformer Engine into the running Python's environment (``make venv`` runs it in the 3.12 lane).

Transformer Engine (TE) comes in three parts: ``transformer-engine`` (its Python code) and
``transformer-engine-cu13`` (the CUDA library) are wheels on PyPI; ``transformer-engine-torch``, the torch
extension, is an sdist only, and must be compiled against the exact torch it will run with. This script compiles
it once per machine and keeps the wheel in a cache outside the repository, so ``make clean`` and fresh clones
reuse it:

    $MVLM_WHEEL_CACHE (default: ~/.cache/megatron-vlm/wheels) / <torch version>-<python tag> / *.whl

The torch extension wheel is taken from, in this order:

1. that cache;
2. a seed folder (``$MVLM_WHEEL_SEED``, default ``../shared/wheels`` next to the repository, as on CI machines),
   only for a wheel listed in :data:`SEEDS`: built for this exact torch and Python, with the pinned sha256;
3. a build from source (10 minutes on an idle 2-core machine, 18 CPU-minutes; 40 on a busy one), after checking
   that what it needs is here: a CUDA build of torch, a C++ compiler, Python's headers, and the CUDA headers
   (``crt/host_config.h``, ``nv/target``), which the pinned ``nvidia-cuda-nvcc`` / ``nvidia-cuda-cccl`` wheels
   supply.

Then all three parts are installed with pip (the torch extension only from the cache, never built by pip) and
``import transformer_engine.pytorch`` is checked. Anything missing stops it with one line naming it and the fix.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TE_VERSION = "2.20.2"
REPO = Path(__file__).resolve().parent.parent

# Prebuilt torch-extension wheels that may seed the cache: (TE version, torch version, python tag) -> sha256.
# A seed for another torch or Python is never used: the extension is only valid for the torch it was built with.
SEEDS = {
    ("2.20.2", "2.13.0+cu130", "cp312"): "b37b72ae7b4b9c5be9cab874e61bc6be49af0e6dae7702d8405df4a5ff155441",
}

# CUDA major.minor of torch -> (TE core wheel extra, the wheels that supply nvcc's headers for the build).
CUDA_TOOLCHAINS = {
    "13.0": ("core-cu13", ["nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-cccl==13.0.85"]),
}
BUILD_TOOLS = ["wheel", "ninja"]
# Headers the extension's C++ sources include from the CUDA toolkit (without them g++ fails midway).
CUDA_HEADERS = ("crt/host_config.h", "nv/target")
BUILD_ENV = {
    "NVTE_FRAMEWORK": "pytorch",
    "NVTE_PYTORCH_FORCE_BUILD": "TRUE",  # never try TE's download of a prebuilt wheel (no internet; wrong torch)
    "NVTE_WITH_NCCL_EP": "0",
    "NVTE_BUILD_USE_NVIDIA_WHEELS": "1",  # CUDA headers from the nvidia-* wheels, no CUDA toolkit needed
}


class InstallError(RuntimeError):
    """What is missing, and the fix (printed as one line)."""


@dataclass(frozen=True)
class Target:
    """What the torch extension wheel must match."""

    torch_version: str  # e.g. 2.13.0+cu130
    cuda: str | None  # torch.version.cuda, None for a CPU build of torch
    python_tag: str  # e.g. cp312

    @property
    def key(self) -> str:
        return f"{self.torch_version}-{self.python_tag}"

    @property
    def wheel_glob(self) -> str:
        return f"transformer_engine_torch-{TE_VERSION}-{self.python_tag}-{self.python_tag}-*.whl"


def current_target() -> Target:
    import torch

    return Target(torch.__version__, torch.version.cuda, f"cp{sys.version_info[0]}{sys.version_info[1]}")


def cache_root() -> Path:
    if os.environ.get("MVLM_WHEEL_CACHE"):
        return Path(os.environ["MVLM_WHEEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "megatron-vlm" / "wheels"


def seed_dir() -> Path:
    return Path(os.environ.get("MVLM_WHEEL_SEED") or REPO.parent / "shared" / "wheels")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cached_wheel(cache: Path, target: Target) -> Path | None:
    found = sorted(cache.glob(target.wheel_glob))
    return found[0] if found else None


def seed_wheel(seeds: Path, target: Target) -> tuple[Path | None, str]:
    """(a verified seed wheel for ``target`` or None, why not)."""
    want = SEEDS.get((TE_VERSION, target.torch_version, target.python_tag))
    if want is None:
        return None, f"no seed is known for torch {target.torch_version}, {target.python_tag}"
    found = sorted(seeds.glob(target.wheel_glob)) if seeds.is_dir() else []
    if not found:
        return None, f"no seed wheel in {seeds}"
    for path in found:
        if sha256(path) == want:
            return path, ""
    return None, f"{found[0]} does not have the pinned sha256 {want[:12]}...: not used"


def put_in_cache(wheel: Path, cache: Path) -> Path:
    """Copy ``wheel`` into ``cache`` atomically (a concurrent install never sees half a file)."""
    cache.mkdir(parents=True, exist_ok=True)
    dst = cache / wheel.name
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tmp-", suffix=".whl")
    os.close(fd)
    try:
        shutil.copyfile(wheel, tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache's wheel from other users
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


def toolchain(target: Target) -> tuple[str, list[str]]:
    if target.cuda is None:
        raise InstallError(
            f"torch {target.torch_version} is a CPU build: Transformer Engine's torch extension needs a CUDA build "
            "of torch (PyPI's default torch on Linux); install that torch, or use the 3.11 lane without TE")
    cuda = ".".join(target.cuda.split(".")[:2])
    if cuda not in CUDA_TOOLCHAINS:
        raise InstallError(f"torch {target.torch_version} uses CUDA {cuda}, for which no TE build is set up here "
                           f"(known: {', '.join(CUDA_TOOLCHAINS)}); use the lane's pinned torch "
                           "(constraints/py312.txt)")
    return CUDA_TOOLCHAINS[cuda]


def missing_build_prerequisites() -> list[str]:
    """What a source build needs from the machine (not from pip), each with its fix."""
    missing = []
    if not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")):
        missing.append("a C++ compiler (g++: apt-get install g++)")
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
        missing.append(f"Python's headers ({include}/Python.h: apt-get install python{ver}-dev)")
    return missing


def missing_cuda_headers(sites: list[Path]) -> list[str]:
    """The CUDA headers of :data:`CUDA_HEADERS` not found under any ``nvidia/*/include`` of ``sites``."""
    roots = []
    for site in sites:
        nvidia = site / "nvidia"
        if nvidia.is_dir():
            roots += [p for p in nvidia.glob("*/include") if p.is_dir()]
            roots += [p for p in nvidia.glob("*/*/include") if p.is_dir()]
    return [h for h in CUDA_HEADERS if not any((r / h).exists() for r in roots)]


def site_dirs() -> list[Path]:
    """This environment's site-packages folders (where the nvidia-* wheels put their headers)."""
    return sorted({Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])})


def pip(*args: str, constraints: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", *(["-c", str(constraints)] if constraints else []), *args]
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        raise InstallError(f"pip could not install {' '.join(a for a in args if not a.startswith('-'))} "
                           "(its output is above)")


def build(target: Target, cache: Path, constraints: Path | None, jobs: int) -> Path:
    """Compile the torch extension from PyPI's sdist against this torch; returns the cached wheel."""
    core, headers = toolchain(target)
    missing = missing_build_prerequisites()
    if missing:
        raise InstallError("cannot build Transformer Engine's torch extension: missing " + "; ".join(missing))
    pip("--no-deps", f"transformer-engine=={TE_VERSION}", f"transformer-engine-{core.split('-')[1]}=={TE_VERSION}",
        constraints=constraints)
    pip(*BUILD_TOOLS, *headers, "einops", "nvidia-cudnn-frontend", constraints=constraints)
    site = site_dirs()
    lost = missing_cuda_headers(site)
    if lost:
        raise InstallError(f"cannot build Transformer Engine's torch extension: the CUDA headers {', '.join(lost)} "
                           f"are missing under {site[0]}/nvidia/*/include; install {' '.join(headers)}")
    cache.mkdir(parents=True, exist_ok=True)
    print(f"building transformer-engine-torch {TE_VERSION} for torch {target.torch_version} ({target.python_tag}) "
          f"with {jobs} jobs: this takes 10-40 minutes on 2 cores (18 CPU-minutes), once per machine", flush=True)
    start = time.time()
    with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as out:
        env = {**os.environ, **BUILD_ENV, "MAX_JOBS": str(jobs)}
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-binary",
               "transformer-engine-torch", f"transformer-engine-torch=={TE_VERSION}", "-w", out]
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd, env=env).returncode:
            raise InstallError("the build of transformer-engine-torch failed (its output is above)")
        built = sorted(Path(out).glob(target.wheel_glob))
        if not built:
            raise InstallError(f"the build wrote no {target.wheel_glob} in {out}")
        wheel = put_in_cache(built[0], cache)
    print(f"built {wheel.name} in {(time.time() - start) / 60:.1f} min -> {cache}", flush=True)
    return wheel


def install(constraints: Path | None, jobs: int) -> None:
    target = current_target()
    core, _ = toolchain(target)
    cache = cache_root() / target.key
    wheel = cached_wheel(cache, target)
    if wheel is not None:
        print(f"transformer-engine-torch: cached {wheel}")
    else:
        seed, why = seed_wheel(seed_dir(), target)
        if seed is not None:
            wheel = put_in_cache(seed, cache)
            print(f"transformer-engine-torch: seed {seed} (sha256 verified) -> {cache}")
        else:
            print(f"transformer-engine-torch: nothing cached in {cache}, {why}: building from source")
            wheel = build(target, cache, constraints, jobs)
    # The extension only from the cache (--only-binary: pip never starts its own 40-minute build).
    pip("--find-links", str(cache), "--only-binary", "transformer-engine-torch",
        f"transformer-engine[{core},pytorch]=={TE_VERSION}", f"transformer-engine-torch=={TE_VERSION}",
        constraints=constraints)
    # torch first, as every user of TE does: TE's core library needs libnccl.so.2, which torch's import loads
    # (from the nvidia-nccl wheel); TE imported alone looks for NCCL in the CUDA toolkit only.
    check = subprocess.run([sys.executable, "-c", "import torch, transformer_engine.pytorch"], capture_output=True,
                           text=True)
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise InstallError(f"Transformer Engine is installed but does not import ({last}); if the cached wheel "
                           f"{wheel} is stale, delete it and run again to rebuild")
    print(f"Transformer Engine {TE_VERSION} imports (torch {target.torch_version})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                epilog="Environment: MVLM_WHEEL_CACHE (wheel cache root), MVLM_WHEEL_SEED (seed "
                                       "folder), MAX_JOBS (parallel compile jobs for a build).")
    p.add_argument("--constraints", type=Path, help="pip constraints file (the lane's constraints/pyXY.txt)")
    p.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1),
                   help="parallel compile jobs for a source build (default: MAX_JOBS, else the CPU count)")
    args = p.parse_args(argv)
    try:
        install(args.constraints, args.jobs)
    except InstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
