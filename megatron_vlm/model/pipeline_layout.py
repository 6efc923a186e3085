"""The pipeline layout: which language layers each pipeline rank holds, and with virtual pipeline parallelism
(VPP, megatron-core's interleaved 1F1B schedule) how a rank's layers are dealt out over its model chunks.

Megatron-LM's two flags set the number of virtual stages per pipeline rank (``vpp``; 1 without VPP):
``--num-virtual-stages-per-pipeline-rank N`` gives it, ``--num-layers-per-virtual-pipeline-stage N`` derives it as
(layers per rank) / N (even stages only, as Megatron-LM). Each rank then holds ``vpp`` model chunks; chunk ``c`` of
rank ``p`` is virtual stage ``c * pp + p``, and the virtual stages run in that order through the model: with 8
layers, PP2 and VPP2, rank 0 holds layers 0-1 (chunk 0) and 4-5 (chunk 1), rank 1 layers 2-3 and 6-7. A rank's
chunks hold equal shares of its layers (megatron-core's rule, uneven stages included: ``--pp-layers 2,4,4,2``
with VPP2 gives chunks of 1, 2, 2, 1 layers per virtual stage round). The vision encoder, projector and embedding
live on virtual stage 0 (chunk 0 of rank 0), the output layer on the last (chunk ``vpp - 1`` of the last rank).

Everything that lays tensors out by pipeline stage (the converters' legacy rank files, the gradient references,
the trainer's start-up line) works on the list of language layers per virtual stage
(:func:`virtual_stage_layers`): with ``vpp == 1`` it is the list per pipeline rank.
"""

from __future__ import annotations

from megatron_vlm.model.spec import ParallelismError

#: the flags, as Megatron-LM names them
LAYERS_FLAG = "--num-layers-per-virtual-pipeline-stage"
STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"


def vpp_size(layers_per_rank: list[int], layers_per_virtual_stage: int | None = None,
             virtual_stages_per_rank: int | None = None, uneven: bool = False) -> int:
    """Virtual stages per pipeline rank (1: no VPP) from Megatron-LM's two flags, for ``layers_per_rank`` language
    layers on each pipeline rank (``uneven``: given by ``--pp-layers``, which Megatron-LM's per-stage flag does not
    take). Raises :class:`ParallelismError` naming the fix for a layout megatron-core cannot build."""
    pp = len(layers_per_rank)
    if layers_per_virtual_stage is None and virtual_stages_per_rank is None:
        return 1
    if layers_per_virtual_stage is not None and virtual_stages_per_rank is not None:
        raise ParallelismError(f"{LAYERS_FLAG} and {STAGES_FLAG} both given; give one of them (Megatron-LM takes one)")
    given = layers_per_virtual_stage if layers_per_virtual_stage is not None else virtual_stages_per_rank
    flag = LAYERS_FLAG if layers_per_virtual_stage is not None else STAGES_FLAG
    if given < 1:
        raise ParallelismError(f"{flag} {given}: must be at least 1")
    if pp < 2:
        raise ParallelismError(f"{flag} needs pipeline parallelism: virtual stages interleave the model chunks of "
                               "several pipeline ranks; use --pp 2 or more, or drop the flag")
    if layers_per_virtual_stage is not None:
        if uneven:
            raise ParallelismError(
                f"{LAYERS_FLAG} with --pp-layers {','.join(map(str, layers_per_rank))}: with an explicit split, give "
                f"the chunks per rank with {STAGES_FLAG} instead (as Megatron-LM asks for uneven stages)")
        per_rank = layers_per_rank[0]
        if per_rank % layers_per_virtual_stage:
            raise ParallelismError(
                f"{LAYERS_FLAG} {layers_per_virtual_stage} does not divide the {per_rank} language layers of each "
                f"pipeline rank (--pp {pp}); choose one of {_divisors(per_rank)}")
        vpp = per_rank // layers_per_virtual_stage
    else:
        vpp = virtual_stages_per_rank
    if vpp == 1:
        return 1
    bad = [(p, n) for p, n in enumerate(layers_per_rank) if n % vpp]
    if bad:
        p, n = bad[0]
        options = [d for d in _divisors(_gcd(layers_per_rank)) if d > 1]
        what = f"--pp-layers {','.join(map(str, layers_per_rank))}" if uneven else f"--pp {pp}"
        fix = (f"choose {STAGES_FLAG} from {options} or " if options else "") + (
            f"give every stage a multiple of {vpp} layers with --pp-layers" if uneven else "change --pp")
        raise ParallelismError(
            f"{STAGES_FLAG} {vpp}: pipeline rank {p} holds {n} language layer{'s' if n != 1 else ''} ({what}), which "
            f"do not split into {vpp} model chunks of equal size (megatron-core gives each chunk of a rank the same "
            f"number of layers); {fix}")
    return vpp


def _gcd(values: list[int]) -> int:
    import math

    return math.gcd(*values)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def virtual_stage(pp_rank: int, chunk: int, pp: int) -> int:
    """The virtual stage of chunk ``chunk`` of pipeline rank ``pp_rank`` (its place in the model's order)."""
    return chunk * pp + pp_rank


def rank_and_chunk(stage: int, pp: int) -> tuple[int, int]:
    """(pipeline rank, chunk) of virtual stage ``stage``."""
    return stage % pp, stage // pp


def virtual_stage_layers(layers_per_rank: list[int], vpp: int = 1) -> list[int]:
    """Language layers per virtual stage, in the model's order (``vpp == 1``: ``layers_per_rank`` itself)."""
    pp = len(layers_per_rank)
    return [layers_per_rank[rank_and_chunk(s, pp)[0]] // vpp for s in range(pp * vpp)]


def chunk_layer_ranges(layers_per_rank: list[int], vpp: int = 1) -> list[list[tuple[int, int]]]:
    """``out[p][c]``: the global language layers ``[start, stop)`` of chunk ``c`` of pipeline rank ``p``."""
    pp = len(layers_per_rank)
    per_stage = virtual_stage_layers(layers_per_rank, vpp)
    out = [[(0, 0)] * vpp for _ in range(pp)]
    start = 0
    for s, n in enumerate(per_stage):
        p, c = rank_and_chunk(s, pp)
        out[p][c] = (start, start + n)
        start += n
    return out


def describe(layers_per_rank: list[int], vpp: int = 1) -> str:
    """The start-up line's layout: the language layers of every chunk of every pipeline rank, and where the vision
    encoder, projector, embedding and output layer live, e.g. ``rank 0: [vision encoder, projector, embedding,
    layers 0-1] [layers 4-5]; rank 1: [layers 2-3] [layers 6-7, output layer]``."""
    ranges = chunk_layer_ranges(layers_per_rank, vpp)
    pp = len(layers_per_rank)
    ranks = []
    for p in range(pp):
        chunks = []
        for c, (a, b) in enumerate(ranges[p]):
            parts = ["vision encoder", "projector", "embedding"] if (p, c) == (0, 0) else []
            parts.append(f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}")
            if (p, c) == (pp - 1, vpp - 1):
                parts.append("output layer")
            chunks.append("[" + ", ".join(parts) + "]")
        ranks.append(f"rank {p}: " + " ".join(chunks))
    return "; ".join(ranks)
