"""An HF model to generate with, from an HF export or straight from a Megatron iteration checkpoint.

``--model DIR`` is an HF LLaVA / LLaVA-NeXT / OneVision directory (``convert/megatron_to_hf.py``'s output, or
``convert/build_llava.py``'s); it loads with ``from_pretrained``.

``--megatron-dir`` is any checkpoint ``megatron_to_hf`` exports (a converted checkpoint, a training run at its
tracker's iteration or ``--iteration``, or one iteration directory). Nothing is written: the checkpoint is read
one tensor at a time by the export's own reader (:func:`megatron_vlm.convert.to_hf.open_source`: torch_dist
resharded to one process, legacy rank files merged), turned into HF tensors by the export's rules
(:mod:`megatron_vlm.convert.mapping`), joined by the HF-only tensors the checkpoint carries, and handed to
``from_pretrained`` of the HF model class of its spec as a state dict of lazy values (:class:`LazyTensor`, read as
transformers reads a safetensors file: each value when its parameter is loaded), so the process holds the model
in its compute dtype plus the few tensors being read, never the checkpoint's state beside it. The model is the
one ``megatron_to_hf`` would write, tensor for tensor, cast to the compute dtype; the tokenizer, chat template,
processor and generation config come from the run's ``tokenizer/`` directory, as the export copies them.
``--tp``/``--pp`` name the layout the checkpoint was written at and are checked, as ``megatron_to_hf.py
--tp/--pp`` are.

**Memory.** Both ways build the model in the compute dtype (``--dtype``; auto: fp32 on CPU, the weights' dtype on
CUDA). Before anything is read, :func:`memory_needed` estimates the bytes (the model in that dtype, plus, from a
checkpoint, the tensors transformers' loader threads read at once), the start-up line says them and the compute
dtype, and a model that would not fit in the memory available (a GPU's free memory with ``--device cuda``) is
refused in one line that names the need and ``--dtype bf16`` where it would halve it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from megatron_vlm.model.spec import ARCHS, VLMSpec

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

    import torch
    import transformers

    from megatron_vlm.cli.inputs import check_hf_dir, check_tokenizer_dir
    from megatron_vlm.convert.streaming import format_bytes

    model_dir = Path(model_dir)
    check_hf_dir(model_dir, "--model")
    check_tokenizer_dir(model_dir, "--model")
    spec = VLMSpec.from_hf_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype")
    cls = getattr(transformers, ARCHS[spec.arch][1])
    compute = compute_dtype(dtype, device, stored)
    total, model_bytes = memory_needed(cls, transformers.AutoConfig.from_pretrained(str(model_dir)), compute)
    check_fits(f"--model {model_dir}", total, model_bytes, compute,
               getattr(torch, stored) if isinstance(stored, str) else None, device)
    log.info("loading %s (an HF %s, stored in %s) in %s (the compute dtype) on %s: about %s of memory", model_dir,
             spec.arch, stored, str(compute).replace("torch.", ""), device, format_bytes(total))
    model = cls.from_pretrained(str(model_dir), dtype=compute).to(device).eval()
    return LoadedModel(model, spec, model_dir, str(model_dir))


#: threads transformers' ``from_pretrained`` reads tensors with (its ``GLOBAL_WORKERS``, at most 4)
LOADER_THREADS = 4


class LazyTensor:
    """One HF tensor of a checkpoint, made when transformers' loader reads it: the loader takes ``value[...]`` of
    each state-dict value (as of a safetensors slice from ``safe_open(...).get_slice``) and casts it to the compute
    dtype, so a tensor is made only while its parameter is loaded."""

    def __init__(self, make, dtype, shape):
        self._make, self.dtype, self.shape = make, dtype, tuple(shape)

    def __getitem__(self, index):
        return self._make()[index]

    def get_shape(self) -> list[int]:
        return list(self.shape)


class _RuleOutputs:
    """The HF tensors of one Megatron tensor (a fused QKV gives three): read once when the first is asked for and
    let go when the last is taken (thread-safe: transformers' loader threads ask in any order)."""

    def __init__(self, source, rule, spec):
        import threading

        self.source, self.rule, self.spec = source, rule, spec
        self._outs: list | None = None
        self._lock = threading.Lock()

    def take(self, k: int):
        from megatron_vlm.convert import mapping

        with self._lock:
            if self._outs is None or self._outs[k] is None:
                self._outs = list(mapping.to_hf(self.rule, self.source.read(self.rule), self.spec))
            t, self._outs[k] = self._outs[k], None
            if all(o is None for o in self._outs):
                self._outs = None
        return t.contiguous()


def lazy_hf_state(source, iter_dir, spec: VLMSpec) -> tuple[dict, int]:
    """``(state, largest)``: the HF tensors (on-disk names) ``megatron_to_hf`` would write for the checkpoint
    ``source`` reads (:func:`megatron_vlm.convert.to_hf.open_source`), as :class:`LazyTensor` s in the dtypes stored,
    with the HF-only tensors of ``iter_dir``; ``largest``: the bytes of the largest Megatron tensor."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert import mapping
    from megatron_vlm.convert.hf_io import SafetensorsFile
    from megatron_vlm.convert.to_hf import meta_full

    state, largest = {}, 0
    for rule in mapping.rules(spec):
        full = meta_full(source, rule)
        largest = max(largest, full.numel() * full.element_size())
        outs = _RuleOutputs(source, rule, spec)
        for k, (name, t) in enumerate(zip(rule.hf, mapping.to_hf(rule, full, spec))):
            state[name] = LazyTensor(lambda outs=outs, k=k: outs.take(k), t.dtype, t.shape)
    extra = Path(iter_dir) / ckpt.EXTRA
    if extra.is_file():
        f = SafetensorsFile(extra)
        for name in f.names():
            info = f.info(name)
            state[name] = LazyTensor(lambda name=name: f.get(name), info.dtype, info.shape)
    return state, largest


def memory_needed(model_class, config, dtype, reading: int = 0) -> tuple[int, int]:
    """``(total, model)`` bytes of building ``model_class(config)`` in ``dtype`` by ``from_pretrained``: the model
    (its parameters and buffers, counted on the meta device) plus ``reading`` (the tensors being read)."""
    import torch

    with torch.device("meta"):
        meta = model_class(config)
    seen, model = set(), 0
    for t in list(meta.parameters()) + list(meta.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            model += t.numel() * (torch.empty((), dtype=dtype).element_size() if t.is_floating_point()
                                  else t.element_size())
    return model + reading, model


def check_fits(what: str, total: int, model: int, dtype, stored, device: str) -> None:
    """Refuse in one line a model that would not fit: ``total`` bytes in this machine's available memory (80%, as
    the converters take), and with CUDA ``model`` bytes in the GPU's free memory."""
    import torch

    from megatron_vlm.cli import InputError
    from megatron_vlm.convert.streaming import AUTO_SHARE, available_bytes, format_bytes

    half = (f"; pass --dtype bf16 (about {format_bytes(total * 2 // 4)})"
            if dtype == torch.float32 and stored != torch.float32 else "")
    avail = available_bytes()
    if avail is not None and total > AUTO_SHARE * avail:
        raise InputError(f"{what}: the model in {str(dtype).replace('torch.', '')} needs about "
                         f"{format_bytes(total)} of memory, more than {AUTO_SHARE:.0%} of the {format_bytes(avail)} "
                         f"available{half or '; use a machine with more memory'}")
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if model > free:
            raise InputError(f"{what}: the model in {str(dtype).replace('torch.', '')} needs about "
                             f"{format_bytes(model)} of GPU memory, more than the {format_bytes(free)} free"
                             f"{half or '; pass --device cpu'}")


