"""tools/build_te_sm90.py: the fat-binary pruning that gives the GPU kit an sm_90-only Transformer Engine core (on a
hand-made ELF library with the fat-binary layout cuobjdump reads; the real 343 MB library is pruned and checked with
cuobjdump by the tool itself, bench/GPU.md section 4), the wheel rewrite, and the build's measurement summary."""

from __future__ import annotations

import base64
import os
import hashlib
import struct
import zipfile
from pathlib import Path

import pytest

from tests.conftest import script
from tests.test_gpu_kit import fake_wheel

pytestmark = pytest.mark.one_lane(
    "3.12",
    reason="tools/build_te_sm90.py rewrites hand-made ELF files and wheels with the standard library; the GPU "
           "kit it serves is made with the 3.12 lane's venv")

MAGIC = 0xBA55ED50


@pytest.fixture(scope="module")
def tool():
    return script("tools/build_te_sm90.py")


def entry(arch: int, payload: bytes, kind: int = 2, flags: int = 0x8011) -> bytes:
    """One fat-binary entry: a 64-byte header (kind, header size, payload size, arch at 28, flags at 40) + payload."""
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x0101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    struct.pack_into("<Q", head, 40, flags)
    return bytes(head) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", MAGIC, 1, 16, len(body)) + body


def elf_with(section: bytes) -> bytes:
    """A minimal 64-bit little-endian ELF file with sections: null, .nv_fatbin (``section``), .shstrtab."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_off = 64
    str_off = fat_off + len(section)
    sh_off = (str_off + len(names) + 7) // 8 * 8
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x28, sh_off)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 2)
    shdrs = b"".join(struct.pack("<IIQQQQIIQQ", name, typ, 0, 0, off, size, 0, 0, 8, 0) for name, typ, off, size in
                     ((0, 0, 0, 0), (1, 1, fat_off, len(section)), (12, 3, str_off, len(names))))
    body = bytes(head) + section + names
    return body + bytes(sh_off - len(body)) + shdrs


def test_prune_keeps_each_containers_sm90_entries_in_place_and_zeroes_the_rest(tool):
    c1 = container(entry(75, b"a" * 40), entry(90, b"B" * 48), entry(100, b"c" * 56, flags=0x1108011),
                   entry(90, b"D" * 16, flags=0x108011))  # sm_90a
    c2 = container(entry(80, b"e" * 24), entry(100, b"f" * 8))  # no sm_90: keeps its smallest entry
    c3 = container(entry(75, b"g" * 32), entry(70, b"PTX" + b"h" * 29, kind=1))  # no sm_90: keeps its PTX
    section = c1 + bytes(8) + c2 + c3  # 8 bytes of alignment padding between containers
    data = bytearray(elf_with(section))
    original = bytes(data)
    stats = tool.prune_fatbin(data, {90})
    assert len(data) == len(original) and data[:64] == original[:64]  # same file layout: every address holds
    off, size = tool.elf_section(data, b".nv_fatbin")
    conts = tool.fatbin_containers(data, off, size)
    assert [c["offset"] - off for c in conts] == [0, len(c1) + 8, len(c1) + 8 + len(c2)]  # containers unmoved
    assert [[(e["kind"], e["arch"]) for e in c["entries"]] for c in conts] == [[(2, 90), (2, 90)], [(2, 100)],
                                                                                [(1, 70)]]
    kept = data[off + 16: off + 16 + (64 + 48) + (64 + 16)]
    assert kept == entry(90, b"B" * 48) + entry(90, b"D" * 16, flags=0x108011)  # the cubins byte for byte
    assert not any(data[off + 16 + len(kept): off + len(c1)])  # the dropped entries are zeros
    assert stats["kept"] == {"sm_90": 1, "sm_90a": 1, "sm_100": 1, "compute_70": 1}
    assert stats["fallback_containers"] == 2 and stats["containers"] == 3
    assert stats["kept_bytes"] + stats["dropped_bytes"] == len(section) - 8 - 3 * 16
    again = bytearray(data)
    assert tool.prune_fatbin(again, {90})["dropped_bytes"] == 0 and again == data  # idempotent


def test_prune_refuses_an_unknown_layout(tool):
    bad = bytearray(elf_with(container(entry(90, b"x" * 8)) + b"junkjunk"))
    with pytest.raises(tool.BuildError, match="no fat-binary header"):
        tool.prune_fatbin(bad, {90})
    with pytest.raises(tool.BuildError, match="not a 64-bit little-endian ELF"):
        tool.prune_fatbin(bytearray(b"MZ" + bytes(100)), {90})


def test_wheel_rewrite_replaces_the_library_and_its_record(tool, tmp_path):
    src = fake_wheel(tmp_path / "in", "transformer_engine_cu13", "2.20.2")
    with zipfile.ZipFile(src, "a") as z:
        z.writestr("transformer_engine/wheel_lib/libtransformer_engine.so", b"old")
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"new library")
    out = tool.replace_in_wheel(src, "wheel_lib/libtransformer_engine.so", lib, tmp_path, "1sm90")
    assert out.name == "transformer_engine_cu13-2.20.2-1sm90-py3-none-any.whl"
    with zipfile.ZipFile(out) as z:
        assert z.read("transformer_engine/wheel_lib/libtransformer_engine.so") == b"new library"
        record = z.read("transformer_engine_cu13-2.20.2.dist-info/RECORD").decode()
        assert "Version: 2.20.2" in z.read("transformer_engine_cu13-2.20.2.dist-info/METADATA").decode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"new library").digest()).rstrip(b"=").decode()
    assert f"transformer_engine/wheel_lib/libtransformer_engine.so,sha256={digest},11" in record.splitlines()
    with pytest.raises(tool.BuildError, match="must start with a digit"):
        tool.replace_in_wheel(src, "wheel_lib/libtransformer_engine.so", lib, tmp_path, "sm90")


def test_build_summary_extrapolates_from_the_measured_objects(tool, tmp_path):
    times = tmp_path / "times.tsv"
    times.write_text("a.cu.o\t0\t90.0\t10.0\t400.0\t1048576\n"
                     "Command exited with non-zero status 1\nb.cu.o\t1\t5\t1\t6\t1024\n"
                     "c.cpp.o\t0\t18.0\t2.0\t50.0\t524288\n")
    rows = tool.read_times(times)
    assert [(r["object"], r["rc"]) for r in rows] == [("a.cu.o", 0), ("b.cu.o", 1), ("c.cpp.o", 0)]
    s = tool.summary(rows, done=2, total=10, wall=500.0)
    assert s["cpu_s"] == 120.0 and s["peak_compiler_mb"] == 1024 and s["cu_objects"] == 1
    assert s["extrapolated_total_cpu_h"] == pytest.approx((120 + 60 * 8) / 3600, abs=0.01)
    assert s["extrapolated_total_wall_h_at_this_load"] == pytest.approx((450 + 225 * 8) / 3600, abs=0.01)
    assert "extrapolated_total_cpu_h" not in tool.summary(rows, done=10, total=10, wall=500.0)


@pytest.mark.slow  # one pip process
def test_a_pip_install_into_the_build_venv_leaves_the_lanes_nvidia_packages_alone(tool, tmp_path):
    """torch-ext's build venv sees the lane's nvidia-* packages through a mirror of links, one per file: a real
    ``pip install`` of a wheel holding nvidia/ files into that venv (as installing TE's import dependencies there did
    with torch 2.11's NCCL and cuDNN) replaces the venv's links and leaves the lane's files as they were."""
    import subprocess
    import sys

    lane = tmp_path / "lane" / "nvidia"
    for rel, text in (("cudnn/lib/libcudnn.so.9", "lane cudnn"), ("nccl/include/nccl.h", "lane nccl"),
                      ("cu13/lib/libcudart.so.13", "lane cudart"), ("cudnn_frontend/include/x.h", "headers")):
        (lane / rel).parent.mkdir(parents=True, exist_ok=True)
        (lane / rel).write_text(text)
    cuda = tmp_path / "cuda"  # the build's CUDA root: its own folders, links into the lane's cu13
    (cuda / "lib64").mkdir(parents=True)
    os.symlink(lane / "cu13" / "lib" / "libcudart.so.13", cuda / "lib64" / "libcudart.so.13")
    (cuda / "lib").symlink_to(cuda / "lib64")
    prefix = tmp_path / "venv"
    purelib = prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    nv = purelib / "nvidia"
    os.makedirs(nv / "cudnn")
    os.symlink(lane / "nccl", nv / "nccl")  # an older run's linked folder: removed, not followed
    assert tool.mirror_nvidia(lane, nv, cuda) == 4  # cu13: lib64 and lib (a link to it) each
    assert (nv / "cudnn" / "lib" / "libcudnn.so.9").read_text() == "lane cudnn" and not (nv / "cudnn_frontend").exists()
    assert (nv / "cu13" / "lib64" / "libcudart.so.13").read_text() == "lane cudart"
    # a name no environment has, and --ignore-installed: pip must uninstall nothing of the running lane's (a wheel
    # named nvidia-cudnn-cu13 would make pip remove the lane's own cuDNN, --prefix or not)
    whl = fake_wheel(tmp_path / "whl", "mvlm-probe-nvidia-files", "1.0")
    with zipfile.ZipFile(whl, "a") as z:
        for rel in ("cudnn/lib/libcudnn.so.9", "nccl/lib/libnccl.so.2", "cu13/lib/libcudart.so.13"):
            z.writestr(f"nvidia/{rel}", "torch 2.11's")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                          "--no-deps", "--no-compile", "--ignore-installed", "--prefix", str(prefix), str(whl)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (nv / "cudnn" / "lib" / "libcudnn.so.9").read_text() == "torch 2.11's"  # the venv's own copy now
    assert sorted(str(p.relative_to(lane)) for p in lane.rglob("*") if p.is_file()) == [
        "cu13/lib/libcudart.so.13", "cudnn/lib/libcudnn.so.9", "cudnn_frontend/include/x.h", "nccl/include/nccl.h"]
    assert [(lane / r).read_text() for r in ("cudnn/lib/libcudnn.so.9", "cu13/lib/libcudart.so.13")] == [
        "lane cudnn", "lane cudart"]
    assert not any(p.is_symlink() for p in nv.rglob("*") if p.is_dir())  # real folders: new files land here
    tool.remove_mirror(nv)
    assert not nv.exists() and (lane / "nccl" / "include" / "nccl.h").read_text() == "lane nccl"
