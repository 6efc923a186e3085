#!/usr/bin/env python
"""Build the GPU kit: everything one prepared command on the lent GPU machine needs, in one folder of <= 60 MiB.

The lent GPU machine (bench/GPU.md) has Python 3.12 with its own CUDA build of torch, transformers, safetensors,
pytest and many common packages, but no megatron-core, no megatron-energon, no webdataset and no network; one
command there carries at most 64 MiB of files (the working tree plus carried paths). This tool owns the kit:

- ``wheels/``: the cp312 x86-64 wheels of megatron-core, megatron-energon and webdataset at the Python 3.12 lane's
  pins (``constraints/py312.txt``) and of their run-time dependencies that the GPU image does not have
  (:data:`GPU_IMAGE`: the image's package list, as KINDS.md records it), each at its pin, fetched from PyPI with
  ``pip download --python-version 3.12 --only-binary=:all: --no-deps``; the dependency tree is walked here from
  each wheel's own ``Requires-Dist`` (markers evaluated for CPython 3.12 on x86-64 Linux, no extras), less
  :data:`LEFT_OUT` (required but never imported by the run: s3fs and botocore). A wheel that needs another version
  of a package the image holds (:data:`IMAGE_VERSIONS`) is refused by name;
- ``te/`` (with ``--te DIR``): Transformer Engine for the H100/H200 (tools/build_te_sm90.py: PyPI's core wheel with
  only its sm_90 code, the torch extension built for the image's torch 2.11) and the dependencies it adds;
- ``project.tar.gz``: the project's tracked files at ``HEAD`` (``git archive``), so the kit runs without the tree,
  less what no GPU step reads (:data:`ARCHIVE_LEAVES_OUT`: the megatron-core fixtures, 4.7 MiB of 5.5);
- ``gpu_quick.sh``: the one script (a copy of bench/gpu_quick.sh), which installs the wheels with
  ``pip install --no-index --find-links`` and runs the measurements;
- ``KIT.json``: the pins, each file's size and SHA-256, the commit, and the sizes.

The run uses the image's own transformers, huggingface_hub, tokenizers and safetensors (5.17, 1.33, 0.23.2,
0.8.0; the project supports transformers>=5.0,<6) rather than carrying the lanes' newer pins (transformers alone is
13 MB, and the versions the carried copies would meet in the image, hf-xet, httpx, click ..., cannot be rehearsed
here). ``--check`` rehearses the GPU command on this CPU machine with nothing but what the GPU machine will have: a
fresh venv of the Python 3.12 lane's base interpreter that sees only the GPU image's packages (and their own
dependencies) from ``.venv-py312``, through a folder of links, with :data:`REHEARSED` at the image's exact versions
installed in front of them (from PyPI, cached); a copy of the kit outside the repository; and
``gpu_quick.sh --tiny --kit <copy>`` run from that copy (so the project comes from ``project.tar.gz`` and the
wheels from the kit). A missing wheel shows up as a failed ``install`` step or an ImportError, and an API the
image's transformers lacks as a failed step, before a GPU lease is spent on it. torch (2.13 here, 2.11 there) and
torchvision are the two differences it cannot rehearse.

It writes into a temporary folder next to ``--out`` and renames it into place at the end, so an interrupted run
leaves the old kit (or none), never half of one. It refuses (one line, exit 1) when the kit is over ``--max-mib``
(60) or when kit + travelling working tree is over the 64 MiB a device command carries.

  make gpu-kit                          # = .venv-py312/bin/python tools/gpu_kit.py
  python tools/gpu_kit.py --te /tmp/te-sm90/wheels    # with Transformer Engine (bench/GPU.md)
  python tools/gpu_kit.py --out .gpu_kit --max-mib 60
  .venv-py312/bin/python tools/gpu_kit.py --check     # rehearse the kit's script (--tiny) in an image-like venv
  python tools/gpu_kit.py --check --te .gpu_kit/te     # on the GPU machine: TE installs and imports (torch 2.11)

``--check --te DIR`` checks DIR's TE wheels (one of each, METADATA against the file name, one version, cp312, the
SHA-256s its README.md lists) and then, in the GPU image's Python 3.12 with its torch 2.11 (refused in one line
elsewhere: the lanes' torch is 2.13, and no CUDA torch is fetched here), installs them with the kit's te/ wheels
into a scratch venv over that Python's packages and imports ``transformer_engine.pytorch`` (which needs the image's
onnx and onnxscript and the carried nvdlfw-inspect); on a GPU it runs one ``te.Linear`` forward and backward.
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
#: required by a kit wheel, but never imported by the GPU run: left out of the kit (``--check`` runs the kit's script
#: without them). botocore alone is 16.6 MB, half of the kit.
LEFT_OUT = {
    "s3fs": "megatron-energon lists it but never imports it (its s3:// paths go through multi-storage-client)",
    "botocore": "s3fs's; multi-storage-client imports it only in its S3 providers, tensorboard only if present",
}
#: the GPU image's versions of the packages the project's code calls most (KINDS.md's pip list, read 2026-11): the kit
#: uses the image's copies (the project supports transformers>=5.0,<6), and ``--check`` rehearses with exactly these,
#: installed from PyPI into its venv in front of the lane's. torch and torchvision stay the lane's there (2.13/0.28:
#: the image's 2.11/0.26 are CUDA builds of 0.5 GB and up), so those two differences are not rehearsed.
IMAGE_VERSIONS = {"transformers": "5.17.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2",
                  "safetensors": "0.8.0", "torch": "2.11.0", "torchvision": "0.26.0"}
#: of those, what the rehearsal installs at the image's version (pure Python or small wheels)
REHEARSED = ("transformers", "huggingface-hub", "tokenizers", "safetensors")
#: tracked paths the kit's project.tar.gz leaves out: no step of bench/gpu_quick.sh reads them, and with them the kit
#: with Transformer Engine (55.2 MiB) and the 9.4 MiB working tree were 64.6 MiB, over the 64 a device command carries
ARCHIVE_LEAVES_OUT = {
    "tests/fixtures": "the megatron-core checkpoint fixtures (7.0 MB; 4.7 MiB of the archive's 5.5): the CPU suite's "
                      "cross-version and MoE-resume tests read them, no GPU step does",
}
#: the Transformer Engine wheels a kit may carry (``--te DIR``: tools/build_te_sm90.py's outputs)
TE_WHEELS = ("transformer_engine_cu13", "transformer_engine", "transformer_engine_torch")


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


def image_conflicts(whl: Path, carried=()) -> list[str]:
    """This wheel's run-time requirements on packages of :data:`IMAGE_VERSIONS` (not carried) that the image's
    version does not meet, as 'wheel needs req (image: version)'."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    env, out = marker_env(), []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            name = norm(req.name)
            if name in IMAGE_VERSIONS and name not in carried and (req.marker is None or req.marker.evaluate(env)) \
                    and not req.specifier.contains(IMAGE_VERSIONS[name], prereleases=True):
                out.append(f"{whl.name.split('-')[0]} needs {req} (image: {IMAGE_VERSIONS[name]})")
    return out


