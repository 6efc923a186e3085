"""Per-rank functions that tests and benchmarks run in a local world (see runtime.spawn.run_world).

One world runs many checks: megatron's model-parallel groups are re-initialised per job, so a 4-process
world covers TP/PP in {(1,1), (2,1), (1,2), (2,2)} without paying process start-up for each.
"""

from __future__ import annotations

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.convert.verify import ReferenceBatch, megatron_forward_logits
from megatron_vlm.model.spec import VLMSpec


def _model_for(iter_dir, tp, pp, seq_length, pp_layers=None, ep: int = 1, etp: int | None = None,
               attention: str = "auto"):
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime import distributed

    distributed.setup(tp, pp, device="cpu", ep=ep, etp=etp)
    spec = VLMSpec.load(iter_dir)
    model = build_model(spec, ModelOptions(tp=tp, pp=pp, pp_layers=pp_layers, seq_length=seq_length,
                                           perform_initialization=False, ep=ep, etp=etp,
                                           attention_backend=attention))
    ckpt.load_model_weights(model, iter_dir)
    model.eval()
    return model


def logits_jobs(jobs: list[dict], batch: ReferenceBatch | None = None) -> list:
    """Each job: {megatron_dir, tp, pp, pp_layers?, save_to?, batch?, attention?} (``batch``: the job's own reference
    batch, else the common one; ``attention``: ``--attention-backend``, default auto). Returns logits per job (on one
    rank)."""
    from megatron.core import parallel_state as ps

    out = []
    for job in jobs:
        job_batch = job.get("batch", batch)
        iter_dir = ckpt.resolve_iteration_dir(job["megatron_dir"])
        model = _model_for(iter_dir, job["tp"], job["pp"], job_batch.combined_length, job.get("pp_layers"),
                           attention=job.get("attention", "auto"))
        logits = megatron_forward_logits(model, job_batch)
        if job.get("save_to"):  # re-save from this TP/PP with megatron's dist_checkpointing
            meta = ckpt.CheckpointMeta.load(iter_dir)
            dst = ckpt.Path(job["save_to"]) / "release"
            ckpt.save_model_weights(model, dst)
            if torch.distributed.get_rank() == 0:
                ckpt.copy_side_files(iter_dir, dst)
                ckpt.CheckpointMeta("torch_dist", job["tp"], job["pp"], meta.pp_layers if job["pp"] == meta.pp
                                    else VLMSpec.load(iter_dir).check_parallelism(job["tp"], job["pp"]),
                                    "release", meta.dtype).save(dst)
                ckpt.write_tracker(job["save_to"], "release")
            torch.distributed.barrier()
        mine = logits if (logits is not None and ps.get_tensor_model_parallel_rank() == 0
                          and ps.get_data_parallel_rank() == 0) else None
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        out.append(next(g for g in gathered if g is not None))
        del model
    return out if torch.distributed.get_rank() == 0 else None


