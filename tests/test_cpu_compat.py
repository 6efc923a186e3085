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

    from megatron_vlm.layer_impl import te_status

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
