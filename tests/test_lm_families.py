"""The current LM families in every LLaVA architecture: Qwen3 (q/k RMSNorm per head, head_dim set on its own, tied
and untied embeddings, rope_theta 5e6, 151,936 rows for the real 151,669-entry tokenizer), Llama-3.2 (tied, llama3
rope scaling of factor 32, checked past position 8,192), a Mistral-NeMo head_dim, multi-head attention and GQA with
several query groups per rank at TP2; TP larger than the KV heads and SigLIP2 NaFlex refused in one line.

Models are random-weight, built with the real ``build_llava``; the Qwen3 ones from the real hub config and tokenizer
(``../shared/hub``, shrunk in size only, :func:`tests.support.hub_models.qwen3_text_model`). One 4-process world
computes Megatron's fp32 logits of every model at its TP/PP layouts; each is compared with HF's own model.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_vlm.convert.hf_io import HFReader
from megatron_vlm.convert.to_hf import convert_megatron_to_hf
from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
from megatron_vlm.convert.verify import hf_logits, reference_batch
from megatron_vlm.model.spec import ParallelismError, UnsupportedArchitectureError, VLMSpec
from tests.support.round_trip import assert_same_bytes

from .conftest import script

#: fp32 logits against HF's: measured 2.5e-7 to 6.3e-7 over every model and layout (the 8,463-position batch: 4.8e-7);
#: a wrong rope factor gives 8.4e-4 on the long batch, a wrong RMSNorm epsilon ~3e-3 (docs/architecture.md)
TOL = 1e-5
ALL = [(1, 1), (2, 1), (1, 2), (2, 2)]
TP2 = [(2, 1), (2, 2)]
LONG = 8448  # text positions of the rope-scaling batch: past Llama-3's original 8,192
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _qwen3(root, arch, vision, tied=True):
    from megatron_vlm.convert.build import build_llava
    from tests.support import hub_models
    from tests.support.tiny import make_vision_model

    lm = hub_models.qwen3_text_model(root / "lm", tie_word_embeddings=tied)
    if vision == "siglip":
        vit = hub_models.siglip_vision_model(root / "vit", image_size=20, patch_size=6)
        kw = dict(vision_feature_layer=-1)
    else:
        vit, kw = make_vision_model(root / "vit", "clip"), {}
    return build_llava(lm, vit, root / "hf", arch=arch, max_grid=3, vision_aspect_ratio="anyres_max_2", **kw)


def _tiny(root, family, **text):
    from tests.support.tiny import make_tiny_llava

    return make_tiny_llava(root / "hf", family, "clip", text_overrides=text)


#: name -> (builder(root), the (TP, PP) layouts checked against HF)
MODELS = {
    # Qwen3-4B's layout (tied) as plain LLaVA + SigLIP; Qwen3-8B's (untied) as LLaVA-NeXT + CLIP; OneVision + SigLIP
    "qwen3_llava": (lambda r: _qwen3(r, "llava", "siglip"), ALL),
    "qwen3_next_untied": (lambda r: _qwen3(r, "llava_next", "clip", tied=False), ALL),
    "qwen3_onevision": (lambda r: _qwen3(r, "llava_onevision", "siglip"), ALL),
    # Llama-3.2-1B/3B: tied embeddings, llama3 rope scaling of factor 32 (the long batch below checks it)
    "llama32": (lambda r: _tiny(r, "llama", tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE,
                                num_attention_heads=2, num_key_value_heads=2), ALL),
    # Mistral-NeMo: head_dim 128 with hidden 5120 and 32 heads (160 each), shrunk to 16 with hidden 80 and 4 heads
    "nemo_head_dim": (lambda r: _tiny(r, "mistral", hidden_size=80, head_dim=16), ALL),
    # llava-1.5 (vicuna): multi-head attention, 4 heads and 4 KV heads, at TP2
    "mha": (lambda r: _tiny(r, "llama", num_key_value_heads=4), TP2),
    # GQA 8 heads / 4 KV heads: two query groups per rank at TP2
    "gqa_8_4": (lambda r: _tiny(r, "llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4), TP2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name) for name, (build, _) in MODELS.items()}


@pytest.mark.slow  # builds the module's models (~30 s)
def test_specs(models):
    """What each family's spec holds: Qwen3's q/k norms, head_dim, rope_theta, rows and embedding tie."""
    from transformers import AutoTokenizer

    q = VLMSpec.from_hf_dir(models["qwen3_llava"])
    assert (q.text_family, q.qk_layernorm, q.qkv_bias, q.kv_channels, q.hidden_size, q.num_attention_heads) == \
        ("qwen3", True, False, 32, 64, 4)
    assert (q.rotary_base, q.vocab_size, q.tie_word_embeddings, q.image_token_id) == (5e6, 151936, True, 151669)
    assert len(AutoTokenizer.from_pretrained(str(models["qwen3_llava"]))) == 151670  # 151,669 + <image>
    ov = VLMSpec.from_hf_dir(models["qwen3_onevision"])
    assert (ov.vocab_size, ov.image_token_id, ov.video_token_id) == (151936, 151669, 151670)
    assert not VLMSpec.from_hf_dir(models["qwen3_next_untied"]).tie_word_embeddings
    ll = VLMSpec.from_hf_dir(models["llama32"])
    assert (ll.rope_scaling_factor, ll.tie_word_embeddings, ll.qk_layernorm) == (32.0, True, False)
    nemo = VLMSpec.from_hf_dir(models["nemo_head_dim"])
    assert (nemo.hidden_size, nemo.num_attention_heads, nemo.kv_channels) == (80, 4, 16)


@pytest.mark.slow  # builds the module's models (~30 s)
def test_tp_larger_than_kv_heads_is_refused_naming_the_largest(models):
    spec = VLMSpec.from_hf_dir(models["gqa_8_4"])
    with pytest.raises(ParallelismError) as e:
        spec.check_parallelism(8, 1)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("the largest --tp that works is 4"), msg
    assert "--tp 8 is larger than the 4 KV heads" in msg
    assert VLMSpec.from_hf_dir(models["qwen3_llava"]).largest_tp() == 2  # 2 KV heads
    assert spec.check_parallelism(4, 1) == [2]


def test_siglip2_naflex_is_refused_in_one_line(tmp_path):
    """SigLIP2 fixed-resolution checkpoints are model_type 'siglip' (they build like SigLIP); NaFlex ones are not."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    from megatron_vlm.convert.build import build_llava
    from tests.support.tiny import make_text_model

    Siglip2VisionModel(Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, patch_size=8)).save_pretrained(tmp_path / "v")
    with pytest.raises(UnsupportedArchitectureError) as e:
        build_llava(make_text_model(tmp_path / "t"), tmp_path / "v", tmp_path / "out")
    assert "\n" not in str(e.value) and "model_type 'siglip2' (SigLIP2 NaFlex" in str(e.value)
    assert "use a fixed-resolution SigLIP2 checkpoint (model_type 'siglip'" in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # builds the module's models (~30 s)
