#!/usr/bin/env python
"""Build Transformer Engine's core library (``libtransformer_engine.so``) for the H100/H200 only (sm_90), on a
machine without a GPU, and measure what the build takes.

PyPI's ``transformer-engine-cu13`` wheel carries the core compiled for every GPU generation (343 MB, 272 MB as a
wheel); the GPU kit (tools/gpu_kit.py, bench/GPU.md) can carry only a few tens of MiB. This tool compiles TE's
``transformer_engine/common`` with CMake for ``--archs 90`` alone (TE's CMake adds sm_90a to the grouped-GEMM
kernels itself) and writes:

- ``<out>/libtransformer_engine.so`` and ``<out>/BUILD.json``: the sources' version, the arguments, the measured
  CPU seconds, wall seconds and peak memory of each compiler process and in all, and the library's sizes
  (``size -A`` sections, gzip -9);
- with ``--core-wheel W`` (PyPI's ``transformer_engine_cu13`` wheel of the same version), a copy of that wheel whose
  ``wheel_lib/libtransformer_engine.so`` is the one built here (``RECORD`` rewritten): what the kit installs with
  ``pip install --no-index --no-deps``.

What it needs: TE's sources with the cutlass submodule (``--src DIR``: a ``git clone --recursive`` at the release tag;
or ``--te-git GITDIR --ref REF --cutlass-git GITDIR``: both exported with ``git archive``, the cutlass commit being
the one TE's tree pins), CMake >= 3.21, ninja, g++, and the CUDA 13 toolchain: nvcc and cccl from the pinned
``nvidia-cuda-nvcc`` / ``nvidia-cuda-cccl`` wheels (installed into ``<work>/toolchain`` with pip when missing), the
CUDA runtime, cuBLAS, NVRTC, cuDNN, NCCL headers and libraries and the cuDNN frontend headers from the running
Python's site-packages (the Python 3.12 lane's venv has them at its pins; ``--site`` picks another).

Every compiler process runs under ``nice -n --nice`` (19) through ``/usr/bin/time`` (``<work>/times.tsv``: one line
per object with its CPU, wall and peak memory), ``--jobs`` at a time (1). ``--max-hours`` stops a build that would
run longer; BUILD.json then says how far it got and extrapolates the rest from the measured rate. A rerun with the
same ``--work`` goes on where the last one stopped (ninja rebuilds nothing that is done).

  .venv-py312/bin/python tools/build_te_sm90.py --src ~/TransformerEngine --work /tmp/te-sm90 --out /tmp/te-sm90/out
  nohup .venv-py312/bin/python tools/build_te_sm90.py --te-git TE.git --ref v2.20.2 --cutlass-git cutlass.git \\
      --work /tmp/te-sm90 --out /tmp/te-sm90/out --max-hours 3 > /tmp/te-sm90.log 2>&1 &
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the toolchain wheels installed into <work>/toolchain when the site has no nvcc: nvcc and cccl at their pins in
#: --constraints, nvcc's own headers (crt) and its device compiler (nvvm) at nvcc's version
NVCC_WHEELS = ("nvidia-cuda-nvcc", "nvidia-cuda-cccl")
NVCC_PARTS = ("nvidia-cuda-crt", "nvidia-nvvm")
#: libraries the link needs by their unversioned names (the wheels ship only the versioned ones)
LINK_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13")
LIB_NAME = "libtransformer_engine.so"


class BuildError(RuntimeError):
    """A refusal: one line on stderr, exit status 2."""


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    log("+ " + " ".join(str(c) for c in cmd))
    res = subprocess.run([str(c) for c in cmd], **kw)
    if res.returncode:
        raise BuildError(f"{Path(str(cmd[0])).name} failed (exit {res.returncode}): {' '.join(map(str, cmd))[:300]}")
    return res


# ---- sources --------------------------------------------------------------------------------------------------
def export_sources(te_git: Path, ref: str, cutlass_git: Path, dest: Path) -> Path:
    """TE's tree at ``ref`` and the cutlass commit it pins, exported from two git repositories into ``dest``."""
    if (dest / "transformer_engine" / "common" / "CMakeLists.txt").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for git, what in ((te_git, ref),):
        archive = subprocess.run(["git", f"--git-dir={git}", "archive", what], capture_output=True)
        if archive.returncode:
            raise BuildError(f"git archive {what} in {git} failed: {archive.stderr.decode()[:200]}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    tree = subprocess.run(["git", f"--git-dir={te_git}", "ls-tree", ref, "3rdparty/cutlass"], capture_output=True,
                          text=True).stdout.split()
    if len(tree) < 3:
        raise BuildError(f"{ref} in {te_git} pins no 3rdparty/cutlass submodule")
    commit = tree[2]
    archive = subprocess.run(["git", f"--git-dir={cutlass_git}", "archive", commit, "include", "tools/util/include"],
                             capture_output=True)
    if archive.returncode:
        raise BuildError(f"cutlass commit {commit} (pinned by TE {ref}) is not in {cutlass_git}: fetch it")
    (tmp / "3rdparty" / "cutlass").mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(tmp / "3rdparty" / "cutlass")], input=archive.stdout, check=True)
    (tmp / "SOURCES.txt").write_text(f"TransformerEngine {ref} from {te_git}\ncutlass {commit} from {cutlass_git}\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def te_version(src: Path) -> str:
    f = src / "build_tools" / "VERSION.txt"
    return f.read_text().strip() if f.is_file() else "?"


def check_sources(src: Path) -> None:
    if not (src / "transformer_engine" / "common" / "CMakeLists.txt").is_file():
        raise BuildError(f"{src} holds no transformer_engine/common/CMakeLists.txt: pass a TransformerEngine "
                         "checkout (git clone --recursive --branch v2.20.2)")
    if not (src / "3rdparty" / "cutlass" / "include" / "cutlass" / "cutlass.h").is_file():
        raise BuildError(f"{src}/3rdparty/cutlass is empty: run 'git submodule update --init 3rdparty/cutlass' there")


# ---- toolchain ------------------------------------------------------------------------------------------------
def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def toolchain(work: Path, site: Path, constraints: Path) -> Path:
    """A CUDA root for CMake (``<work>/cuda``): nvcc's tree from the nvcc/cccl wheels, with the site's CUDA
    headers and libraries linked into its include/ and lib64/; returns it."""
    cu13 = site / "nvidia" / "cu13"
    for need in ("lib/libcudart.so.13", "lib/libcublas.so.13", "lib/libnvrtc.so.13", "include/cuda_runtime.h",
                 "include/cublas_v2.h"):
        if not (cu13 / need).exists():
            raise BuildError(f"{cu13 / need} is missing: run with the Python 3.12 lane's venv (its nvidia-* wheels) "
                             "or pass --site")
    for need in ("nvidia/cudnn/include/cudnn.h", "nvidia/nccl/include/nccl.h"):
        if not (site / need).exists():
            raise BuildError(f"{site / need} is missing: install the pinned nvidia-cudnn-cu13 / nvidia-nccl-cu13")
    nvcc_tree = cu13 if (cu13 / "bin" / "nvcc").is_file() else work / "toolchain" / "nvidia" / "cu13"
    if not (nvcc_tree / "bin" / "nvcc").is_file():
        pins = read_pins(constraints)
        if "nvidia-cuda-nvcc" not in pins:
            raise BuildError(f"{constraints} pins no nvidia-cuda-nvcc: add 'nvidia-cuda-nvcc==<version>'")
        specs = [f"{w}=={pins[w]}" if w in pins else w for w in NVCC_WHEELS]
        specs += [f"{w}=={pins['nvidia-cuda-nvcc']}" for w in NVCC_PARTS]
        run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target",
             work / "toolchain", *specs])
    cuda = work / "cuda"
    shutil.rmtree(cuda, ignore_errors=True)
    (cuda / "include").mkdir(parents=True)
    (cuda / "lib64").mkdir()
    # nvcc finds cicc, ptxas and its own headers relative to its real path: copy bin/, link the rest
    shutil.copytree(nvcc_tree / "bin", cuda / "bin", symlinks=True)
    for sub in ("nvvm",):
        if (nvcc_tree / sub).exists():
            os.symlink(nvcc_tree / sub, cuda / sub)
    for tree in (nvcc_tree, cu13):
        for p in sorted((tree / "include").iterdir()):
            if not (cuda / "include" / p.name).exists():
                os.symlink(p, cuda / "include" / p.name)
        if (tree / "lib").is_dir():
            for p in sorted((tree / "lib").iterdir()):
                if not (cuda / "lib64" / p.name).exists():
                    os.symlink(p, cuda / "lib64" / p.name)
    for lib in LINK_LIBS:
        os.symlink(cuda / "lib64" / lib, cuda / "lib64" / lib.rsplit(".", 1)[0])
    # nvcc's profile adds targets/<arch>/include and lib: point them at the merged folders
    (cuda / "targets" / "x86_64-linux").mkdir(parents=True)
    os.symlink(cuda / "include", cuda / "targets" / "x86_64-linux" / "include")
    os.symlink(cuda / "lib64", cuda / "targets" / "x86_64-linux" / "lib")
    (cuda / "lib").symlink_to(cuda / "lib64")
    return cuda


