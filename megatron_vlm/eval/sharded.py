"""Answers from the sharded Megatron model itself, at any TP/PP layout, with megatron-core's inference stack.

``eval/generate.py --megatron-dir DIR --engine megatron --tp N --pp M [--ep E]`` (and ``eval/evaluate.py``'s) starts
a local world of ``N x M x E`` ranks (:func:`megatron_vlm.runtime.spawn.run_world`: gloo on CPU, NCCL on GPUs), the
E expert-parallel ranks being data-parallel ranks that answer the same prompts together. Every rank builds its part of the model
at that layout (:func:`megatron_vlm.model.build.build_model`, the trainer's build) and loads it from the checkpoint
(torch_dist reshards to any layout; a legacy checkpoint must be read at its own), and
:class:`ShardedGenerator` answers with megatron-core's ``VLMTextGenerationController`` over its
``VLMInferenceWrapper`` (the static-batch loop: a prefill, then one token per step with the KV cache, the logits of
the last pipeline stage broadcast to the others). Nothing is gathered into one process; no HF model is built.

The trainer's ``--eval-generate-interval`` runs the same generator over its own model chunk
(:mod:`megatron_vlm.training.answers`: :class:`ShardedGenerator` takes a built model; :meth:`~ShardedGenerator.
from_checkpoint` builds and loads one).

Prompts are encoded by :class:`megatron_vlm.eval.prompts.PromptEncoder`, the HF path's encoder (the chat template,
the image processor, anyres tiles, video frames); :func:`megatron_inputs` turns its HF-expanded tokens back into what
megatron-core's ``LLaVAModel`` takes: one image token per image or video item, the pixels of every tile (frame) in
token order, and the tiles per item (an anyres model also takes each item's image size, tokens and whether it is a
video: :class:`~megatron_vlm.model.anyres_model.AnyresLLaVAModel` runs with megatron-core's KV cache as
``LLaVAModel`` does, encoding the images at the prompt's pass only).

What megatron-vlm corrects around megatron-core's classes, and why (:class:`_LLaVAInference` and its use):

- the VLM wrapper's context window holds no ``attention_mask``, which its pipeline-parallel forward reads (a
  ``KeyError`` at PP > 1): ``None``, as its own non-pipeline path passes;
- under PP the wrapper advances the KV cache's offset by the image-expanded length of the prefill (the pipeline's
  receive buffer), and then again by the image embeddings beyond the image tokens, as it does without PP: the
  second step of every PP generation would then write past the prompt; the first advance is taken back to the
  prompt's tokens, so the two paths agree;
- the wrapper reads the model's ``image_token_index`` through ``.module`` (it expects megatron-core's
  ``Float16Module``, which refuses an fp32 model): an fp32 model is wrapped in :class:`_Fp32Module`, a
  ``Float16Module`` that casts nothing;
- the wrapper replaces its context by one the size of the request it prepares, and megatron-core 0.19's controller
  checks the next request's length against the context it finds: each request starts from a context of
  ``--max-length``;
- the wrapper counts a prompt's image embeddings as tiles x one number per tile: the request's own total is given
  instead (an anyres image's tokens depend on its size), and an anyres model's own inputs reach its forward.

On a CPU process megatron-core's controller runs through ``cpu_compat.inference_scope`` (registry entry
``cpu-inference``). Greedy decoding (the default) is argmax, as HF's ``generate``: the tokens equal HF's
(tests/test_eval.py, test_internvl.py, test_moe.py). Sampling uses megatron-core's sampler (``--temperature``,
``--top-k`` or ``--top-p``, seeded by ``--seed``), whose draws differ from HF's. The families: LLaVA (dense, and
mixture-of-experts at ``--ep``; TP x EP is refused: megatron-core's generation turns MoE layers to sequence
parallelism there, for GPT models only), LLaVA-NeXT / OneVision (anyres tiles, several images, videos) and InternVL
(images and video frames as tiles). Qwen-VL is refused in one line (``--engine hf`` answers for it).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_vlm.eval.prompts import Prompt

log = logging.getLogger(__name__)


class ShardedUnsupported(ValueError):
    """A model or choice the sharded generator does not answer for; the message names the way that does."""


@dataclass
class MegatronPrompt:
    """A prompt as megatron-core's ``LLaVAModel`` (or :class:`~megatron_vlm.model.anyres_model.AnyresLLaVAModel`)
    takes it."""

    tokens: list[int]  # one image token per image or video item (anyres: which items are videos is in model_kwargs)
    images: torch.Tensor | None  # every tile / frame in token order [sum tiles, 3, H, W]
    num_tiles: torch.Tensor  # tiles (frames) per item (int)
    embeddings: int  # the image embeddings of all items (the tokens they expand into)
    expanded_length: int  # the prompt's length with every item expanded (HF's input_ids)
    model_kwargs: dict  # anyres: image_sizes, num_image_tokens and videos per item


def check_family(spec) -> None:
    """Refuse a model whose megatron model has no inference path here, in one line."""
    if spec.is_qwen_vl:
        raise ShardedUnsupported(f"{spec.arch}: --engine megatron does not generate for Qwen-VL models yet; use "
                                 "--engine hf (the checkpoint read into one process)")


def check_layout(spec, tp: int, pp: int, ep: int) -> None:
    """Refuse a layout megatron-core's static generation does not run for a LLaVA model, in one line."""
    spec.check_parallelism(tp, pp, ep=ep)
    if ep > 1 and tp > 1:
        raise ShardedUnsupported(f"--tp {tp} with --ep {ep}: megatron-core's generation switches its MoE layers to "
                                 "sequence parallelism at TP x EP, which it does for GPT models only; generate at "
                                 f"--tp 1 --ep {ep} (or --ep 1)")