def collect_wheels(pins: dict[str, str], dest: Path, log, image=GPU_IMAGE, roots=ROOTS) -> dict[str, str]:
    """Download ``roots`` and the closure of their run-time dependencies that ``image`` lacks, each at its pin,
    except :data:`LEFT_OUT`; return {name: version}. A needed package without a pin, or a wheel that needs another
    version of a package the image holds (:data:`IMAGE_VERSIONS`), is an error naming it."""
    want, have = list(roots), {}
    while want:
        batch = []
        for name in dict.fromkeys(want):
            if name in have or name in image or NEVER.match(name) or name in LEFT_OUT:
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
    bad = [c for whl in sorted(dest.glob("*.whl")) for c in image_conflicts(whl)]
    if bad:
        raise KitError(f"{'; '.join(bad)}: the GPU machine's copy would not do; pin a version of the wheel that "
                       "accepts the image's, or carry the package (IMAGE_VERSIONS, GPU_IMAGE)")
    return dict(sorted(have.items()))


def project_archive(dest: Path) -> str:
    """The tracked files at HEAD as ``dest`` (tar.gz, prefix ``megatron-vlm/``), less :data:`ARCHIVE_LEAVES_OUT`;
    returns the commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        leave_out = [f":(exclude){p}" for p in ARCHIVE_LEAVES_OUT]
        subprocess.run(["git", "archive", "--format=tar.gz", "--prefix=megatron-vlm/", "-o", str(dest), "HEAD", "--",
                        ".", *leave_out], cwd=ROOT, check=True, capture_output=True)
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


def te_wheels(te_dir: Path) -> list[Path]:
    """The Transformer Engine wheels in ``te_dir``: one of each of :data:`TE_WHEELS`, or an error naming the gap."""
    found = {}
    for whl in sorted(te_dir.glob("*.whl")):
        found.setdefault(whl.name.split("-", 1)[0].lower(), []).append(whl)
    missing = [n for n in TE_WHEELS if len(found.get(n, [])) != 1]
    if missing:
        raise KitError(f"--te {te_dir} needs exactly one wheel of each of {', '.join(TE_WHEELS)}; "
                       f"{', '.join(missing)} missing or doubled (tools/build_te_sm90.py prune / torch-ext make them)")
    return [found[n][0] for n in TE_WHEELS]


def build(out: Path, constraints: Path, max_mib: float, log=print, tree_bytes: int | None = None,
          collect=collect_wheels, te_dir: Path | None = None) -> dict:
    """Write the kit to ``out`` (atomically: a temporary sibling renamed at the end); return KIT.json's content.
    With ``te_dir``, the kit also carries its Transformer Engine wheels in ``te/``, with their run-time dependencies
    that the image and the kit's other wheels lack."""
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
        te = {}
        if te_dir is not None:
            (tmp / "te").mkdir()
            for whl in te_wheels(te_dir):
                shutil.copyfile(whl, tmp / "te" / whl.name)
                te[norm(whl.name.split("-", 1)[0])] = whl.name.split("-")[1]
            needs = sorted({r for whl in (tmp / "te").glob("*.whl") for r in wheel_requires(whl)} - set(got))
            te.update(collect(pins, tmp / "te", log, image=GPU_IMAGE | set(got), roots=needs) if needs else {})
        commit = project_archive(tmp / "project.tar.gz")
        shutil.copyfile(script, tmp / "gpu_quick.sh")
        (tmp / "gpu_quick.sh").chmod(0o755)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"python": PY_VERSION, "constraints": str(constraints.relative_to(ROOT) if
                                                               constraints.is_relative_to(ROOT) else constraints),
                    "commit": commit, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wheels": got,
                    "te": te, "left_out": sorted(LEFT_OUT), "image_versions": IMAGE_VERSIONS,
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
        if te:
            log(f"Transformer Engine ({folder_bytes(out / 'te') / 2**20:.1f} MiB): "
                + ", ".join(f"{k}=={v}" for k, v in te.items()))
        log(f"wrote {out}: {kit_mib:.1f} MiB (limit {max_mib:g}); with the {tree / 2**20:.1f} MiB working tree "
            f"{kit_mib + tree / 2**20:.1f} of {TRAVEL_MIB:g} MiB a device command carries; "
            f"{time.perf_counter() - t0:.0f} s")
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def image_pinned_wheels(cache: Path, pins: dict[str, str]) -> list[Path]:
    """The wheels of :data:`REHEARSED` at the image's versions (:data:`IMAGE_VERSIONS`), and torchvision at the
    lane's pin in ``pins`` (the image has the torchvision of its torch; here the lane's torch runs, and transformers
    5.17's image processors need torchvision), downloaded once into ``cache``."""
    want = {n: IMAGE_VERSIONS[n] for n in REHEARSED}
    if "torchvision" in pins:
        want["torchvision"] = pins["torchvision"]
    have = {_dist_name(w): w for w in cache.glob("*.whl")} if cache.is_dir() else {}
    missing = [f"{n}=={v}" for n, v in want.items() if n not in have or f"-{v}-" not in have[n].name]
    if missing:
        cache.mkdir(parents=True, exist_ok=True)
        pip_download(missing, cache, print)
        have = {_dist_name(w): w for w in cache.glob("*.whl")}
    return [have[n] for n in want]