def cudnn_frontend_include(site: Path) -> Path:
    import importlib.metadata as md

    for d in md.distributions(path=[str(site)]):
        if re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() == "nvidia-cudnn-frontend":
            inc = Path(d.locate_file("include"))
            if (inc / "cudnn_frontend.h").is_file():
                return inc
    raise BuildError(f"no nvidia-cudnn-frontend headers in {site}: pip install the pinned nvidia-cudnn-frontend")


# ---- the build --------------------------------------------------------------------------------------------------
LAUNCHER = """#!/bin/sh
# one compiler process, niced and measured: object, exit status, CPU user s, CPU sys s, wall s, peak RSS kB
out=unknown; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
exec /usr/bin/time -a -o "{times}" -f "$out\\t%x\\t%U\\t%S\\t%e\\t%M" nice -n {nice} "$@"
"""


def configure(src: Path, build: Path, cuda: Path, site: Path, archs: str, times: Path, nice: int) -> None:
    if (build / "build.ninja").is_file():
        return
    build.mkdir(parents=True, exist_ok=True)
    launcher = build.parent / "measure.sh"
    launcher.write_text(LAUNCHER.format(times=times, nice=nice))
    launcher.chmod(0o755)
    env = dict(os.environ, CUDA_HOME=str(cuda), CUDACXX=str(cuda / "bin" / "nvcc"),
               PATH=f"{cuda / 'bin'}:{os.environ.get('PATH', '')}")
    run(["cmake", "-S", src / "transformer_engine" / "common", "-B", build, "-G", "Ninja",
         "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_CUDA_ARCHITECTURES={archs}", f"-DCUDAToolkit_ROOT={cuda}",
         f"-DCMAKE_CUDA_COMPILER={cuda / 'bin' / 'nvcc'}", f"-DPython_EXECUTABLE={sys.executable}",
         f"-DCUDNN_FRONTEND_INCLUDE_DIR={cudnn_frontend_include(site)}", f"-DCUDNN_PATH={site / 'nvidia' / 'cudnn'}",
         f"-DNCCL_INCLUDE_DIR={site / 'nvidia' / 'nccl' / 'include'}", "-DNVTE_WITH_NCCL_EP=OFF",
         f"-DCMAKE_CUDA_COMPILER_LAUNCHER={launcher}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}"], env=env)


