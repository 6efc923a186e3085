#!/usr/bin/env python
"""How the converters' ways of writing bytes into a new file compare on this machine (not a test).

Writes --size-mib of a file held in the page cache to a new file, with its fsync, each way --rounds times (the ways
interleaved, --idle seconds of rest before each, so that memory freed by the last one has gone back to where idle
memory goes): ``os.pwrite`` from memory in pieces of 64 KiB, 1 MiB, 2 MiB and 8 MiB; ``os.copy_file_range`` (``cp``'s
kernel copy) with source and output offsets at one place of a page, and 64 bytes apart; and the converters' own
``copyplan.copy_range`` on offsets 64 bytes apart. It prints each way's seconds and CPU seconds and, per way, its
fastest time over the fastest page-aligned ``copy_file_range``'s (each way's output is checked byte for byte
after its clock stops): where a write of 2 MiB or more costs many times a 1 MiB one (a VM that hands free memory
back to its host), ``file_tensors.WRITE_PIECE`` is why the converters write in pieces of 1 MiB.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vlm.convert import copyplan  # noqa: E402

MIS = 64  # bytes between the source's and the output's place in a page, for the misaligned ways


def _timed(out_path: str, size: int, fill, expected: memoryview) -> tuple[float, float]:
    """Seconds and CPU seconds of ``fill`` with the fsync; then (untimed) the file must hold ``expected``."""
    fd = os.open(out_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size + MIS)
        t, c = time.perf_counter(), time.process_time()
        fill(fd)
        os.fsync(fd)
        took = time.perf_counter() - t, time.process_time() - c
        for off in range(0, len(expected), 1 << 20):
            if os.pread(fd, min(1 << 20, len(expected) - off), off) != expected[off:off + (1 << 20)]:
                raise SystemExit(f"{out_path}: wrong bytes at offset {off} or after: this way of writing is broken")
        return took
    finally:
        os.close(fd)
        os.unlink(out_path)


def ways(src_fd: int, data: memoryview, size: int) -> dict:
    """Name -> ``(fill(fd), the source offset it copies from)``: each way writes the source's bytes from that offset
    on to offset 0 of ``fd``."""
    def pieces(k):
        def fill(fd):
            for off in range(0, size, k):
                os.pwrite(fd, data[off:off + k], off)
        return fill

    def kernel(shift):
        def fill(fd):
            s, d, n = shift, 0, size - shift
            while n:
                k = os.copy_file_range(src_fd, fd, n, s, d)
                s, d, n = s + k, d + k, n - k
        return fill

    out = {f"pwrite, {k >> 10} KiB pieces": (pieces(k), 0) for k in (64 << 10, 1 << 20, 2 << 20, 8 << 20)}
    out["copy_file_range, aligned"] = kernel(0), 0
    out[f"copy_file_range, {MIS} B apart"] = kernel(MIS), MIS
    out[f"copyplan.copy_range, {MIS} B apart"] = (lambda fd: copyplan.copy_range(src_fd, MIS, fd, 0, size - MIS)), MIS
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="bytes to write each time, in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=2, help="times each way is measured (default 2)")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of rest before each measurement (default 5)")
    p.add_argument("--dir", default=None, help="directory for the two files (default: a new one under /tmp)")
    a = p.parse_args(argv)
    size = a.size_mib << 20
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="write-pieces-") as d:
        src = os.path.join(d, "src")
        with open(src, "wb") as f:
            for off in range(0, size, 1 << 20):
                f.write(os.urandom(min(1 << 20, size - off)))
        src_fd = os.open(src, os.O_RDONLY)
        try:
            data = memoryview(bytearray(os.pread(src_fd, size, 0)))  # in memory, and the file in the page cache
            todo = ways(src_fd, data, size)
            measured = {name: [] for name in todo}
            for r in range(a.rounds):
                for name, (fill, shift) in todo.items():
                    time.sleep(a.idle)
                    measured[name].append(_timed(os.path.join(d, "out"), size, fill, data[shift:]))
                    print(f"round {r + 1}: {name}: {measured[name][-1][0]:.2f} s", file=sys.stderr, flush=True)
        finally:
            os.close(src_fd)
    ref = min(t for t, _ in measured["copy_file_range, aligned"])
    print(f"{a.size_mib} MiB to a new file, with fsync ({a.rounds} rounds, {a.idle:g} s idle before each)")
    print(f"{'way':36s} {'seconds':>20s} {'CPU seconds':>20s} {'fastest, x aligned copy':>24s}")
    for name, v in measured.items():
        secs = " ".join(f"{t:.2f}" for t, _ in v)
        cpu = " ".join(f"{c:.2f}" for _, c in v)
        print(f"{name:36s} {secs:>20s} {cpu:>20s} {min(t for t, _ in v) / ref:>24.2f}")


if __name__ == "__main__":
    main()
