"""The cheap integrity checks of a checkpoint, on files made here (no model, no process): the checksum manifest
(:mod:`megatron_vlm.checkpoint.manifest`), legacy rank files, and the newest complete iteration a damaged run's message
names (:mod:`megatron_vlm.checkpoint.checks`). The trainer's use of them runs in tests/test_fault_drill.py, the
launcher's in tests/test_bad_inputs.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.checkpoint import manifest
from megatron_vlm.cli import InputError
from megatron_vlm.checkpoint.checks import (check_iteration_files, check_legacy_ranks, check_torch_file,
                                     newest_complete_iteration, resume_fix)


def _iteration(d, files: dict[str, bytes], meta: bool = True, with_manifest: bool = True):
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    if with_manifest:
        manifest.write(d, manifest.entries(d, manifest.files_of(d)))
    if meta:
        (d / "ckpt_meta.json").write_text(json.dumps({"format": "torch_dist"}))
    return d


def test_manifest_catches_a_changed_byte_that_sizes_cannot(tmp_path):
    d = _iteration(tmp_path / "iter_0000003", {"__0_0.distcp": b"a" * 5000, "__1_0.distcp": b"b" * 3000,
                                               "vlm_spec.json": b"{}"})
    files = manifest.read(d)
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp", "vlm_spec.json"]  # not itself, not ckpt_meta.json
    assert manifest.checksum_problems(d, files, sorted(files)) == []
    data = bytearray((d / "__1_0.distcp").read_bytes())
    data[1500] ^= 1
    (d / "__1_0.distcp").write_bytes(bytes(data))
    check_iteration_files(d)  # the cheap check reads sizes only: it passes
    problems = manifest.checksum_problems(d, files, sorted(files))
    assert len(problems) == 1 and "__1_0.distcp: its bytes changed after the save" in problems[0], problems
    (d / "__0_0.distcp").write_bytes(b"a" * 4999)
    with pytest.raises(InputError, match=r"__0_0.distcp: 4999 bytes, its checksums.json says 5000; the checkpoint "
                                         r"is damaged: re-save or re-convert it, or pick another --iteration"):
        check_iteration_files(d)
    (d / manifest.MANIFEST).write_text('{"algorithm": "crc32", "files": 3}')
    with pytest.raises(InputError, match="checksums.json: unreadable checksum manifest"):
        check_iteration_files(d)


def test_checkpoints_without_a_manifest_pass(tmp_path):
    d = _iteration(tmp_path / "iter_0000003", {"__0_0.distcp": b"x" * 10}, with_manifest=False)
    assert manifest.read(d) is None
    check_iteration_files(d)


def test_every_rank_checksums_a_balanced_share(tmp_path):
    names = [f"f{i}" for i in range(10)]
    sizes = {n: (i + 1) * 100 for i, n in enumerate(names)}
    shares = [manifest.share(names, sizes, 4, r) for r in range(4)]
    assert sorted(sum(shares, [])) == sorted(names)  # each file once
    loads = [sum(sizes[n] for n in s) for s in shares]
    assert max(loads) - min(loads) <= max(sizes.values()), loads
    assert shares == [manifest.share(list(reversed(names)), sizes, 4, r) for r in range(4)]  # same on every rank


def test_legacy_rank_files_are_checked_like_shards(tmp_path):
    d = tmp_path / "release"
    for t in range(2):
        (d / f"mp_rank_{t:02d}").mkdir(parents=True)
        torch.save({"model": {"w": torch.arange(5000.0)}}, d / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
    check_iteration_files(d)
    f = d / "mp_rank_01" / "model_optim_rng.pt"
    whole = f.read_bytes()
    for cut in (len(whole) - 30, len(whole) // 2):  # inside the zip directory, inside the data
        f.write_bytes(whole[:cut])
        with pytest.raises(InputError, match=r"mp_rank_01/model_optim_rng.pt: truncated"):
            check_iteration_files(d)
    f.unlink()
    with pytest.raises(InputError, match=r"mp_rank_01/model_optim_rng.pt: missing rank file \(.*the checkpoint spans "
                                         r"tp=2 pp=1\)"):
        check_legacy_ranks(d)
    old = tmp_path / "old.pt"  # torch's pre-zip format (Megatron-LM's oldest files): not checked, not refused
    torch.save({"w": torch.ones(3)}, old, _use_new_zipfile_serialization=False)
    check_torch_file(old, "fix")


def test_legacy_rank_files_megatron_lm_writes_at_expert_tp_1(tmp_path):
    """Megatron-LM writes a legacy checkpoint only on the ranks of expert data-parallel rank 0 (and since its #4678
    data-parallel rank 0): at TP2 x EP2 with ETP1 the files mp_rank_00_000 and mp_rank_01_001, which hold every
    shard between them. Before that fix, at TP2 x EP1 with ETP1 (TP > EP x ETP) it wrote mp_rank_00 alone, and no
    file holds TP rank 1's dense shards: refused, naming it and why."""
    from megatron_vlm.checkpoint import legacy_ranks

    d = _iteration(tmp_path / "etp1", {f"{n}/model_optim_rng.pt": b"x" for n in ("mp_rank_00_000", "mp_rank_01_001")},
                   meta=False, with_manifest=False)
    check_legacy_ranks(d)  # read as TP x PP the names would lack mp_rank_01_000; read as TP x EP they suffice
    src = legacy_ranks.Sources(d, legacy_ranks.present(d, expert_parallel=True), 2, 1, ep=2, etp=1, experts=True)
    assert [src.dense(t, 0) for t in range(2)] == [0, 1] and [src.experts(0, 0, e) for e in range(2)] == [0, 1]
    (d / "ckpt_meta.json").write_text(json.dumps({"format": "torch", "tp": 2, "pp": 1, "ep": 2, "etp": 1}))
    check_legacy_ranks(d)
    (d / "ckpt_meta.json").write_text(json.dumps({"format": "torch", "tp": 2, "pp": 1, "ep": 2, "etp": 2}))
    with pytest.raises(InputError, match=r"mp_rank_01_000/model_optim_rng.pt: missing rank file \(no rank file "
                                         r"holds expert-parallel rank 0's experts at expert tensor-parallel rank 1: "
                                         r"mp_rank_01_000; the checkpoint spans tp=2 pp=1 ep=2 etp=2\)"):
        check_legacy_ranks(d)  # at ETP2 each (TP, EP) file holds its own expert shards
    old = _iteration(tmp_path / "old", {"mp_rank_00/model_optim_rng.pt": b"x"}, meta=False, with_manifest=False)
    with pytest.raises(legacy_ranks.CheckpointLayoutError, match=r"mp_rank_01/model_optim_rng.pt: missing rank file "
                       r"\(no rank file holds tensor-parallel rank 1's shards of the dense tensors: mp_rank_01; .*"
                       r"Megatron-LM before NVIDIA/Megatron-LM#4678"):
        legacy_ranks.Sources(old, legacy_ranks.present(old), 2, 1, ep=1, etp=1, experts=True)


