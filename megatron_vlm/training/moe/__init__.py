"""Training a mixture-of-experts language model: the load-balancing objective, the positions the routers count, and
the routing numbers a user watches for routing collapse. One concern per module:

- :mod:`.objectives`: ``--moe-router-load-balancing-type``'s choices (``hf``, megatron-core's types, ``none``) and
  the start-up line's words for the term.
- :mod:`.hf_objective`: the ``hf`` objective (the default), HF's ``load_balancing_loss_func`` per micro batch: its
  statistics gathered over the ranks of the sequence and the pipeline stages, each router's exact share of its
  gradient formed in the backward.
- :mod:`.mcore_types`: megatron-core's own types (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) and its
  z-loss, held at the weight the trainer gives them.
- :mod:`.micro_batch`: one micro batch on a rank: its rows' positions of samples (made once, on the device) and its
  record of the HF statistics.
- :mod:`.stats`: an iteration's routing numbers (the load-balancing loss, each MoE layer's expert load and
  imbalance), megatron-core's metrics tracker of either lane.
- :mod:`.orchestration`: :class:`~megatron_vlm.training.moe.orchestration.MoETraining`, what the trainer holds for
  an MoE model: every megatron-core router's routing wrapped (the micro batch's positions of samples, the HF term
  attached, the numbers counted), the micro batches tracked through the schedule (model chunks of virtual pipeline
  stages, recomputation), megatron-core's token dropping applied to the positions of samples, and each step's weight
  of the terms (:func:`~megatron_vlm.training.moe.orchestration.global_loss_tokens`).
"""
