"""bench/gpu.py's plumbing on CPU (``--tiny``: local layers, a tiny model): the GPU session only has to run it."""

from __future__ import annotations

import json
import math

import pytest

from megatron_vlm.testing import forked_cli
from tests.conftest import script


@pytest.mark.slow
def test_gpu_bench_tiny_runs_on_cpu(tmp_path, capsys):
    bench = script("bench/gpu.py")
    out = tmp_path / "r.json"
    assert bench.main(["--tiny", "--out", str(out), "--work-dir", str(tmp_path)], run_command=forked_cli.run) == 0
    rows = {(r["part"], r["impl"], r["dtype"]): r for r in json.loads(out.read_text())["rows"]}
    fp32, bf16 = rows[("logits", "local", "fp32")], rows[("logits", "local", "bf16")]
    assert fp32["ok"] and fp32["diff"] <= 1e-4 and fp32["tolerance"] == 1e-4
    yardstick = rows[("logits", "HF transformers", "bf16")]["diff"]
    assert bf16["ok"] and 0 < bf16["diff"] <= bf16["tolerance"] == pytest.approx(2 * yardstick + 1e-3)
    train = rows[("train", "local", "fp32")]
    losses = train["losses"]
    assert len(losses) == bench.TINY["iters"] and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] and train["tokens_per_s"] > 0  # it trained, and the throughput was read
    assert bench.curve_diff([1.0, 2.02], [1.0, 2.0]) == pytest.approx(0.01)
    table = capsys.readouterr().out
    assert "all checks passed" in table and "local (--transformer-impl local)" in table


def test_gpu_prepare_parts_round_trip(tmp_path, capsys):
    prep = script("bench/gpu_prepare.py")
    archive = tmp_path / "stack.tar"
    archive.write_bytes(bytes(range(256)) * 10 + b"tail")  # 2564 bytes
    parts = prep.split(archive, tmp_path / "parts", part_bytes=1000)
    assert [p.stat().st_size for p in parts] == [1000, 1000, 564]
    # the GPU side: one part per run into the stash, then reassembly checked against the manifest
    stash = tmp_path / "stash"
    for p in parts[:2]:
        one = tmp_path / f"carry_{p.name}"
        one.mkdir()
        (one / p.name).write_bytes(p.read_bytes())
        (one / "MANIFEST.json").write_bytes((tmp_path / "parts" / "MANIFEST.json").read_bytes())
        assert prep.main(["stash", "--parts", str(one), "--stash", str(stash)]) == 0
    assert "missing: part-002" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="lacks part-002"):
        prep.join(stash, tmp_path / "out.tar")
    (stash / "part-002").write_bytes(parts[2].read_bytes())
    assert prep.join(stash, tmp_path / "out.tar").read_bytes() == archive.read_bytes()
    (stash / "part-001").write_bytes(b"x" * 1000)
    with pytest.raises(SystemExit, match="part-001 is corrupt"):
        prep.join(stash, tmp_path / "out.tar")


def test_gpu_prepare_pins_this_environment():
    import importlib.metadata as md

    pins = script("bench/gpu_prepare.py").closure()
    assert pins["megatron-core"] == md.version("megatron-core") and "megatron-energon" in pins
    assert "webdataset" in pins and "multi-storage-client" in pins  # energon's own dependencies come along
    assert not any(n in pins for n in ("torch", "triton")) and not any(n.startswith("nvidia-") for n in pins)
