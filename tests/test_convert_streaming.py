"""Streaming conversion: the kernel-copy plans equal the computed tensors, the memory cap refuses up front naming
the tensor, a failure or Ctrl-C in the middle leaves nothing, --verify refuses what would not fit, and the
writers' files are what torch / safetensors / transformers read."""

from __future__ import annotations

import errno
import gc
import io
import os
import signal
import threading

import pytest
import torch

from megatron_vlm.convert import copyplan, file_tensors
from megatron_vlm.convert import streaming as st
from megatron_vlm.convert.file_tensors import Located
from megatron_vlm.convert.hf_io import HFReader, SafetensorsWriter
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

from .conftest import FAMILIES, script


def _no_copies(monkeypatch):
    monkeypatch.setattr(copyplan.RowPlan, "runs", lambda *a, **k: None)


def _all_copies(monkeypatch):
    monkeypatch.setattr(copyplan, "MIN_COPY_BYTES", 0)
    monkeypatch.setattr(copyplan, "SMALL_RUN", 512)  # the tiny models' runs take both ways


def _legacy_state(meg, ep: int = 1):
    """Every rank file's model state, by (TP, PP, EP) rank; each file must pass zipfile's CRC check."""
    import zipfile

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.checkpoint import legacy_ranks

    it = meg / "release"
    ranks = legacy_ranks.present(it, ep > 1)
    _, pp, _ = legacy_ranks.legacy_layout_ep(it, ep > 1)
    out = {}
    for t, p, e in sorted(ranks):
        f = ckpt.legacy_rank_file(it, t, p, pp, e, ep)
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None, f  # every record's CRC-32 (written as 0 before the data was filled)
        out[(t, p, e)] = ckpt.load_legacy_rank(it, t, p, pp, ep_rank=e, ep=ep)["model"]
    return out


#: conversions of the kernel-copy test: the families at TP2 x PP2, and a Qwen3-MoE LLaVA (multi-head attention, so
#: that TP4 splits its 4 KV heads) at TP4 x PP2 x EP2 with experts whole (ETP1)
COPY_CASES = {**{name: dict(tp=2, pp=2) for name in FAMILIES}, "qwen3_moe_tp4": dict(tp=4, pp=2, ep=2, etp=1)}


@pytest.mark.slow  # 8 conversions of each case (~5 s each family on an idle 2-core machine)
@pytest.mark.parametrize("name", list(COPY_CASES))
def test_kernel_copies_equal_computed_tensors(name, hf_models, tmp_path, monkeypatch):
    """Every output that the copy plans make (forced down to the smallest tensor) equals the one computed by
    mapping's own functions: legacy rank files (row-parallel shards are column blocks of the HF rows; an EP rank's
    whole experts), torch_dist blocks, and the HF files exported from both (byte for byte); every rank file
    passes zipfile's CRC check. The MoE case takes the kernel copies for experts and TP4 shards both ways."""
    from megatron_vlm.convert import to_hf
    from megatron_vlm.convert import to_megatron as tm

    layout = COPY_CASES[name]
    if name in hf_models:
        src = hf_models[name]
    else:
        from tests.support.tiny import make_tiny_llava

        src = make_tiny_llava(tmp_path / "hf", "qwen3_moe", "clip", text_overrides=dict(
            num_hidden_layers=2, mlp_only_layers=[1], num_key_value_heads=4))
    copied = {"import": set(), "export": set()}
    real_task, real_plan = tm._Plan.task, to_hf._copy_plan

    def task(self, rule, outs, files):
        t = real_task(self, rule, outs, files)
        if t.run.__name__ == "copy":
            copied["import"].add(rule.mcore)
        return t

    def plan(source, rule, *args):
        runs = real_plan(source, rule, *args)
        if runs is not None:
            copied["export"].add(rule.mcore)
        return runs

    hinted = []  # (file name, offset, length) given to start_writeback during an export

    def writeback(fd, offset, n):
        hinted.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, n))

    monkeypatch.setattr(tm._Plan, "task", task)
    monkeypatch.setattr(to_hf, "_copy_plan", plan)
    for module in (copyplan, file_tensors):  # the two ways a target is filled: copied, or a tensor written
        monkeypatch.setattr(module, "start_writeback", writeback)
    out, exported = {}, []
    for how in ("copy", "compute"):
        with monkeypatch.context() as m:
            (_all_copies if how == "copy" else _no_copies)(m)
            for fmt in ("torch", "torch_dist"):
                meg = convert_hf_to_megatron(src, tmp_path / f"{how}-{fmt}", ckpt_format=fmt, **layout)
                out[(how, fmt)] = meg
                hinted.clear()
                convert_megatron_to_hf(meg, tmp_path / f"{how}-{fmt}-hf")
                exported.append((tmp_path / f"{how}-{fmt}-hf", sorted(hinted)))
        if how == "copy":
            for way, names in copied.items():
                assert any(".linear_proj." in n for n in names), (way, sorted(names))  # row-parallel shards
                if "ep" in layout:
                    assert any(".local_experts." in n for n in names), (way, sorted(names))
    a, b = _legacy_state(out[("copy", "torch")], layout.get("ep", 1)), \
        _legacy_state(out[("compute", "torch")], layout.get("ep", 1))
    assert len(a) == layout["tp"] * layout["pp"] * layout.get("ep", 1) and a.keys() == b.keys()
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
    for hf, ranges in exported:  # every tensor's bytes were handed to the disk once they were in place
        assert ranges == sorted(_tensor_ranges(hf)), hf.name