def check_sampling(sampling) -> None:
    """megatron-core's sampler takes a top-k or a top-p cut, not both."""
    if sampling.top_k is not None and sampling.top_p is not None:
        raise ShardedUnsupported("--engine megatron samples with --top-k or --top-p, not both")


def megatron_inputs(prompt: Prompt, spec, video_token_id: int | None = None) -> MegatronPrompt:
    """``prompt``'s tokens with each item's run of expanded media tokens back to one image token, and its pixels as
    the tiles (frames) of its items in token order."""
    image_id = spec.image_token_id
    media = {image_id} | ({video_token_id} if video_token_id is not None else set())
    tokens, videos, i = [], [], 0
    items, ids = iter(prompt.items), prompt.input_ids
    while i < len(ids):
        t = ids[i]
        if t not in media:
            tokens.append(t)
            i += 1
            continue
        n = next(items, 0)
        if not n or ids[i:i + n] != [t] * n:
            raise ValueError(f"the prompt's media tokens do not match its {len(prompt.items)} items")
        tokens.append(image_id)
        videos.append(t != image_id)
        i += n
    tiles = torch.tensor(prompt.tiles, dtype=torch.int)
    if not spec.is_anyres:  # pixel_values holds every tile in token order already
        return MegatronPrompt(tokens, prompt.pixel_values if prompt.tiles else None, tiles, sum(prompt.items),
                              len(ids), {})
    frames, sizes, i_img, i_vid = [], [], 0, 0
    for video, n in zip(videos, prompt.tiles):
        if video:
            frames.append(prompt.pixel_values_videos[i_vid])
            sizes.append([0, 0])  # a video packs by its frames alone
            i_vid += 1
        else:
            frames.append(prompt.pixel_values[i_img, :n])  # the image's own tiles of its padded row
            sizes.append(prompt.image_sizes[i_img].tolist())
            i_img += 1
    kwargs = dict(image_sizes=torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2),
                  num_image_tokens=torch.tensor(prompt.items, dtype=torch.int), videos=videos)
    return MegatronPrompt(tokens, torch.cat(frames) if frames else None, tiles, sum(prompt.items), len(ids), kwargs)


