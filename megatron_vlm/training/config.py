"""Training configuration: every setting of a training run, one dataclass field per launcher flag.

``TrainConfig`` is the contract between the launcher (``train/run.py``) and the trainer
(``train/pretrain_vlm.py``):

- ``TrainConfig.from_args(argv)`` parses the command line; ``--config run.yaml`` loads a YAML file first and
  the command line overrides it (every flag can be set in the YAML under its field name).
- ``cfg.resolved()`` fills what the user left open (stage defaults, ``--debug`` shrinking, tensorboard dir,
  precision), makes paths absolute and validates; errors name the input and the fix.
- ``cfg.to_yaml()`` / ``TrainConfig.from_yaml(path)`` write and read the resolved config. The launcher writes it
  to ``cfg.config_path`` (``<save_dir>/<name>/config.yaml``; node r > 0 of a multi-node run:
  ``config.node<r>.yaml``) and starts the trainer with ``--config`` pointing there. ``cfg.checkpoint_dir``
  (``<save_dir>/<name>``, a local directory or an ``msc://`` URL) is where the trainer saves checkpoints;
  ``cfg.run_dir`` is the local directory of config, metrics and logs (the same directory unless ``--log-dir``
  is given, which a remote ``--save-dir`` defaults to ``outputs/<name>``).

Relative paths, on the command line or in a YAML file, are relative to the current directory; the resolved
config holds absolute paths only.

Precedence of a value: command line > YAML > environment (SLURM, device detection, passed by the launcher as
``env_defaults``) > ``--debug`` shrinking > stage default > field default. ``--debug`` is the exception: it
forces TP=PP=1 and tiny batches whatever was asked, and says so in ``resolution_notes``.

This module imports nothing heavier than PyYAML: the launcher runs it on hosts without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_vlm.fp8 import FORMATS as FP8_FORMATS
from megatron_vlm.fp8 import RECIPES as FP8_RECIPES
from megatron_vlm.fp8 import align_size as fp8_align_size
from megatron_vlm.fusions import BY_NAME as FUSIONS
from megatron_vlm.fusions import problems as fusion_problems

CONFIG_FILE = "config.yaml"


class ConfigError(ValueError):
    """An impossible or incomplete training request; the message names the input and the fix."""


# Stage defaults, applied only where the user gave nothing (LLaVA-1.5 recipe).
STAGE_DEFAULTS: dict[int, dict[str, Any]] = {
    1: dict(freeze_lm=True, freeze_vit=True, global_batch_size=256, micro_batch_size=16, lr=1e-3),
    2: dict(freeze_lm=False, freeze_vit=True, global_batch_size=128, micro_batch_size=1, lr=2e-5),
}
DEBUG_TRAIN_ITERS = 10

# Field groups, in --help order.
_GROUPS = {
    "launch": "processes and nodes",
    "parallel": "parallelism and batch",
    "stage": "training stage and freezing",
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
    """A tristate field for one fusion of :data:`megatron_vlm.fusions.FUSIONS` (its Megatron-LM flags)."""
    fu = FUSIONS[name]
    return _f((fu.on_flag,), help + " Default: on where it works (logged at start-up).", "tristate", None, "fusion",
              negative=fu.off_flags)


def _f(flags, help, kind="str", default=None, group="launch", factory=None, **extra):
    meta = dict(flags=tuple(flags), help=help, kind=kind, group=group, **extra)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
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
        ("--dry-run",), "Validate, print the resolved config and the full command, and exit without "
        "launching or writing anything.", "flag", False)

    # ---- parallelism and batch ------------------------------------------------------------------------
    tp: int = _f(("--tp",), "Tensor-parallel size (divides attention heads, FFN and vocab sizes).",
                 "int", 1, "parallel")
    pp: int = _f(("--pp",), "Pipeline-parallel size (language model layers split across stages).",
                 "int", 1, "parallel")
    pp_layers: list[int] | None = _f(
        ("--pp-layers",), "Uneven pipeline split: language layers per stage, e.g. 3,1 for --pp 2. "
        "Default: an even split.", "intlist", None, "parallel", metavar="N,N,...")
    micro_batch_size: int | None = _f(
        ("--micro-batch-size", "--mbs"), "Samples per GPU per forward pass. Default: 16 (stage 1), "
        "1 (stage 2).", "int", None, "parallel")
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
                                 f"{DEBUG_TRAIN_ITERS} with --debug).", "int", None, "optim")
    seq_length: int = _f(("--seq-length",), "Tokens per sample after image-token expansion (longer "
                         "samples are truncated).", "int", 2048, "optim")
    precision: str | None = _f(("--precision",), "Parameter/compute precision. Default: bf16 on cuda, "
                               "fp32 on cpu.", "choice", None, "optim", choices=("bf16", "fp16", "fp32"))
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
    # ---- kernel fusions (see megatron_vlm.fusions) ---------------------------------------------------------
    gradient_accumulation_fusion: bool | None = _fusion(
        "gradient_accumulation_fusion", "Accumulate weight gradients inside the GEMM into the fp32 main_grad "
        "buffers (Transformer Engine linears; apex's fused_weight_gradient_mlp_cuda for local layers).")
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
        "packing; per-sample positions and loss are kept). Needs Transformer Engine attention on CUDA "
        "(megatron-core's 'thd' format). A micro batch is then one packed sequence (--micro-batch-size 1) and "
        "--global-batch-size counts packed sequences. Default: no packing.", "int", None, "model")
    packed_seq_length: int | None = _f(
        ("--packed-seq-length", "--packing-seq-length"), "Image-expanded positions of one packed sequence (the "
        "language model's sequence length with --packing-buffer-size). At least --seq-length, which still "
        "truncates each sample (never inside an image). Default: --seq-length.", "int", None, "model")
    skip_train_iteration_range: list[tuple[int, int]] = _f(
        ("--skip-train-iteration-range",), "Iteration ranges whose batches are consumed but not trained "
        "on, e.g. 1000-1010 2000-2005 (to step over a loss spike).", "ranges", None, "model",
        factory=list, metavar="A-B")

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
    save_total_limit: int | None = _f(("--save-total-limit",), "Keep only the newest N checkpoints. "
                                      "Default: keep all.", "int", None, "ckpt")

    # ---- logging and evaluation -----------------------------------------------------------------------
    log_interval: int = _f(("--log-interval",), "Log loss, learning rate and throughput every N "
                           "iterations.", "int", 10, "log")
    eval_interval: int = _f(("--eval-interval",), "Evaluate on the validation split every N "
                            "iterations (when --eval-iters > 0).", "int", 1000, "log")
    eval_iters: int = _f(("--eval-iters",), "Validation batches per evaluation (0 disables "
                         "evaluation).", "int", 0, "log")
    wandb: bool = _f(("--wandb",), "Log to Weights & Biases.", "bool", False, "log")
    wandb_project: str = _f(("--wandb-project",), "Weights & Biases project.", "str", "megatron-vlm",
                            "log")
    tensorboard_dir: str | None = _f(("--tensorboard-dir",), "TensorBoard log directory. Default: "
                                     "<save-dir>/<name>/tensorboard.", "path", None, "log", metavar="DIR")
    debug: bool = _f(("--debug",), f"Shrink the run for debugging: forces TP=PP=1, micro batch 1, "
                     f"global batch = data-parallel size, logs every step, {DEBUG_TRAIN_ITERS} iterations "
                     "unless --train-iters is given.", "bool", False, "log")

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

    # Set by resolved(): what --debug changed (not a field; never written to YAML).
    resolution_notes = ()

    # ---- derived values -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return (self.gpus or 1) * (self.nodes or 1)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

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

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, argv: list[str] | None = None, *, resolve: bool = True,
                  env_defaults: dict[str, Any] | None = None) -> "TrainConfig":
        """Parse ``argv`` (with ``--config`` YAML underneath); resolve and validate unless ``resolve=False``."""
        given = vars(build_parser().parse_args(argv))
        config_file = given.pop("config", None)
        values = _read_yaml_values(config_file) if config_file else {}
        values.update(given)
        cfg = cls(**values)
        return cfg.resolved(env_defaults) if resolve else cfg

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "TrainConfig":
        return cls(**_coerce_mapping(data, source))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "TrainConfig":
        """Read a config written by ``to_yaml`` (or written by hand); the ``derived`` section is ignored."""
        return cls(**_read_yaml_values(path))

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata["kind"] == "ranges":
                v = [f"{a}-{b}" for a, b in v]
            elif isinstance(v, (list, tuple)):
                v = list(v)
            out[f.name] = v
        return out

    def to_yaml(self) -> str:
        import yaml

        body = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)
        derived = dict(world_size=self.world_size, run_dir=str(self.run_dir))
        if self.checkpoint_dir != str(self.run_dir):
            derived["checkpoint_dir"] = self.checkpoint_dir
        if self.micro_batch_size and self.global_batch_size and self.world_size % (self.tp * self.pp) == 0:
            derived.update(data_parallel=self.dp, grad_accum=self.grad_accum)
        header = "# megatron-vlm training config (read with TrainConfig.from_yaml; 'derived' is informative)\n"
        return header + body + yaml.safe_dump({"derived": derived}, sort_keys=False)

    # ---- resolution and validation ------------------------------------------------------------------
    def resolved(self, env_defaults: dict[str, Any] | None = None) -> "TrainConfig":
        """A copy with open values filled in, paths absolute, and everything validated (``ConfigError``)."""
        cfg = dataclasses.replace(self)
        notes: list[str] = []
        for key, value in (env_defaults or {}).items():
            if key == "gpus" and cfg.gpu_ids:  # explicit --gpu-ids decide the count
                continue
            if getattr(cfg, key) is None and value is not None:
                setattr(cfg, key, value)
        problems = _check_types_and_ranges(cfg)
        if problems:
            raise ConfigError(_join(problems))

        if cfg.gpus is None:
            cfg.gpus = len(cfg.gpu_ids) if cfg.gpu_ids else (cfg.gpus_per_node or 1)
        cfg.nodes = cfg.nodes or 1
        cfg.node_rank = cfg.node_rank or 0
        cfg.device = cfg.device or "cuda"
        cfg.precision = cfg.precision or ("bf16" if cfg.device == "cuda" else "fp32")
        if cfg.nodes == 1 and cfg.master_addr is None:
            cfg.master_addr = "127.0.0.1"
        cfg.name = cfg.name or f"llava-stage{cfg.stage}"
        if cfg.sbatch and cfg.gpus_per_node is None:
            cfg.gpus_per_node = cfg.gpus

        if cfg.packing:  # a micro batch is one packed sequence
            if cfg.micro_batch_size is None:
                cfg.micro_batch_size = 1
            if cfg.packed_seq_length is None:
                cfg.packed_seq_length = cfg.seq_length
        for key, value in STAGE_DEFAULTS[cfg.stage].items():
            if getattr(cfg, key) is None:
                setattr(cfg, key, value)
        if cfg.debug:
            forced = dict(tp=1, pp=1, pp_layers=None, micro_batch_size=1, log_interval=1)
            changed = {k: v for k, v in forced.items() if getattr(cfg, k) != v}
            for k, v in forced.items():
                setattr(cfg, k, v)
            if cfg.global_batch_size != cfg.dp:
                changed["global_batch_size"] = cfg.dp
                cfg.global_batch_size = cfg.dp
            if cfg.train_iters is None:
                cfg.train_iters = changed["train_iters"] = DEBUG_TRAIN_ITERS
            if changed:
                notes.append("--debug set " + ", ".join(f"{k}={v}" for k, v in changed.items()))

        for f in dataclasses.fields(cfg):
            if f.metadata["kind"] == "path" and getattr(cfg, f.name):
                setattr(cfg, f.name, absolute_path(getattr(cfg, f.name)))
        if cfg.log_dir is None and "://" in cfg.save_dir:
            cfg.log_dir = absolute_path(str(Path("outputs") / cfg.name))
            notes.append(f"--save-dir is remote: checkpoints go to {cfg.checkpoint_dir}, config and logs to "
                         f"{cfg.log_dir} (set --log-dir to change)")
        if cfg.tensorboard_dir is None:
            cfg.tensorboard_dir = str(cfg.run_dir / "tensorboard")

        problems = _check_consistency(cfg)
        if problems:
            raise ConfigError(_join(problems))
        object.__setattr__(cfg, "resolution_notes", notes)
        return cfg


def absolute_path(p: str) -> str:
    """``p`` made absolute (``~`` expanded); URLs such as ``s3://`` or ``msc://`` are returned as given."""
    if "://" in p:
        return p
    return str(Path(os.path.expanduser(p)).absolute())


