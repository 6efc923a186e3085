"""The ``moe`` step of bench/gpu.py: a Qwen3-MoE LLaVA (``--moe-layers`` x ``--experts`` experts, top ``--topk``) built
and converted once in ``<inputs>/moe``, trained at EP1 through train/run.py: tokens/s, TFLOP/s of the active
parameters and MFU, with TE's grouped GEMM or local layers."""

from __future__ import annotations

from pathlib import Path

from .common import mfu
from .training import train_run


MOE_FAMILY = "qwen3_moe"


def build_moe_inputs(a, inputs: Path) -> tuple[Path, Path]:
    """(HF dir, converted TP1/EP1 checkpoint) of a Qwen3-MoE LLaVA: ``--moe-layers`` MoE layers of ``--experts``
    experts (top ``--topk``, each of ``--expert-ffn``) at ``--hidden``, the set-up's CLIP ViT (its saved parts)
    and tokenizer style; random weights. Built once in ``inputs/moe``."""
    from megatron_vlm.convert.build import build_llava
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.data.synthetic import COLOURS
    from tests.support.tiny import make_text_model

    work = inputs / "moe"
    hf, meg = work / "hf", work / "megatron"
    if (meg / "latest_checkpointed_iteration.txt").is_file():
        return hf, meg
    texts = ["what colour is the square ? " + " ".join(COLOURS)] * 4
    text = make_text_model(work / "text", MOE_FAMILY, texts=texts, hidden_size=a.hidden,
                           num_hidden_layers=a.moe_layers, num_attention_heads=a.hidden // 64,
                           num_key_value_heads=max(1, a.hidden // 128), head_dim=64, num_experts=a.experts,
                           num_experts_per_tok=a.topk, moe_intermediate_size=a.expert_ffn,
                           intermediate_size=2 * a.expert_ffn)
    build_llava(text, inputs / "parts" / "vision", hf, vocab_size_padding=128)
    convert_hf_to_megatron(hf, meg, tp=1)  # in this process: one interpreter start less than the CLI
    return hf, meg


def check_moe(a, work: Path, inputs: Path, data: Path) -> list[dict]:
    """The MoE row: tokens/s, model TFLOP/s (active parameters: the trainer's count) and MFU of the MoE LLaVA
    trained through train/run.py at EP1 on this GPU, with Transformer Engine's grouped GEMM (TEGroupedMLP,
    ``--moe-grouped-gemm``) when ``--impls`` has transformer_engine, else megatron-core's SequentialMLP (local
    layers: the CPU rehearsal). EP2 needs two GPUs; this is the one-GPU number."""
    te = "transformer_engine" in a.impls
    impl = "transformer_engine" if te else "local"
    label = "TE grouped GEMM, EP1" if te else "local SequentialMLP, EP1"
    row = dict(part="moe", impl=label, dtype=a.precision)
    try:
        hf, meg = build_moe_inputs(a, inputs)
    except Exception as e:  # report and go on
        return [dict(row, ok=False, note=f"set-up: {type(e).__name__}: {e}"[:300])]
    extra = ("--ep", "1") + (("--moe-grouped-gemm",) if te else ())
    r = train_run(a, work, hf, data, meg, f"moe_ep1_{impl}", impl, a.precision, extra=extra)
    if "error" in r:
        return [dict(row, ok=False, note=r["error"])]
    import math

    return [dict(row, loss_first=r["losses"][0], loss_last=r["losses"][-1], losses=r["losses"],
                 tokens_per_s=r["tokens_per_s"], tflops=r["tflops"], s_per_iter=r["s_per_iter"], mfu=mfu(r),
                 ok=all(math.isfinite(x) for x in r["losses"]),
                 note=f"{a.moe_layers} MoE layers x {a.experts} experts (top {a.topk}, FFN {a.expert_ffn}), "
                      f"hidden {a.hidden}; TFLOP/s of the active parameters; " + r.get("layers_line", ""))]
