"""The per-tensor gradient reference's own rules (tests/support/grad_reference.py), on tensors made here.

The tensors of a tiny Qwen3-MoE LLaVA (one dense layer among three MoE layers) stand for gradients: every rank's
shards are cut from them with the conversion's rules at TP2 x PP2 x EP2 (experts split over TP, and unsplit:
ETP1), and assembling them gives back every HF tensor exactly; a shard that did not come back is an error naming
the tensor (it used to drop the tensor from the comparison without a word).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm.model.spec import VLMSpec
from tests.support import grad_reference


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(spec, {HF name: tensor of every mapping rule})."""
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.hf_io import HFReader
    from tests.support.tiny import make_tiny_llava

    hf = make_tiny_llava(tmp_path_factory.mktemp("gradref") / "hf", "qwen3_moe", "clip",
                         text_overrides=dict(num_hidden_layers=4, mlp_only_layers=[1]))
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
