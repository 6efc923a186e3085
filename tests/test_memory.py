"""The memory estimate of train/run.py --dry-run: weights, gradient buffers and optimizer state against what the
built model and megatron-core's optimizer allocate (one process, and TP2/PP2/DP2 worlds), and the launcher's
output and warning."""

import pytest

from megatron_vlm.model import memory

from .launch_helpers import REPO, base_args, no_slurm_env  # noqa: F401


def _rel(a, b):
    return abs(a - b) / max(b, 1)


@pytest.fixture(scope="module")
def specs(hf_models, tmp_path_factory):
    from megatron_vlm.model.spec import VLMSpec
    from tests.support.tiny import make_tiny_onevision

    from tests.support.tiny import make_tiny_llava

    root = tmp_path_factory.mktemp("mem")
    ov = make_tiny_onevision(root / "ov")
    # a mixture-of-experts LM: 3 MoE layers (4 experts of 32, top 2) and a dense one
    moe = make_tiny_llava(root / "moe", "qwen3_moe", "clip", text_overrides=dict(num_hidden_layers=4,
                                                                                   mlp_only_layers=[1]))
    return {"llava": VLMSpec.from_hf_dir(hf_models["llama_clip"]), "qwen2_tied": VLMSpec.from_hf_dir(
        hf_models["qwen2_siglip"]), "ov": VLMSpec.from_hf_dir(ov), "moe": VLMSpec.from_hf_dir(moe)}


@pytest.mark.parametrize("job", [
    dict(precision="bf16", stage=2),
    dict(precision="fp32", stage=2),
    dict(precision="bf16", stage=1),
    dict(precision="bf16", stage=2, freeze_vit=False, dist_optim=True),
])
def test_estimate_equals_allocation_one_process(specs, job):
    """At TP=PP=DP=1 the estimate of weights, gradients and optimizer state is exact, byte for byte (with
    --dist-optim megatron-core pads the gradient buffer's buckets: within 1%)."""
    from megatron_vlm.runtime.session import single_process_world
    from tests.support.memory_jobs import measured_and_estimated
    from tests.support.train_jobs import BASE
    from megatron_vlm.training.config import TrainConfig

    for name, spec in specs.items():
        cfg = TrainConfig(**{**BASE, "freeze_vit": True, "train_iters": 1, "global_batch_size": 1,
                             "micro_batch_size": 1, **job})
        with single_process_world("cpu"):
            r = measured_and_estimated(spec, cfg)
        m, e = r["measured"], r["estimated"]
        if job.get("dist_optim"):
            assert 0 <= m.pop("gradients") - e.pop("gradients") <= 0.01 * e["weights"] + 4096, (name, job, r)
        assert m == e, (name, job, r)


@pytest.mark.slow
def test_estimate_matches_allocation_in_parallel_worlds(specs):
    """TP2 x DP2, PP2 x DP2 and CP2 x DP2 (sharded over DP x CP) with the distributed optimizer (bf16), TP2 x PP2
    in fp32, and for the MoE model EP2 x DP2 and TP2 x EP2 (the experts' optimizer state sharded over their own
    data-parallel group), PP2 x EP2 and PP2 x VPP2 x DP2 (four layers: two model chunks per rank, each with its own
    gradient buffer): every rank's weights exactly, its gradient buffer and optimizer shard within megatron's
    padding."""
    from megatron_vlm.runtime.spawn import run_world
    from tests.support.memory_jobs import memory_jobs

    jobs = [dict(tp=2, precision="bf16", dist_optim=True), dict(pp=2, precision="bf16", dist_optim=True),
            dict(tp=2, pp=2, precision="fp32", stage=1), dict(cp=2, precision="bf16", dist_optim=True)]
    moe_jobs = [dict(ep=2, precision="bf16", dist_optim=True),
                dict(tp=2, ep=2, sequence_parallel=True, precision="bf16", dist_optim=True),
                dict(pp=2, ep=2, precision="fp32"),
                dict(pp=2, num_virtual_stages_per_pipeline_rank=2, precision="bf16", dist_optim=True)]
    for name in ("llava", "ov", "moe"):
        jobs = moe_jobs if name == "moe" else jobs
        results = run_world(memory_jobs, 4, specs[name].to_json(), jobs)
        for rank, per_job in enumerate(results):
            for job, r in zip(jobs, per_job):
                m, e = r["measured"], r["estimated"]
                assert m["weights"] == e["weights"], (name, rank, job, r)
                assert 0 <= m["gradients"] - e["gradients"] <= 0.01 * e["gradients"] + 4096, (name, rank, job, r)
                assert _rel(m["optimizer"], e["optimizer"]) < 0.02, (name, rank, job, r)