@pytest.mark.parametrize("name", ["qwen3_llava", "qwen3_next_untied", "qwen3_onevision"])
def test_qwen3_round_trip_is_byte_identical_and_generates(name, models, tmp_path):
    """HF -> Megatron (TP2 x PP2, torch_dist; and legacy for one) -> HF: every tensor byte for byte, the config's
    rows and tie kept, and HF ``generate`` on the export gives the original's tokens."""
    from megatron_vlm.convert.verify import load_hf_model

    src = models[name]
    for fmt in ("torch_dist",) + (("torch",) if name == "qwen3_llava" else ()):
        meg = convert_hf_to_megatron(src, tmp_path / f"m_{fmt}", tp=2, pp=2, ckpt_format=fmt)
        out = convert_megatron_to_hf(meg, tmp_path / f"hf_{fmt}")
        assert any(n.endswith("self_attn.q_norm.weight") for n in assert_same_bytes(src, out))
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["text_config"]["vocab_size"] == 151936 and cfg["text_config"]["head_dim"] == 32
        assert (out / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    spec = VLMSpec.from_hf_dir(out)
    batch = reference_batch(spec)
    sample = batch.hf_sample(0) if batch.image_sizes is not None else dict(input_ids=batch.hf_input_ids[:1],
                                                                           pixel_values=batch.images[:1])
    ref, got = load_hf_model(src), load_hf_model(out)
    gen = [m.generate(**sample, max_new_tokens=4, do_sample=False, pad_token_id=spec.pad_token_id) for m in (ref, got)]
    assert gen[0].shape[1] == sample["input_ids"].shape[1] + 4 and torch.equal(gen[0], gen[1])


@pytest.fixture(scope="module")
def world(models, tmp_path_factory):
    """One 4-process world: every model at its layouts, plus Llama-3.2's long batch with the right and with a wrong
    scaling factor. Returns {(name, tp, pp): max |logit diff| vs HF} and the checkpoints."""
    import shutil

    from megatron_vlm.runtime.spawn import run_world
    from tests.support import family_jobs

    root = tmp_path_factory.mktemp("families_meg")
    jobs, keys, ckpts = [], [], {}

    def add(key, megatron_dir, hf_dir, batch, spec, ref_name=None):
        ref = root / f"ref_{ref_name or key[0]}.pt"
        if not ref.exists():
            torch.save(hf_logits(hf_dir, batch), ref)
        jobs.append({"megatron_dir": str(megatron_dir), "tp": key[1], "pp": key[2], "batch": batch,
                     "ref_file": str(ref), "vocab": spec.vocab_size})
        keys.append(key)

    for name, (_, layouts) in MODELS.items():
        spec = VLMSpec.from_hf_dir(models[name])
        ckpts[name] = convert_hf_to_megatron(models[name], root / name, tp=2, pp=2)  # torch_dist: loads at any
        batch = reference_batch(spec)
        for tp, pp in layouts:
            add((name, tp, pp), ckpts[name], models[name], batch, spec)
    # Llama-3.2's rope scaling matters past 8,192 positions: a long text batch, and a copy of the checkpoint whose
    # spec says factor 8 (the scaling of Llama-3.1) to show what the long batch catches and the short one does not.
    # At TP2 x PP2 each rank holds one head's attention scores of one layer (8,463^2 fp32: 0.29 GB).
    spec = VLMSpec.from_hf_dir(models["llama32"])
    wrong = root / "llama32_factor8"
    shutil.copytree(ckpts["llama32"], wrong)
    spec_file = wrong / "release" / "vlm_spec.json"
    spec_file.write_text(spec_file.read_text().replace('"rope_scaling_factor": 32.0', '"rope_scaling_factor": 8.0'))
    assert VLMSpec.load(wrong / "release").rope_scaling_factor == 8.0
    long = reference_batch(spec, text_len=LONG, positions=(LONG - 4,))
    assert long.combined_length > 8192 + 100
    add(("long", 2, 2), ckpts["llama32"], models["llama32"], long, spec)
    add(("long_factor8", 2, 2), wrong, models["llama32"], long, spec, "long")
    add(("short_factor8", 1, 1), wrong, models["llama32"], reference_batch(spec), spec, "llama32")
    return dict(zip(keys, run_world(family_jobs.logit_diffs, 4, jobs)[0])), ckpts


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_hf_at_every_layout(name, world):
    diffs = {(tp, pp): world[0][(name, tp, pp)] for tp, pp in MODELS[name][1]}
    print(f"\n{name}: max |logit diff| vs HF per (TP, PP): " + ", ".join(f"{k}: {v:.2g}" for k, v in diffs.items()))
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.slow
def test_llama3_rope_scaling_verified_past_8192(world):
    """fp32 logits (TP2 x PP2) of an 8,463-position sample equal HF's with factor 32; a checkpoint claiming factor 8
    passes the short reference batch (what ``--verify`` runs) but fails here."""
    right, wrong, short = (world[0][k] for k in [("long", 2, 2), ("long_factor8", 2, 2), ("short_factor8", 1, 1)])
    print(f"\nllama3 rope factor 32 at {LONG + 15} positions: max |logit diff| {right:.2g}; with factor 8: "
          f"{wrong:.2g} (short batch: {short:.2g})")
    assert right < TOL and wrong > 5 * TOL and short < TOL


@pytest.mark.slow
def test_qwen3_verify_cli_at_tp2_pp2_and_negative_control(models, tmp_path, capsys, monkeypatch):
    """``hf_to_megatron --verify`` passes at TP2 x PP2; with the q and k norms swapped in the mapping it fails."""
    from megatron_vlm.cli import run_cli
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.verify import VerificationError, verify_checkpoint

    src = models["qwen3_onevision"]
    assert run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(src), "--megatron-dir",
                                                              str(tmp_path / "m"), "--tp", "2", "--pp", "2",
                                                              "--verify"]) == 0
    out = capsys.readouterr().out
    diff = float(re.search(r"verify: max \|logit diff\| .* = (\S+) <=", out).group(1))
    assert diff < TOL
    real = mapping.to_mcore

    def swapped(rule, hf, spec):
        if "_layernorm" in rule.mcore and "self_attention" in rule.mcore:
            other = rule.hf[0].replace("q_norm", "#").replace("k_norm", "q_norm").replace("#", "k_norm")
            return real(rule, [HFReader(src).get(other)], spec)
        return real(rule, hf, spec)

    monkeypatch.setattr(mapping, "to_mcore", swapped)
    meg = convert_hf_to_megatron(src, tmp_path / "bad", ckpt_format="torch")
    monkeypatch.setattr(mapping, "to_mcore", real)
    with pytest.raises(VerificationError, match="logits differ"):
        verify_checkpoint(src, meg, tp=1, pp=1)


