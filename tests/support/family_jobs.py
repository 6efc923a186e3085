"""Per-rank job of tests/test_lm_families.py: Megatron's fp32 logits against HF's, reduced to one number per job.

:func:`tests.support.worlds.logits_jobs` returns every job's full logits on every rank, which is fine for
tiny vocabularies; Qwen3's 151,936 rows make that gigabytes per rank over a dozen jobs. Here the HF reference of
each job is a file (``torch.save``, read with ``mmap``), and the rank that holds the full-vocabulary logits (TP rank 0,
DP rank 0 of the last stage) returns only the max |difference| over the true vocabulary (and valid positions).
"""

from __future__ import annotations

import torch

from megatron_vlm.checkpoint import layout as ckpt


def logit_diffs(jobs: list[dict]) -> list[float] | None:
    """Each job: {megatron_dir, tp, pp, ep?, etp?, batch, ref_file, vocab}; returns the max |logit diff| per job
    (rank 0; a job whose layout needs fewer ranks than the world has runs with data-parallel replicas)."""
    from megatron.core import parallel_state as ps

    from megatron_vlm.convert.verify import max_logit_diff, megatron_forward_logits
    from tests.support.worlds import _model_for

    out = []
    for job in jobs:
        batch = job["batch"]
        model = _model_for(ckpt.resolve_iteration_dir(job["megatron_dir"]), job["tp"], job["pp"],
                           batch.combined_length, ep=job.get("ep", 1), etp=job.get("etp"))
        logits = megatron_forward_logits(model, batch)
        mine = None
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            ref = torch.load(job["ref_file"], mmap=True)
            mine = max_logit_diff(ref, logits[:, : ref.shape[1]], job["vocab"],
                                  batch if batch.variable_length else None)
        del model, logits
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        out.append(next(g for g in gathered if g is not None))
    return out if torch.distributed.get_rank() == 0 else None