def _join(problems: list[str]) -> str:
    return problems[0] if len(problems) == 1 else "\n".join(f"- {p}" for p in problems)


def _flag(name: str) -> str:
    return _FIELDS[name].metadata["flags"][0]


def _check_types_and_ranges(cfg: TrainConfig) -> list[str]:
    p: list[str] = []
    for f in dataclasses.fields(cfg):  # nan and inf pass every comparison below
        v = getattr(cfg, f.name)
        if f.metadata["kind"] == "float" and isinstance(v, float) and v - v != 0:
            p.append(f"{f.metadata['flags'][0]} {v}: must be a finite number")
    positive = ["gpus", "nodes", "tp", "pp", "micro_batch_size", "global_batch_size", "train_iters",
                "seq_length", "save_interval", "save_total_limit", "log_interval", "eval_interval",
                "gpus_per_node", "cpus_per_task", "ddp_bucket_size", "recompute_num_layers",
                "max_consecutive_skipped_samples", "packing_buffer_size", "packed_seq_length"]
    for name in positive:
        v = getattr(cfg, name)
        if v is not None and v < 1:
            p.append(f"{_flag(name)} {v}: must be at least 1")
    for name in ("eval_iters", "num_workers", "min_lr", "weight_decay", "clip_grad", "seed", "image_token_id",
                 "pad_token_id"):
        v = getattr(cfg, name)
        if v is not None and v < 0:
            p.append(f"{_flag(name)} {v}: must not be negative")
    if cfg.stage not in STAGE_DEFAULTS:
        p.append(f"--stage {cfg.stage}: must be 1 (pretraining) or 2 (instruction tuning)")
    if cfg.device not in (None, "cuda", "cpu"):
        p.append(f"--device {cfg.device}: must be cuda or cpu")
    if cfg.precision not in (None, "bf16", "fp16", "fp32"):
        p.append(f"--precision {cfg.precision}: must be bf16, fp16 or fp32")
    if cfg.lr_decay_style not in ("cosine", "linear", "constant"):
        p.append(f"--lr-decay-style {cfg.lr_decay_style}: must be cosine, linear or constant")
    if cfg.lr is not None and cfg.lr <= 0:
        p.append(f"--lr {cfg.lr}: must be positive")
    if not 0 <= cfg.lr_warmup_fraction < 1:
        p.append(f"--lr-warmup-fraction {cfg.lr_warmup_fraction}: must be in [0, 1)")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            p.append(f"{_flag(name)} {getattr(cfg, name)}: must be in [0, 1)")
    if cfg.node_rank is not None and cfg.node_rank < 0:
        p.append(f"--rank {cfg.node_rank}: must not be negative")
    if cfg.master_port is not None and not 0 < cfg.master_port < 65536:
        p.append(f"--master-port {cfg.master_port}: must be a TCP port (1-65535)")
    if cfg.gpu_ids is not None:
        if not cfg.gpu_ids or min(cfg.gpu_ids) < 0 or len(set(cfg.gpu_ids)) != len(cfg.gpu_ids):
            p.append(f"--gpu-ids {','.join(map(str, cfg.gpu_ids))}: give distinct non-negative GPU indices")
    for a, b in cfg.skip_train_iteration_range:
        if a < 0 or b < a:
            p.append(f"--skip-train-iteration-range {a}-{b}: need 0 <= A <= B")
    if cfg.name is not None and (not cfg.name or "/" in cfg.name or cfg.name in (".", "..")):
        p.append(f"--name {cfg.name!r}: must be a plain directory name (no '/')")
    return p