def _tensor_ranges(hf_dir):
    """``(file name, offset, length)`` of every tensor's bytes in the safetensors files of ``hf_dir``."""
    import json
    import struct

    out = []
    for f in hf_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out += [(f.name, 8 + n + a, b - a) for k, (a, b) in
                ((k, v["data_offsets"]) for k, v in header.items() if k != "__metadata__")]
    return out


def test_readahead_follows_the_tasks_and_stays_bounded(tmp_path, monkeypatch):
    """The read-ahead thread asks for the tasks' spans in their order, a device's read-ahead at a time, never more
    than ``ahead`` (plus one step) beyond the finished tasks, and ends when its run does, even while it waits."""
    import time

    paths = []
    for k in range(2):
        paths.append(str(tmp_path / f"src{k}"))
        with open(paths[-1], "wb") as f:
            f.write(os.urandom(64 << 10))
    asked = []
    lock = threading.Lock()

    def fadvise(fd, offset, n, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        with lock:
            asked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))

    def settled():
        while True:  # until the thread has stopped asking (it waits for finished tasks)
            with lock:
                n = len(asked)
            time.sleep(0.2)
            with lock:
                if len(asked) == n:
                    return n

    monkeypatch.setattr(st.os, "posix_fadvise", fadvise)
    monkeypatch.setattr(st, "device_readahead", lambda path: 4096)
    spans = [[(paths[0], 100, 10000)], [], [(paths[1], 0, 8192), (paths[0], 20000, 5000)], [(paths[1], 9000, 3000)]]
    with st.Readahead(spans, ahead=6000) as ra:
        assert settled() == 2  # 8192 of the first task's 10000: past 6000 by less than a step
        ra.finished(0)
        ra.finished(1)
        assert settled() == 5 and sum(n for *_, n in asked) == 10000 + 8192  # up to 6000 past the 10000 finished
        for k in (2, 3):
            ra.finished(k)
        settled()
    assert asked == [(paths[0], 100, 4096), (paths[0], 4196, 4096), (paths[0], 8292, 1808),
                     (paths[1], 0, 4096), (paths[1], 4096, 4096),
                     (paths[0], 20000, 4096), (paths[0], 24096, 904), (paths[1], 9000, 3000)]
    with st.Readahead(spans, ahead=0):  # leaves while its thread waits for the first task
        settled()
    assert not [t for t in threading.enumerate() if t.name == "readahead"]


