"""HF <-> Megatron conversion: logits at TP/PP, gradients at TP=2, exact round trips, resharding, controls."""

import json

import pytest
import torch

from megatron_vlm.convert import mapping
from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import (
    VerificationError,
    hf_logits,
    max_logit_diff,
    reference_batch,
    verify_checkpoint,
)
from megatron_vlm.runtime.spawn import run_world
from megatron_vlm.model.spec import VLMSpec
from tests.support import worlds

from .conftest import FAMILIES, script

TOL = 1e-4
PARALLEL = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def converted(hf_models, tmp_path_factory):
    """Each family converted once to torch_dist and once to legacy torch at TP2xPP2."""
    root = tmp_path_factory.mktemp("meg")
    out = {}
    for name in FAMILIES:
        out[(name, "torch_dist")] = convert_hf_to_megatron(hf_models[name], root / f"{name}_dist", tp=2, pp=2)
        out[(name, "torch")] = convert_hf_to_megatron(hf_models[name], root / f"{name}_legacy", tp=2, pp=2,
                                                      ckpt_format="torch")
    out[("llama3_clip", "uneven")] = convert_hf_to_megatron(hf_models["llama3_clip"], root / "uneven", tp=1, pp=2,
                                                            pp_layers=[2, 1], ckpt_format="torch")
    return out


@pytest.fixture(scope="module")
def world_logits(hf_models, converted, tmp_path_factory):
    """One 4-process world computes the Megatron logits of every (family, TP, PP) and resharding case."""
    resaved = tmp_path_factory.mktemp("resaved") / "tp2"
    jobs, keys = [], []
    for name in FAMILIES:
        for tp, pp in PARALLEL:
            jobs.append({"megatron_dir": str(converted[(name, "torch_dist")]), "tp": tp, "pp": pp})
            keys.append((name, "torch_dist", tp, pp))
        jobs.append({"megatron_dir": str(converted[(name, "torch")]), "tp": 2, "pp": 2})
        keys.append((name, "torch", 2, 2))
        # the core attention on torch's scaled_dot_product_attention (--attention-backend sdpa): GQA, TP, PP
        jobs.append({"megatron_dir": str(converted[(name, "torch_dist")]), "tp": 2, "pp": 2, "attention": "sdpa"})
        keys.append((name, "sdpa", 2, 2))
    jobs.append({"megatron_dir": str(converted[("llama3_clip", "uneven")]), "tp": 1, "pp": 2, "pp_layers": [2, 1]})
    keys.append(("llama3_clip", "uneven", 1, 2))
    # torch_dist saved by a TP=2 model (megatron's multi-rank save), then loaded at TP=1 and at PP=2.
    jobs.append({"megatron_dir": str(converted[("llama_clip", "torch_dist")]), "tp": 2, "pp": 1,
                 "save_to": str(resaved)})
    keys.append(("llama_clip", "saved_tp2", 2, 1))
    jobs.append({"megatron_dir": str(resaved), "tp": 1, "pp": 1})
    keys.append(("llama_clip", "resaved", 1, 1))
    jobs.append({"megatron_dir": str(resaved), "tp": 1, "pp": 2})
    keys.append(("llama_clip", "resaved", 1, 2))
    batches = {}
    results = {}
    for name in list(FAMILIES) + ["llama3_clip"]:
        spec = VLMSpec.from_hf_dir(hf_models[name])
        batches[name] = reference_batch(spec)
    # one 4-process world for every family (each job carries its family's batch): one start-up, not four
    for key, job in zip(keys, jobs):
        job["batch"] = batches[key[0]]
    for key, lg in zip(keys, run_world(worlds.logits_jobs, 4, jobs)[0]):
        results[key] = lg
    return results, batches


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("tp,pp", PARALLEL)
def test_logits_match_hf(name, tp, pp, hf_models, world_logits):
    results, batches = world_logits
    spec = VLMSpec.from_hf_dir(hf_models[name])
    ref = hf_logits(hf_models[name], batches[name])
    got = results[(name, "torch_dist", tp, pp)]
    assert got.shape[1] >= ref.shape[1] and got.shape[2] == spec.padded_vocab_size
    diff = max_logit_diff(ref, got[:, : ref.shape[1]], spec.vocab_size)
    assert diff < TOL, f"{name} tp={tp} pp={pp}: max |logit diff| {diff}"
    # the image sits at different positions in the two samples: both are checked above
    assert batches[name].tokens[0].tolist().index(spec.image_token_id) != batches[name].tokens[1].tolist().index(
        spec.image_token_id)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_legacy_format_logits(name, hf_models, world_logits):
    results, batches = world_logits
    spec = VLMSpec.from_hf_dir(hf_models[name])
    ref = hf_logits(hf_models[name], batches[name])
    assert max_logit_diff(ref, results[(name, "torch", 2, 2)], spec.vocab_size) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_sdpa_attention_logits(name, hf_models, world_logits):
    """--attention-backend sdpa (torch's fused attention as megatron's core attention, language and vision) at
    TP2 x PP2 gives HF's fp32 logits, as megatron's local attention does."""
    results, batches = world_logits
    spec = VLMSpec.from_hf_dir(hf_models[name])
    ref = hf_logits(hf_models[name], batches[name])
    assert max_logit_diff(ref, results[(name, "sdpa", 2, 2)], spec.vocab_size) < TOL