def ninja_counts(build: Path) -> tuple[int, int]:
    """(edges done, edges in all) of the build, from ``ninja -n`` (what is left) and ``-t commands`` (all)."""
    total = len([ln for ln in subprocess.run(["ninja", "-C", str(build), "-t", "commands"], capture_output=True,
                                             text=True).stdout.splitlines() if ln.strip()])
    left = len([ln for ln in subprocess.run(["ninja", "-C", str(build), "-n"], capture_output=True,
                                            text=True).stdout.splitlines() if re.match(r"^\[\d+/\d+\]", ln)])
    return total - left, total


def read_times(times: Path) -> list[dict]:
    rows = []
    if times.is_file():
        for ln in times.read_text().splitlines():
            parts = ln.split("\t")
            if len(parts) == 6 and not parts[0].startswith("Command"):
                try:
                    rows.append(dict(object=parts[0], rc=int(parts[1]), cpu_s=float(parts[2]) + float(parts[3]),
                                     wall_s=float(parts[4]), peak_mb=int(parts[5]) / 1024))
                except ValueError:
                    continue
    return rows


def summary(rows: list[dict], done: int, total: int, wall: float) -> dict:
    ok = [r for r in rows if r["rc"] == 0]
    cu = [r for r in ok if r["object"].endswith(".cu.o")]
    cpu = sum(r["cpu_s"] for r in ok)
    out = dict(edges_done=done, edges_total=total, objects_measured=len(ok), cu_objects=len(cu),
               cpu_s=round(cpu, 1), compiler_wall_s=round(sum(r["wall_s"] for r in ok), 1),
               session_wall_s=round(wall, 1), peak_compiler_mb=round(max((r["peak_mb"] for r in ok), default=0)),
               slowest=sorted(({k: r[k] for k in ("object", "cpu_s", "wall_s", "peak_mb")} for r in ok),
                              key=lambda r: -r["cpu_s"])[:8])
    if 0 < done < total and ok:
        # what is left, at the mean CPU and wall per edge measured so far (edges: objects + the link)
        per_cpu, per_wall = cpu / len(ok), out["compiler_wall_s"] / len(ok)
        out["extrapolated_total_cpu_h"] = round((cpu + per_cpu * (total - done)) / 3600, 2)
        out["extrapolated_total_wall_h_at_this_load"] = round((out["compiler_wall_s"] + per_wall * (total - done))
                                                              / 3600, 2)
    return out


