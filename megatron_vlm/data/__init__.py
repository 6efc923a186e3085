"""Data: input files -> validated energon webdatasets -> batches for Megatron's LLaVAModel.

Preparation (``data_prep/make_wds.py``, ``data_prep/stats.py``):
- :mod:`.readers`      jsonl / jsonl.gz / json / csv records with their source line;
- :mod:`.conversation` the stored conversation format and the vqa / llava / chat conversions + rules;
- :mod:`.images`       image references -> decoded, checked, upright JPEG/PNG bytes;
- :mod:`.shards`       deterministic tar writing;
- :mod:`.make_wds`     the pipeline (workers, progress, rejected.jsonl, splits, atomic output);
- :mod:`.prepare`      energon's ``prepare`` run non-interactively, dataset.yaml / sample loader;
- :mod:`.stats`        sample / token counts and the metadataset blend;
- :mod:`.synthetic`    generated images and inputs for tests and benchmarks.

Training (the trainer calls these):
- :mod:`.sample`       ConversationSample, the energon sample loader and the crude-sample cooker;
- :mod:`.chat_tokens`  chat template rendering, tokenization and assistant-token spans;
- :mod:`.geometry`     image size and image tokens per image from the model's spec; the image processor check;
- :mod:`.skips`        skipped samples counted by reason; the bound on consecutive skips that stops a run;
- :mod:`.task_encoder` ``VLMTaskEncoder`` -> ``VLMBatch``;
- :mod:`.qwen_vl_encoder` Qwen2.5-VL's and Qwen3-VL's samples as HF's processors make them -> ``QwenVLBatch``;
- :mod:`.loader`       ``build_train_loader`` / ``build_eval_loader``.
"""
