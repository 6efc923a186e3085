"""The CPU compatibility layer maps CUDA devices to CPU and backs megatron's RNG tracker with the CPU RNG."""

import pytest
import torch

from megatron_vlm.runtime import cpu_compat
from tests.conftest import not_here


@pytest.fixture(scope="module", autouse=True)
def compat():
    if torch.cuda.is_available():
        not_here("the compatibility layer is for machines without CUDA")
    cpu_compat.enable()


def test_cuda_devices_become_cpu():
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    # pinned staging memory for a host-to-CUDA copy (megatron-core's RoPE under context parallelism): plain memory
    assert torch.tensor([1, 2], device="cpu", pin_memory=True).cuda(non_blocking=True).tolist() == [1, 2]
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    t = torch.arange(4)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert torch.arange(3).to(device="cuda:0").device.type == "cpu"


def test_rng_tracker_forks_the_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("model-parallel-rng", 1234)
    before = torch.get_rng_state().clone()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored
    torch.manual_seed(1234)
    assert torch.equal(a, torch.rand(4))  # the fork drew from the tracked seed
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # and the tracked state advanced


def test_refuses_on_a_cuda_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be used"):
        cpu_compat.enable()


def test_clip_norm_fallback_builds_without_te():
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_vlm.model.layer_impl import te_status

    defaults = clip_vit_model.CLIPViTModel.__init__.__defaults__
    assert torch.nn.LayerNorm not in defaults
    if te_status()[0]:  # with TE (the 3.12 lane) megatron's default is TE's norm: model.py gives local layers torch's
        from megatron.core.extensions.transformer_engine import TENorm

        assert TENorm in defaults
    else:
        assert WrappedTorchNorm in defaults


def test_megatron_compiled_functions_run_eagerly():
    """megatron-core's jit_fuser functions (torch.compile'd at import) are not traced or compiled on CPU: no
    Dynamo frame is compiled, and quick_gelu gives the eager formula's bits."""
    from megatron.core.activations import quick_gelu
    from torch._dynamo.utils import counters

    x = torch.randn(4, 8)
    before = counters["frames"]["total"]
    assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
    assert counters["frames"]["total"] == before

    # the counter sees a compile where the stance allows one (the negative control, on Dynamo's eager backend)
    with torch.compiler.set_stance("default"):
        torch.compile(lambda t: t * 2, backend="eager")(x)
    assert counters["frames"]["total"] > before


def test_moe_router_and_dispatcher_run_on_cpu():
    """megatron-core's MoE on CPU: the router's gating GEMM is torch's (megatron-core binds Transformer Engine's
    general_gemm whenever TE imports, as in the 3.12 lane, and leaves the name unbound without TE), and the
    all-to-all dispatcher's device-to-host stream, which its constructor makes with torch.cuda.Stream(), is the
    CPU's current stream, whose recorded event can be waited on; the router's gating function then gives the plain matmul and its gradients."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert moe_utils.te_general_gemm is None
    stream = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    assert stream is torch.cuda.current_stream() and stream is cpu_compat.CPU_STREAM
    stream.record_event().synchronize()  # the dispatcher waits for its split sizes so
    with torch.cuda.stream(stream):
        assert torch.ones(2, device="cuda").sum() == 2
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert torch.allclose(out, x @ w.t())
    out.sum().backward()
    assert torch.allclose(x.grad, torch.ones(5, 4) @ w) and torch.allclose(w.grad, torch.ones(5, 4).t() @ x)


def test_megatron_autograd_backwards_run_under_the_cpu_mode():
    """The autograd engine runs a Function's backward outside the thread-local mode: the sequence-parallel
    reduce-scatter of megatron's linear allocates its buffer on torch.cuda.current_device() there. Every
    megatron-core autograd Function of the listed modules has its backward wrapped (the sequence-parallel runs of
    tests/test_moe.py exercise them), and a wrapped backward computes what it computed."""
    import importlib

    from megatron_vlm.runtime import mcore_patches

    wrapped, held = [], mcore_patches.held()
    for name in cpu_compat.BACKWARD_MODULES:
        for key, fn in vars(importlib.import_module(name)).items():
            if isinstance(fn, type) and issubclass(fn, torch.autograd.Function) and fn.__module__ == name \
                    and "backward" in fn.__dict__:
                assert held.get(f"{name}:{key}.backward") == "cpu-backward-under-mode", fn
                assert fn.__dict__["backward"] is not mcore_patches.originals("cpu-backward-under-mode")[
                    f"{name}:{key}.backward"], fn
                wrapped.append(fn.__name__)
    assert {"CheckpointFunction", "LinearWithGradAccumulationAndAsyncCommunication",
            "_GatherFromSequenceParallelRegion", "MoEAuxLossAutoScaler"} <= set(wrapped)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    x = torch.ones(3, requires_grad=True)
    aux = torch.tensor(2.0, requires_grad=True)
    MoEAuxLossAutoScaler.apply(x, aux).sum().backward()  # a wrapped backward still computes what it computed
    assert aux.grad is not None and x.grad.tolist() == [1.0, 1.0, 1.0]


def test_optimizer_names_are_megatron_cores_own_fallbacks():
    """megatron-core's optimizer modules hold what their own import binds without Transformer Engine and Apex
    (torch's Adam, megatron.core.utils' local multi-tensor applier; the norm and scale on torch's foreach kernels,
    runtime/optimizer_kernels.py): with TE installed (the 3.12 lane) they bound
    TE's CUDA kernels, which fail on CPU tensors (tests/test_train_parallel.py trains with them in both lanes)."""
    from megatron.core import optimizer
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as base
    from megatron.core.utils import local_multi_tensor_applier

    from megatron_vlm.runtime import optimizer_kernels

    assert optimizer.Adam is torch.optim.AdamW and optimizer.USING_PYTORCH_OPTIMIZER is True
    assert distrib_optimizer.Adam is torch.optim.Adam and distrib_optimizer.HAVE_APEX_OR_TE is False
    assert base.multi_tensor_applier is local_multi_tensor_applier is clip_grads.multi_tensor_applier
    # the norm, clip and copies: torch's foreach kernels in place of megatron's local fallbacks
    assert clip_grads.l2_norm_impl is optimizer_kernels.l2_norm
    assert base.multi_tensor_scale_impl is optimizer_kernels.scale is clip_grads.multi_tensor_scale_impl