def load_megatron_checkpoint(megatron_dir, iteration=None, tp: int | None = None, pp: int | None = None,
                             dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """The HF model that ``megatron_to_hf`` would export from ``megatron_dir``, built in memory one tensor at a
    time (:func:`lazy_hf_state`), in the compute dtype."""
    import torch
    import transformers
    from transformers import GenerationConfig

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.checkpoint.checks import check_checkpoint
    from megatron_vlm.cli.inputs import check_tokenizer_dir
    from megatron_vlm.convert.streaming import format_bytes
    from megatron_vlm.convert.to_hf import open_source

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
    config = spec.to_hf_config()
    config.dtype = meta.dtype
    cls = getattr(transformers, ARCHS[spec.arch][1])
    compute = compute_dtype(dtype, device, meta.dtype)
    with open_source(iter_dir, spec, meta) as source:
        state, largest = lazy_hf_state(source, iter_dir, spec)
        # transformers' loader threads each hold a Megatron tensor being read and its HF parts
        total, model_bytes = memory_needed(cls, config, compute, 2 * LOADER_THREADS * largest)
        check_fits(f"--megatron-dir {megatron_dir}", total, model_bytes, compute, getattr(torch, meta.dtype), device)
        log.info("reading %s (%s, tp=%d pp=%d, stored in %s) into an HF %s in %s (the compute dtype) on %s: about "
                 "%s of memory", iter_dir, meta.format, meta.tp, meta.pp, meta.dtype, spec.arch,
                 str(compute).replace("torch.", ""), device, format_bytes(total))
        model = cls.from_pretrained(None, config=config, state_dict=state, dtype=compute)
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
                        "checkpoint is read resharded into one process); eval/generate.py --engine megatron: the TP "
                        "to generate at")
    g.add_argument("--pp", type=positive_int, default=None,
                   help="with --megatron-dir: the PP the checkpoint was written at (checked if given); "
                        "eval/generate.py --engine megatron: the PP to generate at")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="compute dtype: the model is built and runs in it (auto: fp32 on CPU, the weights' dtype on "
                        "CUDA); the start-up line gives it and the memory it needs, and a model that does not fit "
                        "is refused before anything is read")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the model runs (default: cuda when a GPU is visible, else cpu)")
    g.add_argument("--engine", choices=["hf", "megatron"], default="hf",
                   help="hf (default): HF generate on the model in one process (--model, or --megatron-dir read into "
                        "it); megatron: megatron-core's inference engine on the sharded model itself, on --tp x --pp "
                        "local ranks (any layout for a torch_dist checkpoint; default: the checkpoint's), nothing "
                        "gathered into one process (LLaVA, NeXT, OneVision and InternVL models)")
    g.add_argument("--ep", type=positive_int, default=1,
                   help="--engine megatron: the expert-parallel size of a mixture-of-experts model (ranks: tp x pp x "
                        "ep; default 1)")
    g.add_argument("--max-length", type=positive_int, default=4096, metavar="N",
                   help="--engine megatron: the longest prompt (images expanded) plus new tokens, the KV cache's "
                        "length (default 4096)")


def check_model_flags(p, a) -> None:
    """argparse errors for an impossible choice of model flags."""
    if (a.model is None) == (a.megatron_dir is None):
        p.error("give exactly one of --model HF_DIR and --megatron-dir DIR")
    if a.model is not None:
        for flag, v in (("--iteration", a.iteration), ("--tp", a.tp), ("--pp", a.pp)):
            if v is not None:
                p.error(f"{flag} applies to --megatron-dir; an HF --model has one set of weights")
    if a.engine == "megatron" and a.megatron_dir is None:
        p.error("--engine megatron generates on the sharded checkpoint: give --megatron-dir DIR")
    if a.engine != "megatron" and a.ep != 1:
        p.error("--ep applies to --engine megatron")


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