def test_estimate_scales_with_the_layout():
    """The parts move as the layout says: TP halves weights, --dist-optim divides the optimizer state by DP,
    full recompute cuts activations, PP puts the embedding and the output layer on different stages."""
    from .launch_helpers import tiny_spec

    spec = tiny_spec(num_layers=8, vocab_size=32000, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                     num_query_groups=8, kv_channels=64)
    base = memory.Layout(seq_length=1024, micro_batch_size=2, dp=4)
    one = memory.estimate(spec, base)[0]
    tp2 = memory.estimate(spec, memory.Layout(**{**base.__dict__, "tp": 2}))[0]
    assert tp2.params.language < 0.51 * one.params.language
    dist = memory.estimate(spec, memory.Layout(**{**base.__dict__, "dist_optim": True}))[0]
    assert dist.optimizer == -(-one.optimizer // 4) and dist.gradients == one.gradients
    logits = 2 * 4 * 1024 * 2 * spec.padded_vocab_size  # fp32 logits and softmax of the micro batch
    full = memory.estimate(spec, memory.Layout(**{**base.__dict__, "recompute_granularity": "full"}))[0]
    assert full.activations - logits < 0.5 * (one.activations - logits)
    first, last = memory.estimate(spec, memory.Layout(**{**base.__dict__, "pp": 2, "grad_accum": 8}))
    emb = spec.padded_vocab_size * spec.hidden_size
    assert first.params.vision > 0 and last.params.vision == 0
    assert first.params.language - emb == last.params.language - emb - spec.hidden_size
    assert first.activations > last.activations - logits  # the first stage holds 2 micro batches, the last 1
    stage1 = memory.estimate(spec, memory.Layout(**{**base.__dict__, "trained": (False, True, False)}))[0]
    assert stage1.trainable == stage1.params.projector and stage1.gradients == 4 * stage1.params.projector
    # context parallelism: each rank keeps 1/CP of the language model's positions (Transformer Engine's attention;
    # the projector still runs on every image), megatron's local attention also the gathered keys and values and its
    # S/CP x S scores; the distributed optimizer shards over DP x CP
    for fused in (True, False):
        at = {cp: memory.estimate(spec, memory.Layout(**{**base.__dict__, "cp": cp, "fused_attention": fused}))[0]
              for cp in (1, 2, 4)}
        slack = 0.01 if fused else 0.03  # local attention: the whole sequence's keys and values on every rank
        assert 0.5 < at[2].activations / at[1].activations < 0.5 + slack and \
            0.25 < at[4].activations / at[1].activations < 0.25 + slack, (fused, {c: e.activations for c, e in at.items()})
        assert at[2].weights == at[1].weights and at[2].optimizer == at[1].optimizer
    cp2 = memory.estimate(spec, memory.Layout(**{**base.__dict__, "cp": 2, "dist_optim": True}))[0]
    assert cp2.optimizer == -(-one.optimizer // 8)
    # a trained vision encoder (issue 65): with --vision-cp-split each CP rank keeps its share of the tiles' encoder
    # activations (1/CP), without it every rank keeps them all; the language model's part is the same either way
    vit = {"trained": (True, True, True), "cp": 4}
    shared, whole = (memory.estimate(spec, memory.Layout(**{**base.__dict__, **vit, "vision_cp_split": split}))[0]
                     for split in (True, False))
    frozen = [memory.estimate(spec, memory.Layout(**{**base.__dict__, "cp": 4, "vision_cp_split": split}))[0]
              for split in (True, False)]
    assert frozen[0].activations == frozen[1].activations  # a frozen encoder keeps no activations
    vision = whole.activations - frozen[1].activations  # the encoder's activations on every tile
    assert vision > 0 and shared.activations - frozen[0].activations == vision // 4, (shared, whole, frozen)


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (4, 3), (2, 4)])
def test_interleaved_order_is_megatron_cores(pp, vpp):
    """The order of chunk passes the estimate follows is megatron-core's interleaved schedule: its forward passes
    are megatron-core's schedule table, and each rank's backward passes start after megatron-core's warm-up count."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel import schedules

    for m in (pp, 2 * pp, 3 * pp):
        for rank in range(pp):
            order = memory.interleaved_order(pp, vpp, m, rank)
            comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                                   virtual_pipeline_model_parallel_size=vpp)
            warmup = schedules.get_pp_rank_microbatches(m, vpp, pp, p2p_communicator=comm)[2]
            assert [(mb, c) for kind, mb, c in order if kind == "F"] == schedules.get_schedule_table(m, vpp, pp)
            assert [kind for kind, _, _ in order[:warmup]] == ["F"] * warmup
            assert order[warmup:warmup + 2] == ([("F", *order[warmup][1:]), ("B", 0, vpp - 1)] if warmup < m * vpp
                                                else [("B", 0, vpp - 1)] + order[warmup + 1:warmup + 2])
            held: set = set()
            for kind, mb, c in order:  # every pass backward once, after its forward
                assert ((mb, c) not in held) == (kind == "F")
                (held.add if kind == "F" else held.discard)((mb, c))
            assert not held


def test_estimate_counts_the_interleaved_schedules_passes_in_flight():
    """With virtual pipeline stages the first rank holds more layers' activations than with the plain 1F1B schedule:
    1 + (PP - 1) / (PP x VPP) times as many (Narayanan et al. 2021, the interleaved schedule's memory), measured here
    as what eight more layers per model add to each estimate (the embedding, vision and logits parts cancel)."""
    from .launch_helpers import tiny_spec

    def rank0(layers, **kw):
        spec = tiny_spec(num_layers=layers, vocab_size=32000, hidden_size=512, ffn_hidden_size=1024,
                         num_attention_heads=8, num_query_groups=8, kv_channels=64)
        return memory.estimate(spec, memory.Layout(seq_length=1024, micro_batch_size=2, grad_accum=8, **kw))[0]

    plain = rank0(16, pp=2).activations - rank0(8, pp=2).activations
    for pp, vpp in ((2, 2), (2, 4), (4, 2)):
        if pp != 2:
            plain = rank0(16, pp=pp).activations - rank0(8, pp=pp).activations
        interleaved = rank0(16, pp=pp, vpp=vpp).activations - rank0(8, pp=pp, vpp=vpp).activations
        assert interleaved / plain == pytest.approx(1 + (pp - 1) / (pp * vpp), rel=1e-6), (pp, vpp)
    est = rank0(8, pp=2, vpp=2)
    assert "up to 5 chunk passes in flight (2 chunks of 2 layer(s): the interleaved schedule)" in est.notes[-1]
    assert est.weights == rank0(8, pp=2).weights  # the same layers on each rank


def test_dry_run_prints_the_estimate_and_warns(tmp_path, capsys, no_slurm_env):  # noqa: F811
    from megatron_vlm.launch import cli

    rc = cli.main([*base_args(tmp_path), "-g", "2", "--tp", "2", "--dist-optim", "--stage", "2", "--dry-run"],
                  repo_root=REPO)
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.splitlines()
    head = lines[:lines.index(next(x for x in lines if x.startswith("# resolved config")))]
    assert head[0].startswith("# memory per GPU (estimate") and "TP=2 PP=1 DP=1" in head[0]
    for part in ("weights", "gradients", "optimizer state", "activations", "total"):
        assert any(x.startswith(f"#   {part}") and "GiB" in x for x in head), (part, head)
    assert "warning" not in out.err
    rc = cli.main([*base_args(tmp_path), "-g", "2", "--dry-run", "--gpu-memory-gb", "0.001"], repo_root=REPO)
    out = capsys.readouterr()
    assert rc == 0
    assert "warning: the memory estimate per GPU" in out.err and "exceeds 0.001 GiB (--gpu-memory-gb)" in out.err
    assert "of 0.001 GiB (--gpu-memory-gb)" in out.out
    rc = cli.main([*base_args(tmp_path), "--dry-run", "--gpu-memory-gb", "0"], repo_root=REPO)
    assert rc == 2 and "--gpu-memory-gb 0.0: must be positive" in capsys.readouterr().err
    # a SLURM batch script's dry run: the estimate first, checked against --gpu-memory-gb
    rc = cli.main([*base_args(tmp_path), "--sbatch", str(tmp_path / "job.sh"), "--nodes", "2", "--gpus-per-node", "2",
                   "--dry-run", "--gpu-memory-gb", "0.001"], repo_root=REPO)
    out = capsys.readouterr()
    assert rc == 0 and out.out.startswith("# memory per GPU (estimate") and "exceeds 0.001 GiB" in out.err
    assert not (tmp_path / "job.sh").exists()


def test_stage2_on_cuda_sizes_its_micro_batch_from_the_estimate(tmp_path, capsys, monkeypatch,
                                                                no_slurm_env):  # noqa: F811
    """Stage 2 on CUDA without --micro-batch-size: the largest micro batch of 16, 8, 4, 2 whose estimate fits 80% of
    the GPU's memory (and divides the global batch per DP rank, leaving --pp micro batches), instead of 1; on CPU,
    with --micro-batch-size, packing or stage 1, nothing changes. The launcher's --dry-run shows it."""
    import dataclasses

    from megatron_vlm.launch import cli, probe
    from megatron_vlm.training.config import TrainConfig
    from megatron_vlm.training.config.resolve import size_micro_batch

    from .launch_helpers import tiny_spec

    spec = tiny_spec(num_layers=8, vocab_size=32000, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                     num_query_groups=8, kv_channels=64)
    cfg = TrainConfig.from_args(["--device", "cuda", "--stage", "2", "--seq-length", "2048", "--data-path", "d",
                                 "--megatron-load-dir", "m", "--tokenizer-load-dir", "t", "--save-dir", "s",
                                 "--train-iters", "10"])
    assert cfg.micro_batch_size == 1 and cfg.global_batch_size == 128

    def need(mbs, fused=True):
        trial = dataclasses.replace(cfg, micro_batch_size=mbs)
        return max(s.total for s in memory.estimate(spec, memory.Layout.of_config(trial, fused, spec))) / memory.GIB

    c = dataclasses.replace(cfg)
    assert "--micro-batch-size 16: stage 2 on CUDA sizes" in size_micro_batch(c, spec, 80.0, True)
    assert c.micro_batch_size == 16
    limit = (need(4) + need(8)) / 2 / 0.8  # 4 fits 80% of it, 8 does not
    c = dataclasses.replace(cfg)
    assert size_micro_batch(c, spec, limit, True) and c.micro_batch_size == 4
    assert need(4, fused=False) > need(4)  # local attention keeps the score matrices: a smaller micro batch
    c = dataclasses.replace(cfg)
    assert size_micro_batch(c, spec, need(1) / 0.8 * 1.01, True) is None and c.micro_batch_size == 1
    for other in (dict(device="cpu"), dict(stage=1), dict(micro_batch_size=2), dict(packing_buffer_size=64)):
        c = dataclasses.replace(cfg, **other)
        assert size_micro_batch(c, spec, 80.0, True) is None and c.micro_batch_size == other.get("micro_batch_size",
                                                                                                  1), other
    c = dataclasses.replace(cfg, global_batch_size=16, pp=4, gpus=4)  # 16 per rank: 4 micro batches of 4 keep PP4 fed
    assert size_micro_batch(c, spec, 80.0, True) and c.micro_batch_size == 4
    # the launcher: a probe that reports one 80 GiB GPU, a dry run of stage 2 without --micro-batch-size
    monkeypatch.setattr(probe, "run_probe", lambda *a, **k: {"torch": "2.x", "device_count": 1,
                                                           "memory": [80 << 30]})
    args = [a for a in base_args(tmp_path) if a != "cpu"]
    args[args.index("--device") + 1: args.index("--device") + 1] = ["cuda"]
    assert cli.main([*args, "--stage", "2", "--dry-run"], repo_root=REPO) == 0
    out = capsys.readouterr()
    assert "--micro-batch-size 16: stage 2 on CUDA sizes its micro batch from the memory estimate" in out.out + out.err
    assert cli.main([*args, "--stage", "2", "--micro-batch-size", "2", "--dry-run"], repo_root=REPO) == 0
    assert "sizes its micro batch" not in "".join(capsys.readouterr())