def _fp32_module_class():
    from megatron.core.transformer.module import Float16Module, MegatronModule

    class _Fp32Module(Float16Module):
        """megatron-core's ``Float16Module`` around an fp32 model, casting nothing: the wrapper megatron-core's
        inference wrappers and controllers unwrap (``.module``, ``unwrap_model``)."""

        def __init__(self, config, module):
            MegatronModule.__init__(self, config)  # Float16Module.__init__ refuses a config without fp16/bf16
            self.fp16 = self.bf16 = False
            self.vp_stage = getattr(module, "vp_stage", None)
            self.add_module("module", module)

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    return _Fp32Module


def _wrapper_class():
    from megatron.core.inference.model_inference_wrappers.multimodal.vlm_inference_wrapper import (
        VLMInferenceWrapper,
    )

    class _LLaVAInference(VLMInferenceWrapper):
        """megatron-core's VLM inference wrapper, with the corrections of the module docstring; ``media`` is the
        :class:`MegatronPrompt` of the request being answered."""

        media: MegatronPrompt | None = None

        def prep_inference_input(self, prompts_tokens, num_img_embeddings_per_tile, images, num_tiles,
                                 decoder_seq_length):
            # megatron-core counts tiles x embeddings per tile, one number for all tiles; an anyres image's tokens
            # differ per image: the request carries its total (counted as one tile), the model its tiles per item
            inputs = super().prep_inference_input(prompts_tokens, num_img_embeddings_per_tile, images,
                                                  torch.ones(1, dtype=torch.int), decoder_seq_length)
            inputs["num_tiles"] = num_tiles
            return inputs

        def _forward(self, inputs):
            if not self.media.model_kwargs:
                return super()._forward(inputs)
            # megatron-core's VLM forward, with an anyres model's own inputs (image sizes, tokens per item, videos)
            output = self.model(inputs["images"], inputs["tokens"], position_ids=inputs["position_ids"],
                                attention_mask=None, inference_context=self.inference_context,
                                num_image_tiles=inputs["num_tiles"], runtime_gather_output=True,
                                **self.media.model_kwargs)
            return output[0] if isinstance(output, tuple) else output

        def get_batch_for_context_window(self, *args, **kwargs):
            window = super().get_batch_for_context_window(*args, **kwargs)
            window.setdefault("attention_mask", None)
            return window

        def forward_pass_with_pipeline_parallel_small_input_batch(self, inputs, recv_buffer_seq_len=None):  # 0.16
            return self._prompt_offset(super().forward_pass_with_pipeline_parallel_small_input_batch(
                inputs, recv_buffer_seq_len), inputs, recv_buffer_seq_len)

        def forward_pass_with_pipeline_parallel(self, inputs, recv_buffer_seq_len=None):  # 0.19
            return self._prompt_offset(super().forward_pass_with_pipeline_parallel(inputs, recv_buffer_seq_len),
                                       inputs, recv_buffer_seq_len)

        def _prompt_offset(self, logits, inputs, recv_buffer_seq_len):
            if recv_buffer_seq_len is not None:  # advanced by the expanded length: back to the prompt's tokens
                self.inference_context.sequence_len_offset -= recv_buffer_seq_len - inputs["tokens"].size(1)
            return logits

    return _LLaVAInference


class _ControllerTokenizer:
    """What megatron-core's controller reads of a tokenizer: ``eod`` (the first end token: it stops there),
    ``vocab_size``, ``detokenize``, ``tokenize``."""

    def __init__(self, tokenizer, eod: int):
        self.tokenizer = tokenizer
        self.eod = eod
        self.vocab_size = len(tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids, **kwargs) -> str:
        return self.tokenizer.decode(list(ids))