def test_copies_take_the_kernel_only_page_aligned_and_writes_go_in_small_pieces(tmp_path, monkeypatch):
    """``copy_range`` copies in the kernel where source and output sit at one place of a page, through its buffer
    elsewhere; no write (a tensor's, a buffered copy's, a gathered one of short runs) hands the kernel more than
    ``WRITE_PIECE`` bytes (larger ones cost ~15x on a VM that hands free memory to its host, file_tensors); every
    way gives the source's bytes."""
    piece = file_tensors.WRITE_PIECE
    data = os.urandom(3 * piece + 12345)
    (tmp_path / "src").write_bytes(data)
    kernel, writes = [], []
    real_copy, real_pwrite, real_pwritev = os.copy_file_range, os.pwrite, os.pwritev
    monkeypatch.setattr(copyplan, "_KERNEL_COPY", [True])
    monkeypatch.setattr(os, "copy_file_range", lambda *a: kernel.append(a[2]) or real_copy(*a))
    monkeypatch.setattr(os, "pwrite", lambda fd, b, at: writes.append(memoryview(b).nbytes) or real_pwrite(fd, b, at))
    monkeypatch.setattr(os, "pwritev", lambda fd, bs, at: writes.append(sum(memoryview(b).nbytes for b in bs))
                        or real_pwritev(fd, bs, at))
    src = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        for so, do, aligned in ((0, 0, True), (4096, 8192 + 4096 * 3, True), (64, 0, False), (0, 2, False)):
            n = len(data) - so
            out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            try:
                kernel.clear()
                writes.clear()
                copyplan.copy_range(src, so, out, do, n)
                assert os.pread(out, n + 1, do) == data[so:], (so, do)
            finally:
                os.close(out)
            if aligned and not copyplan._KERNEL_COPY[0]:
                pytest.skip(f"{tmp_path}'s file system refuses copy_file_range: the kernel copy is not checked")
            assert (sum(kernel) == n and not writes) if aligned else (not kernel and max(writes) <= piece), (so, do)
        out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            writes.clear()
            file_tensors.write_all(out, data, 5)  # a computed tensor's bytes
            assert os.pread(out, len(data) + 1, 5) == data and max(writes) == piece
            # short runs (row-parallel shards' rows, gathered from the mapped source) covering 3 pieces and more
            row, rows = 1000, len(data) // 1000
            source = Located(str(tmp_path / "src"), 0, torch.uint8, (rows, row), lambda: None)
            target = file_tensors.Target(out, 0, torch.uint8, (rows, row))
            runs = [(0, (rows - 1 - k) * row, k * row, row) for k in range(rows)]  # the rows reversed
            writes.clear()
            files = copyplan.Files()
            try:
                copyplan.fill(target, None, [source], files, runs=runs)
            finally:
                files.close()
            got = os.pread(out, rows * row, 0)
            assert [got[k * row:(k + 1) * row] for k in range(rows)] == \
                [data[(rows - 1 - k) * row:(rows - k) * row] for k in range(rows)]
            assert len(writes) > 3 and max(writes) <= piece
        finally:
            os.close(out)
    finally:
        os.close(src)


