"""Mixture-of-experts language models, the parts that need no multi-process world: the spec read from HF configs
(Qwen3-MoE's layer pattern and routing, Mixtral's, Qwen3-30B-A3B's as published), the mapping rows, expert-parallel
placement and names, the refusals (each one line naming the fix), the launcher's checks, sequence parallelism for MoE
at TP > 1, each megatron-core version's expert rules, the load-balancing objective's words and, in a one-process world,
one megatron-core router as the trainer wraps it against transformers' load_balancing_loss_func (padding and capacity
included), the active-parameter FLOPs and the legacy rank-file names. tests/test_moe.py runs the models."""

from __future__ import annotations

import pytest

from megatron_vlm.convert import mapping
from megatron_vlm.model.spec import ParallelismError, UnsupportedArchitectureError, VLMSpec
from tests.support.tiny import text_config, vision_config


def _spec(family="qwen3_moe", **text) -> VLMSpec:
    from transformers import LlavaConfig

    cfg = LlavaConfig(text_config=text_config(family, **text).to_dict(), vision_config=vision_config("clip").to_dict(),
                      image_token_id=3)
    return VLMSpec.from_hf(cfg)


def test_qwen3_moe_spec_reads_experts_routing_and_layer_pattern():
    s = _spec(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)
    assert (s.num_moe_experts, s.moe_router_topk, s.moe_ffn_hidden_size) == (4, 2, 32)
    # HF: layer i routes when i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert s.moe_layer_pattern == [0, 1, 0, 0, 0, 1] and s.moe_layers == [1, 5]
    assert s.moe_norm_topk_prob is False and s.qk_layernorm and s.moe_aux_loss_coeff == 0.001
    assert s.has_dense_layers and s.ffn_hidden_size == 128


def test_mixtral_spec_routes_every_layer_with_renormalised_top_k():
    s = _spec("mixtral", num_hidden_layers=3)
    assert s.moe_layers == [0, 1, 2] and not s.has_dense_layers and s.moe_norm_topk_prob
    assert (s.num_moe_experts, s.moe_ffn_hidden_size, s.moe_aux_loss_coeff) == (4, 32, 0.02)
    assert not s.qk_layernorm


def test_the_published_qwen3_30b_a3b_routing():
    """Qwen3-30B-A3B-Instruct-2507's config as published, and shrunk in size only with a dense layer among MoE
    layers (the models of tests/test_moe.py's predecessors and of bench/): routing, norms, rope and vocabulary."""
    from transformers import LlavaConfig, Qwen3MoeConfig

    from tests.support.hub_models import QWEN3_30B_A3B, QWEN3_MOE_SMALL

    def spec(**text) -> VLMSpec:
        lm = Qwen3MoeConfig(**{**QWEN3_30B_A3B, **text})
        return VLMSpec.from_hf(LlavaConfig(text_config=lm.to_dict(), vision_config=vision_config("clip").to_dict(),
                                           image_token_id=3))

    full, small = spec(), spec(**QWEN3_MOE_SMALL, mlp_only_layers=[1])
    assert full.moe_layers == list(range(48)) and (full.num_moe_experts, full.moe_router_topk) == (128, 8)
    assert small.moe_layers == [0, 2, 3] and small.moe_layer_pattern == [1, 0, 1, 1]
    for s in (full, small):
        assert (s.moe_norm_topk_prob, s.moe_aux_loss_coeff, s.vocab_size, s.rotary_base) == (True, 0.001, 151936, 1e7)
        assert not s.tie_word_embeddings and s.qk_layernorm
    assert (small.num_moe_experts, small.moe_router_topk, small.moe_ffn_hidden_size) == (8, 2, 32)