def grads_job(megatron_dir, tp: int, batch: ReferenceBatch, targets: torch.Tensor) -> dict | None:
    """Full-tensor gradients of mean cross entropy (logits vs ``targets``) at TP=tp, PP=1."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_vlm.convert import mapping

    iter_dir = ckpt.resolve_iteration_dir(megatron_dir)
    model = _model_for(iter_dir, tp, 1, batch.combined_length)
    spec = VLMSpec.load(iter_dir)
    out, _ = model(images=batch.images, input_ids=batch.tokens, position_ids=None, attention_mask=None)
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(out)[..., : spec.vocab_size]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab_size).float(), targets.reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    result = {}
    group = ps.get_tensor_model_parallel_group()
    for rule in mapping.rules(spec):
        g = grads[rule.mcore]
        shards = [torch.empty_like(g) for _ in range(tp)]
        torch.distributed.all_gather(shards, g.contiguous(), group=group)
        result[rule.mcore] = mapping.tp_merge(rule, shards)
    return {"loss": loss.item(), "grads": result} if torch.distributed.get_rank() == 0 else None


def megatron_lm_checkpoints(jobs: list[tuple[str, str]], seq_length: int = 64) -> None:
    """For each (converted checkpoint, output dir) of ``jobs``, write at TP=world size under the output dir our
    imitation of the checkpoints Megatron-LM writes (its ``megatron/training/checkpointing.py`` layout, as read from
    its source; Megatron-LM itself is not installed, so nothing here comes from its code), with none of megatron-vlm's
    side files, plus one in megatron-vlm's older ``model.``-prefixed convention:

    - ``dist_te``: torch_dist, keys without prefix, Transformer Engine norm names, TE ``_extra_state`` objects,
      ``args`` in common.pt, ``iter_0000007`` + tracker (as ``megatron/training/checkpointing.py`` saves);
    - ``dist_local``: torch_dist with the local spec's norm names, no ``args``, ``release``;
    - ``legacy``: ``mp_rank_XX/model_optim_rng.pt`` with ``args``, TE norm names and ``_extra_state`` tensors;
    - ``old_prefix``: torch_dist under ``model.`` with megatron-vlm's side files (backward compatibility).

    A job ``(converted checkpoint, output dir, "pp2vpp2", pp_layers)`` writes, at PP2 (``pp_layers`` language layers
    per rank, or None) with two virtual pipeline stages per rank, the same imitation of what Megatron-LM writes of its
    model chunks (:func:`_megatron_lm_vpp_checkpoints`).
    """
    for megatron_dir, out_root, *kind in jobs:
        if kind and kind[0] == "pp2vpp2":
            _megatron_lm_vpp_checkpoints(megatron_dir, out_root, seq_length, kind[1])
        else:
            _megatron_lm_checkpoints(megatron_dir, out_root, seq_length)


def _megatron_lm_vpp_checkpoints(megatron_dir, out_root, seq_length: int, pp_layers=None) -> None:
    """Our imitation of Megatron-LM's checkpoints of a run at PP2 x VPP2 (a 2-process world; ``pp_layers``: an uneven
    split, Megatron-LM's ``--decoder-first-pipeline-num-layers``): megatron-core's own model chunks
    (``model.build_chunks``: chunk ``c`` of pipeline rank ``p`` is virtual stage ``c * 2 + p``) saved by this function,
    with ``args`` and none of megatron-vlm's side files, in the layout ``megatron/training/checkpointing.py``'s
    ``generate_state_dict`` gives a list of chunks (read from its source, not run):

    - ``dist``: torch_dist of ``{"model0": chunk 0's sharded state dict, "model1": ...}`` (global layer numbers),
      ``iter_0000003`` + tracker;
    - ``legacy``: ``mp_rank_00_PPP/model_optim_rng.pt`` with ``model0``, ``model1``: each chunk's ``state_dict()``
      (its layers numbered from 0) under Transformer Engine's norm names.
    """
    import argparse
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnBackend

    from megatron_vlm.model.build import LOCAL_TO_TE_KEYS, ModelOptions, build_chunks
    from megatron_vlm.runtime import distributed

    distributed.setup(1, 2, device="cpu", vpp=2)
    src = ckpt.resolve_iteration_dir(megatron_dir)
    spec = VLMSpec.load(src)
    chunks = build_chunks(spec, ModelOptions(pp=2, pp_layers=pp_layers, vpp=2, seq_length=seq_length,
                                             perform_initialization=False))
    ckpt.load_model_weights(chunks, src)
    out, rank = Path(out_root), ps.get_pipeline_model_parallel_rank()
    args = argparse.Namespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        group_query_attention=True, num_query_groups=spec.num_query_groups, kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size, swiglu=True, padded_vocab_size=spec.padded_vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2, decoder_first_pipeline_num_layers=pp_layers[0] if pp_layers else None,
        attention_backend=AttnBackend.auto, ckpt_format="torch_dist", bf16=False)
    iter_dir = out / "dist" / "iter_0000003"
    if rank == 0:
        iter_dir.mkdir(parents=True)
    torch.distributed.barrier()
    ckpt.save_sharded({**{f"model{c}": ckpt.model_sharded_state_dict(m) for c, m in enumerate(chunks)},
                       "checkpoint_version": 3.0, "iteration": 3, "args": args}, iter_dir)
    if rank == 0:
        ckpt.write_tracker(out / "dist", 3)
    states = {}
    for c, m in enumerate(chunks):
        state = {}
        for k, v in m.state_dict().items():
            for local, te in LOCAL_TO_TE_KEYS.items():
                k = k.replace("." + local, "." + te)
            state[k] = v.clone() if isinstance(v, torch.Tensor) else v
        states[f"model{c}"] = state
    args.ckpt_format = "torch"
    path = ckpt.legacy_rank_file(out / "legacy" / "iter_0000003", 0, rank, 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3, **states}, path)
    torch.distributed.barrier()
    if rank == 0:
        ckpt.write_tracker(out / "legacy", 3)


def _megatron_lm_checkpoints(megatron_dir, out_root, seq_length: int) -> None:
    import argparse
    import os
    import io
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.transformer.enums import AttnBackend

    from megatron_vlm.model.build import LOCAL_TO_TE_KEYS

    tp = int(os.environ["WORLD_SIZE"])  # set by run_world
    src = ckpt.resolve_iteration_dir(megatron_dir)
    model = _model_for(src, tp, 1, seq_length)
    spec = VLMSpec.load(src)
    rank, out = ps.get_tensor_model_parallel_rank(), Path(out_root)
    args = argparse.Namespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        group_query_attention=True, num_query_groups=spec.num_query_groups, kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size, swiglu=True, padded_vocab_size=spec.padded_vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by // tp,  # Megatron-LM pads to this x TP
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, attention_backend=AttnBackend.auto,
        ckpt_format="torch_dist", bf16=False,
    )

    jobs = {
        "dist_te": (ckpt.DistKeyLayout("", True), 7, {"args": args}),
        "dist_local": (ckpt.DistKeyLayout("", False), "release", {}),
        "old_prefix": (ckpt.DistKeyLayout(ckpt.OLD_PREFIX, True), "release", {}),
    }
    for name, (layout, iteration, common) in jobs.items():
        iter_dir = out / name / ckpt.iter_dir_name(iteration)
        sd = {"model": ckpt.model_sharded_state_dict(model, layout), "checkpoint_version": 3.0, **common}
        if iteration != "release":
            sd["iteration"] = iteration
        if name == "dist_te":  # TE's _extra_state objects hold FP8 metadata (local layers save None)
            for sh in nested_values(sd["model"]):
                if isinstance(sh, ShardedObject) and sh.key.endswith("_extra_state"):
                    sh.data = io.BytesIO(b"fp8 scaling metadata")
        if rank == 0:
            iter_dir.mkdir(parents=True)
        torch.distributed.barrier()
        ckpt.save_sharded(sd, iter_dir)
        if rank == 0:
            ckpt.write_tracker(out / name, iteration)
            if name == "old_prefix":
                ckpt.copy_side_files(src, iter_dir)
                meta = ckpt.CheckpointMeta.load(src)
                ckpt.CheckpointMeta("torch_dist", tp, 1, [spec.num_layers], "release", meta.dtype).save(iter_dir)
        torch.distributed.barrier()
    # legacy: each rank's model.state_dict() (the local spec's) renamed as a TE model names it
    state = {}
    for k, v in model.state_dict().items():
        for local, te in LOCAL_TO_TE_KEYS.items():
            k = k.replace("." + local, "." + te)
        state[k] = v.clone() if isinstance(v, torch.Tensor) else v
        if k.endswith("_extra_state"):
            state[k] = torch.zeros(3, dtype=torch.uint8)  # TE's serialised FP8 metadata
    args.ckpt_format = "torch"
    path = ckpt.legacy_rank_file(out / "legacy" / "iter_0000007", rank, 0, 1)
    path.parent.mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": state}, path)
    torch.distributed.barrier()
    if rank == 0:
        ckpt.write_tracker(out / "legacy", 7)


def megatron_lm_moe_checkpoints(megatron_dir, out_root, seq_length: int = 64) -> None:
    """Our imitation of the checkpoints Megatron-LM writes of a mixture-of-experts LLaVA (its layout as read from its
    source), at TP2 x EP2 in a 4-process world (data parallel 2), with Megatron-LM's ``args`` and none of
    megatron-vlm's side files:

    - ``dist``: torch_dist (keys without prefix, Transformer Engine norm names; experts under megatron-core's
      global expert axis, the same for SequentialMLP and TEGroupedMLP), ``iter_0000005`` + tracker;
    - ``legacy_sequential``: ``mp_rank_TT_EEE/model_optim_rng.pt`` per (TP, EP) rank, SequentialMLP's names
      (``mlp.experts.local_experts.<local j>.linear_fc1.weight``);
    - ``legacy_grouped``: the same files under Transformer Engine's TEGroupedMLP names
      (``mlp.experts.linear_fc1.weight<local j>``), as a grouped-GEMM run saves them;
    - ``legacy_etp1``: at expert TP 1, only the files Megatron-LM writes there (``mp_rank_00_000`` and
      ``mp_rank_01_001``: the ranks of expert data-parallel rank 0, which are also those of data-parallel rank 0).
    """
    import argparse
    import os
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnBackend

    from megatron_vlm.model.layer_impl import grouped_expert_name
    from megatron_vlm.model.build import LOCAL_TO_TE_KEYS

    assert int(os.environ["WORLD_SIZE"]) == 4
    src = ckpt.resolve_iteration_dir(megatron_dir)
    model = _model_for(src, 2, 1, seq_length, ep=2)
    spec = VLMSpec.load(src)
    out = Path(out_root)
    args = argparse.Namespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        group_query_attention=True, num_query_groups=spec.num_query_groups, kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size, swiglu=True, padded_vocab_size=spec.padded_vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by // 2, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1, expert_model_parallel_size=2, expert_tensor_parallel_size=2,
        num_experts=spec.num_moe_experts, moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size, qk_layernorm=spec.qk_layernorm,
        attention_backend=AttnBackend.auto, ckpt_format="torch_dist", bf16=False)
    iter_dir = out / "dist" / "iter_0000005"
    if torch.distributed.get_rank() == 0:
        iter_dir.mkdir(parents=True)
    torch.distributed.barrier()
    ckpt.save_sharded({"model": ckpt.model_sharded_state_dict(model), "checkpoint_version": 3.0, "iteration": 5,
                       "args": args}, iter_dir)
    if torch.distributed.get_rank() == 0:
        ckpt.write_tracker(out / "dist", 5)

    def legacy_state(model):
        state = {}
        moe_layers = tuple(f"language_model.decoder.layers.{i}." for i in spec.moe_layers)
        for k, v in model.state_dict().items():
            for local, te in LOCAL_TO_TE_KEYS.items():
                if not (local == "pre_mlp_layernorm." and k.startswith(moe_layers)):  # an MoE layer keeps its own norm
                    k = k.replace("." + local, "." + te)
            state[k] = v.clone() if isinstance(v, torch.Tensor) else v
        return state

    def save_legacy(name, state, run_args, writes: bool) -> None:
        path = ckpt.legacy_rank_file(out / name / "iter_0000005", ps.get_tensor_model_parallel_rank(), 0, 1,
                                     ep_rank=ps.get_expert_model_parallel_rank(), ep=2)
        if writes:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"args": run_args, "checkpoint_version": 3.0, "iteration": 5, "model": state}, path)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            ckpt.write_tracker(out / name, 5)

    # Megatron-LM writes a legacy checkpoint on the ranks of expert data-parallel rank 0 (since its #4678 also on
    # those of data-parallel rank 0): at ETP2 every rank here, at ETP1 only TP0 x EP0 and TP1 x EP1
    args.ckpt_format = "torch"
    state = legacy_state(model)
    save_legacy("legacy_sequential", state, args, True)
    save_legacy("legacy_grouped", {grouped_expert_name(k): v for k, v in state.items()}, args, True)
    del model, state
    model = _model_for(src, 2, 1, seq_length, ep=2, etp=1)
    etp1_args = argparse.Namespace(**dict(vars(args), expert_tensor_parallel_size=1))
    save_legacy("legacy_etp1", legacy_state(model), etp1_args,
                ps.get_expert_data_parallel_rank() == 0 or ps.get_data_parallel_rank() == 0)
    torch.distributed.barrier()


def in_turn(calls: list[tuple]) -> list | None:
    """Several per-rank job functions in one world, one after the other: ``calls`` is ``[(function, args), ...]``
    of module-level functions of this package (e.g. :func:`tests.support.family_jobs.logit_diffs` and
    :func:`tests.support.train_jobs.train_jobs`); returns each one's result (on rank 0), so that a test
    module pays for one world's start-up."""
    out = [function(*args) for function, args in calls]
    return out if torch.distributed.get_rank() == 0 else None


def sharded_generation(jobs: list[dict]) -> list | None:
    """``eval/generate.py --engine megatron``'s generator in turn at each job's layout: ``{megatron_dir, tp, pp, ep?,
    dtype? (fp32 | bf16), prompts: [(messages, images[, videos])], max_new_tokens}``. Returns each job's new token ids per prompt (on rank 0)."""
    from megatron_vlm.eval.generate import Sampling
    from megatron_vlm.eval.sharded import ShardedGenerator
    from megatron_vlm.runtime import distributed

    out = []
    for job in jobs:
        distributed.setup(job["tp"], job["pp"], device="cpu", ep=job.get("ep", 1))
        gen = ShardedGenerator.from_checkpoint(ckpt.resolve_iteration_dir(job["megatron_dir"]),
                                               Sampling(max_new_tokens=job["max_new_tokens"]), max_length=256,
                                               dtype=job.get("dtype", "fp32"))
        out.append(gen.generate_ids([gen.encode(*prompt) for prompt in job["prompts"]]))
        del gen
    return out if torch.distributed.get_rank() == 0 else None
