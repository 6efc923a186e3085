"""Checkpoints interoperable with Megatron-LM: export what Megatron-LM writes, write what it reads.

**What the "Megatron-LM checkpoints" here are: our own imitation of Megatron-LM's format.** Megatron-LM is not
installed in either lane, so no checkpoint in this module was written by Megatron-LM's code. They are written by
:mod:`tests.support.worlds` (megatron-core's own model and chunks, saved with megatron-core's ``dist_checkpointing``
and ``torch.save``) in the layout Megatron-LM's ``megatron/training/checkpointing.py`` gives its files, as read from
that file's source: the entry names (``model``; ``model0``, ``model1`` for chunks), the key convention, ``args``,
``checkpoint_version``, the tracker and the ``mp_rank_TT[_PPP][_EEE]`` names. What the tests show is that what we
read and write agrees with that reading of Megatron-LM's source; a difference between it and what Megatron-LM's code
really writes would not show here. (The MoE fixture of ``tests/fixtures/mcore-0.16-moe``, by contrast, was written by
megatron-core 0.16 itself, through the trainer.)

One 2-process world (TP=2) writes, from a converted checkpoint, imitations of the checkpoints Megatron-LM's
``checkpointing.py`` writes: torch_dist with Transformer Engine norm names and ``_extra_state`` objects at
``iter_0000007`` + tracker with ``args``, torch_dist with local names at ``release`` without ``args``, and legacy
``mp_rank_XX`` rank files; none carries megatron-vlm's side files. Each is exported with only an HF config and
compared with the source HF model (logits in fp32 and every tensor's bytes). The same world writes, from
megatron-core's own model chunks at PP2 x VPP2 (virtual pipeline stages, issue 51) with the uneven split 4,2, a LLaVA
of six language layers (chunks of 2, 1, 2, 1 layers) in the layout Megatron-LM's ``generate_state_dict`` gives a list
of chunks (torch_dist with ``model0``/``model1`` entries; legacy rank files with them, each chunk's layers numbered
from 0): our imitation, not a checkpoint of a Megatron-LM run. Both export to the source HF model byte for byte, and
``hf_to_megatron.py --ckpt-format torch --pp 2 --pp-layers 4,2 --num-virtual-stages-per-pipeline-rank 2 --verify``
(HF's logits against the interleaved schedule's) writes exactly the imitation's entries, names and tensors.
"""

import json
import logging
import shutil

import pytest
import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.megatron_lm import MismatchError
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import hf_logits, max_logit_diff, reference_batch
from megatron_vlm.runtime.spawn import run_world
from megatron_vlm.model.spec import SPEC_FILE, VLMSpec
from tests.support import worlds

from .conftest import script

pytestmark = pytest.mark.slow

TOL = 1e-4
NAME = "llama_clip"
OTHER = "qwen2_siglip"
VPP = "pp2vpp2"  # a 6-layer LLaVA in Megatron-LM's layout at PP2 (4,2) x VPP2 (our imitation of it)
VPP_LAYERS = [4, 2]


@pytest.fixture(scope="module")
def written(hf_models, tmp_path_factory):
    """Megatron-LM-style checkpoints (our imitation of its format, :mod:`tests.support.worlds`) of llama_clip and of
    qwen2_siglip (tied embeddings, qkv bias, no class token), written in one world."""
    from tests.support.tiny import make_tiny_llava

    root = tmp_path_factory.mktemp("mlm")
    out = {}
    for name in (NAME, OTHER):
        converted = convert_hf_to_megatron(hf_models[name], root / f"{name}_converted")
        spec = VLMSpec.from_hf_dir(hf_models[name])
        batch = reference_batch(spec)
        out[name] = {"root": root / name, "converted": converted, "spec": spec, "batch": batch,
                     "ref": hf_logits(hf_models[name], batch)}
    jobs = [(str(v["converted"]), str(v["root"])) for v in out.values()]
    six = make_tiny_llava(root / "six_hf", text_overrides={"num_hidden_layers": sum(VPP_LAYERS)})
    out[VPP] = {"hf": six, "root": root / VPP, "converted": convert_hf_to_megatron(six, root / "six_converted")}
    run_world(worlds.megatron_lm_checkpoints, 2, jobs + [(str(out[VPP]["converted"]), str(out[VPP]["root"]),
                                                          "pp2vpp2", VPP_LAYERS)])
    return out


