"""Run megatron-core on a machine without a GPU (CPU tensors, gloo backend).

megatron-core hard-codes CUDA in a few places: ``device=torch.cuda.current_device()`` / ``device="cuda"``
factory calls, ``.cuda()`` calls, and the torch.cuda RNG functions its RNG tracker uses. ``enable()``
makes the same code run on CPU:

- a ``TorchFunctionMode`` that rewrites CUDA devices (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``,
  integer device indices) to ``"cpu"`` in factory functions / ``Tensor.to``, makes ``Tensor.cuda()``
  a no-op, and factory functions' ``pin_memory=True`` (a host staging buffer for a CUDA copy, which needs an
  accelerator) plain host memory;
- the same mode around the backward of megatron-core's autograd Functions (the autograd engine runs them where
  the thread-local mode is not active): activation recomputation re-runs the forward there, sequence parallelism
  reduce-scatters into buffers made on ``torch.cuda.current_device()``;
- a training step without that mode (:func:`step_scope`, around ``training/step.train_step``): the mode's Python
  ``__torch_function__`` runs for every torch call (~30k per step at the kit's depth, ~4 us each, and it sends
  ``torch.nn.functional`` through torch's Python override path), so inside a step the CUDA devices megatron-core
  names are rewritten at their sources instead: the modules of :data:`STEP_MODULES` see a ``torch`` whose factory
  functions make CPU tensors, and the few functions of :data:`STEP_MODE_FUNCTIONS` that move tensors with
  ``Tensor.cuda()`` / ``.to(<cuda>)`` or assert a CUDA ``Tensor.type()`` run under the mode; the backward wrappers
  above leave the mode off inside a step. The lists were found by recording every rewrite the mode made inside the
  steps of the training tests (TP, SP, PP, VPP, CP, packing, recomputation, MoE); a CUDA device left elsewhere in a
  step fails loudly, naming its call site;
- CPU stand-ins for ``torch.cuda.current_device / synchronize / current_stream / get_rng_state /
  set_rng_state / manual_seed`` (``current_stream`` is torch's no-op CPU stream whose recorded events can be
  waited on, :data:`CPU_STREAM`: megatron-core 0.19's DDP grad sync waits on the current stream's events) (the "CUDA" RNG state *is* the CPU default generator's state, so megatron's RNG tracker
  forks/restores the generator that CPU ops really use) and for megatron's own ``_get/_set_cuda_rng_state``;
- megatron-core's optimizer code on megatron's own fallbacks, as when neither Transformer Engine nor Apex imports
  (:func:`use_torch_optimizer_kernels`): with Transformer Engine installed (the 3.12 lane), megatron binds TE's
  CUDA kernels at import -- ``FusedAdam`` and the ``multi_tensor_*`` ops behind grad norms, clipping and
  main-parameter copies -- which fail on CPU tensors; torch's Adam and ``megatron.core.utils``'s
  ``local_multi_tensor_applier`` run instead, and the norm, clip and copies run on torch's foreach kernels
  (:mod:`.optimizer_kernels`, entry ``foreach-optimizer-kernels``);
- megatron-core's ``torch.compile``'d elementwise functions (its ``jit_fuser``: ``quick_gelu``, the bias-GELU/
  SwiGLU/GeGLU fusions) run eagerly (torch's ``force_eager`` stance): on CPU each process would
  otherwise trace and compile them with TorchInductor at its first forward (g++ on a cold cache, ~2-3 s of CPU
  per process with a warm one), as the fusions they stand for run on CUDA only (``fusions: all off`` on CPU).

- megatron-core's local ``DotProductAttention`` learns packed sequences (:func:`packed_local_attention`): with
  ``PackedSeqParams(qkv_format='thd')`` it runs its own causal attention once per ``cu_seqlens`` segment, so a
  sample attends only to itself (Transformer Engine's fused 'thd' attention does the same on a GPU). Everything
  else on the packed path is megatron-core's own: rotary embeddings restart per segment in its
  ``_apply_rotary_pos_emb_thd``, and LLaVAModel lays out images, labels and loss mask.

- megatron-core's mixture-of-experts layers (:func:`moe_on_cpu`): the router's gating GEMM runs on torch's
  matmul, which megatron-core uses whenever Transformer Engine's ``general_gemm`` is unavailable (the 3.12 lane
  imports TE, whose GEMM needs a GPU); the all-to-all token dispatcher's device-to-host stream, which its
  constructor makes with ``torch.cuda.Stream()``, is :data:`CPU_STREAM` (the current stream, so the dispatcher
  copies its split sizes on it without a side stream, and synchronizes on its event), and its split sizes, CPU
  tensors already, become the numpy arrays megatron-core makes of copied CUDA tensors (torch's
  ``all_to_all_single`` takes no tensors as split sizes). The collectives the dispatchers use (all-gather,
  reduce-scatter, ``all_to_all_single`` with split sizes) are gloo's own.

It is switched on only when CUDA is absent (``enable`` refuses on a GPU machine), for the rest of the process: a
CPU rank meets megatron-core's CUDA calls everywhere it runs (build, forward, backward, optimizer, checkpoints).
Every piece is an entry of :mod:`megatron_vlm.runtime.mcore_patches` (the registry of megatron-core patches, which
installs, checks and records them); :func:`disable` undoes the layer exactly.

``te_construction()`` (a context manager, around :func:`megatron_vlm.model.build.build_model`'s build of Transformer
Engine layers while this layer is on) lets Transformer Engine's modules be *constructed* on CPU, so that the GPU path's
model building, checkpoint loading and saving and training set-up run in tests: ``TransformerEngineBaseModule.__init__``
refuses to run unless ``torch.cuda.is_available()``; that one check, made from that one function, is answered True, and
every other caller still gets the real answer (False). Its limits: TE's kernels (the forward and backward of its
linears, norms and attention, FP8 casts) still need a GPU and fail on CPU; nothing else in TE, megatron-core or torch is
changed for it; it refuses to run on a machine with CUDA, where TE needs no help.

``inference_scope()`` (a context manager, around generation on the sharded model, ``eval/sharded.py``) lets
megatron-core's text-generation controller run on CPU: its sampling generator, made on the CUDA device, is a CPU one;
the ``torch.cuda.Event`` it times each step with is a CPU timing event; and its pipeline broadcasts' check that a
tensor is a CUDA one checks only that it is there.

Separately, three fixes are needed whenever Transformer Engine (and Apex) are missing, on CPU or GPU, and
``fix_without_te()`` applies them (for the process), with megatron-core's local grad norm, clip and copy fallbacks
on torch's foreach kernels (:mod:`.optimizer_kernels`: no host sync per parameter tensor):

- ``fix_norm_fallback()`` repairs CLIPViTModel's LayerNorm fallback (it defaults to ``torch.nn.LayerNorm``,
  which ``build_module`` cannot construct with a config);
- ``fix_torch_adam_state_load()``: without Apex/TE the distributed optimizer runs torch's Adam, whose per-parameter
  state has a ``step`` entry that megatron-core 0.16's checkpoint load skips on the source side but still
  expects on the destination side (a ``KeyError: 'step'`` on every resume); the step is restored from the
  checkpoint's param groups by megatron already, but as ONE tensor shared by all parameters, which torch's Adam
  would increment once per parameter (the bias correction then drifts after a resume): each parameter gets its
  own copy;
- ``fix_moe_router_gemm()``: megatron-core's MoE router tests ``te_general_gemm is not None``, a name its module
  binds only when TE imports (a ``NameError`` without TE): it is bound to None, megatron-core's torch path.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

from megatron_vlm.runtime import mcore_patches, optimizer_kernels

#: the entries :func:`enable` applies after :func:`fix_without_te`'s, in order (the registry holds what each replaces)
LAYER = ("cpu-cuda-stand-ins", "cpu-megatron-rng-state", "cpu-optimizer-kernels", optimizer_kernels.NAME,
         "cpu-compiled-eager", "packed-local-attention", "cpu-moe-dispatcher", "moe-router-torch-gemm",
         "cpu-step-factories", "cpu-step-mode-sites", "cpu-device-mode", "cpu-backward-under-mode")
#: the entries of :func:`fix_without_te`
WITHOUT_TE = ("clip-norm-without-te", "torch-adam-state-load", "moe-router-torch-gemm")
#: megatron-core modules whose autograd Functions allocate on the CUDA device in their backward (activation
#: recomputation, the sequence-parallel gathers and reduce-scatters of linears and mappings, MoE's autograd helpers)
BACKWARD_MODULES = mcore_patches.BACKWARD_MODULES


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an integer device index means a CUDA device in torch
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device argument to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts e.g. grad.type() == 'torch.cuda.FloatTensor': report CPU tensors as CUDA ones
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # staging for a host-to-CUDA copy (context parallelism's RoPE indices)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


#: torch's factory functions that take a ``device`` (and ``pin_memory``): :func:`_cpu_torch`'s
FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint", "randperm",
             "eye", "linspace", "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided")
#: megatron-core modules whose factory calls make tensors on the CUDA device in a training step, and the step's
#: functions that move tensors to it or check its tensor types (the registry holds both lists)
STEP_MODULES, STEP_MODE_FUNCTIONS = mcore_patches.STEP_MODULES, mcore_patches.STEP_MODE_FUNCTIONS


def _cpu_factory(factory):
    def make(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    make.__name__ = make.__qualname__ = factory.__name__
    make.__doc__ = factory.__doc__
    return make


def _cpu_torch():
    """A module that is torch for its reader, except that :data:`FACTORIES` make CPU tensors where they are asked
    for CUDA ones (and unpinned where pinned): the ``torch`` of :data:`STEP_MODULES` on CPU."""
    import types

    ns = types.ModuleType("torch", torch.__doc__)
    ns.__dict__.update(vars(torch))
    ns.__dict__.pop("__getattr__", None)
    ns.__getattr__ = lambda name: getattr(torch, name)  # torch's lazily imported submodules (PEP 562)
    for name in FACTORIES:
        setattr(ns, name, _cpu_factory(getattr(torch, name)))
    return ns


#: whether this thread runs a training step without the device mode (:func:`step_scope`)
_STEP = threading.local()


def in_step() -> bool:
    return getattr(_STEP, "active", False)


@contextlib.contextmanager
def step_scope():
    """The training step without the per-op device mode (a no-op unless the layer is on and its mode is the innermost
    torch function mode). Every torch call of megatron-core otherwise goes through the mode's Python
    ``__torch_function__`` (~4 us each, ~30k per step of the kit's depth, with ``torch.nn.functional`` taking torch's
    Python override path): the step's own CUDA devices are rewritten at their sources instead, by
    ``cpu-step-factories`` (:data:`STEP_MODULES`' factory calls) and ``cpu-step-mode-sites``
    (:data:`STEP_MODE_FUNCTIONS` run under the mode). A CUDA device left anywhere else in a step fails loudly (torch
    has no CUDA) and names its call site: add it there."""
    mode = mcore_patches.values("cpu-device-mode")[mcore_patches.MODE_STACK] if is_enabled() else None
    depth = torch._C._len_torch_function_stack()
    if mode is None or in_step() or not depth or torch._C._get_function_stack_at(depth - 1) is not mode:
        yield
        return
    torch._C._pop_torch_function_stack()
    _STEP.active = True
    try:
        yield
    finally:
        _STEP.active = False
        torch._C._push_on_torch_function_stack(mode)


@mcore_patches.implements("cpu-step-factories")
def _step_factories(originals: dict) -> dict:
    cpu_torch = _cpu_torch()
    return {target: cpu_torch for target in originals}


@mcore_patches.implements("cpu-step-mode-sites")
def _step_mode_sites(originals: dict) -> dict:
    values = {}
    for target, original in originals.items():
        static = isinstance(original, staticmethod)  # an autograd Function's forward
        original = original.__func__ if static else original

        def under_mode(*args, _original=original, **kwargs):
            if not in_step():
                return _original(*args, **kwargs)
            with _CudaToCpuMode():
                return _original(*args, **kwargs)

        wrapped = functools.wraps(original)(under_mode)
        values[target] = staticmethod(wrapped) if static else wrapped
    return values


def cuda_available() -> bool:
    return torch.cuda.is_available()


def enable() -> bool:
    """Install the CPU compatibility layer for the process (idempotent). Returns True if it is active."""
    if cuda_available():
        raise RuntimeError("the CPU compatibility layer must not be used on a machine with CUDA")
    fix_without_te()
    for name in LAYER:
        mcore_patches.apply(name)
    return True


def disable() -> None:
    """Undo the layer and :func:`fix_without_te` (every original back, as the registry recorded it)."""
    for name in reversed(WITHOUT_TE + LAYER):
        mcore_patches.undo(name)


def is_enabled() -> bool:
    return mcore_patches.is_active("cpu-device-mode")


@mcore_patches.implements("cpu-cuda-stand-ins")
def _cuda_stand_ins(originals: dict) -> dict:
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (a no-op without CUDA): that one is left alone.
    return {"torch.cuda:current_device": lambda: 0,
            "torch.cuda:synchronize": lambda *a, **k: None,
            "torch.cuda:current_stream": lambda device=None: CPU_STREAM,
            "torch.cuda:get_rng_state": lambda device="cuda": torch.get_rng_state(),
            "torch.cuda:set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
            "torch.cuda:manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed))}


@mcore_patches.implements("cpu-megatron-rng-state")
def _megatron_rng_state(originals: dict) -> dict:
    module = "megatron.core.tensor_parallel.random"
    return {f"{module}:_get_cuda_rng_state": lambda device="cuda", clone=False, graph_safe=False: (
                torch.get_rng_state().clone() if clone else torch.get_rng_state()),
            f"{module}:_set_cuda_rng_state": lambda new_state, device=-1, graph_safe=False:
                torch.set_rng_state(new_state)}


@mcore_patches.implements("cpu-device-mode")
def _device_mode(originals: dict) -> dict:
    return {mcore_patches.MODE_STACK: _CudaToCpuMode()}


@mcore_patches.implements("cpu-backward-under-mode")
def _backward_under_mode(originals: dict) -> dict:
    """The autograd engine runs a Function's backward outside the thread-local torch function mode: the backward of
    megatron-core's own autograd Functions (:data:`BACKWARD_MODULES`) runs under the CPU mode too, so the devices
    they name there (activation recomputation re-running the forward, the buffers of sequence-parallel
    reduce-scatters) are rewritten as in the forward."""
    values = {}
    for target, original in originals.items():
        original = original.__func__ if isinstance(original, staticmethod) else original

        def backward(ctx, *args, _original=original):
            if in_step():  # the step's devices are rewritten at their sources (step_scope)
                return _original(ctx, *args)
            with _CudaToCpuMode():
                return _original(ctx, *args)

        values[target] = staticmethod(backward)
    return values


def segments(cu_seqlens, total: int) -> list[tuple[int, int]]:
    """(start, end) of each packed sample in a 'thd' row of ``total`` positions: the attention windows of
    :func:`packed_local_attention` (the tests swap this for one window to show a mask across samples fails)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu} do not split the packed row of {total} positions")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def packed_local_attention() -> None:
    """Teach megatron-core's local ``DotProductAttention`` the 'thd' format of packed sequences (idempotent; for the
    process: registry entry ``packed-local-attention``).

    megatron-core's attention squeezes a packed row to ``[t, heads, dim]`` and applies RoPE per ``cu_seqlens``
    segment before its core attention, which for local layers refuses ``packed_seq_params``. The patched forward
    runs megatron's own local attention (its scaling, causal mask, softmax and dropout) on each segment as a
    separate sequence ``[n, 1, heads, dim]`` and concatenates the outputs ``[t, 1, hidden]``: per-sample causal
    attention, the same numbers as each sample in its own row. Calls without 'thd' parameters are unchanged.
    Pure torch: it serves local layers on CPU and on CUDA."""
    mcore_patches.apply("packed-local-attention")


