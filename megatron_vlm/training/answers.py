"""Answers and scores during training (``--eval-generate-interval N``): every N iterations, and at the last, the
model being trained answers the first ``--eval-generate-samples`` samples of a held-out split, and they are scored
as ``eval/evaluate.py`` scores them.

The samples are read once at start-up, on every rank, by ``eval/evaluate.py``'s own reader (energon's
``get_val_dataset`` in order, decoded and cooked as in training): the same samples at every evaluation, of
``--eval-generate-data`` (default ``--data-path``), split ``--eval-generate-split`` (default val). A split that is
empty, a sample without an answer, or a prompt that with ``--eval-generate-max-new-tokens`` does not fit in
``--seq-length`` (the KV cache's length) is refused at start-up in one line that names it.

The answers come from :class:`megatron_vlm.eval.sharded.ShardedGenerator` over this rank's own model chunk (its
``Float16Module`` in bf16; greedy, megatron-core's ``VLMTextGenerationController`` with the KV cache) at the
training layout: TP and PP ranks generate together, data-parallel replicas answer their share of the samples
(every replica all of them with expert parallelism, whose all-to-alls pair the replicas' forwards) and the rows
are gathered over the data-parallel group. ``eval/evaluate.py --engine megatron`` runs the same generator over a
checkpoint, and ``eval/evaluate.py`` over an export gives the same rows (tests/test_eval.py).

Training continues exactly as without it: the training data loader is not read, the random-number generators
(torch, CUDA, megatron's tracker, Python, NumPy) are restored after each evaluation, every module's train/eval mode
is put back as it was, megatron-core's RoPE cache (filled under ``torch.inference_mode``) is emptied, and with
overlapped parameter gathers the forward pre-hooks are off while it runs (the parameters are current then).
The generator's KV cache is dropped after each evaluation.

The logging rank writes the rows to ``<run dir>/eval_generate/iter_XXXXXXX.jsonl`` (``eval/evaluate.py``'s
``--output`` lines) and hands the scores to :class:`~megatron_vlm.training.metrics.MetricsLogger` (the console,
``metrics.jsonl``, TensorBoard, W&B). Not run: context parallelism, virtual pipeline stages, sequence parallelism,
TP x EP, fp16, FP8, Qwen-VL (refused before launch or at start-up, :mod:`.config.checks`).
"""

from __future__ import annotations

import logging
import random
import time

import torch

log = logging.getLogger("megatron_vlm.train")

#: answers printed beside their references at each evaluation
SHOWN = 3


def source(cfg) -> tuple[str, str]:
    """(the dataset answered, the flag that names it)."""
    if cfg.eval_generate_data:
        return str(cfg.eval_generate_data), "--eval-generate-data"
    return str(cfg.data_path), "--data-path"


def read_held_out(cfg, spec) -> list:
    """The first ``--eval-generate-samples`` items (:class:`megatron_vlm.eval.evaluate.Item`) of the split, each
    checked against ``--seq-length``; a bad split or sample raises ``ValueError`` naming it and the fix."""
    from megatron_vlm.eval.evaluate import iterate_split
    from megatron_vlm.eval.prompts import PromptEncoder

    path, flag = source(cfg)
    split, k = cfg.eval_generate_split, cfg.eval_generate_samples
    where = f"{flag} {path} '{split}' split"
    items = []
    try:
        loader, _ = iterate_split(path, split, min(k, 16))
        for batch in loader:
            items += batch[:k - len(items)]
            if len(items) >= k:
                break
    except ValueError as e:
        if "no samples in its" in str(e):
            raise ValueError(f"{where} has no samples for --eval-generate-interval to answer; pass another "
                             "--eval-generate-data or --eval-generate-split (make_wds.py --split sets the "
                             "train,val,test weights)") from None
        raise ValueError(f"{where}: {e}") from None
    if not items:
        raise ValueError(f"{where} has no samples for --eval-generate-interval to answer; pass another "
                         "--eval-generate-data or --eval-generate-split")
    encoder = PromptEncoder(cfg.tokenizer_load_dir, spec, cfg.video_fps, cfg.video_frames)
    for it in items:
        if not it.reference:
            raise ValueError(f"{where}: sample {it.id} has an empty answer to score against; --eval-generate-data "
                             "needs samples whose last assistant turn holds the reference answer")
        n = len(encoder.encode(it.messages, it.images, it.videos).input_ids)
        if n + cfg.eval_generate_max_new_tokens > cfg.seq_length:
            raise ValueError(f"{where}: sample {it.id}'s prompt is {n} tokens (images expanded), which with "
                             f"--eval-generate-max-new-tokens {cfg.eval_generate_max_new_tokens} exceeds --seq-length "
                             f"{cfg.seq_length}; raise --seq-length or lower --eval-generate-max-new-tokens")
    return items


