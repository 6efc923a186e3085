#!/usr/bin/env python
"""Build the GPU kit: everything one prepared command on the lent GPU machine needs, in one folder of <= 60 MiB.

The lent GPU machine (bench/GPU.md) has Python 3.12 with its own CUDA build of torch, transformers, safetensors,
pytest and many common packages, but no megatron-core, no megatron-energon, no webdataset and no network; one
command there carries at most 64 MiB of files (the working tree plus carried paths). This tool owns the kit:

- ``wheels/``: the cp312 x86-64 wheels of megatron-core, megatron-energon and webdataset at the Python 3.12 lane's
  pins (``constraints/py312.txt``) and of their run-time dependencies that the GPU image does not have
  (:data:`GPU_IMAGE`: the image's package list, as KINDS.md records it), each at its pin, fetched from PyPI with
  ``pip download --python-version 3.12 --only-binary=:all: --no-deps``; the dependency tree is walked here from
  each wheel's own ``Requires-Dist`` (markers evaluated for CPython 3.12 on x86-64 Linux, no extras);
- ``project.tar.gz``: the project's tracked files at ``HEAD`` (``git archive``), so the kit runs without the tree;
- ``gpu_quick.sh``: the one script (a copy of bench/gpu_quick.sh), which installs the wheels with
  ``pip install --no-index --find-links`` and runs the measurements;
- ``KIT.json``: the pins, each file's size and SHA-256, the commit, and the sizes.

``--check`` then rehearses the GPU command on this CPU machine with nothing but what the GPU machine will have: a
fresh venv of the Python 3.12 lane's base interpreter that sees only the GPU image's packages (and their own
dependencies) from ``.venv-py312``, through a folder of links; a copy of the kit outside the repository; and
``gpu_quick.sh --tiny --kit <copy>`` run from that copy (so the project comes from ``project.tar.gz`` and the
wheels from the kit). A missing wheel shows up as a failed ``install`` step or an ImportError, before a GPU lease
is spent on it (the image's versions differ from this venv's: that part it cannot rehearse).

It writes into a temporary folder next to ``--out`` and renames it into place at the end, so an interrupted run
leaves the old kit (or none), never half of one. It refuses (one line, exit 1) when the kit is over ``--max-mib``
(60) or when kit + travelling working tree is over the 64 MiB a device command carries.

  make gpu-kit                          # = .venv-py312/bin/python tools/gpu_kit.py
  python tools/gpu_kit.py --out .gpu_kit --max-mib 60
  .venv-py312/bin/python tools/gpu_kit.py --check     # rehearse the kit's script (--tiny) in an image-like venv
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY_VERSION = "3.12"
ROOTS = ("megatron-core", "megatron-energon", "webdataset")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64")
MAX_MIB = 60.0
#: what one device command may carry in all (the working tree + carried paths), MiB
TRAVEL_MIB = 64.0
#: Python packages the GPU machine's image already holds (/work/.library/device/KINDS.md, read 2026-11-17); the
#: kit brings none of them: their versions there are the ones that run (torch, CUDA, transformers above all).
GPU_IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
#: never carried whatever the image holds: the GPU machine's own CUDA stack must win
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|transformer-engine.*)$")


class KitError(SystemExit):
    """A refusal: one line on stderr, exit status 1."""

    def __init__(self, msg: str):
        super().__init__(f"gpu_kit: {msg}")


def norm(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """{normalised name: version} of the ``name==version`` lines of a constraints file."""
    if not path.is_file():
        raise KitError(f"no constraints file {path}: pass --constraints constraints/py312.txt")
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[norm(name.split("[", 1)[0])] = version.strip().split(";", 1)[0].strip()
    return pins


def marker_env() -> dict:
    """PEP 508 marker environment of the GPU machine's Python (CPython 3.12, Linux, x86-64), no extra."""
    from packaging.markers import default_environment

    return dict(default_environment(), python_version=PY_VERSION, python_full_version=PY_VERSION + ".3",
                implementation_name="cpython", platform_python_implementation="CPython", sys_platform="linux",
                platform_system="Linux", platform_machine="x86_64", os_name="posix", extra="")


