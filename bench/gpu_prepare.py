#!/usr/bin/env python
"""Bring this project's software stack to a GPU machine that cannot reach a package registry.

The lent GPU machines (see bench/GPU.md) run Python 3.12 with their own CUDA build of torch, and nothing outside
them can be reached; a command there may carry at most 64 MiB of files. So the stack is prepared here, on the
CPU machine, and carried over in parts:

``python bench/gpu_prepare.py cpu [--out .whl]`` (CPU machine, reaches PyPI) downloads, for Python 3.12 on
x86-64 Linux and with pip's own ``download`` command:

- the wheels of megatron-core, megatron-energon, webdataset and their dependencies, at the versions installed in
  this project's Python 3.12 lane (``.venv-py312``: megatron-core 0.19, known to work together; the command
  refuses to run under another Python), except torch, triton and NVIDIA's CUDA libraries, which
  the GPU machine's torch brings;
- Transformer Engine for CUDA 13: the Python wheel ``transformer_engine`` and the core library wheel
  ``transformer_engine_cu13``;
- the source of ``transformer_engine_torch`` (it is published only as source and must be compiled against the
  GPU machine's torch). pip cannot prepare its metadata without torch and CUDA, so the download is run with
  ``--no-clean`` and the unpacked source that pip leaves behind is packed up.

All of it goes into one tar archive that is split into parts of at most 55 MB: ``<out>/parts/part-000`` ...
(``<out>`` is ignored by git). ``<out>/parts/MANIFEST.json`` lists the parts with their SHA-256.

``python bench/gpu_prepare.py stash`` (GPU machine, one run per part) copies the carried part(s) found under
``.whl/parts/`` into ``--stash`` (default ``/tmp/mvlm_stash``), which survives between runs while the machine
stays warm.

``python bench/gpu_prepare.py gpu`` (GPU machine) checks the parts against the manifest, reassembles and unpacks
them, installs the wheels that the machine does not already have with ``pip install --no-deps --target``
(default ``/tmp/mvlm_site``), and builds ``transformer_engine_torch`` from its source with
``NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=16 pip install --no-build-isolation --no-deps --target``.
It prints the ``PYTHONPATH`` to use and checks that ``transformer_engine.pytorch`` and megatron-core import.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PART_BYTES = 55 * 1000 * 1000
PY_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64")
TE_VERSION = "2.20.2"
ROOTS = ("megatron-core", "megatron-energon", "webdataset")
# The GPU machine's torch brings these (and its own versions must win).
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|setuptools|pip|wheel)$")
STASH = "/tmp/mvlm_stash"
TARGET = "/tmp/mvlm_site"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots=ROOTS) -> dict[str, str]:
    """{distribution: installed version} for ``roots`` and their run-time dependencies in this environment."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = dict(default_environment(), python_version=PY_VERSION, python_full_version=PY_VERSION + ".3",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64", extra="")
    out: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = _norm(todo.pop())
        if name in out or NEVER.match(name):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is needed but not installed in this environment ({sys.executable}); "
                             "run this command with the project's venv") from None
        out[name] = dist.version
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return out


def _pip(args: list[str], **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kw)


def _binary_args() -> list[str]:
    a = ["--only-binary", ":all:", "--python-version", PY_VERSION, "--implementation", "cp", "--no-deps"]
    for p in PLATFORMS:
        a += ["--platform", p]
    return a


