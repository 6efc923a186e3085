"""bench/gpu_quick.sh, the one prepared GPU command, end to end on CPU (``--tiny``: a tiny model, local layers, a few
iterations), so the command the GPU session runs cannot rot; bench/gpu.py's checks on a GPU (marked ``gpu``);
bench/gpu_prepare.py's part splitting (the old part-by-part path)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, script
from tests.data_fixtures import tiny_llava
from tests.test_gpu_kit import fake_wheel

pytestmark = pytest.mark.one_lane(
    "3.12",
    reason="rehearses the GPU kit, which runs in the GPU image's Python 3.12; the steps it times are held in "
           "both lanes by the modules named",
    covered_by=("test_convert", "test_train_reference", "test_te", "test_packing_equivalence", "test_moe"))


@pytest.mark.slow
def test_gpu_quick_tiny_runs_every_step_on_cpu(tmp_path):
    """Every step of the GPU command, in its own process: install from a kit (a hand-made wheel, with pip --no-index),
    set-up, HF vs Megatron logits (fp32, bf16), our training, the HF + SDPA loop on the same batches, the MoE row,
    the context-parallel rows, PP2 x VPP2 against PP2, the InternVL row, the gpu tests (skipped here), the report;
    results merged into one JSON as they come."""
    kit = tmp_path / "kit"
    fake_wheel(kit / "wheels", "mvlm-kit-probe", "1.0")
    out = tmp_path / "out"
    setup = tmp_path / "setup"  # kept: the --perf rehearsal below reuses it
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_quick.sh"), "--tiny", "--kit", str(kit), "--out", str(out),
                          "--setup", str(setup)],
                         env=dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path)), capture_output=True,
                         text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"]) for s in steps] == [(n, 0) for n in ("env", "install", "setup", "logits", "internvl",
                                                                        "pytest", "train", "hf", "cp", "vpp",
                                                                        "moe")]
    assert "all checks passed" in res.stdout and "step(s) failed" not in res.stdout
    rows = {(r["part"], r["impl"], r["dtype"]): r for r in json.loads((out / "gpu_bench.json").read_text())["rows"]}
    fp32, bf16 = rows[("logits", "local", "fp32")], rows[("logits", "local", "bf16")]
    assert fp32["ok"] and fp32["diff"] <= 1e-4 and fp32["tolerance"] == 1e-4
    yardstick = rows[("logits", "HF transformers", "bf16")]["diff"]
    assert bf16["ok"] and 0 < bf16["diff"] <= bf16["tolerance"] == pytest.approx(2 * yardstick + 1e-3)
    ours, hf = rows[("train", "local", "fp32")], rows[("train", "HF + SDPA loop", "fp32")]
    bench = script("bench/gpu.py")
    assert len(ours["losses"]) == bench.TINY["iters"] and all(math.isfinite(x) for x in ours["losses"])
    assert ours["losses"][-1] < ours["losses"][0] and ours["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0
    # same model, batches, optimizer and schedule in fp32: the two loops do the same work
    assert bench.curve_diff(hf["losses"], ours["losses"]) < 1e-3
    assert ours["vs_hf"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
    assert "local (--transformer-impl local; attention local (" in ours["note"]
    runs = (out / "train_runs.log").read_text()  # every run's log in one file (at most 8 files come back)
    assert "==== bf16_local: " in runs
    assert sorted(p.name for p in out.iterdir()) == ["gpu_bench.json", "gpu_quick.log", "steps.jsonl",
                                                     "train_runs.log"]
    # the MoE row: a Qwen3-MoE LLaVA at EP1, local layers on CPU (TE's grouped GEMM on the GPU)
    moe = rows[("moe", "local SequentialMLP, EP1", "fp32")]
    assert moe["ok"] and len(moe["losses"]) == bench.TINY["iters"] and moe["tokens_per_s"] > 0, moe
    assert moe["tflops"] > 0 and "4 experts (top 2" in moe["note"] and "local" in moe["note"]
    assert "==== moe_ep1_local: " in (out / "train_runs.log").read_text()
    assert not bench.not_measured(list(rows.values()))  # on CPU every check runs (two gloo ranks for CP2, PP2)
    # the context-parallel row: one long sample at CP1 and CP2 (2 gloo ranks here; TE's p2p attention on 2 GPUs)
    cp1, cp2 = rows[("cp", "local, CP1", "fp32")], rows[("cp", "local, CP2", "fp32")]
    assert cp1["ok"] and cp2["ok"] and cp2["diff"] <= 1e-5 and cp2["tolerance"] == 0.02, (cp1, cp2)
    assert cp1["positions"] == cp2["positions"] > 3 * 16 and cp2["peak_gib"] > 0 and cp2["memory_ratio"] > 0
    # virtual pipeline stages (issue 53's row): the set-up's 4-layer LM at PP2 and at PP2 x VPP2 (one layer per chunk),
    # two gloo ranks each: the same losses (fp32 on CPU: the schedules sum in other orders only)
    plain, inter = rows[("vpp", "local, PP2", "fp32")], rows[("vpp", "local, PP2 x VPP2", "fp32")]
    assert plain["ok"] and inter["ok"] and len(inter["losses"]) == bench.TINY["iters"]
    assert inter["diff"] == bench.curve_diff(inter["losses"], plain["losses"]) < 1e-5
    assert "--pp-layers 2,2, 2 chunks per rank of 1, 1 layers (interleaved 1F1B)" in inter["note"]
    assert inter["tokens_per_s"] > 0 and inter["speedup"] > 0
    assert "==== vpp2_local: " in (out / "train_runs.log").read_text()
    # the InternVL row: build_llava --arch internvl's model against HF's InternVLForConditionalGeneration, multi-tile
    ivl = {r["dtype"]: r for r in json.loads((out / "gpu_bench.json").read_text())["rows"] if r["part"] == "internvl"
           and r["impl"] == "local"}
    assert ivl["fp32"]["ok"] and ivl["fp32"]["diff"] <= 1e-5 and ivl["bf16"]["ok"], ivl
    assert "tiles per image [3, 1, 2]" in rows[("internvl", "HF transformers", "bf16")]["note"]
    log = (out / "gpu_quick.log").read_text()
    assert "== install: rc 0" in log and "skipped" in log  # pytest: the gpu tests skip without a GPU
    assert bench.curve_diff([1.0, 2.02], [1.0, 2.0]) == pytest.approx(0.01)
    assert (setup / "megatron").is_dir()
    perf_rehearsal(bench, setup, tmp_path / "perf")


def perf_rehearsal(bench, setup, out):
    """The parts of ``bench/gpu_quick.sh --perf`` (bench/gpu_steps/perf.py) on the kept set-up, in this process with
    the training runs forked (no second set-up, no interpreter starts): the profiled runs of ours and of the HF loop
    with their trace and table in $OUT, micro batch 4 against 2 with the host's share, SDPA against local attention
    and packed against padded, each compared with the row it names; the TE rows say they need --te."""
    import signal
    import tarfile

    from tests.support import forked_cli

    out.mkdir()
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        rc = bench.main(["--tiny", "--only", ",".join(bench.PERF_PARTS), "--inputs", str(setup), "--work-dir",
                         str(out), "--out", str(out / "gpu_bench.json")], run_command=forked_cli.run)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        bench.use_run_command(subprocess.run)
    assert rc == 0
    rows = {r["impl"]: r for r in json.loads((out / "gpu_bench.json").read_text())["rows"]}
    ours, hf = rows["ours local, mbs 2"], rows[bench.HF_ROW + ", profiled"]
    assert ours["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0 and hf["ok"], (ours, hf)
    assert ours["vs_hf"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
    assert bench.curve_diff(ours["losses"], hf["losses"]) < 1e-3  # the same work: fp32, same batches and schedule
    with tarfile.open(out / bench.perf.PROFILES) as tar:
        traces = tar.getnames()
        assert b"traceEvents" in __import__("gzip").decompress(tar.extractfile("hf_trace.json.gz").read())
    assert "Self CPU" in (out / bench.perf.TOP_OPS).read_text()
    if bench.perf.trainer_has("--profile"):
        assert ours["ok"] and any(t.startswith("ours_") for t in traces), traces
    else:
        assert rows["ours local, mbs 2, profile"]["note"].startswith("not measured: train/run.py has no --profile")
    big = rows["ours local, mbs 4"]
    assert big["ref"] == "ours local, mbs 2" and big["micro_batches"] == 1 and ours["micro_batches"] == 2
    assert big["speedup"] == pytest.approx(big["tokens_per_s"] / ours["tokens_per_s"]) and "host_share" in big
    packed = rows["ours local, packed"]
    assert packed["speedup"] == pytest.approx(packed["tokens_per_s"] / ours["tokens_per_s"])
    assert "--packed-seq-length 512" in packed["note"] and "host_share" not in packed
    if bench.perf.trainer_has("--attention-backend", "sdpa"):  # against an explicit local-attention run
        sdpa = rows["ours sdpa, mbs 2"]
        assert sdpa["ref"] == "ours local attention, mbs 2" and sdpa["ok"] and sdpa["diff"] < 1e-3, sdpa
        assert sdpa["speedup"] == pytest.approx(sdpa["tokens_per_s"] / rows[sdpa["ref"]]["tokens_per_s"])
    else:
        assert rows["ours sdpa, mbs 2"]["note"].startswith("not measured: train/run.py has no --attention-backend")
    assert rows["TE bf16, mbs 4"]["note"] == "not measured: Transformer Engine rows need --te (a kit with te/)"
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "gpu_bench.json", bench.perf.PROFILES, bench.perf.TOP_OPS, "train_runs.log"]


def test_perf_rows_compare_with_the_row_they_name_and_traces_fit_the_file_limit(tmp_path, monkeypatch):
    """perf_ratios: a row's speed-up over its ``ref``; the one-micro-batch row's host share of the n-micro-batch
    step, h = (t_n - t_1) / (n - 1), share n h / t_n (here t_4 = 1.0 s, t_1 = 0.7 s: h = 0.1 s, 40%).
    pack_profiles: traces that would take the archive over the file limit are left out, smallest kept."""
    import tarfile

    bench = script("bench/gpu.py")
    rows = bench.with_ratios([
        dict(part="perf", impl="ours local, mbs 4", dtype="bf16", tokens_per_s=100.0, s_per_iter=1.0,
             micro_batches=4, note=""),
        dict(part="perf", impl="ours local, mbs 16", dtype="bf16", tokens_per_s=140.0, s_per_iter=0.7,
             micro_batches=1, ref="ours local, mbs 4", note="one micro batch of 16"),
        dict(part="perf", impl="ours local, packed", dtype="bf16", tokens_per_s=150.0, s_per_iter=0.5,
             micro_batches=4, ref="ours local, mbs 4", note="packed"),
        dict(part="perf", impl=bench.HF_ROW + ", profiled", dtype="bf16", tokens_per_s=200.0, note="")])
    assert rows[1]["speedup"] == pytest.approx(1.4) and rows[1]["host_share"] == pytest.approx(0.4)
    assert "host share of the 4-micro-batch step ~40% (per micro batch 100 ms)" in rows[1]["note"]
    assert rows[2]["speedup"] == pytest.approx(1.5) and "host_share" not in rows[2]
    assert [r.get("vs_hf") for r in rows] == [0.5, 0.7, 0.75, None]
    monkeypatch.setattr(bench.perf, "MAX_FILE_BYTES", (64 << 10) + 3000)
    big, small = os.urandom(4000), b"x" * 100_000  # random bytes do not compress
    done = __import__("gzip").compress(b"y" * 1000)  # the trainer's trace comes gzip'd: kept as it is
    assert bench.perf.pack_profiles(tmp_path, {"big.json": big, "small.json": small, "ours.json.gz": done},
                                    {"t": "table"}) == ["big.json"]
    with tarfile.open(tmp_path / bench.perf.PROFILES) as tar:
        assert tar.getnames() == ["ours.json.gz", "small.json.gz"] and tar.extractfile("ours.json.gz").read() == done
    assert "big.json: trace left out" in (tmp_path / bench.perf.TOP_OPS).read_text()


@pytest.mark.slow  # bash processes (no Python start)
def test_gpu_quick_refuses_te_without_a_te_kit_and_bad_arguments(tmp_path):
    sh = str(ROOT / "bench" / "gpu_quick.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run(["bash", sh, "--te", "--kit", str(tmp_path), "--out", str(tmp_path / "o")], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "holds no Transformer Engine build" in res.stderr
    res = subprocess.run(["bash", sh, "--budget", "soon"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "whole numbers" in res.stderr


def test_vpp_rows_say_why_one_gpu_measures_nothing(tmp_path):
    """On a one-GPU machine the PP2 rows are not measured (NCCL runs one rank per GPU) and say so; the split that
    makes two chunks per rank of the full-size set-up's 22 layers is 12,10."""
    from types import SimpleNamespace

    bench = script("bench/gpu.py")
    assert bench.vpp_split(22) == [12, 10] and bench.vpp_split(4) == [2, 2] and bench.vpp_split(2) is None
    a = SimpleNamespace(impls=["transformer_engine"], layers=22, device="cpu", precision="bf16")
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are visible: the rows are measured (bench/gpu.py --only vpp)")
    a.device = "cuda"  # as on the lent machine: the device count decides
    rows = bench.check_vpp(a, tmp_path, tmp_path, tmp_path, tmp_path)
    assert [r["impl"] for r in rows] == ["transformer_engine, PP2", "transformer_engine, PP2 x VPP2"]
    assert all(r["ok"] is None and "PP2 needs 2 GPUs, this machine has" in r["note"] for r in rows)
    assert bench.not_measured(rows) == rows  # named in the verdict, not counted as passed


