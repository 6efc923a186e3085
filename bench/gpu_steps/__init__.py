"""The steps of bench/gpu.py, the GPU session's measuring command: one module per step, each returning the rows of
its part of the table (bench/GPU.md, "What the table checks"). bench/gpu.py parses the flags, runs the steps in its
order and writes the results; the code of a step is here.

- ``common``: what every step shares: the project root, how commands are started, the sizes (``FULL``, ``TINY``),
  bench/train.py as a module, the set-up (HF model, energon data, converted checkpoint), versions, MFU, loss curves;
- ``logits``: HF vs the converted Megatron model, fp32 and bf16 (part ``logits``) and the tolerances;
- ``training``: training runs through train/run.py (part ``train``: local/TE layers, FP8 recipes, ``fusions``);
- ``packing``: packed vs unpacked forward, and the packed training row's flags (part ``packing``);
- ``hf_loop``: the HF + SDPA reference loop (part ``hf``);
- ``moe``: the MoE LLaVA at EP1 (part ``moe``);
- ``cp``: context parallelism, CP1 vs CP2 on one long sample (part ``cp``);
- ``vpp``: PP2 x VPP2 against PP2 (part ``vpp``);
- ``internvl``: the InternVL family's logits against HF (part ``internvl``);
- ``perf``: where a step's time goes (parts ``perf_profile``, ``perf_shapes``, ``perf_te``: bench/gpu_quick.sh --perf);
- ``results``: the results file (rows merged as they come), the ratios to the HF loop, the table and the report.

Only the standard library is imported at module level: ``bench/gpu.py --help`` and ``--report`` need no torch.
"""