@pytest.fixture(scope="module")
def mlm(written):
    return written[NAME]


def _assert_same_model(src, out, mlm):
    diff = max_logit_diff(mlm["ref"], hf_logits(out, mlm["batch"]), mlm["spec"].vocab_size)
    assert diff < TOL, f"max |logit diff| {diff}"
    a, b = HFReader(src), HFReader(out)
    assert a.names() == b.names()
    for n in a.names():
        ta, tb = a.get(n), b.get(n)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), n
    return diff


def test_converted_checkpoints_use_megatron_lm_keys(mlm):
    from megatron.core import dist_checkpointing

    iter_dir = mlm["converted"] / "release"
    assert ckpt.dist_key_layout(iter_dir) == ckpt.DistKeyLayout("", True)
    keys = list(dist_checkpointing.load_tensors_metadata(str(iter_dir)))
    assert "language_model.embedding.word_embeddings.weight" in keys
    assert "language_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert not [k for k in keys if k.startswith("model.")]


def test_torch_dist_te_names_exports_to_hf(hf_models, mlm, tmp_path, capsys):
    from megatron.core import dist_checkpointing

    d = mlm["root"] / "dist_te"
    assert (d / ckpt.TRACKER).read_text() == "7"
    iter_dir = d / "iter_0000007"
    assert not (iter_dir / ckpt.META).exists() and not (iter_dir / SPEC_FILE).exists()
    assert ckpt.dist_key_layout(iter_dir) == ckpt.DistKeyLayout("", True)
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    assert common["args"].tensor_model_parallel_size == 2 and common["iteration"] == 7
    assert list(iter_dir.glob("*.distcp"))
    out = tmp_path / "hf"
    script("convert/megatron_to_hf.py").main(["--megatron-dir", str(d), "--hf-config", str(hf_models[NAME]),
                                              "--hf-dir", str(out)])
    assert "wrote HF LLaVA model" in capsys.readouterr().out
    _assert_same_model(hf_models[NAME], out, mlm)
    assert (out / "tokenizer.json").is_file() and (out / "processor_config.json").is_file()


def test_torch_dist_local_names_release_exports_to_hf(hf_models, mlm, tmp_path):
    d = mlm["root"] / "dist_local"
    assert ckpt.dist_key_layout(d / "release") == ckpt.DistKeyLayout("", False)
    out = convert_megatron_to_hf(d, tmp_path / "hf", hf_config=hf_models[NAME] / "config.json")
    _assert_same_model(hf_models[NAME], out, mlm)


def test_legacy_tp2_exports_to_hf(hf_models, mlm, tmp_path):
    iter_dir = mlm["root"] / "legacy" / "iter_0000007"
    assert ckpt.legacy_layout(iter_dir) == (2, 1)
    rank0 = ckpt.load_legacy_rank(iter_dir, 0, 0, 1)  # weights_only: args and TE extra state are safe globals
    assert rank0["args"].tensor_model_parallel_size == 2
    assert any(k.endswith("linear_qkv.layer_norm_weight") for k in rank0["model"])
    assert any(k.endswith("_extra_state") for k in rank0["model"])
    out = convert_megatron_to_hf(mlm["root"] / "legacy", tmp_path / "hf", hf_config=hf_models[NAME], tp=2)
    _assert_same_model(hf_models[NAME], out, mlm)