def _generation_mode():
    """megatron-core 0.19's process-wide inference flag (its engines set it; the model then keeps only the last
    token's logits), or nothing (0.16 has none)."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return contextlib.nullcontext()
    return InferenceMode.active()


def check_model_config(config) -> None:
    """Refuse a built model whose layers megatron-core's static generation does not run, in one line."""
    if getattr(config, "sequence_parallel", False):
        raise ShardedUnsupported("the model runs sequence-parallel layers, which megatron-core's static generation "
                                 "does not; generate without sequence parallelism")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise ShardedUnsupported(f"the model splits sequences over {config.context_parallel_size} context-parallel "
                                 "ranks, which megatron-core's static generation does not")


class ShardedGenerator:
    """``model`` (this rank's megatron-core ``LLaVAModel`` at the world's layout; ``wrapped``: its ``Float16Module``,
    or None for an fp32 model) answering through megatron-core's text-generation controller. ``files_dir``: the
    tokenizer, chat template and processor files. Collective: every rank of the model's groups makes the same calls.
    :meth:`from_checkpoint` builds and loads the model of an iteration directory; the trainer passes its own."""

    def __init__(self, model, wrapped, spec, files_dir, sampling, max_length: int = 4096, video_fps: float = 1.0,
                 video_frames: int = 32):
        from megatron.core import parallel_state as ps

        from megatron_vlm.eval.prompts import PromptEncoder
        from megatron_vlm.runtime import cpu_compat, mcore_version

        self.spec = spec
        check_family(spec)
        check_layout(spec, ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                     ps.get_expert_model_parallel_world_size())
        check_model_config(model.config)
        self.sampling = sampling
        self.max_length = max_length
        self.files_dir = files_dir = Path(files_dir)
        self.prompts = PromptEncoder(files_dir, spec, video_fps, video_frames)
        self.tokenizer = self.prompts.tokenizer
        self.stops = _end_tokens(files_dir, self.tokenizer)
        if wrapped is None:
            wrapped = _fp32_module_class()(model.config, model)
        params_dtype = torch.bfloat16 if getattr(wrapped, "bf16", False) else \
            torch.float16 if getattr(wrapped, "fp16", False) else torch.float32
        wrapped.eval()
        self.model = model
        with cpu_compat.inference_scope():
            from megatron.core.inference.contexts import StaticInferenceContext
            from megatron.core.inference.text_generation_controllers.vlm_text_generation_controller import (
                VLMTextGenerationController,
            )

            context = StaticInferenceContext(1, max_length)
            if mcore_version.inference_wrapper_takes_context():
                inference = _wrapper_class()(wrapped, context)
            else:
                from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
                    InferenceWrapperConfig,
                )

                config = InferenceWrapperConfig(
                    hidden_size=model.language_model.config.hidden_size, params_dtype=params_dtype,
                    inference_batch_times_seqlen_threshold=-1, fp32_residual_connection=False,
                    padded_vocab_size=model.language_model.vocab_size, inference_max_requests=1,
                    inference_max_seq_length=max_length)
                inference = _wrapper_class()(wrapped, config, inference_context=context)
            eod = self.stops[0] if self.stops else -1  # -1: no token ends generation early
            self.controller = VLMTextGenerationController(inference, _ControllerTokenizer(self.tokenizer, eod))

    @classmethod
    def from_checkpoint(cls, iter_dir, sampling, max_length: int = 4096, dtype: str = "fp32",
                        video_fps: float = 1.0, video_frames: int = 32) -> "ShardedGenerator":
        """This rank's part of the model of ``iter_dir`` at the world's layout, built and loaded here."""
        from megatron.core import parallel_state as ps

        from megatron_vlm.checkpoint import layout as ckpt
        from megatron_vlm.model.build import ModelOptions, build_model
        from megatron_vlm.model.spec import VLMSpec

        spec = VLMSpec.load(iter_dir)
        check_family(spec)
        check_layout(spec, ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                     ps.get_expert_model_parallel_world_size())
        bf16 = dtype == "bf16"
        model = build_model(spec, ModelOptions(
            tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(), seq_length=max_length,
            params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16, perform_initialization=False))
        ckpt.load_model_weights(model, iter_dir)
        wrapped = None
        if bf16:
            from megatron.core.transformer.module import Float16Module

            wrapped = Float16Module(model.config, model)
        return cls(model, wrapped, spec, ckpt.run_dir(iter_dir) / ckpt.TOKENIZER_DIR, sampling, max_length,
                   video_fps, video_frames)

    def encode(self, messages: list[dict], images=(), videos=()) -> Prompt:
        return self.prompts.encode(messages, images, videos)

    def _request(self, prompt: Prompt, request_id: int):
        from megatron.core.inference.inference_request import VLMInferenceRequest
        from megatron.core.inference.sampling_params import SamplingParams

        m = megatron_inputs(prompt, self.spec, getattr(self.prompts.enc, "video_token_id", None))
        need = m.expanded_length + self.sampling.max_new_tokens
        if need > self.max_length:
            raise ShardedUnsupported(f"a prompt of {m.expanded_length} tokens (images expanded) + --max-new-tokens "
                                     f"{self.sampling.max_new_tokens} exceeds --max-length {self.max_length}; raise "
                                     "--max-length")
        s = self.sampling
        check_sampling(s)
        if s.greedy:
            params = SamplingParams(temperature=1.0, top_k=1, top_p=0.0)
        else:
            params = SamplingParams(temperature=s.temperature or 1.0, top_k=s.top_k or 0, top_p=s.top_p or 0.0)
        params.num_tokens_to_generate = s.max_new_tokens
        params.return_log_probs = False
        dtype = next(self.model.parameters()).dtype
        images = m.images.to(dtype) if m.images is not None else torch.zeros(0, 3, 1, 1, dtype=dtype)
        device = next(self.model.parameters()).device
        self.controller.inference_wrapped_model.media = m
        if m.model_kwargs:
            m.model_kwargs["num_image_tokens"] = m.model_kwargs["num_image_tokens"].to(device)
        return VLMInferenceRequest(
            request_id=str(request_id), prompt="", prompt_tokens=m.tokens, sampling_params=params,
            num_img_embeddings_per_tile=m.embeddings, imgs=images.to(device), num_tiles=m.num_tiles.to(device),
            decoder_seq_length=self.max_length)

    def generate_ids(self, prompts: list[Prompt]) -> list[list[int]]:
        """The new token ids of each prompt (end tokens and what follows them removed), one prompt at a time
        (megatron-core's VLM controller takes batches of one)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        from megatron_vlm.runtime import cpu_compat

        out = []
        for i, prompt in enumerate(prompts):
            request = self._request(prompt, i)
            # the VLM wrapper replaces its context by one of the last request's size; 0.19's controller checks the
            # next request against the context it finds
            self.controller.inference_wrapped_model.inference_context = StaticInferenceContext(1, self.max_length)
            if not self.sampling.greedy:
                self.controller.sampling_rng.manual_seed(self.sampling.seed + i)
            with cpu_compat.inference_scope(), _generation_mode():
                done = self.controller.generate_all_output_tokens_static_batch(OrderedDict([(request.request_id,
                                                                                             request)]))
            tokens = next(iter(done.values())).generated_tokens
            row = tokens.tolist() if torch.is_tensor(tokens) else list(tokens)
            cut = next((k for k, t in enumerate(row) if t in self.stops), len(row))
            out.append(row[:cut])
        return out

    def release(self) -> None:
        """Drop the KV cache of the last request (a new, empty context takes its place)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        self.controller.inference_wrapped_model.inference_context = StaticInferenceContext(1, self.max_length)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def answer(self, prompts: list[Prompt]) -> list[str]:
        return [self.decode(ids) for ids in self.generate_ids(prompts)]