def test_moe_settings_megatron_core_receives():
    from megatron_vlm.model.build import ModelOptions, MoEOptions, _moe_config

    s = _spec(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    kw = _moe_config(s, ModelOptions(tp=2, ep=2))
    assert kw["moe_layer_freq"] == [1, 0, 1] and kw["moe_router_pre_softmax"] is False
    assert (kw["expert_model_parallel_size"], kw["expert_tensor_parallel_size"]) == (2, 2)
    # the default objective is HF's (megatron_vlm.training.moe.hf_objective): megatron-core's routers compute no loss of
    # their own
    assert (kw["moe_router_load_balancing_type"], kw["moe_aux_loss_coeff"]) == ("none", 0.0)
    assert kw["moe_expert_capacity_factor"] is None
    mcore = _moe_config(s, ModelOptions(moe=MoEOptions(load_balancing_type="aux_loss")))
    assert (mcore["moe_router_load_balancing_type"], mcore["moe_aux_loss_coeff"]) == ("aux_loss", 0.001)
    assert kw["moe_grouped_gemm"] is False  # local layers: SequentialMLP
    every = _moe_config(_spec("mixtral"), ModelOptions(moe=MoEOptions(aux_loss_coeff=0.0, load_balancing_type="aux_loss",
                                                                       token_dispatcher_type="alltoall")))
    # all layers MoE: megatron's int form, whose checkpoints stack the layers as Megatron-LM's do
    assert every["moe_layer_freq"] == 1 and every["moe_aux_loss_coeff"] == 0.0
    assert every["moe_router_pre_softmax"] is False and every["moe_token_dispatcher_type"] == "alltoall"
    assert _moe_config(_spec(norm_topk_prob=False), ModelOptions())["moe_router_pre_softmax"] is True
    with pytest.raises(ValueError, match="--moe-grouped-gemm needs Transformer Engine layers"):
        _moe_config(s, ModelOptions(moe=MoEOptions(grouped_gemm=True)))


@pytest.mark.parametrize("family,router,gate,up,down", [
    ("qwen3_moe", "mlp.gate.weight", "mlp.experts.3.gate_proj.weight", "mlp.experts.3.up_proj.weight",
     "mlp.experts.3.down_proj.weight"),
    ("mixtral", "block_sparse_moe.gate.weight", "block_sparse_moe.experts.3.w1.weight",
     "block_sparse_moe.experts.3.w3.weight", "block_sparse_moe.experts.3.w2.weight"),
])
def test_mapping_rows_name_hf_experts_one_by_one(family, router, gate, up, down):
    s = _spec(family, num_hidden_layers=2)
    rules = {r.mcore: r for r in mapping.rules(s)}
    h = "language_model.model.layers.1."
    m = "language_model.decoder.layers.1.mlp."
    assert rules[m + "router.weight"].hf == (h + router,)
    fc1, fc2 = rules[m + "experts.local_experts.3.linear_fc1.weight"], rules[m + "experts.local_experts.3.linear_fc2.weight"]
    assert fc1.hf == (h + gate, h + up) and fc1.kind == "gated" and fc1.expert == 3
    assert fc2.hf == (h + down,) and fc2.split == "row"
    assert not any(r.startswith("language_model.") and "mlp.linear_fc1" in r for r in rules)  # every layer routes


def test_expert_parallel_placement_and_local_names():
    s = _spec(num_hidden_layers=4, num_experts=8)
    rules = {r.mcore: r for r in mapping.rules(s)}
    r = rules["language_model.decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight"]
    assert mapping.ep_rank_of(r, s, 2) == 1 and mapping.ep_rank_of(r, s, 4) == 2
    assert mapping.local_name(r, 1, [2, 2], experts_per_rank=4) == \
        "language_model.decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert mapping.split_size(r, tp=2, etp=1) == 1 and mapping.split_size(r, tp=2) == 2
    router = rules["language_model.decoder.layers.3.mlp.router.weight"]
    assert mapping.ep_rank_of(router, s, 2) is None and mapping.split_size(router, 2, 1) == 2


def test_parallelism_refusals_name_the_fix():
    s = _spec(num_experts=6)
    with pytest.raises(ParallelismError, match=r"--ep 4 does not divide the 6 experts .* choose --ep from \[1, 2, 3, 6\]"):
        s.check_parallelism(1, 1, ep=4)
    with pytest.raises(ParallelismError, match="--etp 3 does not divide each expert's moe_ffn_hidden_size=32"):
        s.check_parallelism(1, 1, ep=2, etp=3)
    dense = _spec("llama")
    with pytest.raises(ParallelismError, match="--ep/--etp apply to mixture-of-experts language models; this llama LM "
                                               "is dense: drop --ep/--etp"):
        dense.check_parallelism(1, 1, ep=2)
    assert s.check_parallelism(2, 2, ep=3) == [1, 1]


def test_unsupported_moe_layouts_are_refused_in_one_line():
    with pytest.raises(UnsupportedArchitectureError, match="router_jitter_noise=0.1: HF Mixtral multiplies the "
                                                           "experts' input by the noise too"):
        _spec("mixtral", router_jitter_noise=0.1)
    with pytest.raises(UnsupportedArchitectureError, match=r"mlp_only_layers \[7\] are not layers of a 2-layer"):
        _spec(mlp_only_layers=[7])
    with pytest.raises(UnsupportedArchitectureError, match="num_experts_per_tok=5 must be between 1 and the 4 experts"):
        _spec(num_experts_per_tok=5)
    from transformers import LlavaConfig, Qwen2MoeConfig

    cfg = LlavaConfig(text_config=Qwen2MoeConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4).to_dict(),
                      vision_config=vision_config("clip").to_dict(), image_token_id=3)
    with pytest.raises(UnsupportedArchitectureError, match="language model type 'qwen2_moe' is not supported"):
        VLMSpec.from_hf(cfg)