def build_library(build: Path, jobs: int, max_hours: float, times: Path, state: Path) -> tuple[bool, dict]:
    """ninja in ``build`` (niced, ``jobs`` at a time) until done or ``max_hours``; (finished, summary)."""
    t0 = time.time()
    done0, total = ninja_counts(build)
    log(f"ninja: {done0} of {total} edges done before this run; {jobs} job(s), stop after {max_hours:g} h")
    proc = subprocess.Popen(["nice", "-n", "19", "ninja", "-C", str(build), f"-j{jobs}"], start_new_session=True)
    stopped = False

    def stop(*_):
        nonlocal stopped
        stopped = True
        os.killpg(proc.pid, signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        while proc.poll() is None:
            time.sleep(10)
            rows = read_times(times)
            state.write_text(json.dumps(summary(rows, done0 + len([r for r in rows if r["rc"] == 0 and
                                                                   r["object"] != "unknown"]), total,
                                               time.time() - t0), indent=1))
            if time.time() - t0 > max_hours * 3600 and not stopped:
                log(f"--max-hours {max_hours:g} reached: stopping the build")
                stop()
        proc.wait()
    finally:
        signal.signal(signal.SIGTERM, old)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done, total = ninja_counts(build)
    out = summary(read_times(times), done, total, time.time() - t0)
    finished = proc.returncode == 0 and done == total
    if proc.returncode and not stopped:
        raise BuildError(f"ninja failed (exit {proc.returncode}); its output is above; {done} of {total} edges done")
    return finished, out


# ---- the result -------------------------------------------------------------------------------------------------
def sections(lib: Path) -> dict:
    res = subprocess.run(["size", "-A", str(lib)], capture_output=True, text=True)
    out = {}
    for ln in res.stdout.splitlines():
        parts = ln.split()
        if len(parts) >= 2 and parts[0].startswith(".") and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def gzip_bytes(path: Path) -> int:
    with tempfile.TemporaryFile() as tmp:
        with open(path, "rb") as f, gzip.GzipFile(fileobj=tmp, mode="wb", compresslevel=9) as gz:
            shutil.copyfileobj(f, gz, 1 << 22)
        return tmp.tell()


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def replace_in_wheel(wheel: Path, member_suffix: str, new_file: Path, out_dir: Path, build_tag: str) -> Path:
    """A copy of ``wheel`` in ``out_dir`` with the member ending in ``member_suffix`` replaced by ``new_file`` and
    RECORD rewritten; the version is kept (TE checks its parts' versions against each other), the file name gets
    the wheel build tag ``build_tag`` (``transformer_engine_cu13-2.20.2-1sm90-py3-none-...whl``)."""
    if not re.fullmatch(r"\d\w*", build_tag):
        raise BuildError(f"build tag {build_tag!r} must start with a digit")
    parts = wheel.name[:-4].split("-")
    if len(parts) != 5:
        raise BuildError(f"{wheel.name}: expected a wheel name without a build tag (name-version-py-abi-platform)")
    out = out_dir / ("-".join(parts[:2] + [build_tag] + parts[2:]) + ".whl")
    with zipfile.ZipFile(wheel) as zin:
        names = zin.namelist()
        target = [n for n in names if n.endswith(member_suffix)]
        if len(target) != 1:
            raise BuildError(f"{wheel.name} has {len(target)} members ending in {member_suffix}, expected 1")
        tmp = out.with_name(out.name + ".tmp")
        records, record_name = [], None
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for n in names:
                if n.endswith(".dist-info/RECORD"):
                    record_name = n
                    continue
                src = zin.getinfo(n)
                info = zipfile.ZipInfo(n, date_time=src.date_time)
                info.external_attr = src.external_attr
                info.compress_type = zipfile.ZIP_DEFLATED
                if n == target[0]:
                    data = new_file.read_bytes()
                else:
                    data = zin.read(n)
                zout.writestr(info, data, compresslevel=9)
                records.append(f"{n},{record_hash(data)},{len(data)}")
            if record_name is None:
                raise BuildError(f"{wheel.name} has no RECORD")
            records.append(f"{record_name},,")
            zout.writestr(record_name, "\n".join(records) + "\n", compresslevel=9)
    os.replace(tmp, out)
    return out


# ---- sm_90 from PyPI's wheel: the fat binary pruned -------------------------------------------------------------
FATBIN_MAGIC = 0xBA55ED50
ELF_KIND, PTX_KIND = 2, 1


def elf_section(data, name: bytes) -> tuple[int, int]:
    """(file offset, size) of the section ``name`` of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BuildError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]
    for h in headers:
        start = strtab_off + h[0]
        if bytes(data[start:data.index(b"\0", start)]) == name:
            return h[4], h[5]
    raise BuildError(f"no {name.decode()} section: not a library with CUDA device code")


def fatbin_containers(data, off: int, size: int) -> list[dict]:
    """The fat-binary containers of the ``.nv_fatbin`` section at ``off``: each with its offset, header size and
    entries (offset, total length, kind 1 PTX / 2 ELF, SM architecture, flags)."""
    out, pos, end = [], off, off + size
    while pos < end:
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            if any(data[pos:min(end, pos + 8)]):
                raise BuildError(f"no fat-binary header at offset {pos:#x}: unknown layout, not pruned")
            pos += 8  # alignment padding between containers
            continue
        entries, e, cend = [], pos + hsize, pos + hsize + fsize
        while e < cend:
            kind, _u, ehsize, psize = struct.unpack_from("<HHIQ", data, e)
            arch, = struct.unpack_from("<I", data, e + 28)
            flags, = struct.unpack_from("<Q", data, e + 40)
            entries.append(dict(offset=e, length=ehsize + psize, kind=kind, arch=arch, flags=flags))
            e += ehsize + psize
        if e != cend:
            raise BuildError(f"fat-binary container at {pos:#x}: entries overrun its size")
        out.append(dict(offset=pos, header=hsize, size=fsize, entries=entries))
        pos = cend
    return out


def prune_fatbin(data: bytearray, archs: set[int]) -> dict:
    """Keep, in every container of ``data``'s ``.nv_fatbin``, only the entries for ``archs`` (sm_90 and sm_90a for
    {90}); a container without one keeps its PTX for an older architecture (JIT-compiled on the device) or, failing
    that, its smallest entry (its kernels could not run on that GPU anyway). The kept entries move to the front of
    their container, its size is set to theirs, and the freed bytes become zeros: every address into the section
    stays valid, and the zeros compress to nothing. Returns what was kept and dropped (bytes)."""
    off, size = elf_section(data, b".nv_fatbin")
    stats = dict(containers=0, kept_bytes=0, dropped_bytes=0, kept={}, fallback_containers=0)
    for c in fatbin_containers(data, off, size):
        ents = c["entries"]
        keep = [e for e in ents if e["arch"] in archs]
        if not keep:
            stats["fallback_containers"] += 1
            ptx = [e for e in ents if e["kind"] == PTX_KIND and e["arch"] <= min(archs)]
            keep = ptx[-1:] or [min(ents, key=lambda e: e["length"])]
        blob = b"".join(bytes(data[e["offset"]:e["offset"] + e["length"]]) for e in keep)
        start = c["offset"] + c["header"]
        data[start:start + c["size"]] = blob + bytes(c["size"] - len(blob))
        struct.pack_into("<Q", data, c["offset"] + 8, len(blob))
        stats["containers"] += 1
        stats["kept_bytes"] += len(blob)
        stats["dropped_bytes"] += c["size"] - len(blob)
        for e in keep:
            key = f"{'sm' if e['kind'] == ELF_KIND else 'compute'}_{e['arch']}{'a' if e['flags'] & 0x100000 else ''}"
            stats["kept"][key] = stats["kept"].get(key, 0) + 1
    return stats


def cuobjdump_elves(cuobjdump: str, lib: Path) -> list[str]:
    """The cubins cuobjdump lists in ``lib`` (their SM suffix, e.g. sm_90), in order."""
    res = subprocess.run([cuobjdump, "--list-elf", str(lib)], capture_output=True, text=True)
    if res.returncode:
        raise BuildError(f"cuobjdump --list-elf {lib.name} failed: {res.stderr.strip()[:200]}")
    return re.findall(r"\.(sm_\w+?)\.cubin", res.stdout)


def prune_wheel(core_wheel: Path, out: Path, archs: set[int], cuobjdump: str | None) -> dict:
    """PyPI's core wheel with its library pruned to ``archs``; checks the result (by parsing it again, and with
    cuobjdump when given: every cubin for ``archs`` is still listed, and nothing else). Returns BUILD.json's
    content."""
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    member = f"wheel_lib/{LIB_NAME}"
    with zipfile.ZipFile(core_wheel) as z:
        names = [n for n in z.namelist() if n.endswith(member)]
        if len(names) != 1:
            raise BuildError(f"{core_wheel.name} holds no {member}: is it transformer_engine_cu13?")
        data = bytearray(z.read(names[0]))
    original = bytes(data)
    stats = prune_fatbin(data, archs)
    lib = out / LIB_NAME
    tmp = lib.with_name(lib.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, lib)
    again = prune_fatbin(bytearray(data), archs)  # idempotent: nothing left to drop
    if again["dropped_bytes"] != 0 or again["kept_bytes"] != stats["kept_bytes"]:
        raise BuildError("the pruned library does not parse back to what was kept")
    report = dict(source=core_wheel.name, archs=sorted(archs), **stats,
                  library_mb=round(len(data) / 1e6, 1), original_gzip9_mb=None)
    if cuobjdump:
        orig_path = out / (LIB_NAME + ".orig")
        orig_path.write_bytes(original)
        try:
            before = cuobjdump_elves(cuobjdump, orig_path)
        finally:
            orig_path.unlink()
        after = cuobjdump_elves(cuobjdump, lib)
        want = [s for s in before if int(re.sub(r"\D", "", s)) in archs]
        if after != want:
            raise BuildError(f"cuobjdump lists {len(after)} cubins in the pruned library, expected the original's "
                             f"{len(want)} for {sorted(archs)}")
        report["cuobjdump"] = dict(original_cubins=len(before), kept_cubins=len(after))
    report["library_gzip9_mb"] = round(gzip_bytes(lib) / 1e6, 1)
    report["sections_mb"] = {k: round(v / 1e6, 2) for k, v in sections(lib).items() if v > 100_000}
    whl = replace_in_wheel(core_wheel, member, lib, out, "1sm" + "".join(str(a) for a in sorted(archs)))
    report.update(wheel=whl.name, wheel_mb=round(whl.stat().st_size / 1e6, 1),
                  original_wheel_mb=round(core_wheel.stat().st_size / 1e6, 1), seconds=round(time.time() - t0, 1))
    report.pop("original_gzip9_mb")
    lib.unlink()  # the wheel holds it
    return report


# ---- the torch extension for another torch (the GPU image's) ------------------------------------------------------
def mirror_tree(src: Path, dst: Path) -> int:
    """``dst`` as a copy of ``src``'s directories (real ones, linked directories followed) holding one symbolic link
    per file; returns the number of links. A ``pip install`` into ``dst`` replaces a file's link (pip unlinks a file
    before it writes one) and makes new files in ``dst``'s own directories: nothing is written through into ``src``,
    as it was through a linked directory (``os.symlink(src, dst)``)."""
    n = 0
    for here, dirs, files in os.walk(src, followlinks=True):
        rel = Path(here).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in files:
            os.symlink(Path(here) / f, dst / rel / f)
            n += 1
    return n


def remove_mirror(nv: Path) -> None:
    """Remove ``nv`` (a mirror of :func:`mirror_tree`, or an older run's linked directories) without following a
    link: the lane's files stay."""
    if nv.is_symlink():
        nv.unlink()
    elif nv.is_dir():
        for sub in nv.iterdir():
            if sub.is_symlink():
                sub.unlink()
        shutil.rmtree(nv)  # rmtree removes links, never what they point to


def mirror_nvidia(site_nvidia: Path, nv: Path, cuda: Path) -> int:
    """The build venv's ``nvidia/`` (``nv``): each of ``site_nvidia``'s CUDA 13 packages (the lane's) mirrored file by
    file (:func:`mirror_tree`), with ``cu13`` the CUDA root made for the build; returns the number of links.

    It was a link per package folder, and a ``pip install`` into the build venv then wrote through the links into
    the lane: installing TE's import dependencies there pulled in torch 2.11's NCCL, cuDNN and cuSPARSELt over the
    lane's, and ``import torch`` then failed in .venv-py312 (undefined symbol ``ncclCommResume``)."""
    remove_mirror(nv)
    nv.mkdir(parents=True)
    n = 0
    for sub in sorted(site_nvidia.iterdir()):
        if sub.is_dir() and sub.name != "cudnn_frontend":
            n += mirror_tree(cuda if sub.name == "cu13" else sub, nv / sub.name)
    return n


def torch_extension(torch_version: str, work: Path, out: Path, site: Path, constraints: Path, archs: str,
                    jobs: int, nice: int, core_wheel: Path) -> dict:
    """Compile ``transformer-engine-torch`` (PyPI's sdist, at the core wheel's version) against PyPI's
    ``torch==torch_version`` for ``archs``, in a scratch venv of this Python that holds that torch (no
    dependencies), the core wheel, and links to ``site``'s nvidia-* CUDA 13 packages; returns BUILD.json's
    content. tools/install_te.py builds the extension for the running torch; this one is for a torch that is not
    installed here (the GPU machine's)."""
    import importlib.metadata as md

    sys.path.insert(0, str(ROOT / "tools"))
    import install_te

    te_version_ = core_wheel.name.split("-")[1]
    venv = work / "venv"
    py = venv / "bin" / "python"
    if not py.is_file():
        run([sys._base_executable, "-m", "venv", venv])
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    pins = read_pins(constraints)
    pin = lambda n: f"{n}=={pins[n]}" if n in pins else n  # noqa: E731
    have = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
            for d in md.distributions(path=[str(purelib)])}
    if have.get("torch", "").split("+")[0] != torch_version:
        run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", f"torch=={torch_version}"])
        run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", constraints, pin("numpy"),
             pin("typing-extensions"),
             pin("sympy"), pin("networkx"), pin("jinja2"), pin("filelock"), pin("fsspec"), pin("setuptools"),
             *[pin(n) for n in install_te.BUILD_TOOLS], pin("pybind11"), pin("einops"), pin("packaging"),
             pin("nvidia-cudnn-frontend"), pin("pydantic"), pin("importlib-metadata")])
        run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", core_wheel,
             f"transformer-engine=={te_version_}"])
    # CUDA 13 headers and libraries: the lane's nvidia-* packages (the same CUDA 13.0 as the torch wheel's), with
    # nvidia/cu13 replaced by the CUDA root made for the build (nvcc's own headers, crt/, merged in)
    cuda = work / "cuda" if (work / "cuda" / "bin" / "nvcc").is_file() else toolchain(work, site, constraints)
    nv = purelib / "nvidia"
    mirror_nvidia(site / "nvidia", nv, cuda)
    env = dict(os.environ, **install_te.BUILD_ENV, NVTE_CUDA_ARCHS=archs, MAX_JOBS=str(jobs), CUDA_HOME=str(cuda),
               CUDA_PATH=str(cuda), PATH=f"{cuda / 'bin'}:{venv / 'bin'}:{os.environ.get('PATH', '')}")
    build_dir = work / "wheel"
    shutil.rmtree(build_dir, ignore_errors=True)
    t0 = time.time()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        run(["nice", "-n", str(nice), py, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-binary",
             "transformer-engine-torch", f"transformer-engine-torch=={te_version_}", "-w", build_dir], env=env)
    finally:  # the mirror is the build's alone: the venv is left without it, as pip would make it
        remove_mirror(nv)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    built = sorted(build_dir.glob("transformer_engine_torch-*.whl"))
    if not built:
        raise BuildError(f"the build wrote no transformer_engine_torch wheel in {build_dir}")
    out.mkdir(parents=True, exist_ok=True)
    whl = out / built[0].name
    shutil.copyfile(built[0], whl)
    return dict(torch=torch_version, te_version=te_version_, archs=archs, jobs=jobs, nice=nice, wheel=whl.name,
                wheel_mb=round(whl.stat().st_size / 1e6, 2), wall_s=round(time.time() - t0, 1),
                cpu_s=round((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), 1),
                peak_compiler_mb=round(r1.ru_maxrss / 1024))


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prune", allow_abbrev=False,
                        help="PyPI's transformer_engine_cu13 wheel with the other GPUs' device code removed "
                        "(minutes; no compiler)")
    pr.add_argument("--core-wheel", type=Path, required=True, help="PyPI's transformer_engine_cu13 wheel "
                    "(pip download --no-deps transformer-engine-cu13==2.20.2)")
    pr.add_argument("--out", type=Path, required=True, help="where the pruned wheel and BUILD.json go")
    pr.add_argument("--archs", default="90", help="SM architectures to keep, comma-separated (default 90: H100/H200; "
                    "sm_90a code is kept with 90)")
    pr.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump (the nvidia-cuda-cuobjdump "
                    "wheel has one) to check the result with (default: the one on PATH, if any)")
    b = sub.add_parser("build", allow_abbrev=False, help="compile TE's core from source for --archs (CPU-hours)")
    b.add_argument("--src", type=Path, help="TransformerEngine checkout with 3rdparty/cutlass (git clone --recursive)")
    b.add_argument("--te-git", type=Path, help="instead of --src: a TransformerEngine git directory to export --ref "
                   "from")
    b.add_argument("--ref", default="v2.20.2", help="with --te-git: the tag or commit (default v2.20.2)")
    b.add_argument("--cutlass-git", type=Path, help="with --te-git: a cutlass git directory holding the commit TE "
                   "pins")
    b.add_argument("--work", type=Path, required=True, help="build folder (kept: a rerun resumes)")
    b.add_argument("--out", type=Path, required=True, help="where the library, BUILD.json and the wheel go")
    b.add_argument("--archs", default="90", help="CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200)")
    b.add_argument("--jobs", type=int, default=1, help="compiler processes at a time (default 1; up to 4.4 GB each)")
    b.add_argument("--nice", type=int, default=19, help="niceness of the compilers (default 19)")
    b.add_argument("--max-hours", type=float, default=24.0, help="stop the build after this many hours and "
                   "extrapolate (default 24)")
    b.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]),
                   help="site-packages with the nvidia-* CUDA 13 wheels (default: this Python's)")
    b.add_argument("--constraints", type=Path, default=ROOT / "constraints" / "py312.txt",
                   help="pins of the toolchain wheels (default constraints/py312.txt)")
    b.add_argument("--core-wheel", type=Path, help="PyPI's transformer_engine_cu13 wheel of the same version: write "
                   "a copy with the library built here in it")
    t = sub.add_parser("torch-ext", allow_abbrev=False,
                       help="compile TE's torch extension against another torch (the GPU image's, "
                       "2.11.0+cu130), for --archs (tens of CPU-minutes)")
    t.add_argument("--torch", default="2.11.0", help="PyPI torch version to build against (default 2.11.0: "
                   "2.11.0+cu130, the GPU image's)")
    t.add_argument("--core-wheel", type=Path, required=True, help="the transformer_engine_cu13 wheel (pruned or "
                   "PyPI's): its version picks the extension's")
    t.add_argument("--work", type=Path, required=True, help="scratch folder (its venv is reused)")
    t.add_argument("--out", type=Path, required=True, help="where the wheel and BUILD-torch.json go")
    t.add_argument("--archs", default="90", help="NVTE_CUDA_ARCHS (default 90)")
    t.add_argument("--jobs", type=int, default=1, help="MAX_JOBS (default 1)")
    t.add_argument("--nice", type=int, default=19, help="niceness (default 19)")
    t.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]),
                   help="site-packages with the nvidia-* CUDA 13 wheels (default: this Python's)")
    t.add_argument("--constraints", type=Path, default=ROOT / "constraints" / "py312.txt",
                   help="pins (default constraints/py312.txt)")
    a = p.parse_args(argv)
    if a.cmd == "build" and not a.src and not (a.te_git and a.cutlass_git):
        p.error("build: pass --src DIR, or --te-git GITDIR --cutlass-git GITDIR [--ref TAG]")
    return a