@mcore_patches.implements("packed-local-attention")
def _packed_local_attention(originals: dict) -> dict:
    target = "megatron.core.transformer.dot_product_attention:DotProductAttention.forward"
    original = originals[target]

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_q.cpu(), cu_kv.cpu()):
            raise ValueError("packed local attention needs the same cu_seqlens for queries and keys")
        if attention_mask is not None:
            raise ValueError("packed local attention takes no attention mask: the segments are the mask")
        outs = [original(self, query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1), None,
                         attn_mask_type=attn_mask_type, attention_bias=attention_bias, **kwargs)
                for a, b in segments(cu_q, query.shape[0])]
        return torch.cat(outs, dim=0)  # [t, 1, hidden]

    return {target: forward}


@mcore_patches.implements("cpu-compiled-eager")
def _compiled_eagerly(originals: dict) -> dict:
    """Every ``torch.compile``'d function of this process runs as plain eager code (torch's ``force_eager``
    compiler stance, the object ``torch.compiler.set_stance`` would store): the same operations, without Dynamo
    tracing or Inductor kernels."""
    from torch._dynamo.eval_frame import DynamoStance

    return {"torch._dynamo.eval_frame:_stance": DynamoStance("force_eager")}


@contextlib.contextmanager
def inference_scope():
    """megatron-core's text-generation controller and its pipeline broadcasts on CPU for the time of the block (entry
    ``cpu-inference``); a no-op where the layer is off (a GPU process)."""
    if not is_enabled():
        yield
        return
    with mcore_patches.applied("cpu-inference"):
        yield


