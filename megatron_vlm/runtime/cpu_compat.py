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
- CPU stand-ins for ``torch.cuda.current_device / synchronize / current_stream / get_rng_state /
  set_rng_state / manual_seed`` (``current_stream`` is torch's no-op CPU stream whose recorded events can be
  waited on, :data:`CPU_STREAM`: megatron-core 0.19's DDP grad sync waits on the current stream's events) (the "CUDA" RNG state *is* the CPU default generator's state, so megatron's RNG tracker
  forks/restores the generator that CPU ops really use) and for megatron's own ``_get/_set_cuda_rng_state``;
- megatron-core's optimizer code on megatron's own fallbacks, as when neither Transformer Engine nor Apex imports
  (:func:`use_torch_optimizer_kernels`): with Transformer Engine installed (the 3.12 lane), megatron binds TE's
  CUDA kernels at import -- ``FusedAdam`` and the ``multi_tensor_*`` ops behind grad norms, clipping and
  main-parameter copies -- which fail on CPU tensors; torch's Adam and ``megatron.core.utils``'s
  ``local_multi_tensor_*`` run instead;
- megatron-core's ``torch.compile``'d elementwise functions (its ``jit_fuser``: ``quick_gelu``, the bias-GELU/
  SwiGLU/GeGLU fusions) run eagerly (:func:`run_compiled_functions_eagerly`): on CPU each process would
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

It is switched on only when CUDA is absent (``enable`` refuses on a GPU machine).

``allow_te_construction()`` (called by :func:`megatron_vlm.model.build.build_model` for Transformer Engine layers while
this layer is on) lets Transformer Engine's modules be *constructed* on CPU, so that the GPU path's model building,
checkpoint loading and saving and training set-up run in tests: ``TransformerEngineBaseModule.__init__`` refuses to
run unless ``torch.cuda.is_available()``; that one check, made from that one function, is answered True, and every
other caller still gets the real answer (False). Its limits: TE's kernels (the forward and backward of its
linears, norms and attention, FP8 casts) still need a GPU and fail on CPU; nothing else in TE, megatron-core or
torch is changed for it; it refuses to run on a machine with CUDA, where TE needs no help.

Separately, three fixes are needed whenever Transformer Engine (and Apex) are missing, on CPU or GPU, and
``fix_without_te()`` applies them:

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

import sys

import torch
from torch.overrides import TorchFunctionMode

_MODE: "_CudaToCpuMode | None" = None


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


def cuda_available() -> bool:
    return torch.cuda.is_available()


def enable() -> bool:
    """Install the CPU compatibility layer (idempotent). Returns True if it is active."""
    global _MODE
    if cuda_available():
        raise RuntimeError("the CPU compatibility layer must not be used on a machine with CUDA")
    fix_without_te()
    if _MODE is not None:
        return True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda device=None: CPU_STREAM
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (a no-op without CUDA): leave that alone.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    use_torch_optimizer_kernels()
    run_compiled_functions_eagerly()
    packed_local_attention()
    moe_on_cpu()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _backward_under_mode()
    return True


#: megatron-core modules whose autograd Functions allocate on the CUDA device in their backward (activation
#: recomputation, the sequence-parallel gathers and reduce-scatters of linears and mappings, MoE's autograd helpers)
BACKWARD_MODULES = ("megatron.core.tensor_parallel.random", "megatron.core.tensor_parallel.layers",
                    "megatron.core.tensor_parallel.mappings", "megatron.core.transformer.moe.moe_utils",
                    "megatron.core.transformer.moe.token_dispatcher")


def _backward_under_mode() -> None:
    """The autograd engine runs a Function's backward outside the thread-local torch function mode: run the
    backward of megatron-core's own autograd Functions (:data:`BACKWARD_MODULES`) under the CPU mode too, so the
    devices they name there (activation recomputation re-running the forward, the buffers of sequence-parallel
    reduce-scatters) are rewritten as in the forward."""
    import importlib

    for name in BACKWARD_MODULES:
        module = importlib.import_module(name)
        for fn in vars(module).values():
            if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function) and fn.__module__ == name):
                continue
            original = fn.__dict__.get("backward")
            if original is None or getattr(original, "_cpu_compat", False):
                continue
            original = original.__func__ if isinstance(original, staticmethod) else original

            def backward(ctx, *args, _original=original):
                with _CudaToCpuMode():
                    return _original(ctx, *args)

            backward._cpu_compat = True
            fn.backward = staticmethod(backward)


