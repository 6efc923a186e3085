"""Megatron checkpoints on disk, as the converters, the trainer and the launcher read and write them.

- :mod:`.layout`       the layout: tracker, iteration directories, ``ckpt_meta.json``, the spec and HF-only tensors
                       beside the shards, legacy rank files; reading a checkpoint's structure;
- :mod:`.checks`       cheap checks of an iteration before the heavy libraries see it (JSON, sizes, shards, rank
                       files), each failure one line naming the file and the fix;
- :mod:`.dcp_index`    a torch_dist ``.metadata`` index read without torch and without running code;
- :mod:`.legacy_ranks` legacy rank files: Megatron-LM's names, which exist, which file holds each shard (no torch);
- :mod:`.manifest`     the checksum manifests of a training checkpoint (``checksums.json``, ``integrity.json``).

Saving a training checkpoint (model, optimizer, RNG, data position) is :mod:`megatron_vlm.training.checkpointing`.
"""