def test_the_newest_complete_iteration_is_named(tmp_path):
    run = tmp_path / "run"
    for it in (3, 6, 9):
        _iteration(run / f"iter_{it:07d}", {"__0_0.distcp": b"z" * 100})
    (run / "iter_0000009" / "__0_0.distcp").write_bytes(b"z" * 99)  # damaged
    _iteration(run / "iter_0000012", {"__0_0.distcp": b"z" * 100}, meta=False)  # a save that never finished
    assert newest_complete_iteration(run) == 6
    assert newest_complete_iteration(run, other_than=6) == 3
    assert resume_fix(run, 9) == ("resume from its newest complete iteration with --ckpt-step 6, or start a new run "
                                  "with another --name")
    assert resume_fix(tmp_path / "empty", 9).startswith("the run holds no other complete iteration")


def test_a_shard_torch_cannot_read_at_resume_names_ckpt_step(tmp_path, monkeypatch):
    """What a rank says when torch.distributed.checkpoint fails on the resumed iteration's files (a damage the
    launcher's size checks and a missing manifest let through): the error, the file, --ckpt-step and the newest
    complete iteration. A failure that is not damage (a tensor of another shape) keeps its own message."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_vlm.training import checkpointing, resume

    run = tmp_path / "run"
    for it in (3, 6):
        _iteration(run / f"iter_{it:07d}", {"__0_0.distcp": b"z" * 100})
    (run / "iter_0000006" / "ckpt_meta.json").write_text(json.dumps({
        "format": "torch_dist", "tp": 1, "pp": 1, "pp_layers": [2], "iteration": 6}))
    plan = resume.ResumePlan(str(run / "iter_0000006"), 6, True, False, False, 1234)
    training = SimpleNamespace(models=None, optimizer=None, scheduler=None)  # load() below never reaches them
    gone = FileNotFoundError(2, "No such file or directory", str(run / "iter_0000006" / "__1_0.distcp"))

    def fails(error):
        def load(*args, **kwargs):
            raise CheckpointException("load", {0: error})
        return load

    monkeypatch.setattr(checkpointing, "load", fails(gone))
    with pytest.raises(resume.ResumeError) as e:
        resume.restore(training, plan)
    msg = str(e.value)
    assert f"cannot resume the run in {run} from {run / 'iter_0000006'}: " in msg, msg
    assert "__1_0.distcp: no such file or directory" in msg, msg
    assert msg.endswith("resume from its newest complete iteration with --ckpt-step 3, or start a new run with "
                        "another --name"), msg
    from megatron.core.dist_checkpointing.core import CheckpointingException

    shape = CheckpointingException("Global shape mismatch for loaded (torch.Size([384, 64])) and expected ((512, 64)) "
                                   "tensor for key language_model.embedding.word_embeddings.weight")
    monkeypatch.setattr(checkpointing, "load", fails(shape))
    with pytest.raises(CheckpointException):
        resume.restore(training, plan)


def test_a_commit_is_flushed_in_order(tmp_path, monkeypatch):
    """A save's commit flushes every file (the shards, .metadata, the side files) and the directory, then renames
    it and flushes the run directory, then writes the tracker and flushes it and the run directory: after a power
    loss the tracker never names an iteration whose files are not on disk."""
    import os

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.training.checkpointing import commit_local

    run = tmp_path / "run"
    target = _iteration(run / ".iter_0000006.tmp-x", {"__0_0.distcp": b"d" * 10, ".metadata": b"m",
                                                      "sub/common.pt": b"c"})
    flushed = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    commit_local(target, run / "iter_0000006", run)
    ckpt.write_tracker(run, 6)
    files = {str(target / n) for n in ("__0_0.distcp", ".metadata", "sub/common.pt", "ckpt_meta.json",
                                       manifest.MANIFEST)}
    first_dir = flushed.index(str(target))
    assert files <= set(flushed[:first_dir]) and str(target / "sub") in flushed[:first_dir], flushed
    tracker = flushed.index(next(p for p in flushed if "latest_checkpointed_iteration" in p))
    assert flushed[first_dir + 1:tracker] == [str(run)], flushed  # the rename, before the tracker
    assert flushed[tracker + 1:] == [str(run)], flushed  # the tracker's own rename
    assert (run / "iter_0000006" / "__0_0.distcp").read_bytes() == b"d" * 10


def test_integrity_manifests_of_either_megatron_core(tmp_path):
    """A save's files as each lane records them: megatron-core 0.19 hashes the files it wrote (its integrity.json,
    SHA-256, checked by megatron-core on rank 0) and checksums.json has the rest; with 0.16 checksums.json has all.
    A changed byte in a shard or in a side file is named; --no-verify-integrity reads nothing."""
    from megatron_vlm.runtime import mcore_version
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.training.checkpointing import damaged_files

    d = tmp_path / "iter_0000003"
    d.mkdir()
    for name, data in (("__0_0.distcp", b"s" * 4096), (".metadata", b"m" * 64), ("metadata.json", b"{}")):
        (d / name).write_bytes(data)
    mcore = mcore_version.has_integrity_manifest()
    if mcore:
        from megatron.core.dist_checkpointing.validation import save_integrity_manifest

        save_integrity_manifest(str(d))  # what dist_checkpointing.save(..., verify_integrity=True) writes
    (d / "vlm_spec.json").write_text("{}")
    listed = manifest.mcore_listed(d)
    assert listed == ({"__0_0.distcp", ".metadata", "metadata.json"} if mcore else set())
    manifest.write(d, manifest.entries(d, [n for n in manifest.files_of(d) if n not in listed]))
    with single_process_world():
        assert damaged_files(d) == []
        shard = d / "__0_0.distcp"
        shard.write_bytes(b"s" * 2048 + b"x" + b"s" * 2047)
        (problem,) = damaged_files(d)
        assert problem.startswith(f"{shard}: its bytes changed after the save ("), problem
        assert ("SHA-256" in problem and "integrity.json" in problem) if mcore else "crc32" in problem, problem
        assert damaged_files(d, verify_integrity=False) == []
        shard.write_bytes(b"s" * 4096)
        (d / "vlm_spec.json").write_text("[]")
        assert damaged_files(d) == [f"{d / 'vlm_spec.json'}: its bytes changed after the save (crc32 "
                                    f"{manifest.crc32(d / 'vlm_spec.json')}, its checksums.json says "
                                    f"{manifest.read(d)['vlm_spec.json']['crc32']})"]