@mcore_patches.implements("cpu-inference")
def _inference(originals: dict) -> dict:
    """The controller's ``torch``: torch, with ``Generator(device=...)`` a CPU generator and ``cuda.Event`` a CPU
    timing event; the broadcasts' ``_is_cuda`` checks only that a tensor is there."""
    import types

    cuda = types.ModuleType("torch.cuda", torch.cuda.__doc__)
    cuda.__getattr__ = lambda name: getattr(torch.cuda, name)  # the stand-ins of cpu-cuda-stand-ins included
    cuda.Event = _CpuEvent
    ns = types.ModuleType("torch", torch.__doc__)
    ns.__dict__.update(vars(torch))
    ns.__dict__.pop("__getattr__", None)
    ns.__getattr__ = lambda name: getattr(torch, name)
    ns.Generator = lambda device=None: torch.Generator()
    ns.cuda = cuda

    def is_there(tensor) -> None:
        assert tensor is not None

    return {"megatron.core.inference.communication_utils:_is_cuda": is_there,
            "megatron.core.inference.text_generation_controllers.text_generation_controller:torch": ns}


@contextlib.contextmanager
def te_construction():
    """Let Transformer Engine modules be constructed on this CUDA-less machine for the time of the block (see the
    module docstring for what it does and its limits; registry entry ``cpu-te-construction``)."""
    if cuda_available():
        raise RuntimeError("the CPU shim for Transformer Engine must not be used on a machine with CUDA")
    with mcore_patches.applied("cpu-te-construction"):
        yield