def _end_tokens(files_dir, tokenizer) -> list[int]:
    """The end tokens of the run's generation config (as the HF path's ``generate`` stops), else the tokenizer's."""
    from transformers import GenerationConfig

    eos = None
    if (files_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(files_dir)).eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]) if t is not None]


@dataclass
class RankSetup:
    """What every rank of a sharded world needs to build its generator (:func:`generator_on_rank`)."""

    iter_dir: str
    tp: int
    pp: int
    ep: int
    device: str
    dtype: str  # fp32 | bf16
    max_length: int
    sampling: object  # eval.generate.Sampling
    video_fps: float
    video_frames: int


def generator_on_rank(setup: RankSetup) -> ShardedGenerator:
    """This rank's world at the setup's layout, and its generator."""
    from megatron_vlm.runtime import distributed

    distributed.setup(setup.tp, setup.pp, device=setup.device, ep=setup.ep)
    return ShardedGenerator.from_checkpoint(setup.iter_dir, setup.sampling, setup.max_length, setup.dtype,
                                            setup.video_fps, setup.video_frames)


def answer_on_rank(setup: RankSetup, messages: list[dict], images: list, videos: list) -> str | None:
    """One rank of ``eval/generate.py --engine megatron``: the answer, on rank 0."""
    gen = generator_on_rank(setup)
    ids = gen.generate_ids([gen.encode(messages, images, videos)])[0]
    return gen.decode(ids) if torch.distributed.get_rank() == 0 else None