@pytest.mark.slow
def test_uneven_pipeline_split(hf_models, world_logits):
    results, batches = world_logits
    spec = VLMSpec.from_hf_dir(hf_models["llama3_clip"])
    ref = hf_logits(hf_models["llama3_clip"], batches["llama3_clip"])
    assert max_logit_diff(ref, results[("llama3_clip", "uneven", 1, 2)], spec.vocab_size) < TOL


@pytest.mark.slow
def test_torch_dist_saved_at_tp2_reshards_identically(world_logits):
    """A checkpoint saved by a TP=2 model loads at TP=1 and at PP=2 with bitwise-identical logits to the
    same layouts loaded from the original checkpoint (so the weights are identical)."""
    results, _ = world_logits
    for tp, pp in [(1, 1), (1, 2)]:
        assert torch.equal(results[("llama_clip", "resaved", tp, pp)], results[("llama_clip", "torch_dist", tp, pp)])
    tp2 = results[("llama_clip", "saved_tp2", 2, 1)]
    assert (tp2 - results[("llama_clip", "resaved", 1, 1)]).abs().max() < 1e-5  # only reduction order differs


#: fp32 gradients, relative to each tensor's norm (measured: at most 1.0e-6 over the 48 tensors of llama_clip at TP2)
GRAD_RTOL = 1e-5


@pytest.mark.slow
def test_gradients_match_hf_at_tp2(hf_models, converted):
    from transformers import LlavaForConditionalGeneration

    name = "llama_clip"
    spec = VLMSpec.from_hf_dir(hf_models[name])
    batch = reference_batch(spec)
    targets = torch.randint(0, spec.vocab_size, batch.hf_input_ids.shape, generator=torch.Generator().manual_seed(3))
    got = run_world(worlds.grads_job, 2, str(converted[(name, "torch_dist")]), 2, batch, targets)[0]

    model = LlavaForConditionalGeneration.from_pretrained(str(hf_models[name]), dtype=torch.float32)
    logits = model(input_ids=batch.hf_input_ids, pixel_values=batch.images).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    assert abs(loss.item() - got["loss"]) < 1e-5
    hf_grads = {mapping.canonical_hf_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    hf_grads = {_on_disk(n): g for n, g in hf_grads.items()}
    checked, worst = 0, 0.0
    for rule in mapping.rules(spec):
        ref = mapping.to_mcore(rule, [hf_grads[h] for h in rule.hf], spec)
        # relative to the tensor's own gradient (norm-wise): an absolute bound would pass a 10% error on the
        # ~1e-3 gradients of a tiny model's norms
        diff, size = (ref - got["grads"][rule.mcore]).norm().item(), ref.norm().item()
        assert size > 0 and diff <= GRAD_RTOL * size, f"grad of {rule.mcore} differs by {diff / size:.2e} of its norm"
        worst = max(worst, diff / size)
        checked += 1
    print(f"gradients at TP2 vs HF: worst relative difference {worst:.2e} over {checked} tensors")
    assert checked == len(mapping.rules(spec))


def _on_disk(module_name: str) -> str:
    """HF module parameter names (model.language_model.*) -> on-disk names used by the mapping."""
    return mapping.canonical_hf_name(module_name)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_round_trip_is_exact(name, fmt, hf_models, converted, tmp_path):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    out = convert_megatron_to_hf(converted[(name, fmt)], tmp_path / "hf")
    a, b = HFReader(hf_models[name]), HFReader(out)
    assert a.names() == b.names()
    for n in a.names():
        ta, tb = a.get(n), b.get(n)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), n
    assert LlavaConfig.from_pretrained(str(out)).to_dict()["text_config"]["vocab_size"] == VLMSpec.from_hf_dir(
        hf_models[name]).vocab_size
    LlavaForConditionalGeneration.from_pretrained(str(out))


