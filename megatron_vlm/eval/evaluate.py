"""Score a model on a split of an energon dataset, and the ``eval/evaluate.py`` command.

The split is read once, in order, by energon's own loader (``get_val_dataset`` + ``get_loader``, the
dataset's sample type: ``VQASample`` for ``make_wds --format vqa``, megatron-vlm's ``ConversationSample``
otherwise), decoded as training decodes it (:class:`EvalTaskEncoder`). Each sample becomes a prompt -- its
conversation up to its last assistant turn -- and a reference -- that turn's text. Prompts are answered in
batches of ``--batch-size`` by HF ``generate`` (:mod:`.generate`; a sample with a video goes alone, as videos of
different lengths do not batch). Every answer is scored by exact match and by VQAv2's normalised match
(:mod:`.score`); ``--output`` gets one JSON line per sample: ``id`` (the sample's key in the dataset: make_wds
keys a record by its index in the input), ``question`` (the text of the last user turn), ``reference``,
``prediction``, ``correct`` (exact match) and ``vqa_correct``. The file is written to a temporary path and
renamed when the split is done.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Item:
    """One sample of the split, as a prompt and its reference."""

    id: str
    messages: list  # the conversation up to (not including) its last assistant turn
    question: str
    reference: str
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)


def _text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")


def item_of(key: str, messages: list[dict], images: list, videos: list) -> Item:
    """The prompt and reference of a conversation: everything before its last assistant turn, and that turn."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ValueError(f"sample {key} has no assistant turn to compare with")
    prompt = messages[:last]
    n_img = sum(1 for m in prompt for p in (m.get("content") or []) if isinstance(p, dict) and p.get("type") == "image")
    n_vid = sum(1 for m in prompt for p in (m.get("content") or []) if isinstance(p, dict) and p.get("type") == "video")
    user = next((m for m in reversed(prompt) if m.get("role") == "user"), {"content": []})
    return Item(key, prompt, _text(user).strip(), _text(messages[last]).strip(), list(images)[:n_img],
                list(videos)[:n_vid])


def eval_task_encoder():
    """An energon task encoder that turns the split's samples into :class:`Item` lists (a batch is a list)."""
    from megatron.energon import DefaultTaskEncoder
    from megatron.energon.task_encoder.base import stateless

    from megatron_vlm.data.sample import conversation_of, videos_of
    from megatron_vlm.data.task_encoder import VLMTaskEncoder

    class EvalTaskEncoder(DefaultTaskEncoder):
        """Decodes and cooks samples as training does (PIL RGB images, energon's video decoder); no tokens."""

        decoder = VLMTaskEncoder.decoder
        cookers = VLMTaskEncoder.cookers

        @stateless
        def encode_sample(self, sample):
            messages, images = conversation_of(sample)
            return item_of(sample.__key__, messages, images, videos_of(sample))

        @stateless
        def batch(self, samples):
            return list(samples)

    return EvalTaskEncoder()


def iterate_split(data_path, split: str, batch_size: int, num_workers: int = 0):
    """Batches (lists of :class:`Item`) of one ordered pass over ``split`` of ``data_path``."""
    from megatron.energon import get_loader, get_val_dataset

    from megatron_vlm.data.loader import _check_path, worker_config

    from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError

    try:
        dataset = get_val_dataset(_check_path(data_path), split_part=split,
                                  worker_config=worker_config(0, 1, num_workers), batch_size=batch_size,
                                  task_encoder=eval_task_encoder())
    except EmptyDatasetError:
        raise ValueError(_empty(data_path, split)) from None
    return get_loader(dataset), len(dataset)


def _empty(data_path, split: str) -> str:
    return (f"--data-path {data_path} has no samples in its '{split}' split; choose another --split "
            "(make_wds.py --split sets the train,val,test weights)")


def _sub_batches(items: list[Item]):
    """Items without videos together; each item with a video alone."""
    plain = [it for it in items if not it.videos]
    if plain:
        yield plain
    for it in items:
        if it.videos:
            yield [it]


def answer_items(generator, items: list[Item]) -> list[dict]:
    """``items`` answered by ``generator`` (``encode`` and ``answer``) and scored: one row per item, in order, as
    ``--output`` holds them."""
    from megatron_vlm.eval.score import exact_match, vqa_match

    answers = {}
    for group in _sub_batches(items):
        prompts = [generator.encode(it.messages, it.images, it.videos) for it in group]
        for it, pred in zip(group, generator.answer(prompts)):
            answers[id(it)] = pred
    return [{"id": it.id, "question": it.question, "reference": it.reference, "prediction": answers[id(it)],
             "correct": exact_match(answers[id(it)], it.reference),
             "vqa_correct": vqa_match(answers[id(it)], it.reference)} for it in items]


def scores(rows: list[dict]) -> dict:
    """``{"samples", "exact", "vqa"}`` of scored rows (accuracies in [0, 1])."""
    from megatron_vlm.eval.score import accuracy

    return {"samples": len(rows), "exact": accuracy([r["correct"] for r in rows]),
            "vqa": accuracy([r["vqa_correct"] for r in rows])}