@mcore_patches.implements("cpu-te-construction")
def _te_construction(originals: dict) -> dict:
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    real = originals["torch.cuda:is_available"]
    te_init = TransformerEngineBaseModule.__init__.__code__

    def is_available() -> bool:
        """True only for the check in ``TransformerEngineBaseModule.__init__``; the real answer elsewhere."""
        return sys._getframe(1).f_code is te_init or real()

    return {"torch.cuda:is_available": is_available}


def use_torch_optimizer_kernels() -> None:
    """Point megatron-core's optimizer modules at the implementations its own import picks when neither
    Transformer Engine nor Apex imports (see the module docstring; registry entry ``cpu-optimizer-kernels``)."""
    mcore_patches.apply("cpu-optimizer-kernels")


@mcore_patches.implements("cpu-optimizer-kernels")
def _optimizer_kernels(originals: dict) -> dict:
    from megatron.core.utils import local_multi_tensor_applier

    opt, dist, clip = ("megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer",
                       "megatron.core.optimizer.clip_grads")
    return {f"{opt}:Adam": torch.optim.AdamW, f"{opt}:SGD": torch.optim.SGD, f"{opt}:USING_PYTORCH_OPTIMIZER": True,
            f"{opt}.optimizer:multi_tensor_applier": local_multi_tensor_applier,
            f"{clip}:multi_tensor_applier": local_multi_tensor_applier,
            f"{clip}:multi_tensor_scale_tensor_impl": None,  # megatron-core 0.19 (TE's fused clip); unused by 0.16
            f"{dist}:Adam": torch.optim.Adam, f"{dist}:HAVE_APEX_OR_TE": False, f"{dist}:USING_TE_OPTIMIZER": False,
            f"{dist}:USING_APEX_OPTIMIZER": False}


