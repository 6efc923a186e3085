"""From a trained model to answers, scores and plots: the library behind ``eval/``.

One concept per module:

- ``model``     an HF model to generate with: an HF export (``--model``), or a Megatron iteration checkpoint
                (``--megatron-dir``) turned into the same HF model in memory by the export's own conversion rules;
- ``prompts``   model inputs of a prompt (a conversation ending in a user turn, with images and videos), encoded
                the way training encodes them (the model's chat template, its image processor, anyres tiles,
                video frames), then expanded into HF ``generate``'s inputs; batches left-padded;
- ``generate``  HF ``generate`` (greedy or sampling) and the ``eval/generate.py`` command;
- ``sharded``   answers from the sharded Megatron model itself at any TP/PP (``--engine megatron``), with
                megatron-core's inference controller and KV cache over local ranks;
- ``score``     exact and VQA-normalised (VQAv2's rules) answer matching, and accuracy;
- ``evaluate``  batched generation over a split of an energon dataset and the ``eval/evaluate.py`` command;
- ``plot``      loss, validation loss, learning rate, grad norm and tokens/s from ``metrics.jsonl`` and the
                ``eval/plot.py`` command (the trainer also draws it at the end of a run).
"""