def wheel_requires(whl: Path) -> list[str]:
    """Names this wheel needs at run time on the GPU machine (its Requires-Dist, markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    env = marker_env()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(norm(req.name))
    return out


def pip_download(specs: list[str], dest: Path, log) -> None:
    """``pip download`` cp312 x86-64 binaries of ``specs`` (no dependencies) into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
           "--python-version", PY_VERSION, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += specs
    log(f"+ pip download ... {' '.join(specs)}")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        lines = [ln for ln in (res.stderr + res.stdout).splitlines() if ln.startswith("ERROR")] or \
            res.stderr.splitlines()[-2:]
        raise KitError(f"pip download {' '.join(specs)} failed: {' / '.join(lines)[:400]} (PyPI reachable? pins in "
                       "the constraints file right?)")


def _dist_name(whl: Path) -> str:
    return norm(whl.name.split("-", 1)[0])


def collect_wheels(pins: dict[str, str], dest: Path, log, image=GPU_IMAGE) -> dict[str, str]:
    """Download ROOTS and the closure of their run-time dependencies that ``image`` lacks, each at its pin;
    return {name: version}. A needed package without a pin is an error naming it."""
    want, have = list(ROOTS), {}
    while want:
        batch = []
        for name in dict.fromkeys(want):
            if name in have or name in image or NEVER.match(name):
                continue
            if name not in pins:
                raise KitError(f"{name} is needed on the GPU machine but has no pin in the constraints file: add "
                               f"'{name}==<version>' to it")
            batch.append(name)
        want = []
        if not batch:
            break
        before = set(dest.glob("*.whl"))
        pip_download([f"{n}=={pins[n]}" for n in batch], dest, log)
        for whl in set(dest.glob("*.whl")) - before:
            name = _dist_name(whl)
            have[name] = pins.get(name, "?")
            want += wheel_requires(whl)
        missing = [n for n in batch if n not in have]
        if missing:
            raise KitError(f"pip download brought no wheel for {', '.join(missing)}")
    return dict(sorted(have.items()))