def _check_consistency(cfg: TrainConfig) -> list[str]:
    p: list[str] = []
    if cfg.gpu_ids is not None:
        if cfg.device == "cpu":
            p.append("--gpu-ids is for --device cuda; drop it for a CPU run")
        elif len(cfg.gpu_ids) != cfg.gpus:
            p.append(f"--gpu-ids {','.join(map(str, cfg.gpu_ids))} names {len(cfg.gpu_ids)} GPUs but -g is "
                     f"{cfg.gpus}; give as many ids as --gpus (or leave -g out)")
    if cfg.node_rank >= cfg.nodes:
        p.append(f"--rank {cfg.node_rank} with --node {cfg.nodes}: node ranks run from 0 to {cfg.nodes - 1}")
    if cfg.nodes > 1 and not cfg.master_addr and not cfg.sbatch:
        p.append(f"--node {cfg.nodes}: give --master-addr (the address of node 0, reachable from every node)")
    mp = cfg.tp * cfg.pp
    if cfg.world_size % mp:
        per = f"-g {cfg.gpus}" + (f" --node {cfg.nodes}" if cfg.nodes > 1 else "") + f" --tp {cfg.tp}" + \
            (f" --pp {cfg.pp}" if cfg.pp > 1 else "")
        total = f"{cfg.world_size} GPUs" + (f" ({cfg.gpus} per node x {cfg.nodes} nodes)" if cfg.nodes > 1 else "")
        p.append(f"{per}: {total} is not a multiple of tp*pp={mp}; "
                 f"use a GPU count that is a multiple of {mp} or lower --tp/--pp")
    elif cfg.world_size < mp:  # pragma: no cover - implied by the modulo check
        p.append(f"tp*pp={mp} exceeds {cfg.world_size} GPUs")
    else:
        unit = cfg.micro_batch_size * cfg.dp
        if cfg.global_batch_size % unit:
            src = "" if cfg.global_batch_size != STAGE_DEFAULTS[cfg.stage]["global_batch_size"] else \
                f" (stage {cfg.stage} default)"
            lo, hi = cfg.global_batch_size // unit * unit, (cfg.global_batch_size // unit + 1) * unit
            p.append(f"global batch {cfg.global_batch_size}{src} is not divisible by micro batch "
                     f"{cfg.micro_batch_size} x data-parallel {cfg.dp} = {unit}; pass --global-batch-size "
                     f"{lo or hi}" + (f" or {hi}" if lo else "") + " (or change --micro-batch-size)")
    if cfg.pp_layers is not None and (len(cfg.pp_layers) != cfg.pp or min(cfg.pp_layers) < 1):
        p.append(f"--pp-layers {','.join(map(str, cfg.pp_layers))}: give {cfg.pp} positive layer counts, "
                 f"one per pipeline stage of --pp {cfg.pp}")
    if cfg.lr is not None and cfg.min_lr > cfg.lr:
        p.append(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}")
    if cfg.fp8:
        if cfg.device == "cpu":
            p.append("--fp8 needs a CUDA GPU of compute capability 8.9+ (Hopper/Ada) with Transformer Engine; "
                     "drop --fp8 for --device cpu")
        elif cfg.precision == "fp32":
            p.append("--fp8 runs on top of bf16/fp16 weights; drop --precision fp32")
        if cfg.transformer_impl == "local":
            p.append("--fp8 needs --transformer-impl transformer_engine (FP8 GEMMs are Transformer Engine's); "
                     "drop --transformer-impl local or --fp8")
        align = fp8_align_size(cfg.fp8_recipe)
        if cfg.seq_length % align:
            up = -(-cfg.seq_length // align) * align
            p.append(f"--seq-length {cfg.seq_length}: with --fp8 (--fp8-recipe {cfg.fp8_recipe}) it must be a "
                     f"multiple of {align}, the token alignment of FP8 GEMMs; use --seq-length {up}")
    p += fusion_problems({n: getattr(cfg, n) for n in FUSIONS}, cfg.device)
    p += _check_packing(cfg)
    if cfg.transformer_impl == "transformer_engine" and cfg.device == "cpu":
        p.append("--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local (the "
                 "default on --device cpu)")
    if cfg.overlap_param_gather and not cfg.dist_optim:
        p.append("--overlap-param-gather needs --dist-optim (it overlaps the distributed optimizer's "
                 "parameter all-gather)")
    if cfg.sequence_parallel and (cfg.transformer_impl == "local" or cfg.device == "cpu"):
        p.append("--sequence-parallel needs Transformer Engine layers (megatron-core's LLaVAModel runs sequence "
                 "parallelism only with TE attention); drop --sequence-parallel or use --transformer-impl "
                 "transformer_engine on a GPU")
    if cfg.sequence_parallel and cfg.tp == 1:
        p.append("--sequence-parallel needs --tp > 1 (it splits the sequence over tensor-parallel ranks)")
    if cfg.recompute_granularity != "full":
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(cfg, name) is not None:
                p.append(f"{_flag(name)} only applies with --recompute-granularity full")
    if cfg.precision == "fp16" and cfg.device == "cpu":
        p.append("--precision fp16 is not supported on --device cpu; use fp32 (default) or bf16")
    if cfg.train_iters is None:
        p.append("--train-iters is required: how many optimizer steps to train")
    if not cfg.data_path:
        p.append("--data-path is required: an energon dataset prepared with data_prep/")
    if not cfg.tokenizer_load_dir:
        p.append("--tokenizer-load-dir is required: the HF LLaVA directory from convert/build_llava.py")
    if not cfg.megatron_load_dir and not cfg.init:
        p.append("--megatron-load-dir is required (a checkpoint from convert/hf_to_megatron.py), "
                 "or pass --init to start from random weights")
    for name in ("log_dir", "tensorboard_dir", "tokenizer_load_dir", "sbatch", "sif_path"):
        v = getattr(cfg, name)
        if v and "://" in v:
            p.append(f"{_flag(name)} {v}: must be a local path (only --data-path, --save-dir and "
                     "--megatron-load-dir may be msc:// URLs)")
    if cfg.sif_path and cfg.docker_image:
        p.append("--sif-path and --docker-image both given; choose one container runtime")
    if cfg.bind and not cfg.container:
        p.append("--bind only applies with --sif-path or --docker-image")
    if cfg.submit and not cfg.sbatch:
        p.append("--submit needs --sbatch JOB.sh (the script to write and submit)")
    if not cfg.sbatch:
        for name in ("partition", "time", "account", "cpus_per_task"):
            if getattr(cfg, name) is not None:
                p.append(f"{_flag(name)} only applies with --sbatch JOB.sh")
        if cfg.gpus_per_node is not None and cfg.gpus_per_node != cfg.gpus:
            p.append(f"--gpus-per-node {cfg.gpus_per_node} disagrees with -g {cfg.gpus} (both count GPUs "
                     "per node); give one of them")
    elif cfg.gpus_per_node != cfg.gpus:
        p.append(f"--gpus-per-node {cfg.gpus_per_node} disagrees with -g {cfg.gpus} (both count GPUs per "
                 "node); give one of them")
    return p


def _check_packing(cfg: TrainConfig) -> list[str]:
    p: list[str] = []
    if not cfg.packing:
        if cfg.packed_seq_length is not None:
            p.append("--packed-seq-length only applies with --packing-buffer-size N (packing is on only with a "
                     "buffer of samples to pack from)")
        return p
    if cfg.device == "cpu" or cfg.transformer_impl == "local":
        where = "--device cpu" if cfg.device == "cpu" else "--transformer-impl local"
        p.append(f"--packing-buffer-size needs Transformer Engine attention (packed sequences use megatron-core's "
                 f"'thd' format, which {where} lacks); use --transformer-impl transformer_engine on --device cuda, "
                 "or drop --packing-buffer-size")
    if cfg.micro_batch_size != 1:
        p.append(f"--micro-batch-size {cfg.micro_batch_size} with --packing-buffer-size: a micro batch is one packed "
                 "sequence; use --micro-batch-size 1 (more samples per step: a larger --packed-seq-length or "
                 "--global-batch-size)")
    if cfg.packed_seq_length < cfg.seq_length:
        p.append(f"--packed-seq-length {cfg.packed_seq_length} is below --seq-length {cfg.seq_length}: every "
                 f"sample (up to --seq-length) must fit in a pack; use --packed-seq-length {cfg.seq_length} or more")
    align = fp8_align_size(cfg.fp8_recipe) if cfg.fp8 else 1
    if cfg.sequence_parallel:
        align = math.lcm(align, cfg.tp)
    if align > 1 and cfg.packed_seq_length % align:
        up = -(-cfg.packed_seq_length // align) * align
        p.append(f"--packed-seq-length {cfg.packed_seq_length}: with " + ("--fp8" if cfg.fp8 else "--sequence-parallel")
                 + f" it must be a multiple of {align}; use --packed-seq-length {up}")
    return p


# ---- argument parsing -------------------------------------------------------------------------------
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def parse_int_list(text: str) -> list[int]:
    """``"3,1"`` -> ``[3, 1]``."""
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def parse_range(text) -> tuple[int, int]:
    """``"1000-1010"`` (or ``[1000, 1010]``) -> ``(1000, 1010)``."""
    if isinstance(text, (list, tuple)) and len(text) == 2:
        return int(text[0]), int(text[1])
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an iteration range A-B such as 1000-1010")
    return int(m.group(1)), int(m.group(2))


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if f.default not in (None, dataclasses.MISSING) and f.metadata["kind"] not in ("tristate",):
        shown = "on" if f.default is True else "off" if f.default is False else f.default
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser. Only flags the user gave appear in the parsed namespace."""
    parser = argparse.ArgumentParser(
        prog="train/run.py",
        description="Launch LLaVA-style VLM training on megatron-core: validates the request, writes the "
        "resolved config to <save-dir>/<name>/config.yaml and starts train/pretrain_vlm.py on every rank "
        "through torchrun (optionally inside Apptainer/Docker, or as a SLURM batch job).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="RUN.yaml", help="YAML file with any of the settings below under "
                        "their field names (e.g. micro_batch_size: 4); command-line flags override it.")
    groups = {k: parser.add_argument_group(v) for k, v in _GROUPS.items()}
    for f in dataclasses.fields(TrainConfig):
        m = f.metadata
        g = groups[m["group"]]
        kind, flags = m["kind"], m["flags"]
        kw: dict[str, Any] = dict(dest=f.name, help=_help(f))
        if "metavar" in m or kind in ("int", "float"):
            kw["metavar"] = m.get("metavar", "N" if kind == "int" else "X")
        if kind == "bool":
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif kind == "flag":
            g.add_argument(*flags, action="store_true", **kw)
        elif kind == "tristate":
            ex = g.add_mutually_exclusive_group()
            ex.add_argument(*flags, action="store_const", const=True, **kw)
            negatives = m["negative"] if isinstance(m["negative"], tuple) else (m["negative"],)
            ex.add_argument(*negatives, action="store_const", const=False, dest=f.name,
                            help=f"The opposite of {flags[0]}.")
        elif kind == "choice":
            choices = m["choices"]
            typ = type(choices[0])
            g.add_argument(*flags, type=typ, choices=choices, **kw)
        elif kind == "intlist":
            g.add_argument(*flags, type=parse_int_list, **kw)
        elif kind == "ranges":
            g.add_argument(*flags, type=parse_range, nargs="+", **kw)
        elif kind == "strlist":
            g.add_argument(*flags, action="append", **kw)
        else:
            g.add_argument(*flags, type={"int": int, "float": float}.get(kind, str), **kw)
    return parser


# ---- YAML -------------------------------------------------------------------------------------------
def _read_yaml_values(path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of setting: value, got {type(data).__name__}")
    return _coerce_mapping(data, str(path))


_ALIASES = {"unfreeze_vit": "freeze_vit", "unfreeze_lm": "freeze_lm", "mbs": "micro_batch_size",
            "gbs": "global_batch_size"}


def _coerce_mapping(data: dict[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key == "derived":
            continue
        negate = key.startswith("unfreeze_")
        key = _ALIASES.get(key, key)
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown setting {raw_key!r}{hint}")
        try:
            v = _coerce(_FIELDS[key], value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{source}: {raw_key}: {e}") from None
        if negate and v is not None:
            v = not v
        out[key] = v
    return out


def _coerce(f: dataclasses.Field, value):
    kind = f.metadata["kind"]
    if value is None:
        if kind in ("ranges", "strlist"):
            return []
        if f.default is not None and f.default is not dataclasses.MISSING:
            raise ValueError(f"must not be empty (default {f.default})")
        return None
    if kind in ("bool", "flag", "tristate"):
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "on", "1"):
            return True
        if str(value).lower() in ("false", "no", "off", "0"):
            return False
        raise ValueError(f"{value!r} is not true/false")
    if kind == "int" or (kind == "choice" and isinstance(f.metadata["choices"][0], int)):
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{value!r} is not an integer")
        v = int(value)
        if kind == "choice" and v not in f.metadata["choices"]:
            raise ValueError(f"{value!r} is not one of {list(f.metadata['choices'])}")
        return v
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number")
        return float(value)  # YAML reads 1e-3 as a string; float() takes it
    if kind == "choice":
        if value not in f.metadata["choices"]:
            raise ValueError(f"{value!r} is not one of {list(f.metadata['choices'])}")
        return value
    if kind == "intlist":
        if isinstance(value, (list, tuple)):
            return [int(x) for x in value]
        return parse_int_list(value)
    if kind == "ranges":
        if isinstance(value, (str, int)):
            value = [value]
        return [parse_range(x) for x in value]
    if kind == "strlist":
        if isinstance(value, str):
            return [value]
        return [str(x) for x in value]
    return str(value)
