"""Context parallelism (``--cp N``): each sequence the language model sees split over N ranks. The rules the launcher
checks before anything starts (no torch here): the length every sequence must split into, the attention's
exchange of keys and values.

megatron-core does the work: ``initialize_model_parallel(context_parallel_size=N)`` makes the CP groups (ranks
ordered tp-cp-ep-dp-pp; data-parallel gradients and the per-token loss count are reduced over DP x CP),
``LLaVAModel._process_embedding_token_parallel`` cuts the combined image + text embeddings, labels and loss mask
into 2N chunks and gives CP rank r chunks r and 2N-1-r (``get_batch_on_this_cp_rank``; packed 'thd' rows per
sample, ``thd_get_partitioned_indices``), RoPE takes the same chunks of its positions
(``get_pos_emb_on_this_cp_rank``), and on a GPU Transformer Engine's attention exchanges keys and values over the
CP group (``--cp-comm-type`` p2p, a2a or allgather). Without Transformer Engine (CPU, or ``--transformer-impl
local``) the attention is :class:`megatron_vlm.model.cp_attention.ContextParallelAttention`, a reference path.

The lengths: megatron-core 0.16's ``LLaVAModel`` asserts that the combined sequence divides into 2 x CP (x TP under
sequence parallelism) chunks; 0.19's pads it with zeros when it does not, but only on the first pipeline stage (the
last stage's labels and loss mask stay unpadded, which breaks PP). So the batches come padded already: the task
encoder pads each micro batch's image-expanded length to :func:`length_multiple` (pad tokens, loss mask 0), with PP
every micro batch is ``--seq-length`` long, which must then be such a multiple (the launcher checks), and packing
pads each sample of a pack and the pack. Both lanes then split exactly the same positions.
"""

from __future__ import annotations

#: Megatron-LM's ``--cp-comm-type`` choices for Transformer Engine's attention (p2p: ring exchange of key/value
#: chunks overlapped with compute; a2a: all-to-all over heads, DeepSpeed-Ulysses style; allgather: keys and values
#: gathered before attention)
COMM_TYPES = ("p2p", "a2a", "allgather")


def length_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """What every sequence the language model sees must be a multiple of: ``2 x cp`` (the load-balanced chunks),
    times ``tp`` under sequence parallelism (megatron-core's ``LLaVAModel`` shard factor); packed sequences: each
    sample ``2 x cp`` and the pack this. 1 without either."""
    m = 2 * cp if cp > 1 else 1
    return m * tp if sequence_parallel else m


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def describe(use_te: bool, comm_type: str | None) -> str:
    """The start-up line's words for the language model's attention under CP."""
    if use_te:
        return f"Transformer Engine's context-parallel attention ({comm_type or 'p2p'})"
    return ("megatron's local attention with keys and values all-gathered over the CP group (a reference path, "
            "not a fast one)")
