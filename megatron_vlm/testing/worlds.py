"""Per-rank functions that tests and benchmarks run in a local world (see runtime.spawn.run_world).

One world runs many checks: megatron's model-parallel groups are re-initialised per job, so a 4-process
world covers TP/PP in {(1,1), (2,1), (1,2), (2,2)} without paying process start-up for each.
"""

from __future__ import annotations

import torch

from megatron_vlm import checkpoint as ckpt
from megatron_vlm.convert.verify import ReferenceBatch, megatron_forward_logits
from megatron_vlm.spec import VLMSpec


def _model_for(iter_dir, tp, pp, seq_length, pp_layers=None):
    from megatron_vlm.model import ModelOptions, build_model
    from megatron_vlm.runtime import distributed

    distributed.setup(tp, pp, device="cpu")
    spec = VLMSpec.load(iter_dir)
    model = build_model(spec, ModelOptions(tp=tp, pp=pp, pp_layers=pp_layers, seq_length=seq_length,
                                           perform_initialization=False))
    ckpt.load_model_weights(model, iter_dir)
    model.eval()
    return model


def logits_jobs(jobs: list[dict], batch: ReferenceBatch) -> list:
    """Each job: {megatron_dir, tp, pp, pp_layers?, save_to?}. Returns logits per job (on one rank)."""
    from megatron.core import parallel_state as ps

    out = []
    for job in jobs:
        iter_dir = ckpt.resolve_iteration_dir(job["megatron_dir"])
        model = _model_for(iter_dir, job["tp"], job["pp"], batch.combined_length, job.get("pp_layers"))
        logits = megatron_forward_logits(model, batch)
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