def test_round_trip_bf16_and_sharded(hf_models, tmp_path):
    """--dtype bf16 then back: tensors equal the bf16 cast of the original; output in several shards."""
    src = hf_models["llama_clip"]
    meg = convert_hf_to_megatron(src, tmp_path / "m", tp=2, pp=1, dtype="bf16", ckpt_format="torch")
    out = convert_megatron_to_hf(meg, tmp_path / "hf", max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    a, b = HFReader(src), HFReader(out)
    for n in a.names():
        assert torch.equal(a.get(n).to(torch.bfloat16), b.get(n)), n


@pytest.fixture(scope="module")
def bf16_model(hf_models, tmp_path_factory):
    """llama_clip (llava-1.5's shape: Llama + CLIP, layer -2) saved in bf16, as llava-hf publishes it."""
    import shutil

    from transformers import LlavaForConditionalGeneration

    out = tmp_path_factory.mktemp("bf16") / "llava_bf16"
    shutil.copytree(hf_models["llama_clip"], out)
    (out / "model.safetensors").unlink()
    LlavaForConditionalGeneration.from_pretrained(str(hf_models["llama_clip"]), dtype=torch.bfloat16).save_pretrained(
        str(out))
    return out


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_round_trip_bf16_keeps_every_dtype_and_byte(fmt, bf16_model, tmp_path):
    """A bf16 model comes back byte-identical with every tensor in bf16, norms and conv1 included (megatron
    builds those in fp32 whatever params_dtype says)."""
    meg = convert_hf_to_megatron(bf16_model, tmp_path / "m", tp=2, pp=2, ckpt_format=fmt)
    out = convert_megatron_to_hf(meg, tmp_path / "hf")
    a, b = HFReader(bf16_model), HFReader(out)
    assert a.names() == b.names()
    assert {a.get(n).dtype for n in a.names()} == {torch.bfloat16}
    assert any("layernorm" in n or "layer_norm" in n for n in a.names())
    for n in a.names():
        ta, tb = a.get(n), b.get(n)
        assert tb.dtype == torch.bfloat16, f"{n} came back as {tb.dtype}"
        assert torch.equal(ta.view(torch.int16), tb.view(torch.int16)), n  # bytes, not values
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_padding_is_recorded_and_trimmed(hf_models, converted):
    spec = VLMSpec.load(converted[("llama_clip", "torch_dist")] / "release")
    assert spec.vocab_size % 128 != 0 and spec.padded_vocab_size % 128 == 0
    assert spec.padded_vocab_size > spec.vocab_size
    qspec = VLMSpec.from_hf_dir(hf_models["qwen2_siglip"])
    assert qspec.vocab_size % 64 == 0  # build_llava padded the HF embedding to a multiple of 64


def test_extra_tensors_travel(hf_models, converted):
    from megatron_vlm.checkpoint import layout as ckpt

    extra = ckpt.read_extra(converted[("qwen2_siglip", "torch_dist")] / "release")
    assert any(k.startswith("vision_tower.head.") for k in extra)  # SigLIP pooling head
    assert "vision_tower.post_layernorm.weight" in extra
    assert any(".encoder.layers.2." in k for k in extra)  # layer after vision_feature_layer=-2
    extra = ckpt.read_extra(converted[("mistral_clip_full", "torch_dist")] / "release")
    assert not any(".encoder.layers." in k for k in extra)  # vision_feature_layer=-1 uses all layers


@pytest.mark.slow
def test_verify_cli_passes(hf_models, tmp_path, capsys):
    script("convert/hf_to_megatron.py").main(["--hf-dir", str(hf_models["llama_clip"]), "--megatron-dir", str(tmp_path / "m"),
                         "--tp", "2", "--verify"])
    assert "verify: max |logit diff|" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["qkv_plain_concat", "gate_up_swapped"])