class InLoopAnswers:
    """The held-out items and this rank's generator over the trained model (collective: every rank calls it at the
    same iterations). Built at start-up, after the model: what cannot run is refused before the first step."""

    def __init__(self, cfg, spec, training):
        from megatron.core import parallel_state as ps

        from megatron_vlm.eval.generate import Sampling
        from megatron_vlm.eval.sharded import ShardedGenerator, ShardedUnsupported

        if len(training.models) != 1:
            raise ValueError("--eval-generate-interval runs one model chunk per pipeline rank; drop it with virtual "
                             "pipeline stages")
        self.cfg, self.training = cfg, training
        self.items = read_held_out(cfg, spec)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.shared = ps.get_expert_model_parallel_world_size() > 1  # every replica answers every item
        wrapped = training.ddps[0].module if training.dtype != torch.float32 else None
        modes = _modes(training.ddps[0])
        try:
            self.generator = ShardedGenerator(training.models[0], wrapped, spec, cfg.tokenizer_load_dir,
                                              Sampling(max_new_tokens=cfg.eval_generate_max_new_tokens),
                                              max_length=cfg.seq_length, video_fps=cfg.video_fps,
                                              video_frames=cfg.video_frames)
        except ShardedUnsupported as e:
            raise ValueError(f"--eval-generate-interval: {e}") from None
        finally:
            _restore_modes(modes)  # the generator puts the model in eval mode

    def describe(self) -> str:
        path, _ = source(self.cfg)
        return (f"{len(self.items)} samples of {path} '{self.cfg.eval_generate_split}' answered every "
                f"{self.cfg.eval_generate_interval} iterations (greedy, up to {self.cfg.eval_generate_max_new_tokens} "
                f"new tokens" + (f", {self.dp} data-parallel replicas sharing them" if self.dp > 1 and not self.shared
                                 else "") + ")")

    def _mine(self) -> list:
        return self.items if self.shared else self.items[self.dp_rank::self.dp]

    def __call__(self, iteration: int, progress: bool) -> tuple[list[dict], float]:
        """Every item answered and scored (the rows in item order, on every rank) and the seconds it took."""
        from megatron_vlm.eval.evaluate import answer_items
        from megatron_vlm.training import checkpointing

        t0 = time.time()
        rng = checkpointing.rng_state()
        py, np_state = random.getstate(), _numpy_state()
        modes = _modes(self.training.ddps[0])
        overlap = self.training.overlapping_param_gather()
        if overlap:
            self.training.disable_forward_pre_hook()
        try:
            mine, rows = self._mine(), []
            step = max(len(mine) // 4, 1)
            for i in range(0, len(mine), step):
                rows += answer_items(self.generator, mine[i:i + step])
                if progress:
                    log.info("iter %d | answering held-out samples: %d/%d (%.1f s)", iteration, len(rows),
                             len(mine), time.time() - t0)
            self.generator.release()
        finally:
            if overlap:
                self.training.enable_forward_pre_hook()
            _restore_modes(modes)
            _clear_rope_cache()
            checkpointing.set_rng_state(rng)
            random.setstate(py)
            _set_numpy_state(np_state)
        if not self.shared and self.dp > 1:
            gathered = [None] * self.dp
            torch.distributed.all_gather_object(gathered, rows, group=self.dp_group)
            rows = [None] * len(self.items)
            for r, part in enumerate(gathered):
                rows[r::self.dp] = part
        return rows, time.time() - t0



def _modes(module) -> dict:
    """Every module's train/eval mode under ``module`` (a frozen part may stay in eval mode while the rest trains)."""
    return {m: m.training for m in module.modules()}


def _restore_modes(modes: dict) -> None:
    for m, training in modes.items():
        m.training = training


def _clear_rope_cache() -> None:
    """megatron-core's RoPE embeddings are an ``lru_cache`` over the sequence length; the entries computed under
    ``torch.inference_mode`` cannot be saved for a backward pass."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if clear is not None:
        clear()


def _numpy_state():
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's users here
        return None
    return np.random.get_state()


def _set_numpy_state(state) -> None:
    if state is not None:
        import numpy as np

        np.random.set_state(state)