def test_launcher_checks_expert_groups_against_the_world():
    from megatron_vlm.training.config import ConfigError, TrainConfig

    req = ["--data-path", "d", "--tokenizer-load-dir", "t", "--megatron-load-dir", "m", "--train-iters", "1",
           "--device", "cpu", "-g", "4", "--mbs", "1", "--gbs", "8"]

    def error(*args) -> str:
        with pytest.raises(ConfigError) as e:
            TrainConfig.from_args([*args, *req])
        return str(e.value)

    assert TrainConfig.from_args(["--tp", "2", "--ep", "2", *req]).expert_tp == 2  # tp 2 x dp 2 hold ep 2 x etp 2
    assert TrainConfig.from_args(["--pp", "2", "--expert-model-parallel-size", "2", "--etp", "1", *req]).ep == 2
    assert "--ep 4 x --etp 2 = 8 ranks per expert group do not fit the 4 ranks of a pipeline stage (tp 2 x " \
        "data-parallel 2)" in error("--tp", "2", "--ep", "4")
    assert "needs --moe-expert-capacity-factor" in error("--moe-pad-expert-input-to-capacity")
    assert "--moe-grouped-gemm needs Transformer Engine layers on a GPU" in error("--moe-grouped-gemm")
    assert "--ep 0: must be at least 1" in error("--ep", "0")
    assert "all-gathers expert inputs of different sizes over the expert tensor-parallel ranks, which gloo cannot" \
        in error("--tp", "2", "--ep", "2", "--moe-token-dispatcher-type", "alltoall")


def test_flops_count_the_active_experts():
    from megatron_vlm.training.flops import StepFlops, _attention_block

    s = _spec(num_hidden_layers=2, mlp_only_layers=[1], num_experts=64, num_experts_per_tok=2)
    h, t = s.hidden_size, 100
    q, kv = s.num_attention_heads * s.kv_channels, s.num_query_groups * s.kv_channels
    attention = _attention_block(t, t, h, q, kv, h).weights
    routed = 2 * t * (h * s.num_moe_experts + 2 * 3 * h * s.moe_ffn_hidden_size)  # router + 2 of the 64 experts
    dense = 2 * t * 3 * h * s.ffn_hidden_size
    logits = 2 * t * h * s.vocab_size
    assert StepFlops(s, False, True, True).language(1, t).weights == pytest.approx(2 * attention + routed + dense
                                                                                   + logits)


def test_legacy_rank_files_are_named_as_megatron_lm_names_them(tmp_path):
    from megatron_vlm.checkpoint import layout as ckpt

    assert ckpt.legacy_rank_dir(1, 0, 1) == "mp_rank_01"
    assert ckpt.legacy_rank_dir(1, 0, 1, ep_rank=3, ep=4) == "mp_rank_01_003"
    assert ckpt.legacy_rank_dir(0, 1, 2, ep_rank=1, ep=2) == "mp_rank_00_001_001"
    for t in range(2):
        for e in range(2):
            d = tmp_path / ckpt.legacy_rank_dir(t, 0, 1, e, 2)
            d.mkdir()
            (d / "model_optim_rng.pt").write_bytes(b"x")
    assert ckpt.legacy_layout_ep(tmp_path, expert_parallel=True) == (2, 1, 2)
    assert ckpt.legacy_layout(tmp_path) == (2, 2)  # the names alone read as PP without the EP hint


