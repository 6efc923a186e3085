"""Energon loaders for training and evaluation (the data side of the training loop's contract).

``build_train_loader`` returns energon's savable loader: each data-parallel rank reads its own disjoint
slice of the dataset (energon ``WorkerConfig(rank, world_size, num_workers)``), and the position is saved
and restored with the loader's own ``save_state_rank()`` / ``restore_state_rank()``. ``data_path`` is a
prepared dataset directory or an energon metadataset YAML (e.g. the blend ``data_prep/stats.py`` writes),
local or in an object store (``msc://PROFILE/PATH``: energon reads the shards remotely through
multi-storage-client, nothing is copied to local disk).
"""

from __future__ import annotations

import os

from megatron.energon import WorkerConfig, get_loader, get_savable_loader, get_train_dataset, get_val_dataset

from megatron_vlm.files import storage


def worker_config(dp_rank: int, dp_world_size: int, num_workers: int, seed: int = 0) -> WorkerConfig:
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is outside the data-parallel world of size {dp_world_size}")
    return WorkerConfig(rank=dp_rank, world_size=dp_world_size, num_workers=num_workers, seed_offset=seed)


def _check_path(data_path) -> str:
    data_path = str(data_path)
    if storage.is_remote(data_path):
        data_path = storage.check_url(data_path, "data path")
        base = storage.path(data_path)
        if not base.is_file() and not (base / ".nv-meta" / "dataset.yaml").is_file():
            raise FileNotFoundError(
                f"data path {data_path} is not a prepared energon dataset (no .nv-meta/dataset.yaml there); "
                "write it with data_prep/make_wds.py --output " + data_path)
        return data_path
    if not os.path.exists(data_path):
        raise FileNotFoundError(f"data path {data_path} does not exist; create it with data_prep/make_wds.py")
    if os.path.isdir(data_path) and not os.path.isdir(os.path.join(data_path, ".nv-meta")):
        raise FileNotFoundError(
            f"{data_path} is not a prepared energon dataset (no .nv-meta); run `energon prepare {data_path}` "
            "or data_prep/make_wds.py without --no-prepare"
        )
    return data_path


def build_train_loader(
    data_path,
    task_encoder,
    micro_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int,
    seed: int,
    split: str = "train",
    *,
    shuffle_buffer_size: int = 100,
    max_samples_per_sequence: int = 100,
    checkpoint_every_min_n_samples: int | None = None,
    packing_buffer_size: int | None = None,
):
    """An infinite, shuffled, savable loader of ``VLMBatch``es of ``micro_batch_size`` for this DP rank.

    ``packing_buffer_size``: energon's sequence packing over buffers of that many encoded samples (the task
    encoder must be a :class:`~megatron_vlm.data.packing.PackingTaskEncoder`)."""
    dataset = get_train_dataset(
        _check_path(data_path),
        split_part=split,
        worker_config=worker_config(dp_rank, dp_world_size, num_workers, seed),
        batch_size=micro_batch_size,
        shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=max_samples_per_sequence,
        task_encoder=task_encoder,
        packing_buffer_size=packing_buffer_size,
    )
    return get_savable_loader(dataset, checkpoint_every_min_n_samples=checkpoint_every_min_n_samples)


def build_eval_loader(
    data_path,
    task_encoder,
    micro_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int,
    seed: int = 0,
    split: str = "val",
    packing_buffer_size: int | None = None,
):
    """One deterministic pass (no shuffle, no repeat) over this DP rank's slice of ``split``.

    Same positional arguments as :func:`build_train_loader`; ``seed`` only sets the worker seed offset.
    A plain (not savable) energon loader: build a new one for every evaluation.
    """
    dataset = get_val_dataset(
        _check_path(data_path),
        split_part=split,
        worker_config=worker_config(dp_rank, dp_world_size, num_workers, seed),
        batch_size=micro_batch_size,
        task_encoder=task_encoder,
        packing_buffer_size=packing_buffer_size,
    )
    return get_loader(dataset)
