"""The field table of a training run: one dataclass field per launcher flag, and what is derived from it.

Each field's metadata carries its flags, help text, kind (how the command line and YAML coerce it) and --help
group; :mod:`.parse` builds the argument parser and reads YAML from this table, :mod:`.checks` validates a
resolved config, :mod:`.resolve` fills what the user left open. The stage defaults and the ``--smoke-test`` sizes
live here too, since help texts quote them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_vlm.model.fp8 import FORMATS as FP8_FORMATS
from megatron_vlm.model.fp8 import RECIPES as FP8_RECIPES
from megatron_vlm.model.fusions import BY_NAME as FUSIONS
from megatron_vlm.model.layer_impl import ATTENTION_BACKENDS

CONFIG_FILE = "config.yaml"


class ConfigError(ValueError):
    """An impossible or incomplete training request; the message names the input and the fix."""


# Stage defaults, applied only where the user gave nothing (LLaVA-1.5 recipe).
STAGE_DEFAULTS: dict[int, dict[str, Any]] = {
    1: dict(freeze_lm=True, freeze_vit=True, global_batch_size=256, micro_batch_size=16, lr=1e-3),
    2: dict(freeze_lm=False, freeze_vit=True, global_batch_size=128, micro_batch_size=1, lr=2e-5),
}
SMOKE_TEST_TRAIN_ITERS = 10

# Field groups, in --help order.
GROUPS = {
    "launch": "processes and nodes",
    "parallel": "parallelism and batch",
    "stage": "training stage and freezing",
    "moe": "mixture of experts (Qwen3-MoE, Mixtral language models; Megatron-LM's --moe-* flags)",
    "optim": "optimizer and schedule",
    "fusion": "kernel fusions (Megatron-LM's switches; default: on where they work, i.e. on CUDA, off on CPU)",
    "model": "model, tokenizer and data",
    "ckpt": "checkpoints",
    "log": "logging and evaluation",
    "container": "containers",
    "slurm": "SLURM batch jobs",
}

# Kinds: int, float, str, path (made absolute), bool (--x/--no-x), flag (--x only), tristate (two flags, None = default),
# choice, intlist ("0,1,3"), ranges ("A-B" ...), strlist (repeatable).


def _fusion(name: str, help: str):
    """A tristate field for one fusion of :data:`megatron_vlm.model.fusions.FUSIONS` (its Megatron-LM flags)."""
    fu = FUSIONS[name]
    return _f((fu.on_flag,), help + " Default: on where it works (logged at start-up).", "tristate", None, "fusion",
              negative=fu.off_flags)


def _f(flags, help, kind="str", default=None, group="launch", factory=None, **extra):
    meta = dict(flags=tuple(flags), help=help, kind=kind, group=group, **extra)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ConfigFields:
    """Every setting of a training run (the fields) and the values derived from them (properties).
    :class:`~megatron_vlm.training.config.TrainConfig` adds construction, YAML and resolution."""

    # ---- processes and nodes ------------------------------------------------------------------------
    gpus: int | None = _f(
        ("-g", "--gpus"), "Processes per node, one per GPU (on --device cpu: CPU processes). "
        "Default: the number of --gpu-ids, else SLURM_GPUS_ON_NODE inside a SLURM job, else 1.", "int")
    gpu_ids: list[int] | None = _f(
        ("--gpu-ids",), "Comma-separated GPU indices to use on each node, e.g. 0,1,4,5 "
        "(sets CUDA_VISIBLE_DEVICES). Default: the first --gpus GPUs.", "intlist", metavar="IDS")
    device: str | None = _f(
        ("--device",), "cuda (NCCL) or cpu (gloo, for tests and debugging). Default: cuda when a GPU is "
        "visible, else cpu.", "choice", choices=("cuda", "cpu"))
    nodes: int | None = _f(
        ("--node", "--nodes"), "Number of nodes. Default: SLURM_NNODES inside a SLURM job, else 1.", "int")
    node_rank: int | None = _f(
        ("--rank", "--node-rank"), "Rank of this node, 0..nodes-1 (node 0 hosts the rendezvous). "
        "Default: SLURM_PROCID inside a SLURM job, else 0.", "int")
    master_addr: str | None = _f(
        ("--master-addr",), "Address of node 0, reachable from every node. Default: 127.0.0.1 on one node, "
        "the first host of SLURM_JOB_NODELIST in a SLURM job; required for --node > 1 otherwise.")
    master_port: int | None = _f(
        ("--master-port",), "Rendezvous TCP port on node 0. Default: a free port on one node, 29500 "
        "(or a port derived from SLURM_JOB_ID) for several nodes.", "int")
    interface: str | None = _f(
        ("--interface",), "Network interface for NCCL and gloo traffic, e.g. ib0 or eth0 "
        "(sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME).", metavar="IFACE")
    dry_run: bool = _f(
        ("--dry-run",), "Validate, print the memory estimate per GPU (weights, gradients, optimizer state, "
        "activations), the resolved config and the full command, and exit without launching or writing anything.",
        "flag", False)
    gpu_memory_gb: float | None = _f(
        ("--gpu-memory-gb",), "Memory of one GPU in GiB that the memory estimate is checked against (a warning "
        "when it exceeds it), e.g. 80. Default: the visible GPU's.", "float", None, metavar="GB")

    # ---- parallelism and batch ------------------------------------------------------------------------
    tp: int = _f(("--tp", "--tensor-model-parallel-size"), "Tensor-parallel size (divides attention heads, FFN and "
                 "vocab sizes).", "int", 1, "parallel")
    pp: int = _f(("--pp", "--pipeline-model-parallel-size"), "Pipeline-parallel size (language model layers split "
                 "across stages).", "int", 1, "parallel")
    cp: int = _f(("--cp", "--context-parallel-size"), "Context-parallel size: each sequence the language model sees "
                 "(images expanded) is split over CP ranks, 2 x CP load-balanced chunks, each rank's activations "
                 "about 1/CP (long videos, many images). Lengths are padded to a multiple of 2 x CP (x TP with "
                 "--sequence-parallel). On a GPU Transformer Engine's attention exchanges keys and values "
                 "(--cp-comm-type); local layers (CPU) all-gather them, a reference path, not a fast one.", "int", 1,
                 "parallel")
    cp_comm_type: str | None = _f(
        ("--cp-comm-type",), "How Transformer Engine's attention exchanges keys and values over the CP ranks: p2p "
        "(a ring, overlapped with compute), a2a (all-to-all over attention heads; heads per TP rank must divide by "
        "CP) or allgather. Default: p2p. Transformer Engine layers only.", "choice", None, "parallel",
        choices=("p2p", "a2a", "allgather"))
    vision_cp_split: bool = _f(
        ("--vision-cp-split",), "With --cp > 1, share each micro batch's images, tiles and video frames out over the "
        "CP ranks: each rank encodes about 1/CP of them and the embeddings are all-gathered (differentiably) before "
        "the sequence is split, so the vision encoder's time and, unfrozen, its activations per rank are about 1/CP. "
        "--no-vision-cp-split runs the whole vision encoder on every CP rank (megatron-core's LLaVAModel).", "bool",
        True, "parallel")
    ep: int = _f(("--ep", "--expert-model-parallel-size"), "Expert-parallel size of a mixture-of-experts language "
                 "model: its experts are dealt out over EP ranks of each pipeline stage (must divide the number of "
                 "experts; EP x --etp must divide TP x CP x data-parallel size).", "int", 1, "parallel")
    etp: int | None = _f(("--etp", "--expert-tensor-parallel-size"), "Tensor-parallel size inside each expert. "
                         "Default: --tp (megatron-core's).", "int", None, "parallel")
    pp_layers: list[int] | None = _f(
        ("--pp-layers",), "Uneven pipeline split: language layers per stage, e.g. 3,1 for --pp 2. "
        "Default: an even split.", "intlist", None, "parallel", metavar="N,N,...")
    num_layers_per_virtual_pipeline_stage: int | None = _f(
        ("--num-layers-per-virtual-pipeline-stage",), "Virtual pipeline parallelism (megatron-core's interleaved "
        "1F1B schedule): language layers per model chunk; each pipeline rank then holds (its layers / N) chunks, "
        "which divides the pipeline bubble by that number. Needs --pp 2 or more, an even split, and micro batches "
        "per step (global batch / (micro batch x data-parallel size)) a multiple of --pp. Default: off.", "int", None,
        "parallel", metavar="N")
    num_virtual_stages_per_pipeline_rank: int | None = _f(
        ("--num-virtual-stages-per-pipeline-rank",), "Virtual pipeline parallelism: model chunks per pipeline rank "
        "(the other way to say it; works with --pp-layers when every stage's layers divide by N). The vision encoder "
        "and projector stay on the first chunk of the first rank. Default: off.", "int", None, "parallel",
        metavar="N")
    micro_batch_size: int | None = _f(
        ("--micro-batch-size", "--mbs"), "Samples per GPU per forward pass. Default: 16 (stage 1), "
        "1 (stage 2; on CUDA sized from the memory estimate instead: the largest of 16, 8, 4, 2 that fits 80% of "
        "the GPU's memory, docs/training.md).", "int", None, "parallel")
    global_batch_size: int | None = _f(
        ("--global-batch-size", "--gbs"), "Samples per optimizer step over all data-parallel ranks; "
        "must be a multiple of micro batch x data-parallel size. Default: 256 (stage 1), 128 (stage 2).",
        "int", None, "parallel")
    dist_optim: bool = _f(
        ("--dist-optim", "--use-distributed-optimizer"), "Shard optimizer state over data-parallel ranks "
        "(megatron distributed optimizer).", "bool", False, "parallel")
    sequence_parallel: bool = _f(
        ("--sequence-parallel",), "Split layer norms and dropout along the sequence over the tensor-parallel "
        "ranks (needs --tp > 1 and Transformer Engine attention, which megatron-core's LLaVAModel requires "
        "for it).", "bool", False, "parallel")
    overlap_grad_reduce: bool = _f(
        ("--overlap-grad-reduce",), "Overlap the data-parallel gradient reduction with the backward pass "
        "(megatron-core DDP buckets).", "bool", False, "parallel")
    overlap_param_gather: bool = _f(
        ("--overlap-param-gather",), "Overlap the distributed optimizer's parameter all-gather with the "
        "next forward pass (needs --dist-optim).", "bool", False, "parallel")
    ddp_bucket_size: int | None = _f(
        ("--ddp-bucket-size",), "Elements per DDP gradient bucket when overlapping. Default: megatron-core's "
        "(one bucket without overlap; max(40M, 1M x data-parallel size) with --overlap-grad-reduce).", "int",
        None, "parallel")
    recompute_granularity: str | None = _f(
        ("--recompute-granularity",), "Activation recomputation of the language model: full (whole layers, "
        "see --recompute-method) or selective (only the attention core). Default: none.", "choice", None,
        "parallel", choices=("full", "selective"))
    recompute_method: str | None = _f(
        ("--recompute-method",), "With --recompute-granularity full: uniform (recompute every chunk of "
        "--recompute-num-layers layers) or block (recompute the first --recompute-num-layers layers of each "
        "pipeline stage). Default: uniform.", "choice", None, "parallel", choices=("uniform", "block"))
    recompute_num_layers: int | None = _f(
        ("--recompute-num-layers",), "Layers per recomputed chunk (uniform) or recomputed layers per stage "
        "(block). Default: 1.", "int", None, "parallel")

    # ---- mixture of experts ---------------------------------------------------------------------------
    moe_aux_loss_coeff: float | None = _f(
        ("--moe-aux-loss-coeff",), "Load-balancing loss coefficient. Default: the HF config's "
        "router_aux_loss_coef (what the language model was trained with; logged at start-up). 0 turns the term off: "
        "HF LLaVA's plain cross entropy.", "float", None, "moe")
    moe_router_load_balancing_type: str = _f(
        ("--moe-router-load-balancing-type",), "Load-balancing loss. hf: the model's HF objective, transformers' "
        "load_balancing_loss_func over all MoE layers together (E x sum_i f_i P_i over every layer and position of "
        "a micro batch, padding excluded; balanced routing gives top-k), per micro batch, averaged over micro "
        "batches and data-parallel ranks. megatron-core's, per MoE layer and summed over layers (balanced routing "
        "gives 1 per layer): aux_loss (the switch loss of each micro batch), seq_aux_loss (per sequence, averaged "
        "over the micro batch's), global_aux_loss (expert counts over the global batch); each averaged over micro "
        "batches and data-parallel ranks. none: no term.", "choice", "hf", "moe",
        choices=("hf", "aux_loss", "seq_aux_loss", "global_aux_loss", "none"))
    moe_z_loss_coeff: float | None = _f(
        ("--moe-z-loss-coeff",), "Router z-loss coefficient (ST-MoE; 1e-3 is a usual start). Default: off.",
        "float", None, "moe")
    moe_token_dispatcher_type: str = _f(
        ("--moe-token-dispatcher-type",), "How tokens reach their experts' ranks: allgather (Megatron-LM's default) "
        "or alltoall (less traffic at larger --ep).", "choice", "allgather", "moe", choices=("allgather", "alltoall"))
    moe_expert_capacity_factor: float | None = _f(
        ("--moe-expert-capacity-factor",), "Tokens an expert takes, as a multiple of an even share; the rest are "
        "dropped. Default: no capacity and no dropping, as in HF's model.", "float", None, "moe")
    moe_pad_expert_input_to_capacity: bool = _f(
        ("--moe-pad-expert-input-to-capacity",), "With --moe-expert-capacity-factor: pad each expert's input to its "
        "capacity (fixed shapes).", "flag", False, "moe")
    moe_grouped_gemm: bool | None = _f(
        ("--moe-grouped-gemm",), "Run a rank's experts as one grouped GEMM (Transformer Engine's TEGroupedMLP). "
        "Default: on with Transformer Engine layers, off with local layers (megatron-core's SequentialMLP). "
        "Checkpoints load into either.", "tristate", None, "moe", negative="--no-moe-grouped-gemm")
    moe_router_dtype: str | None = _f(
        ("--moe-router-dtype",), "Precision of the router's gating GEMM and softmax (fp32 is steadier in bf16 "
        "runs). Default: the parameters' precision.", "choice", None, "moe", choices=("fp32", "fp64"))
    moe_per_layer_logging: bool = _f(
        ("--moe-per-layer-logging",), "Also log each MoE layer's load-balancing loss and expert-load imbalance to "
        "TensorBoard (the console and metrics.jsonl give the mean and the worst layer).", "flag", False, "moe")

    # ---- stage and freezing ---------------------------------------------------------------------------
    stage: int = _f(
        ("--stage",), "1 = pretraining (vision encoder and language model frozen, projector trained); "
        "2 = instruction tuning (vision encoder frozen, language model and projector trained). "
        "Sets the defaults of freezing, batch sizes and learning rate.", "choice", 1, "stage",
        choices=(1, 2))
    freeze_lm: bool | None = _f(
        ("--freeze-lm",), "Freeze the language model. Default: frozen in stage 1, trained in stage 2.",
        "tristate", None, "stage", negative="--unfreeze-lm")
    freeze_vit: bool | None = _f(
        ("--freeze-vit",), "Freeze the vision encoder. Default: frozen in both stages.",
        "tristate", None, "stage", negative="--unfreeze-vit")

    # ---- optimizer and schedule -----------------------------------------------------------------------
    lr: float | None = _f(("--lr",), "Peak learning rate. Default: 1e-3 (stage 1), 2e-5 (stage 2).",
                          "float", None, "optim")
    min_lr: float = _f(("--min-lr",), "Learning rate at the end of the decay.", "float", 0.0, "optim")
    lr_decay_style: str = _f(("--lr-decay-style",), "Learning-rate decay after warmup.", "choice",
                             "cosine", "optim", choices=("cosine", "linear", "constant"))
    lr_warmup_fraction: float = _f(("--lr-warmup-fraction",), "Fraction of --train-iters spent in "
                                   "linear warmup.", "float", 0.03, "optim")
    weight_decay: float = _f(("--weight-decay",), "AdamW weight decay (LLaVA uses 0).", "float", 0.0,
                             "optim")
    clip_grad: float = _f(("--clip-grad",), "Gradient-norm clipping threshold (0 disables).", "float",
                          1.0, "optim")
    adam_beta1: float = _f(("--adam-beta1",), "AdamW beta1.", "float", 0.9, "optim")
    adam_beta2: float = _f(("--adam-beta2",), "AdamW beta2.", "float", 0.999, "optim")
    train_iters: int | None = _f(("--train-iters",), "Optimizer steps to train (required; "
                                 f"{SMOKE_TEST_TRAIN_ITERS} with --smoke-test).", "int", None, "optim")
    override_opt_param_scheduler: bool = _f(
        ("--override-opt-param-scheduler", "--override-opt_param-scheduler"), "On resume, follow this command line's "
        "learning-rate schedule (--lr, --min-lr, --lr-warmup-fraction, --lr-decay-style, --train-iters, "
        "--weight-decay) instead of the checkpoint's; the schedule continues at the checkpoint's iteration "
        "(Megatron-LM's flag). Without it or --use-checkpoint-opt-param-scheduler, a resume whose schedule differs "
        "from the checkpoint's is refused.", "flag", False, "optim")
    use_checkpoint_opt_param_scheduler: bool = _f(
        ("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"), "On resume, keep the "
        "checkpoint's learning-rate schedule and ignore this command line's (Megatron-LM's flag); past the "
        "checkpoint's --train-iters the learning rate stays at its --min-lr.", "flag", False, "optim")
    loss_over_padded_vocab: bool | None = _f(
        ("--loss-over-padded-vocab",), "Take the loss's softmax over the padded vocabulary rows too (Megatron-LM's "
        "objective, for bit-compatibility with Megatron-LM runs). Default: off, the padded rows (the rows "
        "up to a multiple of make_vocab_size_divisible_by, 128, whatever the TP) are masked out, so training optimises the model that is exported to HF. "
        "A resume keeps the objective its checkpoint was trained with.", "tristate", None, "optim",
        negative="--no-loss-over-padded-vocab")
    seq_length: int = _f(("--seq-length",), "Tokens per sample after image-token expansion (longer "
                         "samples are truncated).", "int", 2048, "optim")
    precision: str | None = _f(("--precision",), "Parameter/compute precision. Default: bf16 on cuda, "
                               "fp32 on cpu.", "choice", None, "optim", choices=("bf16", "fp16", "fp32"))
    loss_scale: float | None = _f(
        ("--loss-scale",), "With --precision fp16: a static loss scale (a power of 2). Default: dynamic loss scaling "
        "(--initial-loss-scale, halved after --hysteresis overflowing steps, which are skipped; doubled after "
        "--loss-scale-window steps without one).", "float", None, "optim")
    initial_loss_scale: float = _f(("--initial-loss-scale",), "With fp16 and dynamic loss scaling: the first "
                                   "loss scale (Megatron-LM's default, 2^32).", "float", 2.0 ** 32, "optim")
    min_loss_scale: float = _f(("--min-loss-scale",), "With fp16 and dynamic loss scaling: the smallest loss "
                               "scale.", "float", 1.0, "optim")
    loss_scale_window: int = _f(("--loss-scale-window",), "With fp16 and dynamic loss scaling: steps without an "
                                "overflow before the loss scale doubles.", "int", 1000, "optim")
    hysteresis: int = _f(("--hysteresis",), "With fp16 and dynamic loss scaling: overflowing steps before the loss "
                         "scale is halved (each is skipped).", "int", 2, "optim")
    fp8: bool = _f(("--fp8",), "FP8 matmuls through Transformer Engine (needs transformer_engine and a "
                   "GPU of compute capability 8.9 or newer).", "bool", False, "optim")
    fp8_recipe: str = _f(("--fp8-recipe",), "FP8 scaling recipe with --fp8 (megatron-core's): delayed, tensorwise "
                         "(current scaling), blockwise (Hopper+, CUDA 12.9+) or mxfp8 (Blackwell); refused where the "
                         "GPU cannot run it.", "choice", "delayed", "optim", choices=tuple(FP8_RECIPES))
    fp8_format: str = _f(("--fp8-format",), "FP8 format with --fp8: hybrid (E4M3 forward, E5M2 gradients) or e4m3.",
                         "choice", "hybrid", "optim", choices=FP8_FORMATS)
    transformer_impl: str | None = _f(
        ("--transformer-impl",), "Transformer layers: transformer_engine (fused Transformer Engine layers; needed "
        "by --fp8) or local (megatron-core's own). Default: transformer_engine when it imports on CUDA, else local "
        "(the choice is logged at start-up). Checkpoints load into either.", "choice", None, "optim",
        choices=("transformer_engine", "local"))
    attention_backend: str | None = _f(
        ("--attention-backend",), "Core attention (Megatron-LM's flag; megatron-core's AttnBackend names plus sdpa). "
        "With Transformer Engine layers: auto (TE picks), flash, fused or unfused, TE's kernels. With local layers: "
        "sdpa (torch's scaled_dot_product_attention: fused flash / memory-efficient kernels, causal GQA for the "
        "language model, unmasked for the vision encoder, per sample for packed sequences) or local (megatron-core's "
        "DotProductAttention: the full score matrix and an fp32 softmax per head). Default auto: TE's attention with "
        "TE layers, sdpa for local layers on CUDA, local on CPU and under --cp > 1 (sdpa refuses context "
        "parallelism). The choice is logged at start-up.", "choice", None, "optim",
        choices=ATTENTION_BACKENDS)
    # ---- kernel fusions (see megatron_vlm.model.fusions) ---------------------------------------------------------
    gradient_accumulation_fusion: bool | None = _fusion(
        "gradient_accumulation_fusion", "Accumulate weight gradients inside the GEMM into the fp32 main_grad "
        "buffers (Transformer Engine linears; apex's fused_weight_gradient_mlp_cuda for local layers and, with "
        "Transformer Engine, for the output layer, which stays unfused without it).")
    bias_activation_fusion: bool | None = _fusion(
        "bias_activation_fusion", "Fused SwiGLU in the language model's MLP (--no-bias-gelu-fusion is accepted "
        "as the same switch; the vision encoder's and projector's GELU are never fused, as megatron's fused "
        "bias-GELU is the tanh approximation).")
    bias_dropout_fusion: bool | None = _fusion("bias_dropout_fusion", "Fused bias + dropout + residual add.")
    apply_rope_fusion: bool | None = _fusion(
        "apply_rope_fusion", "Transformer Engine's fused rotary position embedding.")
    masked_softmax_fusion: bool | None = _fusion(
        "masked_softmax_fusion", "Fused scale + mask + softmax in megatron-core's own attention.")
    persist_layer_norm: bool | None = _fusion(
        "persist_layer_norm", "Persistent fused layer-norm kernel (apex layer norms; not torch norms).")
    cross_entropy_loss_fusion: bool | None = _fusion(
        "cross_entropy_loss_fusion", "megatron-core's fused vocab-parallel cross-entropy for the loss.")

    seed: int = _f(("--seed",), "Random seed (model init, data order, dropout).", "int", 1234, "optim")
    deterministic: bool = _f(("--deterministic",), "Bitwise reproducible kernels where possible "
                             "(slower; sets CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO=Ring).", "bool", False,
                             "optim")

    # ---- model, tokenizer and data --------------------------------------------------------------------
    megatron_load_dir: str | None = _f(
        ("--megatron-load-dir",), "Megatron checkpoint to start from (from convert/hf_to_megatron.py or an "
        "earlier stage): holds vlm_spec.json and latest_checkpointed_iteration.txt. Required unless --init.",
        "path", None, "model", metavar="DIR")
    tokenizer_load_dir: str | None = _f(
        ("--tokenizer-load-dir",), "Hugging Face LLaVA directory (from convert/build_llava.py) whose "
        "tokenizer, chat template and image processor are used. Required.", "path", None, "model",
        metavar="DIR")
    data_path: str | None = _f(
        ("--data-path",), "Energon dataset prepared by data_prep/ (a directory with .nv-meta/dataset.yaml) "
        "or an energon metadataset .yaml file. Required.", "path", None, "model", metavar="PATH")
    init: bool = _f(("--init",), "Start from random weights instead of a checkpoint (architecture from "
                    "--megatron-load-dir's vlm_spec.json or --tokenizer-load-dir's config.json).", "bool",
                    False, "model")
    image_token_id: int | None = _f(("--image-token-id",), "Id of the image token. Default: read from the "
                                    "tokenizer in --tokenizer-load-dir.", "int", None, "model")
    pad_token_id: int | None = _f(("--pad-token-id",), "Id of the pad token. Default: read from the "
                                  "tokenizer in --tokenizer-load-dir.", "int", None, "model")
    no_add_class_token: bool = _f(("--no-add-class-token",), "Require a vision encoder without a class token "
                                  "(as Megatron's launcher takes it). The checkpoint's vlm_spec.json decides: "
                                  "SigLIP has none; CLIP has one, and the flag is refused for it.", "flag", False,
                                  "model")
    num_workers: int = _f(("--num-workers",), "Data-loader worker processes per rank.", "int", 2, "model")
    max_consecutive_skipped_samples: int = _f(
        ("--max-consecutive-skipped-samples",), "Stop training with the skip reasons counted when this many "
        "samples in a row (in one data-loader worker) are skipped, e.g. because the chat template drops the "
        "image token or samples do not fit --seq-length.", "int", 1000, "model", metavar="N")
    packing_buffer_size: int | None = _f(
        ("--packing-buffer-size",), "Sequence packing: pack variable-length samples into sequences of "
        "--packed-seq-length image-expanded positions, chosen from a buffer of N encoded samples (energon's "
        "packing; per-sample attention, positions and loss are kept: megatron-core's 'thd' format, Transformer "
        "Engine attention on CUDA, megatron's local attention per sample on CPU). A micro batch is then one packed sequence (--micro-batch-size 1) and "
        "--global-batch-size counts packed sequences. Default: no packing.", "int", None, "model")
    packed_seq_length: int | None = _f(
        ("--packed-seq-length", "--packing-seq-length"), "Image-expanded positions of one packed sequence (the "
        "language model's sequence length with --packing-buffer-size). At least --seq-length, which still "
        "truncates each sample (never inside an image). Default: --seq-length.", "int", None, "model")
    skip_train_iteration_range: list[tuple[int, int]] = _f(
        ("--skip-train-iteration-range",), "Iteration ranges whose batches are consumed but not trained "
        "on, e.g. 1000-1010 2000-2005 (to step over a loss spike).", "ranges", None, "model",
        factory=list, metavar="A-B")
    video_fps: float = _f(
        ("--video-fps",), "Frames taken per second of video. LLaVA-OneVision/InternVL: one frame every "
        "round(fps / N) frames (LLaVA-NeXT's video_fps; 1: one per second). Qwen2.5-VL: duration x N frames, at "
        "least 4, in pairs, evenly spaced (its video processor's fps sampling; qwen-vl-utils uses 2). See "
        "--video-frames.", "float", 1.0, "model", metavar="N")
    video_frames: int = _f(
        ("--video-frames",), "At most N frames per video: when --video-fps gives more, N frames evenly spaced from "
        "the first to the last (LLaVA-NeXT's frames_upbound; Qwen2.5-VL's max_frames). A OneVision frame costs "
        "ceil(side/2)^2 tokens (196 at 384 px, patch 14), plus one per video; a Qwen2.5-VL pair of frames its "
        "merged patches.", "int", 32, "model", metavar="N")

    # ---- checkpoints ----------------------------------------------------------------------------------
    save_dir: str = _f(("--save-dir",), "Parent directory of runs; checkpoints, config.yaml and "
                       "tensorboard logs go to <save-dir>/<name>/. An object-store URL msc://PROFILE/PATH "
                       "(profile from the MSC config named by MSC_CONFIG) keeps the checkpoints there and the "
                       "logs in --log-dir.", "path", "outputs", "ckpt", metavar="DIR")
    log_dir: str | None = _f(("--log-dir",), "Local directory for this run's config.yaml, metrics.jsonl, "
                             "TensorBoard and W&B files. Default: <save-dir>/<name>; with a remote --save-dir "
                             "(msc://...): outputs/<name> in the current directory.", "path", None, "ckpt",
                             metavar="DIR")
    name: str | None = _f(("--name",), "Run name (a directory under --save-dir). Default: "
                          "llava-stage<stage>.", "str", None, "ckpt")
    save: bool = _f(("--save",), "Save checkpoints.", "bool", True, "ckpt")
    save_interval: int = _f(("--save-interval",), "Save a checkpoint every N iterations (and at the "
                            "end).", "int", 1000, "ckpt")
    save_optim: bool = _f(("--save-optim",), "Include optimizer and scheduler state in checkpoints.",
                          "bool", True, "ckpt")
    load_optim: bool = _f(("--load-optim",), "Load optimizer and scheduler state when resuming "
                          "(--no-load-optim: continue from the checkpoint's weights with a fresh optimizer).",
                          "bool", True, "ckpt")
    load_rng: bool = _f(("--load-rng",), "Restore the random-number generators' state when resuming.",
                        "bool", True, "ckpt")
    reset_data_position: bool = _f(
        ("--reset-data-position",), "When resuming at a different data-parallel size, read the data from a new "
        "deterministic position (seeded by --seed and the iteration). energon's saved position is per "
        "data-parallel rank and cannot move to another DP size; without this flag such a resume is refused.",
        "flag", False, "ckpt")
    verify_integrity: bool = _f(
        ("--verify-integrity",), "Record the checksums of every checkpoint file when saving (megatron-core's SHA-256 "
        "integrity manifest where it has one, megatron-core 0.19, and crc32 for the rest) and check them before a "
        "resume loads anything; each reads every byte back once. --no-verify-integrity skips both re-reads (for "
        "multi-TB checkpoints); file sizes are still checked.", "bool", True, "ckpt")
    save_total_limit: int | None = _f(("--save-total-limit",), "Keep only the newest N checkpoints. "
                                      "Default: keep all.", "int", None, "ckpt")
    ckpt_step: int | None = _f(
        ("--ckpt-step",), "Resume from iteration N of <save-dir>/<name> instead of the one its tracker names (e.g. "
        "when the newest is damaged), or, for a new run, load iteration N of --megatron-load-dir (Megatron-LM's "
        "--ckpt-step). Drop it once the run has saved again: re-running with it starts from N again.", "int", None,
        "ckpt")

    # ---- logging and evaluation -----------------------------------------------------------------------
    log_interval: int = _f(("--log-interval",), "Log loss, learning rate and throughput every N "
                           "iterations.", "int", 10, "log")
    eval_interval: int = _f(("--eval-interval",), "Evaluate on the validation split every N "
                            "iterations (when --eval-iters > 0).", "int", 1000, "log")
    eval_iters: int = _f(("--eval-iters",), "Validation batches per evaluation (0 disables "
                         "evaluation).", "int", 0, "log")
    eval_generate_interval: int = _f(
        ("--eval-generate-interval",), "Every N iterations (and at the last), answer held-out samples with the "
        "model being trained, at its own layout (megatron-core's inference engine, greedy), and score them as "
        "eval/evaluate.py does: exact and VQA-normalised accuracy in the console, metrics.jsonl, TensorBoard and "
        "W&B, every answer in <run dir>/eval_generate/iter_N.jsonl. 0 (the default) disables it.", "int", 0,
        "log")
    eval_generate_data: str | None = _f(
        ("--eval-generate-data",), "Energon dataset whose --eval-generate-split is answered (a directory made by "
        "data_prep/, or a metadataset .yaml). Default: --data-path.", "path", None, "log", metavar="PATH")
    eval_generate_split: str = _f(("--eval-generate-split",), "The split of --eval-generate-data that is "
                                  "answered.", "choice", "val", "log", choices=("val", "test", "train"))
    eval_generate_samples: int = _f(("--eval-generate-samples",), "Samples answered per evaluation: the first K "
                                    "of the split, the same ones every time.", "int", 64, "log")
    eval_generate_max_new_tokens: int = _f(("--eval-generate-max-new-tokens",), "Tokens generated at most per "
                                           "answer (an answer also ends at the model's end token).", "int", 32,
                                           "log")
    wandb: bool = _f(("--wandb",), "Log to Weights & Biases.", "bool", False, "log")
    wandb_project: str = _f(("--wandb-project",), "Weights & Biases project.", "str", "megatron-vlm",
                            "log")
    tensorboard_dir: str | None = _f(("--tensorboard-dir",), "TensorBoard log directory. Default: "
                                     "<save-dir>/<name>/tensorboard.", "path", None, "log", metavar="DIR")
    log_throughput: bool = _f(
        ("--log-throughput",), "Samples/s, real tokens/s (image-expanded positions of the samples, never padding), "
        "model TFLOP/s per GPU and MFU (known GPUs) in the console line and TensorBoard every --log-interval "
        "(Megatron-LM's flag; on by default here: it costs no sync). metrics.jsonl records the counts and FLOPs "
        "either way.", "bool", True, "log")
    timing_log_level: int = _f(
        ("--timing-log-level",), "What the step timers report every --log-interval (Megatron-LM's levels): 0 the "
        "step only; 1 the step, data-wait, forward-backward, optimizer and loss-reduce; 2 also data-wait's two "
        "halves (batch-load, batch-distribute) and, on a GPU, the host's time beside the device's. The timers "
        "add no sync or barrier at any level (docs/training.md#step-timers).", "choice", 1, "log",
        choices=(0, 1, 2))
    timing_log_option: str = _f(
        ("--timing-log-option",), "How the timers are reported over the ranks: max, minmax (the fastest and the "
        "slowest rank) or all (every rank). One all-gather per --log-interval.", "choice", "minmax", "log",
        choices=("max", "minmax", "all"))
    profile: bool = _f(
        ("--profile",), "Record iterations --profile-step-start+1 to --profile-step-end with torch.profiler on the "
        "--profile-ranks: a gzipped Chrome trace (at most 16 MiB) and a table of the top kernels and host ops in "
        "<save-dir>/<name>/profile/.", "flag", False, "log")
    use_pytorch_profiler: bool = _f(
        ("--use-pytorch-profiler",), "Accepted for Megatron-LM's scripts: --profile always uses torch.profiler "
        "here.", "flag", False, "log")
    profile_step_start: int = _f(
        ("--profile-step-start",), "--profile starts after this many iterations (Megatron-LM's counting: steps "
        "from 0), with one warm-up iteration before when it is above 0.", "int", 10, "log")
    profile_step_end: int = _f(
        ("--profile-step-end",), "--profile stops after this iteration: it records iterations A+1 to B "
        "(B - A of them).", "int", 12, "log")
    profile_ranks: list[int] = _f(("--profile-ranks",), "The global ranks that --profile records, comma- or (as "
                                  "Megatron-LM) space-separated. Default: 0.", "intlist", None, "log",
                                  factory=lambda: [0], metavar="RANKS", nargs=True)
    smoke_test: bool = _f(
        ("--smoke-test",), "Shrink the run to check that it starts: forces TP=PP=1, micro batch 1, global batch = "
        f"data-parallel size, logs every step, {SMOKE_TEST_TRAIN_ITERS} iterations unless --train-iters is given. "
        "(--debug is a deprecated alias; for verbose logs use -v.)", "flag", False, "log",
        deprecated={"--debug": "it shrinks the run, as --smoke-test does; for verbose logs and tracebacks use -v"})
    verbose: bool = _f(
        ("-v", "--verbose"), "Verbose logs on every rank (library warnings too); on an error also print the Python "
        "traceback (as every megatron-vlm command does with -v; MVLM_DEBUG=1 does the same).", "flag", False, "log")

    # ---- containers -----------------------------------------------------------------------------------
    sif_path: str | None = _f(("--sif-path",), "Run each node's ranks inside this Apptainer/Singularity "
                              "image (apptainer exec --nv).", "path", None, "container", metavar="IMG")
    docker_image: str | None = _f(("--docker-image",), "Run each node's ranks inside this Docker image "
                                  "(docker run --gpus all --ipc=host).", "str", None, "container",
                                  metavar="IMAGE")
    bind: list[str] = _f(("--bind",), "Extra container mount SRC[:DST[:ro]] (repeatable). The data, "
                         "checkpoint, tokenizer, run and code directories are mounted automatically.",
                         "strlist", None, "container", factory=list, metavar="SRC[:DST[:ro]]")

    # ---- SLURM ----------------------------------------------------------------------------------------
    sbatch: str | None = _f(("--sbatch",), "Write a SLURM batch script to this path (one task per node "
                            "running this launcher; its settings go to JOB.yaml beside it; --device defaults "
                            "to cuda) instead of launching.", "path", None, "slurm",
                            metavar="JOB.sh")
    submit: bool = _f(("--submit",), "Submit the --sbatch script with sbatch.", "flag", False, "slurm")
    gpus_per_node: int | None = _f(("--gpus-per-node",), "GPUs to request per node in the --sbatch "
                                   "script. Default: --gpus.", "int", None, "slurm")
    partition: str | None = _f(("--partition",), "SLURM partition for --sbatch.", "str", None, "slurm")
    time: str | None = _f(("--time",), "SLURM time limit for --sbatch, e.g. 24:00:00.", "str", None,
                          "slurm")
    account: str | None = _f(("--account",), "SLURM account for --sbatch.", "str", None, "slurm")
    cpus_per_task: int | None = _f(("--cpus-per-task",), "CPUs per node task for --sbatch. Default: "
                                   "request whole nodes (--exclusive).", "int", None, "slurm")

    # Set by resolved(): what --smoke-test changed (not a field; never written to YAML).
    resolution_notes = ()

    # ---- derived values -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return (self.gpus or 1) * (self.nodes or 1)

    @property
    def dp(self) -> int:
        """Data-parallel replicas (each reads its own samples): the world over TP x PP x CP."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model and share its micro batches: TP x PP x CP."""
        return self.tp * self.pp * self.cp

    @property
    def virtual_pipeline(self) -> bool:
        """Virtual pipeline parallelism was asked for (the number of chunks needs the model's layers:
        :meth:`vpp_size`)."""
        return self.num_layers_per_virtual_pipeline_stage is not None or \
            self.num_virtual_stages_per_pipeline_rank is not None

    def vpp_size(self, spec) -> int:
        """Virtual pipeline stages (model chunks) per pipeline rank for ``spec``'s language model: 1 without virtual
        pipeline parallelism (:func:`megatron_vlm.model.pipeline_layout.vpp_size`, which refuses an impossible
        layout)."""
        from megatron_vlm.model.pipeline_layout import vpp_size

        layers = spec.check_parallelism(self.tp, self.pp, self.pp_layers, self.ep, self.etp)
        return vpp_size(layers, self.num_layers_per_virtual_pipeline_stage, self.num_virtual_stages_per_pipeline_rank,
                        uneven=self.pp_layers is not None)

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size: ``--etp``, else ``--tp``."""
        return self.etp if self.etp is not None else self.tp

    def moe_options(self):
        """The :class:`~megatron_vlm.model.build.MoEOptions` of this run (read only for an MoE language model)."""
        from megatron_vlm.model.build import MoEOptions

        return MoEOptions(aux_loss_coeff=self.moe_aux_loss_coeff,
                          load_balancing_type=self.moe_router_load_balancing_type,
                          z_loss_coeff=self.moe_z_loss_coeff, token_dispatcher_type=self.moe_token_dispatcher_type,
                          expert_capacity_factor=self.moe_expert_capacity_factor,
                          pad_expert_input_to_capacity=self.moe_pad_expert_input_to_capacity,
                          grouped_gemm=self.moe_grouped_gemm, router_dtype=self.moe_router_dtype,
                          per_layer_logging=self.moe_per_layer_logging)

    @property
    def packing(self) -> bool:
        """Sequence packing is on (``--packing-buffer-size``)."""
        return self.packing_buffer_size is not None

    @property
    def lm_seq_length(self) -> int:
        """Positions the language model sees per sequence: ``--packed-seq-length`` with packing, else
        ``--seq-length``."""
        return (self.packed_seq_length or self.seq_length) if self.packing else self.seq_length

    @property
    def grad_accum(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def run_name(self) -> str:
        return self.name or f"llava-stage{self.stage}"

    @property
    def run_dir(self) -> Path:
        """Local directory of this run's config.yaml, metrics and logs: ``--log-dir``, else ``<save_dir>/<name>``."""
        return Path(self.log_dir) if self.log_dir else Path(self.save_dir) / self.run_name

    @property
    def checkpoint_dir(self) -> str:
        """Where the trainer saves and resumes checkpoints: ``<save_dir>/<name>`` (a path or an msc:// URL)."""
        return str(self.save_dir).rstrip("/") + "/" + self.run_name if "://" in str(self.save_dir) else \
            str(Path(self.save_dir) / self.run_name)

    @property
    def config_path(self) -> Path:
        """The resolved config this node's trainer reads (node 0: ``config.yaml``, node r: ``config.node<r>.yaml``)."""
        rank = self.node_rank or 0
        return self.run_dir / (CONFIG_FILE if rank == 0 else f"config.node{rank}.yaml")

    @property
    def trained_parts(self) -> dict[str, bool]:
        """What this run trains: ``{"vision": ..., "projector": True, "language": ...}`` (unset freezing: the
        stage's default, vision encoder frozen)."""
        freeze_vit = self.freeze_vit if self.freeze_vit is not None else True
        freeze_lm = self.freeze_lm if self.freeze_lm is not None else self.stage == 1
        return {"vision": not freeze_vit, "projector": True, "language": not freeze_lm}

    @property
    def unfreeze_vit(self) -> bool:
        return not self.freeze_vit

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"

    @property
    def container(self) -> str | None:
        return "apptainer" if self.sif_path else "docker" if self.docker_image else None


#: field name -> dataclasses.Field, in --help order
FIELDS = {f.name: f for f in dataclasses.fields(ConfigFields)}


def flag(name: str) -> str:
    """The first command-line flag of field ``name``, e.g. ``--micro-batch-size``."""
    return FIELDS[name].metadata["flags"][0]