class _CpuEvent:
    """An event recorded on the CPU "stream": CPU work is complete when it is issued, so there is nothing to wait
    for; :meth:`record` notes the host clock, which :meth:`elapsed_time` reads (milliseconds, as torch.cuda.Event's)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._at = None

    def record(self, stream=None) -> None:
        self._at = time.perf_counter()

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._at - self._at) * 1e3

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream(torch.cpu.Stream):
    """torch's CPU stream (no-op waits), whose ``record_event`` gives an event to synchronize on (torch's returns
    None; megatron-core's all-to-all dispatcher synchronizes on the event of its device-to-host copies)."""

    def record_event(self, event=None) -> _CpuEvent:
        return _CpuEvent()


#: the one "CUDA stream" of a CPU process: torch.cuda.current_stream() and the dispatcher's side stream
CPU_STREAM = _CpuStream()


def moe_on_cpu() -> None:
    """megatron-core's MoE layers on CPU (idempotent; see the module docstring)."""
    for name in ("cpu-moe-dispatcher", "moe-router-torch-gemm"):
        mcore_patches.apply(name)


@mcore_patches.implements("cpu-moe-dispatcher")
def _moe_dispatcher(originals: dict) -> dict:
    utils, dispatcher = "megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.token_dispatcher"
    original = originals[f"{utils}:maybe_move_tensor_to_cpu"]

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        """megatron-core's helper moves only CUDA tensors (and makes them numpy arrays, the all-to-all's split
        sizes): a CPU tensor gets the same conversion."""
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return {f"{dispatcher}:MoEAlltoAllTokenDispatcher.cuda_dtoh_stream": CPU_STREAM,
            f"{utils}:maybe_move_tensor_to_cpu": to_host, f"{dispatcher}:maybe_move_tensor_to_cpu": to_host}


