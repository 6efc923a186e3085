"""The model-FLOPs count behind TFLOP/s and MFU, against torch's own FLOP counter on the HF model."""

import pytest
import torch

from megatron_vlm.model.spec import VLMSpec
from megatron_vlm.training.flops import PartFlops, StepFlops, peak_flops

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="the FLOPs formula against torch's FLOP counter on HF's own model: torch and transformers, pinned "
           "alike in both lanes")


@pytest.mark.parametrize("train_vit,train_lm", [(False, False), (False, True), (True, True)],
                         ids=["stage1", "stage2", "all"])
def test_step_flops_match_torch_flop_counter(hf_models, train_vit, train_lm):
    """Forward + backward of HF LLaVA (eager attention, so every matmul is visible to FlopCounterMode) with the
    stage's parts trainable counts what StepFlops predicts. The CLIP model here uses vision_feature_layer=-1, so
    HF runs exactly the ViT layers Megatron builds."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlavaForConditionalGeneration

    hf_dir = hf_models["mistral_clip_full"]
    spec = VLMSpec.from_hf_dir(hf_dir)
    model = LlavaForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                          attn_implementation="eager")
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    model.model.language_model.requires_grad_(train_lm)
    model.lm_head.requires_grad_(train_lm)
    model.model.vision_tower.requires_grad_(train_vit)

    k, text = spec.num_image_tokens, 9
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, k + text), generator=g)
    for row, start in ((0, 1), (1, 5)):  # the image at different positions
        ids[row, start:start + k] = spec.image_token_id
    pixels = torch.randn(2, 3, spec.image_size, spec.image_size, generator=g)
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=ids, pixel_values=pixels).logits
        logits.float().pow(2).mean().backward()
    measured = counter.get_total_flops()
    predicted = StepFlops(spec, train_vit, True, train_lm)(samples=2, tokens=2 * (k + text), images=2)
    assert predicted == measured  # exactly (e.g. 24 832 768 FLOPs in stage 1, 34 510 592 in stage 2)


def test_backward_rules():
    part = PartFlops(weights=10.0, attention=4.0, entry=2.0)
    assert part.step(trained=False, grads_pass=False) == 14  # frozen, nothing before it trains: forward only
    assert part.step(trained=False, grads_pass=True) == 14 + 10 + 8  # activation gradients only
    assert part.step(trained=True, grads_pass=True) == 14 + 10 + 8 + 10  # plus weight gradients
    assert part.step(trained=True, grads_pass=False) == 14 + 8 + 8 + 10  # no gradient for the part's own input


def test_no_peak_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_attention_counts_each_sample_over_its_own_length(hf_models):
    """Two samples of different lengths (each its own forward and backward, no padding): torch's FLOP counter
    equals StepFlops given the sum of their squared lengths; the batch mean length (the count without it)
    under-counts their attention."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlavaForConditionalGeneration

    hf_dir = hf_models["mistral_clip_full"]
    spec = VLMSpec.from_hf_dir(hf_dir)
    model = LlavaForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                          attn_implementation="eager")
    k = spec.num_image_tokens
    g = torch.Generator().manual_seed(0)
    lengths = [k + 3, k + 40]
    with FlopCounterMode(display=False) as counter:
        for n in lengths:
            ids = torch.randint(3, 200, (1, n), generator=g)
            ids[0, 1:1 + k] = spec.image_token_id
            pixels = torch.randn(1, 3, spec.image_size, spec.image_size, generator=g)
            model(input_ids=ids, pixel_values=pixels).logits.float().pow(2).mean().backward()
    flops = StepFlops(spec, True, True, True)
    exact = flops(samples=2, tokens=sum(lengths), images=2, squares=sum(n * n for n in lengths))
    assert exact == counter.get_total_flops()
    assert flops(samples=2, tokens=sum(lengths), images=2) < exact