def test_tensor_parallel_moe_turns_sequence_parallelism_on():
    """MoE at --tp > 1 trains on a sequence-parallel split (megatron-core's MoE layers need it): turned on and said
    so, rather than refused; a packed length that the split cannot take is refused in one line."""
    from megatron_vlm.training.config import ConfigError, TrainConfig
    from megatron_vlm.training.config.resolve import settle_with_spec

    req = ["--data-path", "d", "--tokenizer-load-dir", "t", "--megatron-load-dir", "m", "--train-iters", "1",
           "--device", "cpu", "-g", "4", "--mbs", "1", "--gbs", "8"]
    cfg = TrainConfig.from_args(["--tp", "2", "--ep", "2", *req])
    assert not cfg.sequence_parallel
    notes = settle_with_spec(cfg, _spec())
    assert cfg.sequence_parallel and notes == ["sequence parallelism on: the mixture-of-experts language model trains "
                                               "at --tp 2 on a sequence-parallel split (megatron-core's MoE layers "
                                               "need it with tensor parallelism)"]
    assert settle_with_spec(cfg, _spec()) == []  # already on
    dense = TrainConfig.from_args(["--tp", "2", *req])
    assert settle_with_spec(dense, _spec("llama")) == [] and not dense.sequence_parallel
    packed = TrainConfig.from_args(["--tp", "4", "--packing-buffer-size", "8", "--packed-seq-length", "2050",
                                    "--seq-length", "2048", *req])
    with pytest.raises(ConfigError, match="--packed-seq-length 2050: with --sequence-parallel it must be a multiple "
                                          "of 4; use --packed-seq-length 2052"):
        settle_with_spec(packed, _spec())


def test_sequence_parallelism_turned_on_rechecks_the_context_parallel_length():
    """MoE at --tp 2 --cp 2: once sequence parallelism is on, every sequence must split into 2 x CP x TP = 8
    chunks. --seq-length 1028 passes the checks before the spec is read (a multiple of 2 x CP = 4) and used to fail
    only in the ranks; the settled config is refused in one line naming the flag and the fix."""
    from megatron_vlm.training.config import ConfigError, TrainConfig
    from megatron_vlm.training.config.resolve import settle_with_spec

    req = ["--data-path", "d", "--tokenizer-load-dir", "t", "--megatron-load-dir", "m", "--train-iters", "1",
           "--device", "cpu", "-g", "8", "--tp", "2", "--cp", "2", "--ep", "2", "--mbs", "1", "--gbs", "8"]
    cfg = TrainConfig.from_args([*req, "--seq-length", "1028"])  # the checks before the spec: 2 x CP divides it
    with pytest.raises(ConfigError) as e:
        settle_with_spec(cfg, _spec())
    assert str(e.value) == (
        "--seq-length 1028 does not split over the context-parallel ranks: it must be a multiple of 8 (2 x --cp 2 x "
        "--tp 2, with --sequence-parallel, which the mixture-of-experts language model turns on at --tp 2); use "
        "--seq-length 1032"), str(e.value)
    fine = TrainConfig.from_args([*req, "--seq-length", "1032"])
    assert len(settle_with_spec(fine, _spec())) == 1 and fine.sequence_parallel


def test_the_expert_optimizer_rule_is_each_versions():
    """megatron-core 0.16 keeps the experts' optimizer state apart iff EP > 1; 0.19 iff EP > 1 or ETP != TP. 0.16
    cannot train EP1 with ETP != TP (the experts' gradients miss the other TP ranks' tokens): refused."""
    from megatron_vlm.runtime import mcore_version as mv

    for version, apart_at_etp in (("0.16.1", False), ("0.19.2", True)):
        assert mv.experts_optimizer_apart(2, 1, 1, version) and mv.experts_optimizer_apart(2, 2, 2, version)
        assert not mv.experts_optimizer_apart(1, 2, 2, version)
        assert mv.experts_optimizer_apart(1, 1, 2, version) is apart_at_etp
    assert mv.expert_optimizer_rule("0.16.1") == "megatron-core 0.16.1 keeps it apart when --ep > 1 (whatever --etp)"
    assert mv.expert_optimizer_rule("0.19.2") == ("megatron-core 0.19.2 keeps it apart when --ep > 1 or --etp differs "
                                                  "from --tp")
    assert mv.expert_layout_problem(1, 1, 2, "0.16.1").startswith(
        "--etp 1 with --tp 2 at --ep 1: megatron-core 0.16.1 sums the experts' gradients over the data-parallel "
        "ranks only")
    assert mv.expert_layout_problem(1, 1, 2, "0.19.2") is None and mv.expert_layout_problem(2, 1, 2, "0.16.1") is None