def segments(cu_seqlens, total: int) -> list[tuple[int, int]]:
    """(start, end) of each packed sample in a 'thd' row of ``total`` positions: the attention windows of
    :func:`packed_local_attention` (the tests swap this for one window to show a mask across samples fails)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu} do not split the packed row of {total} positions")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def packed_local_attention() -> None:
    """Teach megatron-core's local ``DotProductAttention`` the 'thd' format of packed sequences (idempotent).

    megatron-core's attention squeezes a packed row to ``[t, heads, dim]`` and applies RoPE per ``cu_seqlens``
    segment before its core attention, which for local layers refuses ``packed_seq_params``. The patched forward
    runs megatron's own local attention (its scaling, causal mask, softmax and dropout) on each segment as a
    separate sequence ``[n, 1, heads, dim]`` and concatenates the outputs ``[t, 1, hidden]``: per-sample causal
    attention, the same numbers as each sample in its own row. Calls without 'thd' parameters are unchanged.
    Pure torch: it serves local layers on CPU and on CUDA."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.forward
    if getattr(original, "_packed_thd", False):
        return

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

    forward._packed_thd = True
    DotProductAttention.forward = forward


def run_compiled_functions_eagerly() -> None:
    """Every ``torch.compile``'d function of this process runs as plain eager code (torch's
    ``force_eager`` compiler stance): the same operations, without Dynamo tracing or Inductor kernels."""
    torch.compiler.set_stance("force_eager")


def is_enabled() -> bool:
    return _MODE is not None


def allow_te_construction() -> None:
    """Let Transformer Engine modules be constructed on this CUDA-less machine (idempotent; see the module
    docstring for what it does and its limits)."""
    if cuda_available():
        raise RuntimeError("the CPU shim for Transformer Engine must not be used on a machine with CUDA")
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    if getattr(torch.cuda.is_available, "_te_construction", False):
        return
    real = torch.cuda.is_available
    te_init = TransformerEngineBaseModule.__init__.__code__

    def is_available() -> bool:
        """True only for the check in ``TransformerEngineBaseModule.__init__``; the real answer elsewhere."""
        return sys._getframe(1).f_code is te_init or real()

    is_available._te_construction = True
    torch.cuda.is_available = is_available


def use_torch_optimizer_kernels() -> None:
    """Point megatron-core's optimizer modules at the implementations its own import picks when neither
    Transformer Engine nor Apex imports (see the module docstring); idempotent, and a no-op without TE/Apex."""
    from megatron.core import optimizer as package
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as base
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm, local_multi_tensor_scale

    package.Adam, package.SGD, package.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, torch.optim.SGD, True
    base.multi_tensor_applier, base.multi_tensor_scale_impl = local_multi_tensor_applier, local_multi_tensor_scale
    clip_grads.multi_tensor_applier = local_multi_tensor_applier
    clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = local_multi_tensor_scale
    clip_grads.multi_tensor_scale_tensor_impl = None  # megatron-core 0.19 (TE's fused clip); unused by 0.16
    distrib_optimizer.Adam = torch.optim.Adam
    distrib_optimizer.HAVE_APEX_OR_TE = False
    distrib_optimizer.USING_TE_OPTIMIZER = distrib_optimizer.USING_APEX_OPTIMIZER = False


class _CpuEvent:
    """An event recorded on the CPU "stream": CPU work is complete when it is issued, so there is nothing to wait
    for."""

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
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron.core.transformer.moe import token_dispatcher

    moe_utils.te_general_gemm = None
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = CPU_STREAM
    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_cpu_compat", False):
        return

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        """megatron-core's helper moves only CUDA tensors (and makes them numpy arrays, the all-to-all's split
        sizes): a CPU tensor gets the same conversion."""
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._cpu_compat = True
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = to_host


def fix_without_te() -> None:
    fix_norm_fallback()
    fix_torch_adam_state_load()
    fix_moe_router_gemm()


def fix_moe_router_gemm() -> None:
    """See the module docstring: bind megatron-core's ``te_general_gemm`` to None where TE did not import."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def fix_torch_adam_state_load() -> None:
    """See the module docstring (idempotent; a no-op for optimizers whose state has no ``step``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_keeps_step", False):
        return

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

    set_states._keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def fix_norm_fallback() -> None:
    """Make CLIPViTModel's default ln_pre/ln_post build without Transformer Engine (no-op with TE)."""
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    init = clip_vit_model.CLIPViTModel.__init__
    defaults = init.__defaults__ or ()
    if torch.nn.LayerNorm in defaults:
        init.__defaults__ = tuple(WrappedTorchNorm if d is torch.nn.LayerNorm else d for d in defaults)