def test_write_pieces_bench_measures_every_way(tmp_path, capsys, monkeypatch):
    """``bench/write_pieces.py`` (why WRITE_PIECE is 1 MiB) runs each way, checks its bytes (a broken copy stops
    it) and prints it against the aligned kernel copy (1.00 for that copy itself)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "write_pieces.py"
    spec = importlib.util.spec_from_file_location("write_pieces", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--size-mib", "3", "--rounds", "1", "--idle", "0", "--dir", str(tmp_path)])
    rows = {line[:36].strip(): line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert len(rows) == 7 and rows["copy_file_range, aligned"][-1] == "1.00", rows
    assert not list(tmp_path.iterdir())  # its files are gone
    real = copyplan.copy_range
    monkeypatch.setattr(copyplan, "copy_range", lambda s, so, d, do, n: real(s, so + 1, d, do, n - 1))  # off by one
    with pytest.raises(SystemExit, match="wrong bytes at offset 0"):
        bench.main(["--size-mib", "2", "--rounds", "1", "--idle", "0", "--dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_row_runs_follow_only_row_moves():
    """A proxy step that moves whole rows (or column blocks) gets a plan; one that mixes inside rows, casts or
    changes the row size does not."""
    loc = [Located("a", 0, torch.bfloat16, (8, 64), None), Located("b", 0, torch.bfloat16, (4, 64), None)]
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


class _Xor(io.RawIOBase):
    """A stream whose bytes are those of ``raw`` XOR 0x5A (a stand-in for a compressed item)."""

    def __init__(self, raw):
        super().__init__()
        self.raw = raw

    def readable(self):
        return True

    def readinto(self, b):
        data = self.raw.read(len(b))
        b[:len(data)] = bytes(x ^ 0x5A for x in data)
        return len(data)


def test_items_stored_through_a_transform_are_read_through_it_or_refused(hf_models, tmp_path, monkeypatch):
    """torch.distributed.checkpoint can store an item through a stream transform (``transform_descriptors``, e.g.
    ZStandard): the export reads it through the transform, never copying its stored bytes (every copy plan forced
    on, so the embedding would be copied otherwise), and refuses in one line where no extension undoes it."""
    import pickle

    from torch.distributed.checkpoint import _extension

    from megatron_vlm.checkpoint import layout as ckpt

    class Xor(_extension.StreamTransformExtension):
        @staticmethod
        def registry_name():
            return "mvlm-test-xor"

        @staticmethod
        def from_descriptor(version):
            return Xor()

        def get_descriptor(self):
            return "mvlm-test-xor/1"

        def transform_to(self, output):
            raise NotImplementedError

        def transform_from(self, input):
            return _Xor(input)

    src = hf_models["llama_clip"]
    iter_dir = convert_hf_to_megatron(src, tmp_path / "m") / "release"
    md = pickle.loads((iter_dir / ".metadata").read_bytes())
    index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn.endswith("word_embeddings.weight"))
    path = iter_dir / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset:info.offset + info.length] = bytes(x ^ 0x5A for x in data[info.offset:info.offset + info.length])
    path.write_bytes(bytes(data))
    info.transform_descriptors = [Xor().get_descriptor()]
    (iter_dir / ".metadata").write_bytes(pickle.dumps(md))
    _all_copies(monkeypatch)
    with pytest.raises(ckpt.CheckpointLayoutError, match=r"word_embeddings.weight is stored through "
                       r"torch.distributed.checkpoint transform\(s\) mvlm-test-xor/1, which this environment cannot "
                       r"undo \(.*\); read the checkpoint where the extension is installed"):
        convert_megatron_to_hf(tmp_path / "m", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    real = _extension.ExtensionRegistry.__init__

    def with_xor(self):
        real(self)
        self.register(Xor)

    monkeypatch.setattr(_extension.ExtensionRegistry, "__init__", with_xor)
    out = convert_megatron_to_hf(tmp_path / "m", tmp_path / "hf")
    orig, back = HFReader(src), HFReader(out)
    assert orig.names() == back.names()
    for n in orig.names():
        assert torch.equal(orig.get(n), back.get(n)), n


def test_memory_cap_refuses_up_front_naming_the_tensor(hf_models, tmp_path, capsys):
    """A cap below what the largest computed tensor needs is refused before anything is written, naming that
    tensor, by the function and by the command (what the cap does to real memory: the next test)."""
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
    assert not (tmp_path / "m").exists()


def _wide_vocab(src, out, rows: int):
    """``src`` (a tiny LLaVA) with ``rows`` embedding and output rows of random fp32 weights: two large tensors, each
    converted on its own (a cast to fp16 computes it), beside tiny ones."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = rows
    (out / "config.json").write_text(json.dumps(cfg))
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for k in list(weights):
        if k.endswith(("embed_tokens.weight", "lm_head.weight")):
            weights[k] = torch.randn(rows, weights[k].shape[1], generator=g)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


class _PeakAnon:
    """The process's anonymous memory (``streaming.anon_bytes``: what the cap covers), its highest value sampled
    every millisecond from another thread while the block runs."""

    def __enter__(self):
        self.peak, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, st.anon_bytes() or 0)
            self._done.wait(0.001)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


@pytest.mark.slow  # two conversions of a 0.2 GB model
def test_memory_cap_holds_the_process_real_memory(hf_models, tmp_path, monkeypatch):
    """Under --max-memory the process's real anonymous memory, sampled while it converts, stays below the cap that
    admits one large tensor at a time. The control lifts the budget: the two large tensors (embedding, output
    layer) are then made together (each held at its peak until the other is, a barrier) and the same real
    measure goes over the same cap. Each large task rests 50 ms at its peak so the sampler sees it, and reads the
    measure itself there too (in the control after the barrier, when both tensors are whole): the control's excess
    does not hang on a sampler thread being scheduled in time on a busy machine."""
    from megatron_vlm.convert import to_megatron

    # 400,001 rows: the vocabulary is padded (to 400,128), so each large tensor is made anew and then cast
    wide = _wide_vocab(hf_models["llama_clip"], tmp_path / "wide", 400_001)
    convert_hf_to_megatron(hf_models["llama_clip"], tmp_path / "warm", dtype="fp16")  # imports and allocator warm
    monkeypatch.setattr(st, "SLACK", 32 << 20)
    largest = []
    real_budget, real_cast = st.memory_budget, to_megatron._cast
    monkeypatch.setattr(st, "memory_budget", lambda tasks, *a: largest.append(max(t.cost for t in tasks))
                        or real_budget(tasks, *a))
    with pytest.raises(st.MemoryCapError, match=r"word_embeddings.weight needs about"):
        convert_hf_to_megatron(wide, tmp_path / "refused", dtype="fp16", max_memory=1)
    together, at_peak = [None], []

    def cast(t, dtype):
        out = real_cast(t, dtype)
        if out.numel() > 10_000_000:
            if together[0] is not None:
                together[0].wait(timeout=120)
            at_peak.append(st.anon_bytes() or 0)
            threading.Event().wait(0.05)
        return out

    monkeypatch.setattr(to_megatron, "_cast", cast)
    peaks = {}
    for run in ("capped", "control"):
        if run == "control":
            together[0] = threading.Barrier(2)
            monkeypatch.setattr(st.Budget, "acquire", lambda self, n, cancelled: True)
            monkeypatch.setattr(st.Budget, "release", lambda self, n: None)
        # the previous run's garbage (a tensor a reference cycle keeps until the collector runs) would count in the
        # baseline and hide the control's second tensor (the suite saw both runs' peaks equal): collected first
        gc.collect()
        held = st.anon_bytes()
        cap = held + st.SLACK + largest[0] + (4 << 20)
        at_peak.clear()
        with _PeakAnon() as seen:
            convert_hf_to_megatron(wide, tmp_path / run, dtype="fp16", max_memory=cap)
        assert len(at_peak) == 2, at_peak  # the embedding and the output layer each reached the hook
        peaks[run] = (max(seen.peak, *at_peak) - held, cap - held)
    assert peaks["capped"][0] <= peaks["capped"][1], peaks
    assert peaks["control"][0] > peaks["control"][1], peaks