def _te_torch_source(dest: Path, work: Path) -> Path:
    """Download and unpack the transformer_engine_torch sdist; return the source directory (a tar.gz in dest)."""
    tmp = work / "pip-tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    # Metadata preparation fails (no torch/CUDA here) after pip unpacked the source; --no-clean keeps it.
    res = _pip(["download", "--no-deps", "--no-binary", ":all:", "--no-clean", "-v", "-d", str(work / "sdist"),
                f"transformer_engine_torch=={TE_VERSION}"], env=env, capture_output=True, text=True)
    found = [p.parent for p in tmp.rglob("setup.py") if p.parent.parent.name.startswith("pip-")
             or (p.parent / "PKG-INFO").is_file()]
    found = [d for d in found if "transformer_engine_torch" in (d / "PKG-INFO").read_text(errors="replace")] \
        if found else []
    if not found:
        sys.stdout.write(res.stdout[-3000:] + res.stderr[-3000:])
        raise SystemExit("pip left no transformer_engine_torch source behind; see its output above")
    src = min(found, key=lambda d: len(d.parts))
    out = dest / f"transformer_engine_torch-{TE_VERSION}-src.tar.gz"
    def skip_built(info):  # byte code pip's failed metadata step left behind
        return None if "__pycache__" in info.name or info.name.endswith(".egg-info") else info

    with tarfile.open(out, "w:gz") as tf:
        tf.add(src, arcname=f"transformer_engine_torch-{TE_VERSION}", filter=skip_built)
    print(f"transformer_engine_torch source: {sum(1 for _ in src.rglob('*'))} files from {src} -> {out.name}")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split(archive: Path, parts_dir: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut ``archive`` into ``parts_dir/part-000`` ... of at most ``part_bytes``; write MANIFEST.json."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(archive, "rb") as f:
        while chunk := f.read(part_bytes):
            p = parts_dir / f"part-{len(parts):03d}"
            p.write_bytes(chunk)
            parts.append(p)
    manifest = {"archive": archive.name, "sha256": _sha256(archive), "size": archive.stat().st_size,
                "parts": [{"name": p.name, "size": p.stat().st_size, "sha256": _sha256(p)} for p in parts]}
    (parts_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return parts


def join(parts_dir: Path, out: Path) -> Path:
    """Reassemble the archive from the parts named in MANIFEST.json, checking every hash."""
    manifest = json.loads((parts_dir / "MANIFEST.json").read_text())
    missing = [p["name"] for p in manifest["parts"] if not (parts_dir / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"{parts_dir} lacks {', '.join(missing)}: carry each part once with `stash` first")
    with open(out, "wb") as f:
        for p in manifest["parts"]:
            path = parts_dir / p["name"]
            if _sha256(path) != p["sha256"]:
                raise SystemExit(f"{path} is corrupt (SHA-256 differs from MANIFEST.json); carry it again")
            f.write(path.read_bytes())
    if _sha256(out) != manifest["sha256"]:
        raise SystemExit(f"the reassembled {out} does not match MANIFEST.json")
    return out


def cmd_cpu(a) -> int:
    if "%d.%d" % sys.version_info[:2] != PY_VERSION:
        raise SystemExit(f"run this with the Python {PY_VERSION} lane's venv, whose megatron-core (0.19) is the one "
                         f"the GPU machine's Python {PY_VERSION} gets: make venv PYTHON=python{PY_VERSION} && "
                         f".venv-py312/bin/python bench/gpu_prepare.py cpu (this is Python "
                         f"{'%d.%d' % sys.version_info[:2]})")
    out = (ROOT / a.out).resolve()
    parts_dir = out / "parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="mvlm-gpu-prepare-") as work:
        work = Path(work)
        stage = work / "stack"
        wheels = stage / "wheels"
        wheels.mkdir(parents=True)
        pins = closure()
        print(f"{len(pins)} distributions: " + ", ".join(f"{k}=={v}" for k, v in sorted(pins.items())))
        reqs = [f"{k}=={v}" for k, v in sorted(pins.items())]
        reqs += [f"transformer_engine=={TE_VERSION}", f"transformer_engine_cu13=={TE_VERSION}"]
        if _pip(["download", *_binary_args(), "-d", str(wheels), *reqs]).returncode:
            raise SystemExit("pip download failed (see above)")
        _te_torch_source(stage, work)
        (stage / "stack.json").write_text(json.dumps({"pins": pins, "te_version": TE_VERSION}, indent=1))
        archive = work / "mvlm_gpu_stack.tar"
        with tarfile.open(archive, "w") as tf:  # wheels are compressed already
            tf.add(stage, arcname="stack")
        parts = split(archive, parts_dir, a.part_bytes)
    total = sum(p.stat().st_size for p in parts)
    print(f"{len(parts)} parts, {total / 1e6:.1f} MB in {parts_dir}:")
    for p in parts:
        print(f"  {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}  {p.stat().st_size / 1e6:.1f} MB")
    return 0


def cmd_stash(a) -> int:
    src = (ROOT / a.parts).resolve()
    dst = Path(a.stash)
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for p in sorted(src.glob("part-*")) + sorted(src.glob("MANIFEST.json")):
        shutil.copyfile(p, dst / p.name)
        n += 1
    have = sorted(p.name for p in dst.glob("part-*"))
    print(f"stashed {n} file(s) from {src} into {dst}; it now holds {len(have)} part(s): {' '.join(have)}")
    manifest = dst / "MANIFEST.json"
    if manifest.is_file():
        want = [p["name"] for p in json.loads(manifest.read_text())["parts"]]
        print("missing:", " ".join(w for w in want if w not in have) or "none")
    return 0 if n else 1


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def cmd_gpu(a) -> int:
    stash, target = Path(a.stash), Path(a.target)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    archive = join(stash, work / "stack.tar")
    with tarfile.open(archive) as tf:
        tf.extractall(work, filter="data")
    stack = work / "stack"
    target.mkdir(parents=True, exist_ok=True)
    todo, kept = [], []
    for whl in sorted((stack / "wheels").glob("*.whl")):
        name = _norm(whl.name.split("-")[0])
        have = _installed(name)
        if have and not name.startswith(("transformer-engine", "megatron")):
            kept.append(f"{name} {have}")
        else:
            todo.append(whl)
    print("already on this machine (kept):", ", ".join(kept))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    if _pip(["install", "--no-deps", "--no-index", "--upgrade", "--target", str(target),
             *map(str, todo)], env=env).returncode:
        raise SystemExit("installing the wheels failed (see above)")
    src_tar = next(stack.glob("transformer_engine_torch-*-src.tar.gz"))
    with tarfile.open(src_tar) as tf:
        tf.extractall(work, filter="data")
    src = next(work.glob("transformer_engine_torch-*/"))
    build_env = dict(env, NVTE_FRAMEWORK="pytorch", NVTE_CUDA_ARCHS=a.cuda_archs, MAX_JOBS=str(a.jobs))
    if _pip(["install", "--no-build-isolation", "--no-deps", "--no-index", "--target", str(target), "-v",
             str(src)], env=build_env).returncode:
        raise SystemExit("building transformer_engine_torch failed (see above)")
    check = ("import torch, transformer_engine.pytorch as te, megatron.core, megatron.energon; "
             "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'TE', te.__version__ if hasattr(te, "
             "'__version__') else '?', 'megatron-core', megatron.core.__version__)")
    res = subprocess.run([sys.executable, "-c", check], env=env)
    print(f"\nuse: export PYTHONPATH={target}:$PYTHONPATH")
    return res.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description=__doc__.splitlines()[0], epilog="See bench/GPU.md for the sequence "
                                 "of device runs.", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", allow_abbrev=False,
                       help="download the stack for Python 3.12 and split it into parts (CPU machine)")
    c.add_argument("--out", default=".whl", help="output folder, ignored by git (default: .whl)")
    c.add_argument("--part-bytes", type=int, default=PART_BYTES, help="largest part (default: 55 MB)")
    s = sub.add_parser("stash", allow_abbrev=False, help="copy the carried part(s) into the stash folder (GPU machine)")
    s.add_argument("--parts", default=".whl/parts", help="carried parts folder (default: .whl/parts)")
    s.add_argument("--stash", default=STASH, help=f"where parts collect between runs (default: {STASH})")
    g = sub.add_parser("gpu", allow_abbrev=False, help="reassemble, install and build Transformer Engine (GPU machine)")
    g.add_argument("--stash", default=STASH, help=f"folder holding every part and MANIFEST.json (default: {STASH})")
    g.add_argument("--target", default=TARGET, help=f"install folder for PYTHONPATH (default: {TARGET})")
    g.add_argument("--work", default="/tmp/mvlm_stack", help="scratch folder (default: /tmp/mvlm_stack)")
    g.add_argument("--cuda-archs", default="90", help="NVTE_CUDA_ARCHS (default: 90, Hopper)")
    g.add_argument("--jobs", type=int, default=16, help="MAX_JOBS for the build (default: 16)")
    a = ap.parse_args(argv)
    return {"cpu": cmd_cpu, "stash": cmd_stash, "gpu": cmd_gpu}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