def test_the_verdict_names_every_check_that_did_not_run(tmp_path, capsys):
    """A row whose check could not run here says so in the closing line, with its reason, beside the checks that
    passed; reference and throughput rows (no check) do not."""
    bench = script("bench/gpu.py")
    rows = [dict(part="logits", impl="HF transformers", dtype="bf16", ok=None, note="the yardstick"),
            dict(part="logits", impl="local", dtype="fp32", ok=True),
            dict(part="cp", impl="local, CP2", dtype="bf16", ok=None, note="not measured: CP2 needs 2 GPUs, this "
                                                                            "machine has 1")]
    assert bench.verdict(rows) == "all checks passed; 1 not measured: cp local, CP2 (CP2 needs 2 GPUs, this machine " \
        "has 1)"
    assert bench.verdict(rows[:1]) == "no check ran"
    failed = dict(part="moe", impl="local", dtype="bf16", ok=False)
    assert bench.verdict([*rows, failed]).startswith("1 check(s) failed")
    results = tmp_path / "gpu_bench.json"
    bench.write_results(results, {}, rows)
    assert bench.main(["--report", str(results)]) == 0
    assert "all checks passed; 1 not measured: cp local, CP2" in capsys.readouterr().out


def test_report_of_a_timed_out_run(tmp_path, capsys):
    """What a command killed by its limit leaves: the rows measured so far, and the steps with their rc."""
    bench = script("bench/gpu.py")
    results, steps = tmp_path / "gpu_bench.json", tmp_path / "steps.jsonl"
    bench.write_results(results, {"gpu": "X"}, [dict(part="train", impl="local", dtype="bf16", tokens_per_s=300.0)])
    bench.write_results(results, {}, [dict(part="train", impl=bench.HF_ROW, dtype="bf16", tokens_per_s=200.0)])
    steps.write_text('{"step": "train", "rc": 0, "seconds": 50, "limit": 180}\n'
                     '{"step": "hf", "rc": 124, "seconds": 150, "limit": 150}\n')
    assert bench.main(["--report", str(results), "--steps", str(steps)]) == 1
    out = capsys.readouterr().out
    assert "TIMED OUT" in out and "no check ran; step(s) failed: hf" in out and " 1.50 " in out
    assert json.loads(results.read_text())["rows"][0]["vs_hf"] == 1.5


@pytest.mark.gpu
def test_local_layers_match_hf_on_gpu(tmp_path_factory):
    """Local (non-TE) layers on the GPU: fp32 logits with TF32 off within 1e-4 of HF, bf16 within the yardstick."""
    import torch

    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    bench = script("bench/gpu.py")
    hf = tiny_llava(tmp_path_factory, "llama", "clip")
    meg = convert_hf_to_megatron(hf, tmp_path_factory.mktemp("gpu_local") / "m")
    rows = bench.check_logits(hf, meg, ["local"], "cuda")
    # the HF yardstick is the one row without a check: a local row that could not be checked fails here
    assert [(r["impl"], r["dtype"], r["ok"]) for r in rows] == [
        ("HF transformers", "bf16", None), ("local", "fp32", True), ("local", "bf16", True)], rows
    assert torch.cuda.is_available()


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
