"""The model: what a VLM is (its spec) and this rank's megatron-core model of it.

Nothing here is imported at package import: the launcher reads the spec, FP8 recipes and fusions on hosts without
torch, and the data and conversion code read the spec and the anyres geometry without megatron-core.

The contract (pure Python, read by every other part):

- :mod:`.spec`            ``VLMSpec``: the architecture (language / vision family, MoE routing and layer pattern,
                          projector, image geometry, tokens, vocab padding), the one place that derives Megatron
                          configs from an HF config; saved as ``vlm_spec.json`` next to every checkpoint;
- :mod:`.tokenizer`       the image, video and pad tokens of a LLaVA directory, and its embedding rows;
- :mod:`.anyres`          anyres geometry: tiles, packing, token counts, video pooling;
- :mod:`.pipeline_layout` the language layers of every model chunk of every pipeline rank;
- :mod:`.memory`          the memory a rank needs (weights, gradients, optimizer state, activations);
- :mod:`.fp8`, :mod:`.fusions`, :mod:`.context_parallel`: FP8 recipes, kernel fusions and context parallelism's
                          rules, read by the launcher before anything heavy is imported.

The megatron-core side (imports megatron-core):

- :mod:`.build`           this rank's ``LLaVAModel`` (one per model chunk with virtual pipeline stages), or
                          Qwen2.5-VL's ``QwenVLModel``;
- :mod:`.layer_impl`      Transformer Engine or local layers, and the checkpoint keys between them;
- :mod:`.anyres_model`    ``AnyresLLaVAModel`` (LLaVA-NeXT / OneVision image features);
- :mod:`.internvit`       InternViT on megatron-core's ViT;
- :mod:`.qwen_vit`        Qwen2.5-VL's windowed ViT with 2-D rotary positions and its patch merger;
- :mod:`.qwen_vl`         Qwen2.5-VL's model (the ViT, the merger, ``GPTModel`` with M-RoPE) and its 3-D positions;
- :mod:`.cp_attention`    context parallelism without Transformer Engine.
"""