def image_like_venv(venv: Path, lane_site: Path, pinned: list[Path] = ()) -> Path:
    """A venv at ``venv`` that sees, of ``lane_site``'s distributions, only those of :data:`GPU_IMAGE` and their
    run-time dependencies (linked into ``venv/image``), with ``pinned`` wheels (the image's own versions of some of
    them) installed in front of those; returns its python."""
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
    pinned_names = {_dist_name(w) for w in pinned}
    if pinned:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                        "--no-deps", "--target", str(venv / "pinned"), *map(str, pinned)], check=True)
    for name in sorted(keep - pinned_names):
        for f in dists[name].files or []:
            top = f.parts[0]
            if top not in ("..", "bin") and not (image / top).exists() and (lane_site / top).exists():
                os.symlink(lane_site / top, image / top)
    if not (image / "pip").exists():  # the image has pip; this venv was made without it
        os.symlink(lane_site / "pip", image / "pip")
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "gpu_image.pth").write_text("".join(f"{d}\n" for d in (venv / "pinned", image) if d.is_dir()))
    return py


def check(kit_dir: Path, constraints: Path) -> int:
    """Run the kit's own script with --tiny in an image-like venv from a copy of the kit; its exit status."""
    if not (kit_dir / "KIT.json").is_file():
        raise KitError(f"no kit in {kit_dir}: run make gpu-kit first")
    if "%d.%d" % sys.version_info[:2] != PY_VERSION:
        raise KitError(f"--check needs the Python {PY_VERSION} lane's interpreter (.venv-py312/bin/python)")
    import sysconfig

    with tempfile.TemporaryDirectory(prefix="gpu-kit-check-") as tmp:
        tmp = Path(tmp)
        pinned = image_pinned_wheels(Path(os.environ.get("MVLM_WHEEL_CACHE") or Path.home() / ".cache" /
                                          "megatron-vlm" / "wheels") / "gpu-image", read_pins(constraints))
        py = image_like_venv(tmp / "venv", Path(sysconfig.get_paths()["purelib"]), pinned)
        print("rehearsing with the image's " + ", ".join(f"{n} {IMAGE_VERSIONS[n]}" for n in REHEARSED), flush=True)
        copy = tmp / "kit"
        shutil.copytree(kit_dir, copy)
        cmd = ["bash", str(copy / "gpu_quick.sh"), "--tiny", "--kit", str(copy), "--out", str(tmp / "out")]
        print("+", " ".join(cmd), flush=True)
        res = subprocess.run(cmd, cwd=tmp, env=dict(os.environ, PYTHON=str(py), TMPDIR=str(tmp), PYTHONPATH=""))
        print(f"gpu_kit --check: the kit's script {'passed' if res.returncode == 0 else 'FAILED'} with only the GPU "
              "image's packages and the kit's wheels (the image's " + ", ".join(REHEARSED) + "; this venv's torch "
              "and the rest)")
        return res.returncode