def write_rows(output, rows: list[dict]) -> None:
    """``rows`` as JSON lines at ``output``, written to a temporary path and renamed."""
    from megatron_vlm.files.atomic import atomic_write_text

    atomic_write_text(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def evaluate(generator, data_path, split: str, output, batch_size: int = 8, limit: int | None = None,
             num_workers: int = 0, progress: bool | None = None) -> dict:
    """Generate for every sample of ``split`` (or the first ``limit``), write ``output`` (jsonl; ``None``: nothing, a
    sharded world's other ranks) and return ``{"samples", "exact", "vqa"}`` (accuracies in [0, 1]).
    ``generator``: :class:`~megatron_vlm.eval.generate.Generator` or :class:`~megatron_vlm.eval.sharded.ShardedGenerator`
    (``encode`` and ``answer``)."""
    from tqdm import tqdm

    loader, total = iterate_split(data_path, split, batch_size, num_workers)
    if limit is not None:
        total = min(total, limit) if total else limit
    rows: list[dict] = []
    # a bar on a terminal only (tqdm's disable=None), never with progress=False; log lines otherwise
    bar = tqdm(total=total or None, desc=f"evaluating {split}", unit="sample", disable=True if progress is False else None)
    for n_batches, batch in enumerate(loader, 1):
        if limit is not None:
            batch = batch[:max(limit - len(rows), 0)]
        rows += answer_items(generator, batch)
        bar.update(len(batch))
        if not sys.stderr.isatty() and n_batches % 50 == 0:  # no bar in a log file: a line now and then
            log.info("evaluated %d samples", len(rows))
        if limit is not None and len(rows) >= limit:
            break
    bar.close()
    if not rows:
        raise ValueError(_empty(data_path, split))
    if output is not None:
        write_rows(output, rows)
    return scores(rows)


def evaluate_on_rank(setup, data_path, split: str, output, batch_size: int, limit: int | None,
                     num_workers: int) -> dict | None:
    """One rank of ``eval/evaluate.py --engine megatron``: every rank reads the split and generates (the collectives
    need them all), rank 0 writes ``output`` and returns the scores."""
    import torch

    from megatron_vlm.eval.sharded import generator_on_rank

    gen = generator_on_rank(setup)
    first = torch.distributed.get_rank() == 0
    res = evaluate(gen, data_path, split, output if first else None, batch_size, limit, num_workers,
                   progress=False if not first else None)
    return res if first else None


def main(argv=None) -> int:
    """``eval/evaluate.py``: accuracy of a model on a split of an energon dataset."""
    from megatron_vlm.cli import add_debug_flag, positive_int, setup_logging
    from megatron_vlm.eval import model as model_mod
    from megatron_vlm.eval.generate import add_sampling_flags, sampling_of

    p = argparse.ArgumentParser(allow_abbrev=False, 
        prog="eval/evaluate.py",
        description="Score a trained model on a split of an energon dataset made by data_prep/: it answers every "
                    "sample's last question (batched HF generate, greedy unless sampling flags are given), prints "
                    "'accuracy X%' by exact match and by VQAv2-normalised match, and writes one JSON line per "
                    "sample (id, question, reference, prediction, correct, vqa_correct) to --output.",
        epilog="example: python eval/evaluate.py --model /ckpt/llava-out --data-path /data/vqa --split val "
               "--output preds.jsonl")
    model_mod.add_model_flags(p)
    g = p.add_argument_group("data")
    g.add_argument("--data-path", required=True, metavar="DIR",
                   help="prepared energon dataset (data_prep/make_wds.py's --output)")
    g.add_argument("--split", default="val", help="split to score: train, val or test (default val)")
    g.add_argument("--output", required=True, metavar="PREDS.jsonl", help="where the per-sample lines go")
    g.add_argument("--batch-size", type=positive_int, default=8, help="prompts per generate call (default 8)")
    g.add_argument("--limit", type=positive_int, default=None, help="score only the first N samples of the split")
    g.add_argument("--num-workers", type=int, default=0, help="energon data-loader workers (default 0)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (one is drawn only on a terminal)")
    add_sampling_flags(p)
    p.set_defaults(max_new_tokens=32)
    add_debug_flag(p)
    a = p.parse_args(argv)
    model_mod.check_model_flags(p, a)
    if a.split not in ("train", "val", "test"):
        p.error(f"argument --split: {a.split!r} is not one of train, val, test")
    setup_logging(a.verbose)
    from megatron_vlm.cli.overlap import check_output_apart
    from megatron_vlm.data.loader import _check_path
    from megatron_vlm.eval.generate import Generator

    _check_path(a.data_path)
    check_output_apart("--output", a.output, [("--data-path", a.data_path), ("--model", a.model),
                                              ("--megatron-dir", a.megatron_dir)])
    if a.engine == "megatron":
        from megatron_vlm.eval import sharded

        res = sharded.run_on_ranks(a, sampling_of(a), evaluate_on_rank, a.data_path, a.split, a.output, a.batch_size,
                                   a.limit, a.num_workers)
    else:
        loaded = model_mod.load_from_args(a)
        gen = Generator(loaded, sampling_of(a), a.video_fps, a.video_frames)
        res = evaluate(gen, a.data_path, a.split, a.output, a.batch_size, a.limit, a.num_workers,
                       progress=False if a.no_progress else None)
    print(f"{res['samples']} samples of '{a.split}' in {a.data_path}: accuracy {100 * res['exact']:.1f}% (exact "
          f"match), accuracy {100 * res['vqa']:.1f}% (VQA-normalised); predictions in {a.output}")
    return 0