def test_size_flag():
    assert st.parse_size("16GB") == 16 * 10**9 and st.parse_size("800MiB") == 800 * 2**20
    assert st.parse_size("2") == 2 * 2**30 and st.parse_size("1.5 TB") == 1.5 * 10**12
    for bad, why in (("", "is not a size"), ("GB", "is not a size"), ("12 parsecs", "is not a size"),
                     ("0", "must be more than zero"), ("-1GB", "is not a size")):
        with pytest.raises(ValueError, match=f"^{bad!r} {why}"):
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
    interrupted = threading.Event()

    def ctrl_c(signum, frame):  # Python's own SIGINT handling, and a mark that the main thread got it
        interrupted.set()
        raise KeyboardInterrupt

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:
            if how == "error":
                raise OSError(errno.ENOSPC, "No space left on device")
            os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread, as a terminal's Ctrl-C
            assert interrupted.wait(60)  # this copy goes on only once the main thread has the interrupt
        return real(*args)

    monkeypatch.setattr(copyplan, "copy_range", failing)
    monkeypatch.setattr(copyplan, "SMALL_RUN", 0)  # every run by copy_range, even the tiny model's
    _all_copies(monkeypatch)
    threads = set(threading.enumerate())
    previous = signal.signal(signal.SIGINT, ctrl_c)
    try:
        if how == "ctrl-c":
            with pytest.raises(KeyboardInterrupt):
                convert_hf_to_megatron(src, tmp_path / "m", ckpt_format=fmt, overwrite=True)
        else:
            with pytest.raises(OSError, match="No space left on device") as e:
                convert_hf_to_megatron(src, tmp_path / "m", ckpt_format=fmt, overwrite=True)
            assert e.value.errno == errno.ENOSPC
    finally:
        signal.signal(signal.SIGINT, previous)
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


def test_a_tensor_that_does_not_fit_its_slot_is_refused_naming_it(tmp_path):
    """``write_tensor`` (the path the export's extra tensors and the import's computed blocks take, without the
    writer's own check) holds a tensor to its planned slot: a wrong shape (one row too many: its bytes would run into
    the next tensor), a wrong dtype, the right bytes in another shape, are refused naming the tensor, and the file
    keeps the next tensor's bytes."""
    from safetensors import safe_open

    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.full((4,), 7.0)
    w = SafetensorsWriter(tmp_path, [("a", a.dtype, (2, 3)), ("b", b.dtype, (4,))])
    try:
        w.write("b", b)
        for wrong in (torch.ones(3, 3), a.double(), a.reshape(3, 2), a.to(torch.int32)):
            with pytest.raises(ValueError, match=r"^a: made .* but its slot in the output file holds torch.float32 "
                                                 r"\(2, 3\) \(24 bytes\); nothing was written"):
                file_tensors.write_tensor(w.target("a"), wrong)
        file_tensors.write_tensor(w.target("a"), a)
    finally:
        w.close()
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("a"), a) and torch.equal(f.get_tensor("b"), b)


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
