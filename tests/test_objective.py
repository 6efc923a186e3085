"""HF's loss objective (:mod:`megatron_vlm.training.objective`) on megatron-core's own loss paths, in this process.

- which local columns of each tensor-parallel rank are padding, including ranks that hold only padding;
- the masked loss of a real LLaVAModel's language model (megatron-core's vocab-parallel cross entropy, and its
  fused 'native' version, both on CPU) equals ``torch`` cross entropy over the true vocabulary to 1e-6, and
  Megatron-LM's objective (padded rows in the softmax) does not;
- logits of another width than padded/TP are refused (the mask would hit the wrong columns), and so is a
  cross-entropy implementation that computes the loss outside ``compute_language_model_loss`` ('linear');
- a TP that does not divide the padded vocabulary is refused before launch, in one line.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm.training import objective

from .launch_helpers import tiny_spec

RTOL = 1e-6


@pytest.mark.parametrize("vocab,padded,tp,expect", [
    (517, 640, 1, [slice(517, 640)]),
    (517, 640, 2, [None, slice(197, 320)]),
    # 100 real rows, 512 padded over 4 ranks of 128: rank 0 holds both, ranks 1-3 only padding
    (100, 512, 4, [slice(100, 128), slice(0, 128), slice(0, 128), slice(0, 128)]),
    (256, 256, 2, [None, None]),  # nothing padded
    (151669, 151936, 8, [None] * 7 + [slice(18725, 18992)]),  # Qwen's tokenizer and rows at TP8
])
def test_padded_columns_of_every_tensor_parallel_rank(vocab, padded, tp, expect):
    got = [objective._padded_columns(vocab, padded, r, tp) for r in range(tp)]
    assert got == expect
    # the masked columns over all ranks are exactly the padded rows
    masked = {r * (padded // tp) + c for r, s in enumerate(got) if s for c in range(s.start, s.stop)}
    assert masked == set(range(vocab, padded))


@pytest.fixture(scope="module")
def world():
    from megatron_vlm.runtime.session import single_process_world

    with single_process_world("cpu") as rt:
        yield rt


@pytest.fixture
def language_model(world):
    """A real LLaVAModel (TP1, random weights) in a one-process world, and its spec."""
    from megatron_vlm.model.build import ModelOptions, build_model

    spec = tiny_spec()  # 303 tokens, 384 padded rows
    return build_model(spec, ModelOptions(seq_length=16)), spec


def _loss(lm, labels, logits):
    """The language model's per-token loss, as LLaVAModel computes it (labels [b, s], logits [s, b, v])."""
    return lm.compute_language_model_loss(labels, logits)


@pytest.mark.parametrize("fused", [False, True], ids=["vocab_parallel", "fused_native"])
def test_masked_loss_is_cross_entropy_over_the_true_vocabulary(language_model, fused):
    model, spec = language_model
    lm = model.language_model
    lm.config.cross_entropy_loss_fusion = fused
    torch.manual_seed(0)
    logits = torch.randn(16, 2, spec.padded_vocab_size) * 3  # [s, b, padded rows]
    logits[..., spec.vocab_size:] += 4.0  # padded rows that would take softmax mass
    labels = torch.randint(0, spec.vocab_size, (2, 16))
    ref = torch.nn.functional.cross_entropy(logits[..., :spec.vocab_size].transpose(0, 1).reshape(-1, spec.vocab_size),
                                            labels.reshape(-1), reduction="none").view(2, 16)
    megatron_lm = _loss(lm, labels, logits.clone())
    assert (megatron_lm - ref).min() > 0.1  # Megatron-LM's objective: the padded rows take their share
    columns = objective.apply(model, spec.vocab_size, spec.padded_vocab_size, over_padded=False)
    assert columns == slice(spec.vocab_size, spec.padded_vocab_size)
    got = _loss(lm, labels, logits.clone())
    assert torch.allclose(got, ref, rtol=RTOL, atol=0), (got - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["native", "te"])