def test_the_objective_is_named_with_its_coefficient():
    from megatron_vlm.training.moe.objectives import OBJECTIVES, describe_objective
    from megatron_vlm.training.config import TrainConfig

    assert TrainConfig().moe_router_load_balancing_type == OBJECTIVES[0] == "hf"
    assert describe_objective("hf", 0.001, "the HF config's router_aux_loss_coef", 48) == (
        "HF's load_balancing_loss_func over all 48 MoE layers together, per micro batch, padding excluded, "
        "coefficient 0.001 (the HF config's router_aux_loss_coef)")
    assert describe_objective("aux_loss", 0.01, "--moe-aux-loss-coeff", 3) == (
        "megatron-core's aux_loss per MoE layer, summed over 3 layers, coefficient 0.01 (--moe-aux-loss-coeff)")
    assert describe_objective("hf", 0.0, "--moe-aux-loss-coeff", 3) == "no load-balancing loss (cross entropy only)"



def test_a_router_counts_and_balances_the_samples_positions_only():
    """megatron-core's TopKRouter as the trainer wraps it (megatron_vlm.training.moe.orchestration.MoETraining), in a
    one-process world, on a micro batch of two rows of 8 positions whose second row holds a sample of 3 (the rest is
    padding, whose logits favour expert 0 most): HF's term equals transformers' own load_balancing_loss_func with the
    attention mask, value and gradient; the routing numbers count the 11 positions of samples; with capacity factor
    1 the capacity is ceil(11 x 2 / 4) = 6 and padding takes none of it (it used to count all 16 positions and route
    the padding); megatron-core's own token dropping is back once the routing calls are over."""
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler, TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.training.moe.orchestration import MoETraining

    spec = _spec(num_hidden_layers=1)
    s, b, h, e, k = 8, 2, 8, spec.num_moe_experts, spec.moe_router_topk
    valid = torch.arange(s)[:, None] < torch.tensor([8, 3])[None, :]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(s, b, h, generator=g)
    hidden[~valid] = 0  # padded positions: every one routed alike, to expert 0 first (its weight row below)
    from megatron.core.transformer.moe import router as router_module

    megatron_cores = router_module.apply_router_token_dropping
    with single_process_world("cpu"):
        results = {}
        for capacity in (None, 1.0):
            config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, num_moe_experts=e,
                                       moe_router_topk=k, moe_router_load_balancing_type="none",
                                       moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=capacity,
                                       add_bias_linear=False, use_cpu_initialization=True)
            router = TopKRouter(config=config, pg_collection=get_default_pg_collection())
            router.set_layer_number(1)
            with torch.no_grad():
                router.weight.copy_(torch.randn(e, h, generator=torch.Generator().manual_seed(1)))
            MoEAuxLossAutoScaler.main_loss_backward_scale = None  # the schedule's loss scale: none here
            moe = MoETraining(router, spec, config, "hf", 1.0)
            x = hidden.clone().requires_grad_(True)
            with moe.step(loss_tokens=1.0, micro_batches=1):
                micro = moe.begin(SimpleNamespace(row_tokens=torch.tensor([8, 3])))
                probs, routing_map = router(x)
                moe.forward_done(micro, probs)
                (probs * 0).sum().backward()  # only the term's gradient
            results[capacity] = (micro, routing_map, moe.collect(1, torch.device("cpu")), x.grad)
    # the trainer's token dropping was megatron-core's for the routing calls only (issue 62): its own function after
    assert router_module.apply_router_token_dropping is megatron_cores
    micro, routing_map, numbers, grad = results[None]
    mask = valid.reshape(1, -1).float()  # HF's attention mask over the rows in the router's order
    x = hidden.clone().requires_grad_(True)
    logits = torch.nn.functional.linear(x, router.weight.detach()).reshape(-1, e)
    reference = load_balancing_loss_func((logits,), e, k, attention_mask=mask)
    reference.backward()
    assert abs(micro.value - float(reference)) <= 1e-6 * float(reference), (micro.value, float(reference))
    assert torch.allclose(grad, x.grad, rtol=1e-5, atol=1e-8), (grad - x.grad).abs().max()
    assert sum(numbers["moe_tokens_per_expert"][0]) == k * 11 and numbers["moe_load_balancing_loss"] == micro.value
    _, capped, numbers, _ = results[1.0]
    flat = valid.reshape(-1)
    assert not capped[~flat].any() and int(capped[flat].sum(0).max()) == 6, capped[flat].sum(0)
    assert sum(numbers["moe_tokens_per_expert"][0]) == int(capped[flat].sum())


