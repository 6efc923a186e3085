"""--verify: bounded memory at any vocabulary and sequence length, the same strict verdict, nothing left behind
when it fails, and progress lines while it runs (issue 27, items 4 and 10)."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_vlm.convert import verify
from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import VerificationError, verify_checkpoint
from megatron_vlm.model.spec import VLMSpec

from .conftest import script


class LargestLogits(TorchDispatchMode):
    """Records the largest tensor allocated (views of an op's inputs excluded) whose last dimension spans the
    vocabulary, in rows (positions): full-vocabulary logits of a whole batch or sample show up here, model weights
    ([vocab, hidden]) do not."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows, self.seen = vocab, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] >= self.vocab and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.rows = max(self.rows, t.numel() // t.shape[-1])
                self.seen += 1
        return out


@pytest.fixture(scope="module")
def tp1_checkpoint(hf_models, tmp_path_factory):
    return convert_hf_to_megatron(hf_models["llama_clip"], tmp_path_factory.mktemp("verify") / "m", tp=1)


def test_logits_are_formed_a_chunk_of_positions_at_a_time(hf_models, tp1_checkpoint, tmp_path, monkeypatch, caplog):
    """Neither side ever holds more than CHUNK_BYTES of logits: full-vocabulary fp32 logits of a batch (4 x 7k
    positions x 152k for OneVision: 18 GB per side) were what ran a real-geometry --verify out of memory. At
    TP=PP=1 the whole verification runs in this process, so every tensor it allocates is seen here.

    The verdict stays as strict: the max |difference| over every position and every true vocabulary entry. A
    change of one lm_head row (the last real token: the last column that counts, in every chunk) fails it."""
    from safetensors.torch import load_file, save_file

    spec = VLMSpec.from_hf_dir(hf_models["llama_clip"])
    batch = verify.reference_batch(spec)
    rows = 5  # a batch holds 2 x 27 positions: 11 chunks of at most 5
    monkeypatch.setattr(verify, "CHUNK_BYTES", rows * 4 * spec.padded_vocab_size, raising=False)
    caplog.set_level(logging.INFO, logger="megatron_vlm.convert.verify")
    with LargestLogits(spec.vocab_size) as seen:
        diff = verify_checkpoint(hf_models["llama_clip"], tp1_checkpoint)
    assert diff < 1e-5
    assert seen.seen > 0 and seen.rows <= rows, f"logits of {seen.rows} rows ({seen.rows / rows:.0f}x the chunk)"
    assert batch.num_samples * batch.combined_length > 10 * rows  # the old whole-batch logits would be 11x over
    # progress: a line per HF sample, per compared sample and for the Megatron load (verify at PP2 was ~60 s silent)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("verify: ")]
    assert lines[:3] == [f"verify: HF forward, sample {b} of 2 (27 positions)" for b in (1, 2)] + [
        "verify: loading the checkpoint into a tp=1 pp=1 Megatron model"]
    assert len(lines) == 5 and all(re.fullmatch(rf"verify: sample {b} of 2 \(27 positions\): max \|logit diff\| "
                                                r"[0-9.e+-]+", ln) for b, ln in zip((1, 2), lines[3:])), lines

    hf = tmp_path / "hf"
    shutil.copytree(hf_models["llama_clip"], hf)
    weights = load_file(hf / "model.safetensors")
    head = next(k for k in weights if k.endswith("lm_head.weight"))
    assert weights[head].shape[0] == spec.vocab_size  # its last row is the last column that counts
    weights[head][spec.vocab_size - 1] += 1e-2
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    with LargestLogits(spec.vocab_size) as seen, \
            pytest.raises(VerificationError, match=r"logits differ by 0\.\d+ > 0.0001"):
        verify_checkpoint(hf, tp1_checkpoint)
    assert seen.rows <= rows


def test_failed_verify_leaves_no_checkpoint(hf_models, tmp_path, capsys):
    """A checkpoint that fails --verify is deleted before it is committed; with --overwrite the previous
    checkpoint stays as it was."""
    h2m = script("convert/hf_to_megatron.py")
    from megatron_vlm.cli import run_cli

    out = tmp_path / "meg"
    # bf16 rounding of an fp32 model is far above the default 1e-4 tolerance
    args = ["--hf-dir", str(hf_models["llama_clip"]), "--megatron-dir", str(out), "--dtype", "bf16", "--verify"]
    assert run_cli(h2m.main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --verify: logits differ by ") and f"nothing was written to {out}" in err
    assert "raise --tolerance" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    # a good checkpoint there, then a failing --overwrite: the good one is untouched
    assert run_cli(h2m.main, args[:-3] + ["--ckpt-format", "torch"]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert run_cli(h2m.main, args + ["--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the previous checkpoint in {out} is unchanged" in err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meg"]


def test_verify_memory_counts_every_rank_of_an_expert_parallel_world(tmp_path):
    """--verify at EP > 1 runs a world with data-parallel replicas (each EP rank beside a TP group), and every
    replica holds its own copy of the dense weights: the estimate counts what the ranks load, here the bytes of
    the legacy rank file each rank of megatron-core's layout loads (megatron-core's RankGenerator places the ranks),
    more than HF's one fp32 copy that the estimate counted before."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_vlm.checkpoint import layout as ckpt
    from tests.support.tiny import make_tiny_llava

    hf = make_tiny_llava(tmp_path / "moe", "qwen3_moe", "clip", text_overrides=dict(num_hidden_layers=2,
                                                                                     mlp_only_layers=[1]))
    spec = VLMSpec.from_hf_dir(hf)
    hf_bytes = 4 * sum(t.numel() for t in map(HFReader(hf).view, HFReader(hf).names()))
    for tp, ep, etp in ((1, 2, None),):  # 2 ranks: 2 data-parallel replicas of the dense weights, an EP rank each
        meg = convert_hf_to_megatron(hf, tmp_path / f"tp{tp}ep{ep}", tp=tp, ep=ep, etp=etp, ckpt_format="torch",
                                     dtype="fp32")
        world = verify.world_size(tp, 1, ep, etp)
        dense = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=etp or tp, ep=ep, dp=world // ((etp or tp) * ep), pp=1, cp=1,
                               order="tp-cp-ep-dp-pp")
        tp_rank = {g: grp.index(g) for grp in dense.get_ranks("tp") for g in grp}
        ep_rank = {g: grp.index(g) for grp in expert.get_ranks("ep") for g in grp}
        loaded = 0
        for g in range(world):
            state = ckpt.load_legacy_rank(meg / "release", tp_rank[g], 0, 1, ep_rank=ep_rank[g], ep=ep)["model"]
            loaded += sum(4 * v.numel() for v in state.values() if isinstance(v, torch.Tensor))
        assert loaded > 1.5 * hf_bytes  # the dense weights once per data-parallel replica (most of this model)
        assert verify.megatron_weight_bytes(spec, tp, 1, ep, etp) == loaded, (tp, ep, etp)
        need, parts = verify.memory_needed(hf, spec, tp, 1, 0, ep, etp)
        base, _ = verify.memory_needed(hf, spec, tp, 1, 0)  # the same TP without experts split: one copy
        assert need - base == loaded - max(hf_bytes, verify.megatron_weight_bytes(spec, tp, 1)), parts