#: what ``import transformer_engine.pytorch`` needs besides torch and the TE wheels: the GPU image has onnx and
#: onnxscript, the kit's te/ carries nvdlfw-inspect (and pydantic ...)
TE_IMPORT_NEEDS = ("onnx", "onnxscript")
TE_CARRIED_NEEDS = ("nvdlfw-inspect",)
#: the check the scratch venv runs: TE imports against this torch, and on a GPU one TE layer runs forward and backward
TE_IMPORT_CHECK = """import torch, transformer_engine, transformer_engine.pytorch as te, transformer_engine_torch
print("torch", torch.__version__, "| transformer_engine", transformer_engine.__version__, "| cuda",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
if torch.cuda.is_available():
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    torch.cuda.synchronize()
    print("te.Linear forward and backward on", torch.cuda.get_device_name(), "ok")
"""


def _wheel_meta(whl: Path) -> dict:
    with zipfile.ZipFile(whl) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            raise KitError(f"{whl} holds no .dist-info/METADATA: not a wheel (rebuild it)")
        text = z.read(meta).decode("utf-8", "replace")
    return dict(ln.split(": ", 1) for ln in text.splitlines() if ln.startswith(("Name: ", "Version: ")))


def te_files_checked(te_dir: Path) -> list[Path]:
    """The TE wheels of ``te_dir`` (:func:`te_wheels`), checked: each a wheel whose METADATA names the project and
    version of its file name, the three at one version, the torch extension for CPython 3.12, and each wheel's
    SHA-256 the one ``te_dir``'s README.md lists for it (where it lists one: ../shared/wheels' READMEs do)."""
    wheels = te_wheels(te_dir)
    versions = {}
    for whl in wheels:
        meta = _wheel_meta(whl)
        name, version = whl.name.split("-")[:2]
        if norm(meta.get("Name", "")) != norm(name) or meta.get("Version") != version:
            raise KitError(f"{whl.name}: its METADATA says {meta.get('Name')} {meta.get('Version')}, not {name} "
                           f"{version}: the file was renamed or rebuilt wrongly")
        versions[whl.name] = version
    if len(set(versions.values())) != 1:
        raise KitError(f"the TE wheels in {te_dir} are of different versions ({', '.join(versions)}): take the three "
                       "from one build (tools/build_te_sm90.py)")
    ext = wheels[TE_WHEELS.index("transformer_engine_torch")]
    if f"-cp{PY_VERSION.replace('.', '')}-" not in ext.name:
        raise KitError(f"{ext.name} is not built for CPython {PY_VERSION}, the GPU image's Python")
    readme = te_dir / "README.md"
    listed = dict(re.findall(r"`([^`]+\.whl)`[^|]*\|\s*`([0-9a-f]{64})`", readme.read_text())) if readme.is_file() \
        else {}
    for whl in wheels:
        if whl.name in listed and sha256(whl) != listed[whl.name]:
            raise KitError(f"{whl} does not match the SHA-256 its README.md lists ({listed[whl.name][:12]}...): a "
                           "changed or truncated copy; fetch it again")
    return wheels


