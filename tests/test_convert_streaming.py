"""Streaming conversion: the kernel-copy plans equal the computed tensors, the memory cap refuses up front naming
the tensor, a failure or Ctrl-C in the middle leaves nothing, --verify refuses what would not fit, and the
writers' files are what torch / safetensors / transformers read."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from megatron_vlm.convert import copyplan
from megatron_vlm.convert import streaming as st
from megatron_vlm.convert.hf_io import HFReader, SafetensorsWriter
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

from .conftest import FAMILIES, script


def _no_copies(monkeypatch):
    monkeypatch.setattr(copyplan.RowPlan, "runs", lambda *a, **k: None)


def _all_copies(monkeypatch):
    monkeypatch.setattr(copyplan, "MIN_COPY_BYTES", 0)
    monkeypatch.setattr(copyplan, "SMALL_RUN", 512)  # the tiny models' runs take both ways


def _legacy_state(meg, tp, pp):
    from megatron_vlm import checkpoint as ckpt

    return {(t, p): ckpt.load_legacy_rank(meg / "release", t, p, pp)["model"] for t in range(tp) for p in range(pp)}


@pytest.mark.slow  # 8 conversions of each family (~5 s each family on an idle 2-core machine)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_kernel_copies_equal_computed_tensors(name, hf_models, tmp_path, monkeypatch):
    """Every output that the copy plans make (forced down to the smallest tensor) equals the one computed by
    mapping's own functions: legacy rank files at TP2xPP2 (row-parallel shards are column blocks of the HF rows),
    torch_dist blocks, and the HF files exported from both (byte for byte)."""
    src = hf_models[name]
    out = {}
    for how in ("copy", "compute"):
        with monkeypatch.context() as m:
            (_all_copies if how == "copy" else _no_copies)(m)
            for fmt in ("torch", "torch_dist"):
                meg = convert_hf_to_megatron(src, tmp_path / f"{how}-{fmt}", tp=2, pp=2, ckpt_format=fmt)
                out[(how, fmt)] = meg
                convert_megatron_to_hf(meg, tmp_path / f"{how}-{fmt}-hf")
    a, b = _legacy_state(out[("copy", "torch")], 2, 2), _legacy_state(out[("compute", "torch")], 2, 2)
    for rank in a:
        assert a[rank].keys() == b[rank].keys()
        for k in a[rank]:
            assert a[rank][k].dtype == b[rank][k].dtype and torch.equal(a[rank][k], b[rank][k]), (rank, k)
    for fmt in ("torch", "torch_dist"):
        copy_hf, comp_hf = tmp_path / f"copy-{fmt}-hf", tmp_path / f"compute-{fmt}-hf"
        files = sorted(p.name for p in comp_hf.glob("*.safetensors"))
        assert files and files == sorted(p.name for p in copy_hf.glob("*.safetensors"))
        for f in files:
            assert (copy_hf / f).read_bytes() == (comp_hf / f).read_bytes(), (fmt, f)
    orig, back = HFReader(src), HFReader(tmp_path / "copy-torch_dist-hf")
    assert orig.names() == back.names()
    for n in orig.names():
        assert torch.equal(orig.get(n), back.get(n)), n


def test_row_runs_follow_only_row_moves():
    """A proxy step that moves whole rows (or column blocks) gets a plan; one that mixes inside rows, casts or
    changes the row size does not."""
    loc = [copyplan.Located("a", 0, torch.bfloat16, (8, 64), None), copyplan.Located("b", 0, torch.bfloat16, (4, 64), None)]
    runs = copyplan.row_runs(lambda xs: torch.cat(xs), loc, (12, 64), torch.bfloat16)
    assert runs == [(0, 0, 0, 8 * 128), (1, 0, 8 * 128, 4 * 128)]
    runs = copyplan.row_runs(lambda xs: xs[0].chunk(2, dim=1)[1], loc[:1], (8, 32), torch.bfloat16)
    assert runs == [(0, r * 128 + 64, r * 64, 64) for r in range(8)]  # one column block per row
    pad = copyplan.row_runs(lambda xs: torch.cat([xs[0], xs[0].new_zeros(2, *xs[0].shape[1:])]), loc[:1], (10, 64),
                            torch.bfloat16)
    assert pad == [(0, 0, 0, 8 * 128)]  # padding rows stay holes
    for fn, shape, dtype in ((lambda xs: xs[0].flip(1), (8, 64), torch.bfloat16),
                             (lambda xs: xs[0].t(), (64, 8), torch.bfloat16),
                             (lambda xs: xs[0].float(), (8, 64), torch.float32),
                             (lambda xs: xs[0].reshape(16, 32), (16, 32), torch.bfloat16)):
        assert copyplan.row_runs(fn, loc[:1], shape, dtype) is None


def test_memory_cap_refuses_up_front_naming_the_tensor(hf_models, tmp_path, capsys):
    """A cap below what the largest computed tensor needs is refused before anything is written, naming that
    tensor; a cap that admits one tensor at a time converts, and the budget never held more than the cap allows."""
    src = hf_models["llama_clip"]
    held = st.anon_bytes()
    with pytest.raises(st.MemoryCapError, match=r"--max-memory.*word_embeddings.*needs about .*at least"):
        convert_hf_to_megatron(src, tmp_path / "m", dtype="fp16", max_memory=held)
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.tmp*"))
    from megatron_vlm.cli import run_cli

    assert run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(src), "--megatron-dir", str(tmp_path / "m"), "--dtype", "fp16",
                        "--max-memory", "1MB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --max-memory") and "needs about" in err and "raise --max-memory" in err
    peaks = []
    real = st.Budget.__init__

    def spy(self, limit):
        real(self, limit)
        peaks.append(self)

    import unittest.mock

    # the process's own memory is pinned at what it held before the first conversion: imports and allocator caches
    # grow it between calls (by ~100 MB on megatron-core's first import), which would make the cap's room random
    with unittest.mock.patch.object(st.Budget, "__init__", spy), \
            unittest.mock.patch.object(st, "anon_bytes", lambda: held):
        meg = convert_hf_to_megatron(src, tmp_path / "m", dtype="fp16", max_memory=held + st.SLACK + (1 << 20))
    assert (meg / "latest_checkpointed_iteration.txt").is_file()
    assert peaks and all(b.peak <= b.limit for b in peaks) and peaks[0].limit <= (1 << 20)


def test_size_flag():
    assert st.parse_size("16GB") == 16 * 10**9 and st.parse_size("800MiB") == 800 * 2**20
    assert st.parse_size("2") == 2 * 2**30 and st.parse_size("1.5 TB") == 1.5 * 10**12
    for bad in ("", "GB", "12 parsecs", "0", "-1GB"):
        with pytest.raises(ValueError):
            st.parse_size(bad)


@pytest.mark.parametrize("how", ["error", "ctrl-c"])
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_failure_midway_leaves_nothing(how, fmt, hf_models, tmp_path, monkeypatch):
    """A worker's failure, or Ctrl-C reaching the main thread while the workers copy, removes the half-written
    checkpoint (with --overwrite the previous one stays, byte for byte) and leaves no worker running."""
    src = hf_models["llama_clip"]
    old = convert_hf_to_megatron(src, tmp_path / "m", ckpt_format=fmt)
    before = {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    calls = []
    real = copyplan.copy_range

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:
            if how == "error":
                raise OSError(28, "No space left on device")
            os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread, as a terminal's Ctrl-C
            threading.Event().wait(1.0)
        return real(*args)

    monkeypatch.setattr(copyplan, "copy_range", failing)
    monkeypatch.setattr(copyplan, "SMALL_RUN", 0)  # every run by copy_range, even the tiny model's
    _all_copies(monkeypatch)
    threads = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt if how == "ctrl-c" else (OSError, Exception)):
        convert_hf_to_megatron(src, tmp_path / "m", ckpt_format=fmt, overwrite=True)
    assert len(calls) >= 5
    assert {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    new = [t for t in threading.enumerate() if t not in threads and t.name.startswith("convert-")]
    for t in new:
        t.join(1.0)  # (a thread that has returned may still be listed for a moment)
    assert not [t for t in new if t.is_alive()]


def test_verify_refuses_what_does_not_fit(hf_models, tmp_path, capsys):
    from megatron_vlm.cli import run_cli

    src = hf_models["llama_clip"]
    held = st.anon_bytes()
    args = ["--hf-dir", str(src), "--megatron-dir", str(tmp_path / "m"), "--verify", "--tp", "2",
            "--max-memory", f"{(held + st.SLACK + (16 << 20)) / 1e9:.3f}GB"]
    assert run_cli(script("convert/hf_to_megatron.py").main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --verify needs about") and "2 processes" in err and "nothing was written" in err
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".*"))


def test_safetensors_writer_plans_shards_and_any_order(tmp_path):
    """Shards of at most the limit, widest dtypes first, written in any order from several threads; safetensors
    and the index agree with what was written."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(100 + i, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
               for i in range(9)}
    tensors["ids"] = torch.arange(7)
    w = SafetensorsWriter(tmp_path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], max_shard_bytes=1000)
    names = list(tensors)[::-1]
    workers = [threading.Thread(target=lambda ns: [w.write(n, tensors[n]) for n in ns], args=(names[i::3],))
               for i in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    w.close()
    index = __import__("json").loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.getsize(tmp_path / s) <= 1000 + 1024 for s in shards)
    for n, t in tensors.items():
        with safe_open(str(tmp_path / index["weight_map"][n]), "pt") as f:
            assert torch.equal(f.get_tensor(n), t), n