@pytest.mark.parametrize("fmt", ["dist", "legacy"])
def test_megatron_lm_virtual_pipeline_checkpoints_export(fmt, written, tmp_path):
    """Checkpoints in Megatron-LM's layout of a PP2 (4,2) x VPP2 run (our imitation, written from megatron-core's
    chunks by tests.support.worlds; model0/model1 entries; legacy: each chunk's layers numbered from 0, args saying
    virtual_pipeline_model_parallel_size=2) export with only the HF config to the source model, every tensor's
    bytes."""
    w = written[VPP]
    iter_dir = w["root"] / fmt / "iter_0000003"
    if fmt == "legacy":
        for rank, want in ((0, ["0", "1"]), (1, ["0"])):
            f = ckpt.load_legacy_rank(iter_dir, 0, rank, 2)
            assert "model" not in f and f["args"].virtual_pipeline_model_parallel_size == 2
            layers = {k: sorted({n.split(".")[3] for n in f[k] if n.startswith("language_model.decoder.layers.")})
                      for k in ("model0", "model1")}
            assert layers == {"model0": want, "model1": want}, (rank, layers)
        assert "language_model.output_layer.weight" in f["model1"] and "vision_projection.encoder.linear_fc1.weight" \
            in ckpt.load_legacy_rank(iter_dir, 0, 0, 2)["model0"]
    out = convert_megatron_to_hf(w["root"] / fmt, tmp_path / "hf", hf_config=w["hf"])
    a, b = HFReader(w["hf"]), HFReader(out)
    assert a.names() == b.names()
    for n in a.names():
        assert a.get(n).dtype == b.get(n).dtype and torch.equal(a.get(n), b.get(n)), n


def test_hf_to_megatron_writes_megatron_lms_virtual_pipeline_rank_files(written, tmp_path, capsys):
    """hf_to_megatron --ckpt-format torch at PP2 (4,2) x VPP2, checked by --verify (HF's fp32 logits against the
    interleaved schedule's over the four chunks of 2, 1, 2 and 1 layers), writes what the imitation of Megatron-LM's
    rank files holds: in each rank file the entries model0 and model1 with megatron-core's chunk state dicts' names
    (local layer numbers) and tensors; the checkpoint records vpp=2, and a layout mismatch on load names the flag."""
    w = written[VPP]
    script("convert/hf_to_megatron.py").main([
        "--hf-dir", str(w["hf"]), "--megatron-dir", str(tmp_path / "meg"), "--ckpt-format", "torch", "--pp", "2",
        "--pp-layers", ",".join(map(str, VPP_LAYERS)), "--num-virtual-stages-per-pipeline-rank", "2", "--verify"])
    out = capsys.readouterr().out
    assert "wrote torch checkpoint (tp=1 pp=2 vpp=2)" in out and "verify: max |logit diff| HF vs Megatron (fp32, " \
        "tp=1 pp=2 vpp=2) = " in out, out
    ours = tmp_path / "meg" / "release"
    assert ckpt.CheckpointMeta.load(ours).vpp == 2 and ckpt.CheckpointMeta.load(ours).stage_layers == [2, 1, 2, 1]
    theirs = w["root"] / "legacy" / "iter_0000003"
    for rank in range(2):
        a, b = ckpt.load_legacy_rank(ours, 0, rank, 2), ckpt.load_legacy_rank(theirs, 0, rank, 2)
        assert sorted(k for k in a if k.startswith("model")) == ["model0", "model1"]
        for key in ("model0", "model1"):
            x, y = ckpt.normalize_legacy_names(a[key]), ckpt.normalize_legacy_names(b[key])
            assert sorted(x) == sorted(y), (rank, key, sorted(set(x) ^ set(y)))
            for n in x:
                assert x[n].dtype == y[n].dtype and torch.equal(x[n], y[n]), (rank, key, n)
    spec = VLMSpec.load(ours)
    with pytest.raises(ckpt.CheckpointLayoutError, match="written at tp=1 pp=2 vpp=2, which cannot be loaded at tp=1 "
                                                         "pp=2 vpp=1; use --tp 1 --pp 2 "
                                                         "--num-virtual-stages-per-pipeline-rank 2, or convert it"):
        ckpt.check_meta(ckpt.CheckpointMeta.load(ours), spec, 1, 2, ours)


@pytest.mark.parametrize("fmt", ["dist_te", "legacy"])
def test_qwen2_siglip_tied_embeddings_export(fmt, hf_models, written, tmp_path):
    out = convert_megatron_to_hf(written[OTHER]["root"] / fmt, tmp_path / "hf", hf_config=hf_models[OTHER])
    _assert_same_model(hf_models[OTHER], out, written[OTHER])