def te_check_plan(te_dir: Path, venv: Path, kit_dir: Path | None = None) -> list[list[str]]:
    """The commands of ``--check --te``: a scratch venv over this Python's packages (the GPU image's torch, onnx,
    onnxscript), the TE wheels of ``te_dir`` and every other wheel there and in the kit's te/ installed into it
    (``--no-index --no-deps --ignore-installed``: pip then removes nothing of this Python's), and the import check."""
    wheels = {norm(w.name.split("-", 1)[0]): w for w in te_files_checked(te_dir)}
    for folder in (te_dir, *([kit_dir / "te"] if kit_dir and (kit_dir / "te").is_dir() else [])):
        for whl in sorted(folder.glob("*.whl")):
            wheels.setdefault(norm(whl.name.split("-", 1)[0]), whl)
    missing = [n for n in TE_CARRIED_NEEDS if n not in wheels]
    if missing:
        raise KitError(f"no wheel of {', '.join(missing)} in {te_dir} or the kit's te/ (TE's import needs it): build "
                       "the kit with --te (make gpu-kit TE=...) and pass --te .gpu_kit/te")
    py = venv / "bin" / "python"
    return [[sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
            [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
             "--ignore-installed", "--no-compile", *map(str, wheels.values())],
            [str(py), "-c", TE_IMPORT_CHECK]]


def te_refusal(torch_version: str | None, python: str, has=None) -> str | None:
    """Why ``--check --te`` cannot run in this Python (one line), or None: the extension is for the GPU image's
    Python and torch (:data:`IMAGE_VERSIONS`), and TE's import needs :data:`TE_IMPORT_NEEDS` there."""
    import importlib.util

    has = has or (lambda m: importlib.util.find_spec(m) is not None)
    want = IMAGE_VERSIONS["torch"]
    if python != PY_VERSION:
        return f"--check --te needs Python {PY_VERSION} (the GPU image's; the extension is cp312), this is {python}"
    if torch_version is None or torch_version.split("+")[0] != want:
        return (f"--check --te: the Transformer Engine torch extension is built for torch {want} (the GPU image's), "
                f"this Python has torch {torch_version or 'none'}: run it on the GPU machine (python "
                f"tools/gpu_kit.py --check --te .gpu_kit/te), or build the extension for this torch "
                f"(tools/build_te_sm90.py torch-ext --torch {(torch_version or want).split('+')[0]})")
    lacking = [m for m in TE_IMPORT_NEEDS if not has(m)]
    if lacking:
        return f"--check --te: import transformer_engine.pytorch needs {', '.join(lacking)}, which this Python lacks " \
               "(the GPU image has them): run it on the GPU machine"
    return None


def check_te(te_dir: Path, kit_dir: Path | None, run=subprocess.run) -> int:
    """``--check --te DIR``: the files checked, then (on the GPU machine: its Python 3.12 and torch 2.11) the TE
    wheels installed into a scratch venv and ``import transformer_engine.pytorch`` (a TE layer run on its GPU);
    refused in one line where this Python is not the image's. Exit status of the import check."""
    import importlib.metadata as md

    if not te_dir.is_dir():
        raise KitError(f"--te {te_dir} is not a folder: pass the TE wheels' folder (../shared/wheels/te-sm90-torch2.11 "
                       "or a kit's te/)")
    te_files_checked(te_dir)
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = None
    why = te_refusal(torch_version, "%d.%d" % sys.version_info[:2])
    if why:
        raise KitError(why)
    with tempfile.TemporaryDirectory(prefix="gpu-kit-te-") as tmp:
        for cmd in te_check_plan(te_dir, Path(tmp) / "venv", kit_dir):
            print("+", " ".join(cmd[:3] + ["..."] if cmd[1] == "-c" else cmd), flush=True)
            res = run(cmd)
            if res.returncode:
                print(f"gpu_kit --check --te: FAILED (exit {res.returncode})")
                return res.returncode
    print(f"gpu_kit --check --te: Transformer Engine from {te_dir} imports against torch {torch_version}")
    return 0


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".gpu_kit", help="kit folder, ignored by git (default: "
                   ".gpu_kit)")
    p.add_argument("--constraints", type=Path, default=ROOT / "constraints" / "py312.txt",
                   help="pins of the Python 3.12 lane (default: constraints/py312.txt)")
    p.add_argument("--max-mib", type=float, default=MAX_MIB, help=f"refuse a kit over this (default {MAX_MIB:g})")
    p.add_argument("--te", type=Path, default=None, metavar="DIR", help="also carry the Transformer Engine wheels in "
                   "DIR (transformer_engine_cu13 pruned to sm_90, transformer_engine, transformer_engine_torch built "
                   "for the image's torch: tools/build_te_sm90.py) and their dependencies, in the kit's te/")
    p.add_argument("--check", action="store_true", help="build nothing: rehearse the kit at --out (its script, "
                   "--tiny) in a venv that has only the GPU image's packages; exit status of that run. With --te DIR: "
                   "check DIR's TE wheels, install them into a scratch venv over this Python's torch (the GPU "
                   "image's 2.11; refused elsewhere) and import transformer_engine.pytorch")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    try:
        import packaging.requirements  # noqa: F401
    except ImportError:
        raise KitError(f"{sys.executable} has no 'packaging': run with the project's venv "
                       "(make gpu-kit uses .venv-py312/bin/python)") from None
    if a.check and a.te:
        return check_te(a.te.resolve(), a.out.resolve())
    if a.check:
        return check(a.out.resolve(), a.constraints.resolve())
    build(a.out, a.constraints.resolve(), a.max_mib, te_dir=a.te.resolve() if a.te else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