def test_routing_refuses_a_chunk_or_rows_it_cannot_place():
    """The trainer numbers each model chunk's micro batches by the chunk the schedule passes to the forward step, and
    masks the padding by each row's positions of samples: a chunk that is none of the rank's, a call that names no
    chunk where the rank has several, and a router routing other rows than the batch's are refused, naming what did
    not match (the chunk used to fall back to chunk 0, and the rows to "every position is a sample")."""
    from types import SimpleNamespace

    import torch

    from megatron_vlm.training.moe.micro_batch import MicroBatchRouting
    from megatron_vlm.training.moe.orchestration import MoETraining

    config = SimpleNamespace(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
                             sequence_parallel=False, context_parallel_size=1)
    chunks = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    wrapped = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]  # as the schedule passes them (DDP)
    moe = MoETraining(chunks, _spec(num_hidden_layers=1), config, "none", 0.0, wrapped=wrapped)
    batch = SimpleNamespace(row_tokens=torch.tensor([8, 3]))
    with moe.step(loss_tokens=1.0, micro_batches=1):
        assert moe.begin(batch, wrapped[1]).index == 0 and moe.begin(batch, wrapped[0]).index == 0
        with pytest.raises(ValueError, match=r"the forward step ran a Linear that is none of this rank's 2 model "
                                             r"chunks \(the ones the schedule passes\)"):
            moe.begin(batch, chunks[0])  # the unwrapped module: not what the schedule runs
        with pytest.raises(ValueError, match="the forward step named no model chunk, and this rank has 2"):
            moe.begin(batch)
    micro = MicroBatchRouting(0, torch.tensor([8, 3]), config, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"micro batch 0: a router routes 3 rows of 8 positions, but the batch gives "
                                         r"the positions of samples of 2 rows \(row_tokens\)"):
        micro.valid(8, 3)


def test_a_moe_models_samples_are_hfs_whole_sequence(tmp_path):
    """The task encoder of a mixture-of-experts model frames a sample as HF's forward takes it: the model's input is
    the whole conversation (Megatron's tokens and its last label), the labels the same next tokens and one pad label
    of loss mask 0 (the cross entropy is the same; the routers also see the last position, as HF's do); a dense
    model keeps Megatron's framing. --seq-length bounds the positions the model sees in both."""
    from megatron.energon import VQASample
    from PIL import Image

    import torch

    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.data.synthetic import image_array
    from megatron_vlm.data.task_encoder import whole_sequence
    from tests.support.tiny import make_tiny_llava

    hf = make_tiny_llava(tmp_path / "moe", "qwen3_moe", "clip")
    spec = VLMSpec.from_hf_dir(hf)
    assert whole_sequence(spec) and not whole_sequence(_spec("llama"))
    sample = VQASample(__key__="a", image=Image.fromarray(image_array((40, 30), 0)), context="what colour ?",
                       answers="a red square", answer_weights=None, __restore_key__=(), __subflavors__=None,
                       __sources__=None)

    def both(seq_length):
        enc = task_encoder_for(spec, hf, seq_length, image_token_id=spec.image_token_id)
        hf_framed = enc.encode_sample(sample)
        enc.whole = False  # Megatron's framing, as a dense model's encoder frames it
        return hf_framed, enc.encode_sample(sample)

    whole, megatron = both(256)
    assert torch.equal(whole.tokens, torch.cat([megatron.tokens, megatron.labels[-1:]]))
    assert torch.equal(whole.labels[:-1], megatron.labels) and torch.equal(whole.loss_mask[:-1], megatron.loss_mask)
    assert whole.loss_mask.sum() == megatron.loss_mask.sum() > 0  # the same predictions: the same cross entropy
    assert whole.loss_mask[-1] == 0 and whole.num_tokens == megatron.num_tokens + 1 == len(whole.tokens) - 1 + \
        spec.num_image_tokens
    cut, kept = both(int(megatron.num_tokens))  # Megatron's sample fills --seq-length; HF's whole one does too
    assert cut.num_tokens == kept.num_tokens == megatron.num_tokens and torch.equal(cut.tokens, kept.tokens)
    assert torch.equal(cut.labels[:-1], kept.labels[:-1]) and torch.equal(cut.loss_mask[:-1], kept.loss_mask[:-1])
    assert cut.loss_mask[-1] == 0  # the label past the positions the model sees is Megatron's framing's only