def main_prune(a) -> int:
    if not a.core_wheel.is_file():
        raise BuildError(f"no wheel {a.core_wheel}: pip download --no-deps transformer-engine-cu13==2.20.2")
    archs = {int(x) for x in a.archs.split(",") if x.strip()}
    report = prune_wheel(a.core_wheel.resolve(), a.out.resolve(), archs, a.cuobjdump)
    (a.out / "BUILD.json").write_text(json.dumps(report, indent=1) + "\n")
    log(json.dumps(report))
    return 0


def main_build(a) -> int:
    for tool in ("cmake", "ninja", "g++", "size") + (("git",) if a.te_git else ()):
        if not shutil.which(tool):
            raise BuildError(f"{tool} is not on PATH: apt-get install {tool}")
    if not Path("/usr/bin/time").is_file():
        raise BuildError("/usr/bin/time is missing (it measures each compiler): apt-get install time")
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = a.src.resolve() if a.src else export_sources(a.te_git.resolve(), a.ref, a.cutlass_git.resolve(),
                                                         work / "src")
    check_sources(src)
    cuda = toolchain(work, a.site, a.constraints)
    times = work / "times.tsv"
    configure(src, work / "build", cuda, a.site, a.archs, times, a.nice)
    finished, meas = build_library(work / "build", a.jobs, a.max_hours, times, work / "progress.json")
    a.out.mkdir(parents=True, exist_ok=True)
    report = dict(te_version=te_version(src), sources=(src / "SOURCES.txt").read_text().strip()
                  if (src / "SOURCES.txt").is_file() else str(src), archs=a.archs, jobs=a.jobs, nice=a.nice,
                  cpus=os.cpu_count(), finished=finished, **meas)
    if finished:
        lib = work / "build" / LIB_NAME
        shutil.copyfile(lib, a.out / LIB_NAME)
        report.update(library_mb=round(lib.stat().st_size / 1e6, 1), library_gzip9_mb=round(gzip_bytes(lib) / 1e6, 1),
                      sections_mb={k: round(v / 1e6, 2) for k, v in sections(lib).items() if v > 100_000})
        if a.core_wheel:
            whl = replace_in_wheel(a.core_wheel, f"wheel_lib/{LIB_NAME}", lib, a.out,
                                   "2sm" + a.archs.replace(";", ""))
            report.update(wheel=whl.name, wheel_mb=round(whl.stat().st_size / 1e6, 1))
    (a.out / "BUILD.json").write_text(json.dumps(report, indent=1) + "\n")
    log(json.dumps({k: v for k, v in report.items() if k != "slowest"}))
    return 0 if finished else 3


def main(argv=None) -> int:
    a = parse(argv)
    try:
        if a.cmd == "torch-ext":
            report = torch_extension(a.torch, a.work.resolve(), a.out.resolve(), a.site, a.constraints, a.archs,
                                     a.jobs, a.nice, a.core_wheel.resolve())
            (a.out / "BUILD-torch.json").write_text(json.dumps(report, indent=1) + "\n")
            log(json.dumps(report))
            return 0
        return main_prune(a) if a.cmd == "prune" else main_build(a)
    except BuildError as e:
        print(f"build_te_sm90: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
