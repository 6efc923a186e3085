"""The ``packing`` step of bench/gpu.py: packed ('thd', image-expanded ``cu_seqlens``) vs unpacked forward of the
same samples with TE layers in bf16 (tests.support.packing_check), and the flags of the packed training row that
the ``train`` step adds (:func:`packing_flags`)."""

from __future__ import annotations


def packing_flags(a) -> tuple:
    """The packed training row: packs of ``--pack-factor`` x --seq-length positions from a buffer of 64 samples;
    a micro batch is one pack, and a global batch holds as many packs as the unpacked run has micro batches."""
    return ("--packing-buffer-size", "64", "--packed-seq-length", str(a.pack_factor * a.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(max(1, a.gbs // a.mbs)))


def check_packing(hf, meg, a) -> list[dict]:
    """Packed ('thd') vs unpacked forward, TE layers in bf16 (tests.support.packing_check)."""
    from tests.support.packing_check import packed_vs_unpacked

    try:
        r = packed_vs_unpacked(meg, hf, seq_length=a.seq_length)
    except Exception as e:  # report it as a failed check
        return [dict(part="packing", impl="transformer_engine", dtype="bf16", ok=False,
                     note=f"{type(e).__name__}: {e}"[:300])]
    return [dict(part="packing", impl="transformer_engine", dtype="bf16", diff=r["logit_diff"],
                 tolerance=r["logit_tolerance"], ok=r["ok"],
                 note=f"logits packed vs unpacked fp32 (unpacked bf16: {r['unpacked_bf16_error']:.3g}); per-sample "
                      f"loss rel. diff {r['loss_rel_diff']:.2g} (<= {r['loss_rtol']:g}); cu_seqlens {r['cu_seqlens']}")]