def project_archive(dest: Path) -> str:
    """The tracked files at HEAD as ``dest`` (tar.gz, prefix ``megatron-vlm/``); returns the commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        subprocess.run(["git", "archive", "--format=tar.gz", "--prefix=megatron-vlm/", "-o", str(dest), "HEAD"],
                       cwd=ROOT, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise KitError(f"git archive of {ROOT} failed ({e}): run this in the project's git checkout") from None
    return commit


def travelling_tree_bytes() -> int:
    """Bytes of the working tree that a device command carries besides the kit (tracked + untracked, not ignored)."""
    res = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True)
    total = 0
    for rel in res.stdout.decode(errors="replace").split("\0"):
        p = ROOT / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(out: Path, constraints: Path, max_mib: float, log=print, tree_bytes: int | None = None,
          collect=collect_wheels) -> dict:
    """Write the kit to ``out`` (atomically: a temporary sibling renamed at the end); return KIT.json's content."""
    script = ROOT / "bench" / "gpu_quick.sh"
    if not script.is_file():
        raise KitError(f"{script} is missing: the kit's script is a copy of it")
    pins = read_pins(constraints)
    for name in ROOTS:
        if name not in pins:
            raise KitError(f"{constraints} pins no {name}: add '{name}==<version>'")
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # a sibling ignored by the same .gitignore line as the kit (/.gpu_kit*), so it never travels
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        (tmp / "wheels").mkdir()
        got = collect(pins, tmp / "wheels", log)
        commit = project_archive(tmp / "project.tar.gz")
        shutil.copyfile(script, tmp / "gpu_quick.sh")
        (tmp / "gpu_quick.sh").chmod(0o755)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"python": PY_VERSION, "constraints": str(constraints.relative_to(ROOT) if
                                                               constraints.is_relative_to(ROOT) else constraints),
                    "commit": commit, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wheels": got,
                    "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
                              for p in files}}
        kit_bytes = folder_bytes(tmp)
        manifest["kit_mib"] = round(kit_bytes / 2**20, 2)
        tree = travelling_tree_bytes() if tree_bytes is None else tree_bytes
        manifest["tree_mib"] = round(tree / 2**20, 2)
        (tmp / "KIT.json").write_text(json.dumps(manifest, indent=1) + "\n")
        kit_mib = folder_bytes(tmp) / 2**20
        if kit_mib > max_mib:
            raise KitError(f"the kit is {kit_mib:.1f} MiB, over --max-mib {max_mib:g}: drop a wheel from ROOTS or its "
                           "dependencies, or add the package to GPU_IMAGE if the GPU machine has it")
        if kit_mib + tree / 2**20 > TRAVEL_MIB:
            raise KitError(f"kit {kit_mib:.1f} MiB + working tree {tree / 2**20:.1f} MiB is over the {TRAVEL_MIB:g} "
                           "MiB a device command carries: shrink the tree (untracked files?) or the kit")
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
        log(f"{len(got)} wheels: " + ", ".join(f"{k}=={v}" for k, v in got.items()))
        log(f"wrote {out}: {kit_mib:.1f} MiB (limit {max_mib:g}); with the {tree / 2**20:.1f} MiB working tree "
            f"{kit_mib + tree / 2**20:.1f} of {TRAVEL_MIB:g} MiB a device command carries; "
            f"{time.perf_counter() - t0:.0f} s")
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def image_like_venv(venv: Path, lane_site: Path) -> Path:
    """A venv at ``venv`` that sees, of ``lane_site``'s distributions, only those of :data:`GPU_IMAGE` and their
    run-time dependencies (linked into ``venv/image``); returns its python."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    dists = {norm(d.metadata["Name"]): d for d in md.distributions(path=[str(lane_site)])}
    env, keep, todo = marker_env(), set(), [n for n in dists if n in GPU_IMAGE]
    while todo:
        name = todo.pop()
        if name in keep or name not in dists:
            continue
        keep.add(name)
        for r in dists[name].requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(norm(req.name))
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    image = venv / "image"
    image.mkdir()
    for name in sorted(keep):
        for f in dists[name].files or []:
            top = f.parts[0]
            if top not in ("..", "bin") and not (image / top).exists() and (lane_site / top).exists():
                os.symlink(lane_site / top, image / top)
    if not (image / "pip").exists():  # the image has pip; this venv was made without it
        os.symlink(lane_site / "pip", image / "pip")
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "gpu_image.pth").write_text(str(image) + "\n")
    return py


def check(kit_dir: Path) -> int:
    """Run the kit's own script with --tiny in an image-like venv from a copy of the kit; its exit status."""
    if not (kit_dir / "KIT.json").is_file():
        raise KitError(f"no kit in {kit_dir}: run make gpu-kit first")
    if "%d.%d" % sys.version_info[:2] != PY_VERSION:
        raise KitError(f"--check needs the Python {PY_VERSION} lane's interpreter (.venv-py312/bin/python)")
    import sysconfig

    with tempfile.TemporaryDirectory(prefix="gpu-kit-check-") as tmp:
        tmp = Path(tmp)
        py = image_like_venv(tmp / "venv", Path(sysconfig.get_paths()["purelib"]))
        copy = tmp / "kit"
        shutil.copytree(kit_dir, copy)
        cmd = ["bash", str(copy / "gpu_quick.sh"), "--tiny", "--kit", str(copy), "--out", str(tmp / "out")]
        print("+", " ".join(cmd), flush=True)
        res = subprocess.run(cmd, cwd=tmp, env=dict(os.environ, PYTHON=str(py), TMPDIR=str(tmp), PYTHONPATH=""))
        print(f"gpu_kit --check: the kit's script {'passed' if res.returncode == 0 else 'FAILED'} with only the GPU "
              "image's packages and the kit's wheels (versions: this venv's, not the image's)")
        return res.returncode


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".gpu_kit", help="kit folder, ignored by git (default: "
                   ".gpu_kit)")
    p.add_argument("--constraints", type=Path, default=ROOT / "constraints" / "py312.txt",
                   help="pins of the Python 3.12 lane (default: constraints/py312.txt)")
    p.add_argument("--max-mib", type=float, default=MAX_MIB, help=f"refuse a kit over this (default {MAX_MIB:g})")
    p.add_argument("--check", action="store_true", help="build nothing: rehearse the kit at --out (its script, "
                   "--tiny) in a venv that has only the GPU image's packages; exit status of that run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    try:
        import packaging.requirements  # noqa: F401
    except ImportError:
        raise KitError(f"{sys.executable} has no 'packaging': run with the project's venv "
                       "(make gpu-kit uses .venv-py312/bin/python)") from None
    if a.check:
        return check(a.out.resolve())
    build(a.out, a.constraints.resolve(), a.max_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
