"""An HF model to generate with, from an HF export or straight from a Megatron iteration checkpoint.

``--model DIR`` is an HF LLaVA / LLaVA-NeXT / OneVision directory (``convert/megatron_to_hf.py``'s output, or
``convert/build_llava.py``'s); it loads with ``from_pretrained``.

``--megatron-dir`` is any checkpoint ``megatron_to_hf`` exports (a converted checkpoint, a training run at its
tracker's iteration or ``--iteration``, or one iteration directory). Nothing is written: the checkpoint is read
by the export's own reader (:func:`megatron_vlm.convert.to_hf.read_full_megatron_state`: torch_dist resharded to
one process, legacy rank files merged), turned into HF tensors by the export's rules
(:mod:`megatron_vlm.convert.mapping`), cast to the dtype the export would write (the checkpoint's), joined by the
HF-only tensors the checkpoint carries, and loaded into the HF model class of its spec. The model is therefore
the one ``megatron_to_hf`` would write, tensor for tensor; the tokenizer, chat template, processor and generation
config come from the run's ``tokenizer/`` directory, as the export copies them. ``--tp``/``--pp`` name the
layout the checkpoint was written at and are checked, as ``megatron_to_hf.py --tp/--pp`` are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from megatron_vlm.spec import ARCHS, VLMSpec

log = logging.getLogger(__name__)

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class LoadedModel:
    """An HF model in eval mode, the spec it was built from, and the directory of its tokenizer/processor."""

    model: object  # a transformers LLaVA / LLaVA-NeXT / OneVision model
    spec: VLMSpec
    files_dir: Path  # tokenizer, chat template, image processor, generation config
    source: str  # what was loaded, for the log


def compute_dtype(name: str, device: str, stored: str | None = None):
    """``--dtype``: fp32/bf16/fp16, or auto: fp32 on CPU (bf16 matmuls are slow there), else the stored dtype."""
    import torch

    if name != "auto":
        return getattr(torch, DTYPES[name])
    if device == "cpu" or stored is None:
        return torch.float32
    return getattr(torch, stored) if isinstance(stored, str) else stored


def load_hf_export(model_dir, dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """The HF model of an HF LLaVA directory."""
    import json

    import transformers

    from megatron_vlm.cli.inputs import check_hf_dir, check_tokenizer_dir

    model_dir = Path(model_dir)
    check_hf_dir(model_dir, "--model")
    check_tokenizer_dir(model_dir, "--model")
    spec = VLMSpec.from_hf_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype")
    cls = getattr(transformers, ARCHS[spec.arch][1])
    model = cls.from_pretrained(str(model_dir), dtype=compute_dtype(dtype, device, stored)).to(device).eval()
    return LoadedModel(model, spec, model_dir, str(model_dir))


def hf_state_of_checkpoint(iter_dir, spec: VLMSpec, meta) -> dict:
    """The HF tensors (on-disk names) ``megatron_to_hf`` would write for ``iter_dir``, in memory."""
    import torch

    from megatron_vlm import checkpoint as ckpt
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.to_hf import read_full_megatron_state

    dtype = getattr(torch, meta.dtype)  # the export's default: the checkpoint's dtype

    def cast(t):
        return t.to(dtype) if t.is_floating_point() else t

    state = read_full_megatron_state(iter_dir, spec, meta)
    out = {}
    for rule in mapping.rules(spec):
        full = state.pop(rule.mcore)
        for name, t in zip(rule.hf, mapping.to_hf(rule, full, spec)):
            out[name] = cast(t).contiguous()
    for name, t in ckpt.read_extra(iter_dir).items():
        out[name] = cast(t)
    return out


def load_megatron_checkpoint(megatron_dir, iteration=None, tp: int | None = None, pp: int | None = None,
                             dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """The HF model that ``megatron_to_hf`` would export from ``megatron_dir``, built in memory."""
    import transformers
    from transformers import GenerationConfig

    from megatron_vlm import checkpoint as ckpt
    from megatron_vlm.cli.inputs import check_checkpoint, check_tokenizer_dir

    iter_dir = check_checkpoint(megatron_dir, iteration)  # the iteration directory, its files checked
    if not (Path(iter_dir) / ckpt.META).is_file():
        raise ckpt.CheckpointLayoutError(
            f"{iter_dir} has no {ckpt.META}: it was not written by megatron-vlm (a Megatron-LM checkpoint?); export "
            "it with convert/megatron_to_hf.py --hf-config and pass the export as --model")
    meta = ckpt.CheckpointMeta.load(iter_dir)
    for flag, given, have in (("--tp", tp, meta.tp), ("--pp", pp, meta.pp)):
        if given is not None and given != have:
            raise ckpt.CheckpointLayoutError(
                f"{flag} {given} does not match the checkpoint {iter_dir} (written at tp={meta.tp} pp={meta.pp}); "
                f"drop {flag} or pass {flag} {have}")
    spec = VLMSpec.load(iter_dir)
    files = ckpt.run_dir(iter_dir) / ckpt.TOKENIZER_DIR
    check_tokenizer_dir(files, "the checkpoint's tokenizer directory")
    log.info("reading %s (%s, tp=%d pp=%d) into an HF %s", iter_dir, meta.format, meta.tp, meta.pp, spec.arch)
    state = hf_state_of_checkpoint(iter_dir, spec, meta)
    config = spec.to_hf_config()
    config.dtype = meta.dtype
    cls = getattr(transformers, ARCHS[spec.arch][1])
    model = cls.from_pretrained(None, config=config, state_dict=state, dtype=compute_dtype(dtype, device, meta.dtype))
    if (files / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(files))
    return LoadedModel(model.to(device).eval(), spec, files, str(iter_dir))


def load(model_dir=None, megatron_dir=None, iteration=None, tp=None, pp=None, dtype: str = "auto",
         device: str = "cpu") -> LoadedModel:
    """``--model`` or ``--megatron-dir`` (exactly one)."""
    if (model_dir is None) == (megatron_dir is None):
        raise ValueError("give exactly one of --model (an HF export) and --megatron-dir (a Megatron checkpoint)")
    if model_dir is not None:
        return load_hf_export(model_dir, dtype, device)
    return load_megatron_checkpoint(megatron_dir, iteration, tp, pp, dtype, device)


def add_model_flags(p) -> None:
    """The flags that choose the model, shared by eval/generate.py and eval/evaluate.py."""
    from megatron_vlm.cli import iteration as iteration_type
    from megatron_vlm.cli import positive_int

    g = p.add_argument_group("model (one of --model and --megatron-dir)")
    g.add_argument("--model", default=None, metavar="HF_DIR",
                   help="HF LLaVA directory (convert/megatron_to_hf.py's export, or convert/build_llava.py's output)")
    g.add_argument("--megatron-dir", default=None, metavar="DIR",
                   help="Megatron checkpoint: a converted checkpoint, a training run (its latest iteration unless "
                        "--iteration) or one iteration directory; read in memory into the HF model the export "
                        "would write, nothing is written")
    g.add_argument("--iteration", "--ckpt-step", dest="iteration", type=iteration_type, default=None,
                   help="with --megatron-dir: the iteration to read (an integer or 'release'; default: the "
                        "tracker's latest). --ckpt-step is Megatron-LM's name")
    g.add_argument("--tp", type=positive_int, default=None,
                   help="with --megatron-dir: the TP the checkpoint was written at (checked if given; the "
                        "checkpoint is read resharded into one process)")
    g.add_argument("--pp", type=positive_int, default=None,
                   help="with --megatron-dir: the PP the checkpoint was written at (checked if given)")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="compute dtype (auto: fp32 on CPU, the weights' dtype on CUDA)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the model runs (default: cuda when a GPU is visible, else cpu)")


def check_model_flags(p, a) -> None:
    """argparse errors for an impossible choice of model flags."""
    if (a.model is None) == (a.megatron_dir is None):
        p.error("give exactly one of --model HF_DIR and --megatron-dir DIR")
    if a.model is not None:
        for flag, v in (("--iteration", a.iteration), ("--tp", a.tp), ("--pp", a.pp)):
            if v is not None:
                p.error(f"{flag} applies to --megatron-dir; an HF --model has one set of weights")


def device_of(a) -> str:
    import torch

    if a.device is not None:
        if a.device == "cuda" and not torch.cuda.is_available():
            from megatron_vlm.cli import InputError

            raise InputError("--device cuda: no CUDA GPU is visible; run on a GPU node, or pass --device cpu")
        return a.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_from_args(a) -> LoadedModel:
    return load(a.model, a.megatron_dir, a.iteration, a.tp, a.pp, a.dtype, device_of(a))