def test_the_layer_undoes_to_megatron_cores_and_torchs_own_objects():
    """The layer is process-wide on a CPU process, and undoable: disable() gives every attribute it replaced the
    identical object it had (the mode stack popped, attributes that did not exist deleted), enable() installs it
    again (each entry alone: tests/test_mcore_patches.py)."""
    from megatron_vlm.runtime import mcore_patches

    names = [n for n in cpu_compat.WITHOUT_TE + cpu_compat.LAYER if mcore_patches.is_active(n)]
    assert set(cpu_compat.LAYER) <= set(names)
    originals = {t: v for n in dict.fromkeys(names) for t, v in mcore_patches.originals(n).items()}
    cpu_compat.disable()
    try:
        assert not cpu_compat.is_enabled() and not set(names) & set(mcore_patches.active())
        assert all(mcore_patches._same(mcore_patches.read(t), v) for t, v in originals.items())
    finally:
        cpu_compat.enable()
    assert cpu_compat.is_enabled() and torch.zeros(2, device="cuda").device.type == "cpu"


def test_a_step_runs_without_the_device_mode():
    """A training step (``cpu_compat.step_scope``, around ``training/step.train_step``) runs without the per-op device
    mode: torch calls are torch's own there (a CUDA device fails, as torch has no CUDA), and the megatron-core code of
    a step that names the CUDA device makes CPU tensors all the same: the factory calls of its modules (the causal
    mask, the global memory buffer, the schedule's token count) and the functions that move tensors or check their
    CUDA type (the gradient clip, rotary embeddings). The clip gives torch's own clip_grad_norm_'s gradients. With
    either entry undone the same calls fail (the negative controls)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

    from megatron_vlm.runtime import mcore_patches

    def device_mode_on() -> bool:
        return any(isinstance(torch._C._get_function_stack_at(i), cpu_compat._CudaToCpuMode)
                   for i in range(torch._C._len_torch_function_stack()))

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    grads = [torch.randn_like(p) * 3 for p in params]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, g in zip(reference, grads):
        r.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(reference, 1.0))
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)

    def step_calls():
        for p, g in zip(params, grads):
            p.grad = g.clone()
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
        return (get_default_causal_mask(4), GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe"),
                rope(6), clip_grads.torch.zeros([], dtype=torch.int, device="cuda"))

    assert device_mode_on()
    with cpu_compat.step_scope():
        assert not device_mode_on() and cpu_compat.in_step()
        with pytest.raises((AssertionError, RuntimeError)):  # torch's own: no CUDA in this build / on this machine
            torch.zeros(1, device="cuda")
        made = step_calls()
        assert all(t.device.type == "cpu" for t in made)
        assert torch.equal(made[0], torch.triu(torch.ones(4, 4), diagonal=1).bool())
        for p, r in zip(params, reference):
            assert torch.allclose(p.grad, r.grad, rtol=1e-6, atol=0)
        for name in ("cpu-step-factories", "cpu-step-mode-sites"):  # each piece is needed
            mcore_patches.undo(name)
            try:
                with pytest.raises((AssertionError, RuntimeError)):
                    step_calls()
            finally:
                mcore_patches.apply(name)
    assert device_mode_on() and not cpu_compat.in_step()
    assert torch.zeros(1, device="cuda").device.type == "cpu"