@pytest.mark.te
@pytest.mark.slow
def test_qwen3_transformer_engine_layers_load_the_converted_checkpoint(models, world):
    """The GPU path's layers (Transformer Engine, built on CPU through the construction shim; no forward): at TP2
    every tensor of the Qwen3 OneVision's TE model (q/k norms included: the local model has them, and neither side
    has a key the other lacks) loads from the converted checkpoint and equals the local layers' under the same
    sharded key."""
    from .conftest import require_te

    require_te()
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import te_jobs

    _, ckpts = world
    job = {"name": "qwen3", "megatron_dir": str(ckpts["qwen3_onevision"]), "tp": 2, "pp": 1}
    reports = run_world(te_jobs.run, 2, [job], [], str(ckpts["qwen3_onevision"]), str(models["qwen3_onevision"]))[0]
    for r in reports["layouts"]["qwen3"]:
        c = r["compare"]
        assert c["tensors"] > 0 and (c["te_only_tensors"], c["local_only_tensors"], c["different"],
                                     c["dtypes_differ"], c["uncovered_params"]) == ([], [], [], [], []), c
        assert r["keys_absent_from_checkpoint"] == [] or all(k.endswith("_extra_state")
                                                            for k in r["keys_absent_from_checkpoint"]), r


@pytest.mark.slow
def test_qwen3_megatron_lm_checkpoints_export(models, tmp_path):
    """Checkpoints of a Qwen3 LLaVA in the layout Megatron-LM writes (our imitation, tests.support.worlds: torch_dist
    with TE names and args, legacy rank files; TP2) export with only the HF config, byte for byte; an HF config
    without q/k norms is refused naming them."""
    from megatron_vlm.convert.megatron_lm import MismatchError
    from megatron_vlm.runtime.spawn import run_world
    from tests.support import worlds

    src = models["qwen3_llava"]
    single = convert_hf_to_megatron(src, tmp_path / "tp1")  # megatron_lm_checkpoints reads it at TP=world size
    run_world(worlds.megatron_lm_checkpoints, 2, [(str(single), str(tmp_path / "mlm"))])
    for fmt in ("dist_te", "legacy"):
        out = convert_megatron_to_hf(tmp_path / "mlm" / fmt, tmp_path / f"hf_{fmt}", hf_config=src)
        a, b = HFReader(src), HFReader(out)
        assert a.names() == b.names()
        for n in a.names():
            assert torch.equal(a.get(n), b.get(n)), (fmt, n)
    cfg = json.loads((src / "config.json").read_text())  # the same shapes as a Llama (head_dim 32): no q/k norms
    cfg["text_config"]["model_type"] = "llama"
    (tmp_path / "llama_like.json").write_text(json.dumps(cfg))
    with pytest.raises(MismatchError, match=r"without q/k norms .* has self_attention.q_layernorm"):
        convert_megatron_to_hf(tmp_path / "mlm" / "dist_te", tmp_path / "bad", hf_config=tmp_path / "llama_like.json")
