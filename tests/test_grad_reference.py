"""The per-tensor gradient reference's own rules (tests/support/grad_reference.py), on tensors made here.

The tensors of a tiny Qwen3-MoE LLaVA (one dense layer among three MoE layers) stand for gradients: every rank's
shards are cut from them with the conversion's rules at TP2 x PP2 x EP2 (experts split over TP, and unsplit:
ETP1), and assembling them gives back every HF tensor exactly; a shard that did not come back is an error naming
the tensor (it used to drop the tensor from the comparison without a word), and so is a whole tensor no rank
returned, which the comparison finds against HF's trained tensors (HF's frozen ones are not among them).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm.model.spec import VLMSpec
from tests.support import grad_reference


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.support.tiny import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("gradref") / "hf", "qwen3_moe", "clip",
                           text_overrides=dict(num_hidden_layers=4, mlp_only_layers=[1]))


@pytest.fixture(scope="module")
def model(hf_dir):
    """(spec, {HF name: tensor of every mapping rule})."""
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.hf_io import HFReader

    hf = hf_dir
    spec, reader = VLMSpec.from_hf_dir(hf), HFReader(hf)
    on_disk = {mapping.canonical_hf_name(n): n for n in reader.names()}
    return spec, {h: reader.get(on_disk[h]) for rule in mapping.rules(spec) for h in rule.hf}


def _ranks(spec, hf: dict, tp: int, pp: int, ep: int, etp: int) -> list[tuple[dict, dict]]:
    """Every rank's (coordinates, {local name: shard}) at the layout, cut with the conversion's rules."""
    from megatron_vlm.convert import mapping

    layers = spec.check_parallelism(tp, pp, None, ep, etp)
    ranks = []
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                c = dict(tp=t, pp=p, ep=e, etp=t % etp, dp=0)
                local = {}
                for rule in mapping.rules(spec):
                    owner = mapping.ep_rank_of(rule, spec, ep)
                    if p not in mapping.stages_of(rule, spec, layers) or owner not in (None, e):
                        continue
                    full = mapping.to_mcore(rule, [hf[h] for h in rule.hf], spec)
                    size, r = (etp, c["etp"]) if rule.expert is not None else (tp, t)
                    name = mapping.local_name(rule, p, layers, spec.num_moe_experts // ep)
                    local[name] = mapping.tp_shard(rule, full, size, r)
                ranks.append((c, local))
    return ranks


@pytest.mark.parametrize("etp", [2, 1])
def test_assemble_gives_back_every_hf_tensor(model, etp):
    spec, hf = model
    ranks = _ranks(spec, hf, 2, 2, 2, etp)
    got = grad_reference.assemble(ranks, spec, tp=2, pp=2, ep=2, etp=etp)
    assert set(got) == set(hf) and sum(".mlp.experts." in n for n in got) == 3 * spec.num_moe_experts * 3
    for name, t in hf.items():
        assert torch.equal(got[name], t), name


def test_a_missing_shard_is_an_error_naming_the_tensor(model):
    spec, hf = model
    ranks = _ranks(spec, hf, 2, 1, 2, 2)
    local = next(g for c, g in ranks if c["tp"] == 1 and c["ep"] == 1)
    del local[next(n for n in local if n.endswith(".local_experts.1.linear_fc2.weight"))]
    with pytest.raises(grad_reference.MissingShard, match=r"experts\.3\.down_proj.*ETP shard\(s\) \[1\] of 2"):
        grad_reference.assemble(ranks, spec, tp=2, ep=2)


def test_frozen_tensors_are_left_out_and_unknown_ones_refused(model):
    spec, hf = model
    ranks = [(c, {n: g for n, g in local.items() if n.startswith("vision_projection.")})
             for c, local in _ranks(spec, hf, 2, 1, 1, 2)]
    assert set(grad_reference.assemble(ranks, spec, tp=2)) == {h for h in hf if h.startswith("multi_modal_projector.")}
    with pytest.raises(KeyError, match="not_a_tensor"):
        grad_reference.compare({"not_a_tensor": torch.ones(2)}, {})
    assert grad_reference.compare({"a": torch.tensor([3.0, 0.0])}, {"a": torch.tensor([3.0, 4.0])}) == {"a": 0.8}


def test_a_tensor_no_rank_returned_fails_the_comparison(model):
    """A trained tensor missing from every rank leaves ``assemble`` nothing to merge (as a frozen one); the comparison
    against HF's trained tensors names it instead of comparing the rest."""
    spec, hf = model
    ranks = _ranks(spec, hf, 2, 2, 2, 2)
    dropped = "language_model.decoder.layers.0.self_attention.linear_proj.weight"
    for c, local in ranks:
        if c["pp"] == 0:  # layer 0 (stage 1's local layer 0 is layer 2)
            local.pop(dropped)
    mine = grad_reference.assemble(ranks, spec, tp=2, pp=2, ep=2, etp=2)
    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    assert name in hf and name not in mine
    with pytest.raises(grad_reference.MissingGradient, match=r"1 of the \d+ tensors HF trains .*0\.self_attn\.o_proj"):
        grad_reference.compare(mine, hf)
    zero = dict(hf, **{name: torch.zeros_like(hf[name])})  # a tensor HF's loss never reaches may be absent
    assert name not in grad_reference.compare(mine, zero)


def test_hf_gradients_are_those_of_the_trained_parameters(hf_dir):
    """``saved_gradients`` of an HF model with its vision tower frozen: no vision tensor; every trained one, zeros for
    one the loss did not reach (the projector, on a text-only batch)."""
    from megatron_vlm.convert.verify import load_hf_model

    hf = load_hf_model(hf_dir)
    for n, p in hf.named_parameters():
        p.requires_grad_("vision_tower" not in n)
    ids = torch.randint(0, 100, (1, 12))
    hf(input_ids=ids, labels=ids).loss.backward()
    got = grad_reference.saved_gradients(hf)
    assert got and not any(n.startswith("vision_tower.") for n in got)
    projector = [n for n in got if n.startswith("multi_modal_projector.")]
    assert projector and all(not got[n].any() for n in projector)
    assert got["language_model.model.embed_tokens.weight"].any()
    assert all(not p.isnan().any() for p in hf.parameters())  # the weights are back