def test_masked_fused_loss_on_cuda(impl):
    """The fused cross entropies that run on a GPU only: megatron's 'native' one compiled for CUDA, and Transformer
    Engine's ('te'), under the same mask, against torch's cross entropy over the true vocabulary."""
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.runtime.session import single_process_world

    if impl == "te":
        from .conftest import require_te

        require_te()
    spec = tiny_spec()
    with single_process_world("cuda"):
        model = build_model(spec, ModelOptions(seq_length=16)).cuda()
        lm = model.language_model
        lm.config.cross_entropy_loss_fusion = True
        lm.config.cross_entropy_fusion_impl = impl
        torch.manual_seed(0)
        logits = torch.randn(16, 2, spec.padded_vocab_size, device="cuda") * 3
        logits[..., spec.vocab_size:] += 4.0
        labels = torch.randint(0, spec.vocab_size, (2, 16), device="cuda")
        ref = torch.nn.functional.cross_entropy(
            logits[..., :spec.vocab_size].transpose(0, 1).reshape(-1, spec.vocab_size), labels.reshape(-1),
            reduction="none").view(2, 16)
        objective.apply(model, spec.vocab_size, spec.padded_vocab_size, over_padded=False)
        got = _loss(lm, labels, logits.clone())
        assert torch.allclose(got, ref, rtol=RTOL, atol=0), (got - ref).abs().max()


def test_a_checkpoint_from_before_the_record_keeps_megatron_lms_objective_and_says_why():
    notes: list = []
    assert objective.resolve(None, {"trained": ["projector"]}, "/ckpt/iter_0000100", notes) is True
    assert len(notes) == 1 and "/ckpt/iter_0000100 predates the record of the loss objective" in notes[0], notes
    notes.clear()
    assert objective.resolve(None, {"trained": ["projector"], objective.META_KEY: False}, "x", notes) is False
    assert notes == []  # recorded: nothing to explain


def test_logits_of_another_width_are_refused(language_model):
    model, spec = language_model
    objective.apply(model, spec.vocab_size, spec.padded_vocab_size, over_padded=False)
    logits = torch.randn(4, 1, spec.padded_vocab_size - 128)
    with pytest.raises(ValueError, match=r"gives 256 logits per tensor-parallel rank, the padded vocabulary divided "
                                         r"over TP gives 384"):
        _loss(model.language_model, torch.zeros(1, 4, dtype=torch.long), logits)


def test_a_loss_outside_compute_language_model_loss_is_refused(language_model):
    model, spec = language_model
    model.language_model.config.cross_entropy_loss_fusion = True
    model.language_model.config.cross_entropy_fusion_impl = "linear"
    with pytest.raises(ValueError, match=r"cross_entropy_fusion_impl='linear' computes the loss without "
                                         r"compute_language_model_loss.*--no-cross-entropy-loss-fusion"):
        objective.apply(model, spec.vocab_size, spec.padded_vocab_size, over_padded=False)
    assert objective.apply(model, spec.vocab_size, spec.padded_vocab_size, over_padded=True) is None  # Megatron-LM's


@pytest.mark.parametrize("tp", [3, 6])
def test_a_tp_that_does_not_divide_the_padded_vocabulary_is_refused_before_launch(tp):
    """Heads and hidden sizes divide 3 and 6; the padded vocabulary (640 rows) does not: one line, before launch."""
    from megatron_vlm.launch.preflight import check_spec
    from megatron_vlm.training.config import TrainConfig

    shapes = dict(num_attention_heads=6, num_query_groups=6, hidden_size=96, kv_channels=16, ffn_hidden_size=192,
                  vision_num_attention_heads=6, vision_hidden_size=96, vision_ffn_hidden_size=192)
    spec = tiny_spec(vocab_size=600, **shapes)
    assert spec.padded_vocab_size == 640
    problems = check_spec(TrainConfig(tp=tp, seq_length=256), spec, "the model")
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith(f"tp={tp} does not divide padded vocab size=640 of language model; choose --tp "
                                  "from [1, 2], the sizes every part of this model splits over"), problems
    divides = tiny_spec(vocab_size=700, **shapes)  # 768 rows: TP 3 and 6 pass
    assert check_spec(TrainConfig(tp=tp, seq_length=256), divides, "the model") == []


def test_packing_with_local_layers_on_cuda_says_it_is_slow():
    from megatron_vlm.training.build import packing_note

    assert "Python loop over every pack's segments" in packing_note("local", "cuda")
    assert packing_note("transformer_engine", "cuda") is None and packing_note("local", "cpu") is None
    assert packing_note("local", "cuda", "sdpa") is None  # one masked scaled_dot_product_attention call per pack