def test_negative_control_wrong_layout_fails_verification(broken, hf_models, tmp_path, monkeypatch):
    """The logit check has teeth: a wrong QKV interleave or a swapped SwiGLU is caught."""
    real = mapping.to_mcore

    def wrong(rule, hf, spec):
        if broken == "qkv_plain_concat" and rule.kind == "qkv" and rule.mcore.startswith("language_model"):
            return torch.cat(hf, dim=0)
        if broken == "gate_up_swapped" and rule.kind == "gated":
            return torch.cat(hf[::-1], dim=0)
        return real(rule, hf, spec)

    monkeypatch.setattr(mapping, "to_mcore", wrong)
    meg = convert_hf_to_megatron(hf_models["llama_clip"], tmp_path / "m", ckpt_format="torch")
    monkeypatch.setattr(mapping, "to_mcore", real)
    with pytest.raises(VerificationError, match="logits differ"):
        verify_checkpoint(hf_models["llama_clip"], meg, tp=1, pp=1)


def test_meta_model_holds_no_storage_where_cuda_is(hf_models, monkeypatch):
    """Where CUDA is, megatron-core's layers name ``torch.cuda.current_device()`` (``use_cpu_initialization`` is off)
    and its CLIP ViT calls ``.cuda()`` on a buffer: the converters' meta build must still make no tensor with data
    (the first H200 run, 2026-11-28, failed there: "Cannot copy out of meta tensor")."""
    from megatron_vlm.convert import mcore_io
    from megatron_vlm.runtime.session import single_process_world

    spec = VLMSpec.from_hf_dir(hf_models["llama_clip"])
    with single_process_world("cpu"):
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            model = mcore_io.meta_model(spec, torch.float32)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert tensors
    assert not [n for n, t in tensors.items() if not t.is_meta], "tensors with storage in the meta build"


def test_spec_json_round_trip(hf_models, converted):
    spec = VLMSpec.from_hf_dir(hf_models["llama_clip"])
    saved = VLMSpec.load(converted[("llama_clip", "torch_dist")])
    assert saved.to_json() == spec.to_json()
    assert VLMSpec.from_json(saved.to_json()) == saved
    assert json.loads(saved.to_json())["rope_scaling_factor"] == 8.0


def test_export_cli_iteration_dir_dtype_and_one_result_line(hf_models, tmp_path, capsys):
    """megatron_to_hf takes an iter_XXXXXXX directory of a run (the tokenizer comes from the run), --dtype (default:
    the checkpoint's), and an --iteration that names the same iteration; each converter prints its result once,
    and no progress bar writes a carriage return into a log (stderr is not a terminal here)."""
    from megatron_vlm.cli import run_cli

    h2m, m2h = script("convert/hf_to_megatron.py").main, script("convert/megatron_to_hf.py").main
    run = tmp_path / "runs" / "stage1"
    assert run_cli(h2m, ["--hf-dir", str(hf_models["llama_clip"]), "--megatron-dir", str(run), "--ckpt-format",
                         "torch"]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
    assert [ln for ln in (out.out + out.err).splitlines() if str(run) in ln] == [
        f"wrote torch checkpoint (tp=1 pp=1) to {run}"]
    (run / "release").rename(run / "iter_0000010")  # as training lays out a run
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    assert run_cli(m2h, ["--megatron-dir", str(run / "iter_0000010"), "--iteration", "10", "--hf-dir", str(fp32)]) == 0
    assert run_cli(m2h, ["--megatron-dir", str(run), "--dtype", "bf16", "--hf-dir", str(bf16)]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
    assert [ln for ln in (out.out + out.err).splitlines() if "wrote" in ln] == [
        f"wrote HF LLaVA model to {fp32}", f"wrote HF LLaVA model to {bf16}"]
    src, a, b = HFReader(hf_models["llama_clip"]), HFReader(fp32), HFReader(bf16)
    for n in src.names():
        assert a.get(n).dtype == torch.float32 and torch.equal(a.get(n), src.get(n)), n
        assert b.get(n).dtype == torch.bfloat16 and torch.equal(b.get(n), src.get(n).to(torch.bfloat16)), n
    assert [json.loads((d / "config.json").read_text())["dtype"] for d in (fp32, bf16)] == ["float32", "bfloat16"]
    assert (fp32 / "tokenizer_config.json").read_bytes() == (hf_models["llama_clip"] / "tokenizer_config.json").read_bytes()