def test_old_model_prefix_checkpoint_still_loads(hf_models, mlm, tmp_path):
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world

    old, new = mlm["root"] / "old_prefix" / "release", mlm["converted"] / "release"
    assert ckpt.dist_key_layout(old) == ckpt.DistKeyLayout(ckpt.OLD_PREFIX, True)
    out = convert_megatron_to_hf(mlm["root"] / "old_prefix", tmp_path / "hf", tokenizer_dir=hf_models[NAME])
    _assert_same_model(hf_models[NAME], out, mlm)
    with single_process_world():
        states = []
        for d in (old, new):
            model = build_model(mlm["spec"], ModelOptions(perform_initialization=False, seq_length=64))
            ckpt.load_model_weights(model, d)
            states.append({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def _config_dir(hf_dir, tmp_path, edit=None, tokenizer=True):
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    if edit:
        edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    if tokenizer:
        for p in hf_dir.iterdir():
            if p.name.startswith(("tokenizer", "processor", "chat_template", "generation")):
                shutil.copy(p, d / p.name)
    return d


@pytest.mark.parametrize("case,edit,message", [
    ("hidden", lambda c: c["text_config"].update(hidden_size=128),
     r"hidden size \(text_config.hidden_size\) = 128, but the checkpoint .* has 64"),
    ("vocab", lambda c: c["text_config"].update(vocab_size=c["text_config"]["vocab_size"] + 500),
     r"vocab_size=\d+ \(text_config.vocab_size\), but the checkpoint .* has an embedding of 384 rows"),
    ("layers", lambda c: c["text_config"].update(num_hidden_layers=3),
     r"args.num_layers=2|language layers \(text_config.num_hidden_layers\) = 3, but the checkpoint .* has 2"),
    ("vit", lambda c: c.update(vision_feature_layer=-1),
     r"vision_feature_layer=-1 of 3 vision layers makes LLaVA read the output of 3 layers, but the checkpoint .* "
     r"holds a ViT of 2 layers .* set vision_feature_layer to -2"),
])
def test_wrong_hf_config_is_refused(case, edit, message, hf_models, mlm, tmp_path):
    bad = _config_dir(hf_models[NAME], tmp_path, edit, tokenizer=False)
    fmt = "legacy" if case == "layers" else "dist_te"
    with pytest.raises(MismatchError, match=message):
        convert_megatron_to_hf(mlm["root"] / fmt, tmp_path / "hf", hf_config=bad)
    assert not (tmp_path / "hf").exists()


def test_megatron_lm_checkpoint_without_hf_config_is_refused(mlm, tmp_path):
    with pytest.raises(ckpt.CheckpointLayoutError, match="pass --hf-config"):
        convert_megatron_to_hf(mlm["root"] / "dist_te", tmp_path / "hf")


def test_hf_config_of_another_model_is_refused_for_our_checkpoint(hf_models, mlm, tmp_path):
    with pytest.raises(MismatchError, match=r"gives num_layers=3, but .* holds num_layers=2 \(its vlm_spec.json\)"):
        convert_megatron_to_hf(mlm["converted"], tmp_path / "hf", hf_config=hf_models["llama3_clip"])


def test_hf_only_tensors_are_initialised_without_hf_weights(hf_models, mlm, tmp_path, caplog):
    """With a config (and tokenizer) but no weights, the vision layer after vision_feature_layer and the
    post layernorm are initialised with a warning; LLaVA's logits are unchanged."""
    cfg = _config_dir(hf_models[NAME], tmp_path)
    with caplog.at_level(logging.WARNING, logger="megatron_vlm.convert.megatron_lm"):
        out = convert_megatron_to_hf(mlm["root"] / "dist_te", tmp_path / "hf", hf_config=cfg)
    assert "do not affect its outputs" in caplog.text
    diff = max_logit_diff(mlm["ref"], hf_logits(out, mlm["batch"]), mlm["spec"].vocab_size)
    assert diff < TOL
    got = HFReader(out)
    assert torch.equal(got.get("vision_tower.post_layernorm.weight"), torch.ones(32))
    assert torch.equal(got.get("vision_tower.encoder.layers.2.layer_norm1.bias"), torch.zeros(32))
    assert got.names() == HFReader(hf_models[NAME]).names()


@pytest.fixture(scope="module")
def moe_written(tmp_path_factory):
    """A Qwen3-MoE LLaVA (3 MoE layers, 1 dense) in the layout Megatron-LM writes at TP2 x EP2 (our imitation,
    tests.support.worlds): torch_dist, and legacy rank files with SequentialMLP's and with TEGroupedMLP's expert
    names."""
    from tests.support.tiny import make_tiny_llava

    root = tmp_path_factory.mktemp("mlm_moe")
    hf = make_tiny_llava(root / "hf", "qwen3_moe", "clip", text_overrides=dict(num_hidden_layers=4,
                                                                                 mlp_only_layers=[2]))
    converted = convert_hf_to_megatron(hf, root / "converted")
    run_world(worlds.megatron_lm_moe_checkpoints, 4, str(converted), str(root / "mlm"))
    return hf, root / "mlm"


@pytest.mark.parametrize("kind", ["dist", "legacy_sequential", "legacy_grouped", "legacy_etp1"])
def test_megatron_lm_moe_checkpoints_export(kind, moe_written, tmp_path, capsys):
    """Each exports byte for byte; at ETP1 from the two rank files Megatron-LM writes there (by its source; through
    the command, whose up-front checks read Megatron-LM's mp_rank_TT_EEE names either way)."""
    hf, mlm = moe_written
    iter_dir = mlm / kind / "iter_0000005"
    if kind != "dist":
        every = ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
        assert sorted(p.name for p in iter_dir.glob("mp_rank_*")) == (
            ["mp_rank_00_000", "mp_rank_01_001"] if kind == "legacy_etp1" else every)
        keys = ckpt.load_legacy_rank(iter_dir, 1, 0, 1, ep_rank=1, ep=2)["model"]
        grouped = "language_model.decoder.layers.0.mlp.experts.linear_fc1.weight1"
        sequential = "language_model.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
        assert (grouped in keys, sequential in keys) == ((True, False) if kind == "legacy_grouped" else (False, True))
    out = tmp_path / "hf"
    if kind == "legacy_etp1":
        script("convert/megatron_to_hf.py").main(["--megatron-dir", str(mlm / kind), "--hf-config", str(hf),
                                                  "--hf-dir", str(out)])
        assert "wrote HF LLaVA model" in capsys.readouterr().out
    else:
        convert_megatron_to_hf(mlm / kind, out, hf_config=hf)
    a, b = HFReader(hf), HFReader(out)
    assert a.names() == b.names() and any(".mlp.experts.3.gate_proj." in n for n in a.names())
    for n in a.names():
        assert a.get(n).dtype == b.get(n).dtype and torch.equal(a.get(n), b.get(n)), n


def test_megatron_lm_moe_checkpoint_without_a_shard_is_refused(moe_written, tmp_path, capsys):
    """At ETP1 without mp_rank_01_001 no file holds TP rank 1's dense shards (nor EP rank 1's experts): the command
    refuses in one line naming the file, before anything is written."""
    from megatron_vlm.cli import run_cli

    hf, mlm = moe_written
    part = tmp_path / "mlm"
    shutil.copytree(mlm / "legacy_etp1", part)
    shutil.rmtree(part / "iter_0000005" / "mp_rank_01_001")
    with pytest.raises(ckpt.CheckpointLayoutError, match=r"mp_rank_01_000/model_optim_rng.pt: missing rank file \(no "
                       r"rank file holds tensor-parallel rank 1's shards of the dense tensors: mp_rank_01_000 or "
                       r"mp_rank_01_001; the checkpoint spans tp=2 pp=1 ep=2 etp=1\); the checkpoint is incomplete$"):
        convert_megatron_to_hf(part, tmp_path / "hf", hf_config=hf)
    args = ["--megatron-dir", str(part), "--hf-config", str(hf), "--hf-dir", str(tmp_path / "hf")]
    assert run_cli(script("convert/megatron_to_hf.py").main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "mp_rank_01" in err and "missing rank file" in err, err
    assert not (tmp_path / "hf").exists()


def test_megatron_lm_moe_checkpoint_with_other_experts_is_refused(moe_written, tmp_path):
    from tests.support.tiny import make_tiny_llava

    hf, mlm = moe_written
    other = make_tiny_llava(tmp_path / "other", "qwen3_moe", "clip",
                            text_overrides=dict(num_hidden_layers=4, mlp_only_layers=[2], num_experts=8))
    with pytest.raises(MismatchError, match="experts .* = 8, but the checkpoint .* has 4"):
        convert_megatron_to_hf(mlm / "legacy_grouped", tmp_path / "hf", hf_config=other)