def fix_without_te() -> None:
    """The fixes a process without Transformer Engine and Apex needs (each idempotent, for the process)."""
    fix_norm_fallback()
    fix_torch_adam_state_load()
    fix_moe_router_gemm()
    optimizer_kernels.use_foreach_kernels()  # megatron-core's norm, clip and copy fallbacks: torch's foreach kernels


def fix_moe_router_gemm() -> None:
    """See the module docstring: bind megatron-core's ``te_general_gemm`` to None where TE did not import."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        mcore_patches.apply("moe-router-torch-gemm")


@mcore_patches.implements("moe-router-torch-gemm")
def _router_torch_gemm(originals: dict) -> dict:
    return {"megatron.core.transformer.moe.moe_utils:te_general_gemm": None}


def fix_torch_adam_state_load() -> None:
    """See the module docstring (idempotent; a no-op for optimizers whose state has no ``step``)."""
    mcore_patches.apply("torch-adam-state-load")


@mcore_patches.implements("torch-adam-state-load")
def _torch_adam_state_load(originals: dict) -> dict:
    target = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states"
    original = originals[target]

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if state.get("step") is not None:
                # megatron gives every parameter the same step tensor, which torch's Adam then increments once
                # per parameter in place: each parameter needs its own
                state["step"] = state["step"].clone()
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    return {target: set_states}


def fix_norm_fallback() -> None:
    """Make CLIPViTModel's default ln_pre/ln_post build without Transformer Engine (no-op with TE)."""
    from megatron.core.models.vision import clip_vit_model

    if torch.nn.LayerNorm in (clip_vit_model.CLIPViTModel.__init__.__defaults__ or ()):
        mcore_patches.apply("clip-norm-without-te")


@mcore_patches.implements("clip-norm-without-te")
def _clip_norm(originals: dict) -> dict:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    target = "megatron.core.models.vision.clip_vit_model:CLIPViTModel.__init__.__defaults__"
    defaults = originals[target] or ()
    return {target: tuple(WrappedTorchNorm if d is torch.nn.LayerNorm else d for d in defaults)}