def run_on_ranks(a, sampling, fn, *args):
    """``--engine megatron`` of eval/generate.py and eval/evaluate.py: the checks, then ``fn(RankSetup, *args)`` on
    a local world of ``--tp x --pp`` ranks; rank 0's result."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.checkpoint.checks import check_checkpoint
    from megatron_vlm.cli import InputError
    from megatron_vlm.eval.model import device_of
    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.runtime.spawn import run_world

    iter_dir = check_checkpoint(a.megatron_dir, a.iteration)
    meta = ckpt.CheckpointMeta.load(iter_dir)
    spec = VLMSpec.load(iter_dir)
    tp, pp, ep = a.tp or meta.tp, a.pp or meta.pp, a.ep
    try:
        check_family(spec)
        check_layout(spec, tp, pp, ep)
        check_sampling(sampling)
    except ShardedUnsupported as e:
        raise InputError(str(e)) from None
    if meta.format != "torch_dist" and (tp, pp) != (meta.tp, meta.pp):
        raise InputError(f"--tp {tp} --pp {pp}: {iter_dir} is a legacy ({meta.format}) checkpoint written at "
                         f"tp={meta.tp} pp={meta.pp}, which loads only at its own layout; pass --tp {meta.tp} --pp "
                         f"{meta.pp}, or convert it to torch_dist")
    device = device_of(a)
    if a.dtype == "fp16":
        raise InputError("--engine megatron runs in fp32 or bf16; pass --dtype fp32 or --dtype bf16")
    dtype = a.dtype if a.dtype != "auto" else ("bf16" if device == "cuda" and "bf" in str(meta.dtype) else "fp32")
    log.info("generating from %s with megatron-core's inference engine on %d rank(s) (tp=%d pp=%d ep=%d) in %s on "
             "%s", iter_dir, tp * pp * ep, tp, pp, ep, dtype, device)
    setup = RankSetup(str(iter_dir), tp, pp, ep, device, dtype, a.max_length, sampling, a.video_fps, a.video_frames)
    result = run_world(_refusing_in_one_line, tp * pp * ep, fn, setup, *args)[0]
    if isinstance(result, ShardedUnsupported):
        raise InputError(str(result))
    return result


def _refusing_in_one_line(fn, setup: RankSetup, *args):
    """``fn(setup, *args)`` on a rank; a request the generator refuses (a prompt longer than --max-length) is returned,
    for the command's one line, not raised as a rank's traceback. Every rank refuses the same request before any
    collective of its generation, so none waits on another."""
    try:
        return fn(setup, *args)
    except ShardedUnsupported as e:
        return e
