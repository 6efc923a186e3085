"""Numerical verification: HF LLaVA logits vs the Megatron model loaded from a checkpoint, in fp32.

The reference batch holds images at different positions of the text (a OneVision model with a video token:
also a video of 3 frames, and a sample with an image and a 2-frame video; Qwen2.5-VL: images of two sizes, expanded
by the processor's rule, with their M-RoPE positions, :mod:`megatron_vlm.convert.qwen_reference`). HF takes the
image (video) token expanded to its number of tokens and videos as ``pixel_values_videos``; Megatron's LLaVAModel
takes one token per image or video and expands it itself. The Megatron side runs in a world of TP*PP processes (in
this process at TP=PP=1), through megatron-core's pipeline schedule (forward only), and logits are compared on the
true vocabulary.

Memory stays bounded at any vocabulary and sequence length (:func:`verify_checkpoint`): full-vocabulary
logits of image-expanded sequences are large (OneVision, 152k vocabulary, ~7k positions: 4.5 GB per sample
in fp32), so neither side ever holds them whole. The HF side keeps each sample's final hidden states (its
``lm_head`` input) and ``lm_head``'s weight; the HF model is freed before Megatron's is built. The Megatron
side runs one sample per micro batch, and its output layer hands back its input
(:class:`_OutputLayerTap`); the logits of both are then formed by each side's own output layer
:data:`CHUNK_BYTES` worth of positions at a time, and only the running maximum of ``|HF - Megatron|`` is kept.
The verdict is the same: the maximum absolute difference over every valid position and the true vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatron_vlm.model.spec import VLMSpec

log = logging.getLogger(__name__)
DEFAULT_TOLERANCE = 1e-4
#: logits formed at once per side while comparing (positions x vocabulary x 4 bytes)
CHUNK_BYTES = 64 << 20


@dataclass
class ReferenceBatch:
    tokens: torch.Tensor  # [B, L] Megatron input: one image token per image
    hf_input_ids: torch.Tensor  # [B, L - 1 + N] HF input: image token expanded (anyres: right-padded)
    images: torch.Tensor  # [B, 3, H, W]; anyres: the tiles of all images [sum tiles, 3, H, W]
    # anyres models (LLaVA-NeXT / OneVision): images of several sizes (and OneVision videos), one list of items
    # in token order; a video's tiles are its frames
    image_sizes: torch.Tensor | None = None  # [items, 2] (h, w)
    num_image_tiles: torch.Tensor | None = None  # [items]
    num_image_tokens: torch.Tensor | None = None  # [items]
    image_token_id: int | None = None  # anyres: which tokens are images, and which videos
    video_token_id: int | None = None
    # InternVL: several tiles of one size per image (``num_image_tiles``), no image sizes; samples differ in length

    @property
    def variable_length(self) -> bool:
        """Whether samples differ in length (anyres and InternVL: tokens per image vary); HF then runs each alone."""
        return self.num_image_tokens is not None

    @property
    def combined_length(self) -> int:
        return self.hf_input_ids.shape[1]

    def forward_inputs(self, device) -> dict:
        """The Megatron model's forward arguments, every tensor on ``device``: images and tokens, and the extra ones
        of the family (none for plain LLaVA; InternVL: its tiles per image; anyres: sizes, tiles and tokens per
        item). megatron-core's LLaVA combines the tile counts with the embeddings on the model's device, as the
        trainer's batches (``training/step.py``) have them."""
        extra = {}
        if self.image_sizes is not None:
            extra = dict(image_sizes=self.image_sizes, num_image_tiles=self.num_image_tiles,
                         num_image_tokens=self.num_image_tokens)
        elif self.num_image_tiles is not None:
            extra = dict(num_image_tiles=self.num_image_tiles)
        return dict(images=self.images.to(device), input_ids=self.tokens.to(device), position_ids=None,
                    attention_mask=None, **{k: v.to(device) for k, v in extra.items()})

    def items(self, b: int) -> tuple[int, list[bool]]:
        """Index of sample ``b``'s first image/video item, and for each of its items whether it is a video."""
        ids = (self.image_token_id, self.video_token_id)
        media = [[int(t) for t in row if int(t) in ids] for row in self.tokens]
        return sum(len(m) for m in media[:b]), [t == self.video_token_id for t in media[b]]

    def length(self, b: int) -> int:
        """Positions of sample ``b`` with its images and videos expanded."""
        first, kinds = self.items(b)
        return int(self.tokens.shape[1] - len(kinds) + self.num_image_tokens[first:first + len(kinds)].sum())

    @property
    def num_samples(self) -> int:
        return self.tokens.shape[0]

    def valid_length(self, b: int) -> int:
        """Positions of sample ``b`` (image-expanded); anyres samples differ in length."""
        if self.num_image_tokens is None:
            return self.combined_length
        return self.length(b)

    def sample(self, b: int) -> "ReferenceBatch":
        """Sample ``b`` alone, as a batch of one (HF input trimmed to its length)."""
        if not self.variable_length:
            return replace(self, tokens=self.tokens[b:b + 1], hf_input_ids=self.hf_input_ids[b:b + 1],
                           images=self.images[b:b + 1])
        first, kinds = self.items(b)
        last = first + len(kinds)
        starts = [0] + self.num_image_tiles.cumsum(0).tolist()
        return replace(self, tokens=self.tokens[b:b + 1],
                       hf_input_ids=self.hf_input_ids[b:b + 1, :self.valid_length(b)],
                       images=self.images[int(starts[first]):int(starts[last])],
                       image_sizes=None if self.image_sizes is None else self.image_sizes[first:last],
                       num_image_tiles=self.num_image_tiles[first:last],
                       num_image_tokens=self.num_image_tokens[first:last])

    def hf_inputs(self, b: int) -> dict:
        """HF forward inputs of sample ``b`` alone."""
        if not self.variable_length:
            return dict(input_ids=self.hf_input_ids[b:b + 1], pixel_values=self.images[b:b + 1])
        return self.hf_sample(b)

    def hf_sample(self, b: int) -> dict:
        """HF forward inputs of sample ``b`` alone (anyres samples differ in length)."""
        first, kinds = self.items(b)
        starts = [0] + self.num_image_tiles.cumsum(0).tolist()
        out = dict(input_ids=self.hf_input_ids[b:b + 1, :self.length(b)])
        if self.image_sizes is None:  # InternVL: every tile of the sample's images, in token order
            out["pixel_values"] = self.images[starts[first]:starts[first + len(kinds)]]
            return out
        for j, video in enumerate(kinds, start=first):
            rows = self.images[starts[j]:starts[j + 1]][None]
            if video:
                out["pixel_values_videos"] = rows
            else:
                out.update(pixel_values=rows, image_sizes=self.image_sizes[j:j + 1])
        return out


# anyres reference images (h, w) as multiples of the tile size: a wide, a tall, a large (downsampled by
# OneVision when its grid exceeds anyres_max_N) and a small one
ANYRES_SIZES = ((1.0, 1.6), (2.3, 0.9), (3.0, 3.0), (0.5, 0.7))
# OneVision with a video token adds two samples: [(item, position)] with an item an image size or a frame count
VIDEO_SAMPLES = ([(3, 5)], [((1.2, 0.8), 2), (2, 8)])
# InternVL: [(tiles, position)] per sample: an image of 2 tiles + thumbnail, and a sample of two images (1 and 2 tiles)
INTERNVL_SAMPLES = ([(3, 1)], [(1, 2), (2, 8)])


def reference_batch(spec: VLMSpec, text_len: int = 12, positions=(1, 7), seed: int = 0) -> ReferenceBatch:
    """A fixed batch: one image per sample at ``positions[b]`` among random text tokens (anyres models: four
    samples with images of different sizes)."""
    if spec.is_anyres:
        return _anyres_reference_batch(spec, text_len, seed)
    if spec.is_internvl:
        return internvl_reference_batch(spec, INTERNVL_SAMPLES, text_len, seed)
    if spec.is_qwen_vl:  # images of two sizes, expanded as its processor does, with M-RoPE positions
        from megatron_vlm.convert.qwen_reference import qwen_reference_batch

        return qwen_reference_batch(spec, seed)
    g = torch.Generator().manual_seed(seed)
    vocab = spec.vocab_size
    rows, hf_rows = [], []
    for pos in positions:
        ids = torch.randint(0, vocab, (text_len,), generator=g)
        ids[ids == spec.image_token_id] = (spec.image_token_id + 1) % vocab
        ids[pos] = spec.image_token_id
        rows.append(ids)
        hf_rows.append(torch.cat([ids[:pos], ids.new_full((spec.num_image_tokens,), spec.image_token_id), ids[pos + 1:]]))
    images = torch.randn(len(positions), 3, spec.image_size, spec.image_size, generator=g)
    return ReferenceBatch(torch.stack(rows), torch.stack(hf_rows), images)


def internvl_reference_batch(spec: VLMSpec, samples, text_len: int = 12, seed: int = 0) -> ReferenceBatch:
    """InternVL samples ``[[(tiles, position)]]``: each image token at its position stands for ``tiles`` tiles of
    the tile size (HF: ``image_seq_length`` x tiles image tokens, every tile in ``pixel_values``)."""
    g = torch.Generator().manual_seed(seed)
    vocab, image = spec.vocab_size, spec.image_token_id
    tiles, rows, expanded = [], [], []
    for sample in samples:
        ids = torch.randint(0, vocab, (text_len,), generator=g)
        ids[ids == image] = (image + 1) % vocab
        counts = {}
        for n, pos in sample:
            ids[pos] = image
            counts[pos] = n * spec.num_image_tokens
            tiles.append(n)
        rows.append(ids)
        expanded.append([t for i, t in enumerate(ids.tolist()) for _ in range(counts.get(i, 1))])
    width = max(len(e) for e in expanded)
    hf_rows = torch.tensor([e + [0] * (width - len(e)) for e in expanded])
    images = torch.randn(sum(tiles), 3, spec.image_size, spec.image_size, generator=g)
    tiles = torch.tensor(tiles)
    return ReferenceBatch(torch.stack(rows), hf_rows, images, None, tiles.to(torch.int32),
                          (tiles * spec.num_image_tokens).to(torch.int32), image)


def _anyres_reference_batch(spec: VLMSpec, text_len: int, seed: int) -> ReferenceBatch:
    geo = spec.anyres
    g = torch.Generator().manual_seed(seed)
    vocab = spec.vocab_size
    media = spec.media_token_ids

    def size(a, b):
        return max(8, round(a * geo.tile_size)), max(8, round(b * geo.tile_size))

    samples = [[(size(a, b), (1 + 3 * i) % text_len)] for i, (a, b) in enumerate(ANYRES_SIZES)]
    if spec.video_token_id is not None:
        samples += [[(size(*it) if isinstance(it, tuple) else it, pos) for it, pos in s] for s in VIDEO_SAMPLES]
    sizes, tiles, counts, rows, expanded = [], [], [], [], []
    for sample in samples:
        ids = torch.randint(0, vocab, (text_len,), generator=g)
        for t in media:  # no stray image/video tokens in the text
            ids[ids == t] = (max(media) + 1) % vocab
        first = len(counts)
        for item, pos in sample:  # in token order
            video = isinstance(item, int)
            ids[pos] = spec.video_token_id if video else spec.image_token_id
            h, w = (geo.tile_size, geo.tile_size) if video else item
            sizes.append((h, w))
            tiles.append(item if video else geo.num_tiles(h, w))
            counts.append(geo.video_tokens(item) if video else geo.num_tokens(h, w))
        hf, k = [], first
        for t in ids.tolist():  # each image / video token expanded to its count, as HF's processor writes it
            hf += [t] * counts[k] if t in media else [t]
            k += t in media
        rows.append(ids)
        expanded.append(hf)
    width = max(len(e) for e in expanded)
    hf_rows = torch.tensor([e + [0] * (width - len(e)) for e in expanded])
    images = torch.randn(sum(tiles), 3, spec.image_size, spec.image_size, generator=g)
    return ReferenceBatch(torch.stack(rows), hf_rows, images, torch.tensor(sizes), torch.tensor(tiles),
                          torch.tensor(counts), spec.image_token_id, spec.video_token_id)


def load_hf_model(hf_dir, dtype=torch.float32):
    """The HF model of ``hf_dir`` (LLaVA, LLaVA-NeXT or OneVision, by its config's model_type)."""
    import json
    from pathlib import Path

    from megatron_vlm.model import spec as spec_mod

    arch = json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type", "llava")
    if arch not in spec_mod.ARCHS:
        raise spec_mod.UnsupportedArchitectureError(f"{hf_dir}: model_type {arch!r} is not one of "
                                                    f"{', '.join(spec_mod.ARCHS)}")
    import transformers

    return getattr(transformers, spec_mod.ARCHS[arch][1]).from_pretrained(str(hf_dir), dtype=dtype).eval()


def hf_logits(hf_dir, batch: ReferenceBatch) -> torch.Tensor:
    """HF fp32 logits ``[B, S, vocab]`` (anyres: each sample alone, zero beyond its length)."""
    model = load_hf_model(hf_dir)
    with torch.no_grad():
        if not batch.variable_length:
            return model(input_ids=batch.hf_input_ids, pixel_values=batch.images).logits
        out = torch.zeros(*batch.hf_input_ids.shape, model.config.text_config.vocab_size)
        for b in range(batch.tokens.shape[0]):
            logits = model(**batch.hf_sample(b)).logits[0]
            out[b, : logits.shape[0]] = logits
        return out


def valid_positions(batch: ReferenceBatch) -> torch.Tensor:
    """[B, S] True where a sample has a token (anyres samples differ in length)."""
    lengths = (torch.tensor([batch.length(b) for b in range(batch.tokens.shape[0])])
               if batch.num_image_tokens is not None else torch.full((batch.tokens.shape[0],), batch.combined_length))
    return torch.arange(batch.combined_length)[None] < lengths[:, None]


def megatron_forward_logits(model, batch: ReferenceBatch) -> torch.Tensor | None:
    """Full-vocab logits [B, S, padded_vocab] on the last PP stage (None elsewhere). Collective."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device

    def step(data_iterator, chunk):
        b = next(data_iterator)
        out, _ = chunk(**b.forward_inputs(device))

        def loss_func(output, non_loss_data=False):
            return tensor_parallel.gather_from_tensor_model_parallel_region(output)

        return out, loss_func

    with torch.no_grad():
        result = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=batch.combined_length,
            micro_batch_size=batch.tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        return result[0].float().cpu()
    return None


def max_logit_diff(a: torch.Tensor, b: torch.Tensor, vocab: int, batch: ReferenceBatch | None = None) -> float:
    """Max |a - b| over the true vocabulary (and, with ``batch``, over its samples' valid positions only)."""
    d = (a[..., :vocab].float() - b[..., :vocab].float()).abs()
    if batch is not None:
        d = d[valid_positions(batch)[:, : d.shape[1]]]
    return d.max().item()


# ---- bounded-memory verification (what convert/hf_to_megatron.py --verify runs) --------------------------------
def _progress(text: str) -> None:
    log.info("verify: %s", text)


def write_hf_reference(hf_dir, batch: ReferenceBatch, path) -> None:
    """HF's side of the comparison, in fp32: each sample's final hidden states (the input of ``lm_head``, valid
    positions only) and ``lm_head`` itself, saved to ``path`` (safetensors). The HF model is freed on return."""
    from safetensors.torch import save_file

    model = load_hf_model(hf_dir)
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise VerificationError(f"{hf_dir}: the output layer is a {type(head).__name__}, not a Linear layer")
    out = {"lm_head.weight": head.weight.detach().contiguous()}
    if head.bias is not None:
        out["lm_head.bias"] = head.bias.detach().contiguous()
    with torch.no_grad():
        for b in range(batch.num_samples):
            _progress(f"HF forward, sample {b + 1} of {batch.num_samples} ({batch.valid_length(b)} positions)")
            hidden = model.model(**batch.hf_inputs(b), use_cache=False)[0][0]  # what HF's forward gives lm_head
            out[f"hidden.{b}"] = hidden[: batch.valid_length(b)].contiguous()
            del hidden
    del model, head
    save_file(out, str(path))


class _OutputLayerTap(contextlib.AbstractContextManager):
    """While active, the Megatron model's output layer returns its input (the final hidden states ``[s, b, h]``)
    instead of logits and remembers the arguments it was called with; :meth:`logits` then runs the same layer
    on a slice of positions. The model's forward thus never forms full-vocabulary logits."""

    def __init__(self, layer):
        self.layer = layer
        self.forward = layer.forward
        self.args: tuple = ()
        self.kwargs: dict = {}

    def __enter__(self):
        def tap(hidden, *args, **kwargs):
            self.args, self.kwargs = args, kwargs
            return hidden, None

        self.layer.forward = tap
        return self

    def __exit__(self, *exc):
        del self.layer.forward  # the class's forward again
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[s, b, padded vocab]`` of ``hidden`` (gathered over TP; collective)."""
        from megatron.core import tensor_parallel

        out, _ = self.forward(hidden, *self.args, **self.kwargs)
        return tensor_parallel.gather_from_tensor_model_parallel_region(out)


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Positions whose fp32 logits over ``vocab`` fit in ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab))


def compare_chunked(n: int, hf_hidden: torch.Tensor | None, hf_head: dict, meg_hidden: torch.Tensor, tap,
                    vocab: int, rows: int) -> torch.Tensor | None:
    """Max ``|HF - Megatron|`` logit of one sample over its first ``n`` positions and the true ``vocab``, formed
    ``rows`` positions at a time by each side's own output layer. ``hf_hidden``: HF's final hidden states
    ``[n, h]``, ``hf_head``: its ``lm_head`` (``weight``, ``bias``); ``meg_hidden``: Megatron's ``[1, s, h]``.
    Collective over the TP group (every TP rank forms Megatron's logits); ranks without ``hf_hidden`` only
    take part and return None."""
    if meg_hidden.shape[1] < n or (hf_hidden is not None and hf_hidden.shape[0] != n):
        raise VerificationError(f"a reference sample of {n} positions came back with {meg_hidden.shape[1]} from "
                                f"Megatron and {None if hf_hidden is None else hf_hidden.shape[0]} from HF")
    # one running maximum, updated in place: a list of per-chunk results (small tensors outliving each chunk's
    # large temporaries) fragments the heap, which then grew by ~20 MB per chunk (1.5 GB over a 7k sample)
    worst = torch.zeros(()) if hf_hidden is not None else None
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        meg = tap.logits(meg_hidden[:, start:stop].transpose(0, 1).contiguous())[:, 0, :vocab].float()
        if hf_hidden is not None:
            ref = torch.nn.functional.linear(hf_hidden[start:stop], hf_head["weight"], hf_head.get("bias"))
            torch.maximum(worst, (ref[:, :vocab] - meg).abs().max(), out=worst)  # a NaN stays in the verdict
            del ref
        del meg
    return worst


def megatron_max_diffs(model, batch: ReferenceBatch, reference_file, vocab: int, rows: int) -> list | None:
    """Per-sample max ``|HF - Megatron|`` on TP rank 0 of the last pipeline stage (None elsewhere): one sample per
    micro batch through megatron's pipeline schedule, compared chunk by chunk as it leaves the last stage. ``model``:
    this rank's model, or its list of model chunks (virtual pipeline stages: megatron-core's interleaved schedule,
    which takes micro batches in groups of PP, so the samples are repeated up to a multiple of PP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    comparing = last and ps.get_tensor_model_parallel_rank() == 0
    ref = None
    if comparing:
        from safetensors.torch import load_file

        ref = load_file(str(reference_file))
    head = {k.split(".", 1)[1]: v for k, v in (ref or {}).items() if k.startswith("lm_head.")}
    device = next(chunks[0].parameters()).device
    tap = _OutputLayerTap(chunks[-1].language_model.output_layer) if last else contextlib.nullcontext()
    n = batch.num_samples
    groups = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    order = [i % n for i in range(-(-n // groups) * groups)]
    samples = [(b, batch.sample(b)) for b in order]
    left = {b: order.count(b) for b in set(order)}  # a sample's HF hidden states are dropped after its last use

    def step(data_iterator, chunk):
        b, sb = next(data_iterator)
        out, _ = chunk(**sb.forward_inputs(device))

        def compare(output, non_loss_data=False):
            left[b] -= 1
            hf_hidden = (ref.pop(f"hidden.{b}") if not left[b] else ref[f"hidden.{b}"]) if comparing else None
            diff = compare_chunked(batch.valid_length(b), hf_hidden, head, output, tap, vocab, rows)
            if comparing and not left[b]:
                _progress(f"sample {b + 1} of {batch.num_samples} ({batch.valid_length(b)} positions): "
                          f"max |logit diff| {diff.item():.3g}")
            return diff

        return out, compare

    with torch.no_grad(), tap:
        result = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(samples) if len(chunks) == 1 else [iter(samples) for _ in chunks],
            model=chunks,
            num_microbatches=len(samples),
            seq_length=batch.combined_length,
            micro_batch_size=1,
            forward_only=True,
            collect_non_loss_data=True,
        )
    return [float(d.item()) for d in result] if comparing else None


def _verify_worker(megatron_dir, iteration, tp: int, pp: int, batch: ReferenceBatch, reference_file, rows: int,
                   device=None, progress: bool = False, ep: int = 1, etp: int | None = None, vpp: int = 1):
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.model.build import ModelOptions, build_chunks
    from megatron_vlm.runtime import distributed

    if progress and not logging.getLogger().handlers:  # a spawned rank: show the progress lines as the parent does
        from megatron_vlm.cli import setup_logging

        setup_logging()
    distributed.setup(tp, pp, device=device, ep=ep, etp=etp, vpp=vpp)
    iter_dir = ckpt.resolve_iteration_dir(megatron_dir, iteration)
    spec = VLMSpec.load(iter_dir)
    meta = ckpt.CheckpointMeta.load(iter_dir)
    pp_layers = meta.pp_layers if meta.pp == pp else None
    opts = ModelOptions(tp=tp, pp=pp, pp_layers=pp_layers, seq_length=batch.combined_length, perform_initialization=False,
                        ep=ep, etp=etp, vpp=vpp)
    chunks = build_chunks(spec, opts)
    for m in chunks:
        if torch.cuda.is_available():
            m.cuda()
        m.eval()
    ckpt.load_model_weights(chunks, iter_dir)
    return megatron_max_diffs(chunks if vpp > 1 else chunks[0], batch, reference_file, spec.vocab_size, rows)


def world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """Processes of a verification world: TP x PP, with as many data-parallel replicas as expert parallelism needs
    (each pipeline stage's ranks must hold whole EP x expert-TP groups)."""
    experts = ep * (tp if etp is None else etp)
    return pp * math.lcm(tp, experts)


def megatron_weight_bytes(spec: VLMSpec, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """fp32 bytes of the weights every rank of a verification world holds together: each rank's share
    (:func:`megatron_vlm.model.memory.estimate`, which tests/test_memory.py holds to what ranks allocate) times
    the ranks of its stage. At EP > 1 the world has data-parallel replicas (:func:`world_size`), each holding its
    copy of the dense weights, and the experts are replicated over their own data-parallel group."""
    from megatron_vlm.model import memory

    world = world_size(tp, pp, ep, etp)
    layout = memory.Layout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, etp=etp, precision="fp32",
                           trained=(False, False, False))
    return sum(stage.weights for stage in memory.estimate(spec, layout)) * (world // pp)


def memory_needed(hf_dir, spec: VLMSpec, tp: int, pp: int, runtime: int, ep: int = 1,
                  etp: int | None = None) -> tuple[int, str]:
    """Bytes :func:`verify_checkpoint` adds at its peak to the converter's own process, and how they split.

    The larger of HF's fp32 model and Megatron's (:func:`megatron_weight_bytes`: over the world's ranks, with the
    dense weights once per data-parallel replica of an EP world; never both at once), each rank's runtime
    (``runtime``: what one process holds for torch and megatron-core; the converter's own process counts when
    the world has more than one rank only as the parent), one sample's activations (on CPU megatron-core's local
    attention holds 2 x heads x S^2 fp32 scores for the longest, S-position, reference sample), the fp32
    ``lm_head`` and the logit slices of :data:`CHUNK_BYTES`."""
    from megatron_vlm.convert.hf_io import HFReader

    reader = HFReader(hf_dir)
    numel = sum(math.prod(reader.info(n).shape) for n in reader.names())
    batch = reference_batch(spec)
    longest = max(batch.valid_length(b) for b in range(batch.num_samples))
    hf_model, megatron = 4 * numel, megatron_weight_bytes(spec, tp, pp, ep, etp)
    model = max(hf_model, megatron)
    world = world_size(tp, pp, ep, etp)
    ranks = world if world > 1 else 0
    scores = 0 if torch.cuda.is_available() else 2 * spec.num_attention_heads * longest**2 * 4 // tp
    head = 4 * spec.padded_vocab_size * spec.hidden_size
    total = model + ranks * runtime + scores + head + 8 * CHUNK_BYTES
    replicas = world // (tp * pp)
    which = (f"Megatron's over {world} ranks, the dense weights {replicas} times" if megatron > hf_model and
             replicas > 1 else "HF's" if hf_model >= megatron else f"Megatron's over {world} ranks")
    parts = (f"the model in fp32: {_gb(model)} ({which})"
             + (f", {ranks} processes of about {_gb(runtime)}" if ranks else "")
             + f", attention scores and logits of the longest reference sample ({longest} positions): "
               f"{_gb(scores + head + 8 * CHUNK_BYTES)}")
    return total, parts


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_memory(hf_dir, spec: VLMSpec, tp: int, pp: int, max_memory: int | None, ep: int = 1,
                 etp: int | None = None) -> None:
    """Refuse ``--verify`` before anything is written when it would not fit under ``max_memory`` (or the memory
    available): :class:`VerificationError` with the memory it needs."""
    from megatron_vlm.convert.streaming import AUTO_SHARE, anon_bytes, available_bytes

    held = anon_bytes() or 0
    need, parts = memory_needed(hf_dir, spec, tp, pp, held, ep, etp)
    if max_memory is not None:
        cap, what = max_memory, f"--max-memory {_gb(max_memory)}"
    else:
        avail = available_bytes()
        if avail is None:
            return
        cap, what = held + int(AUTO_SHARE * avail), f"{AUTO_SHARE:.0%} of the {_gb(avail)} available"
    if held + need > cap:
        raise VerificationError(
            f"--verify needs about {_gb(held + need)} ({parts}, beside the converter's {_gb(held)}), more than "
            f"{what}; nothing was written: convert without --verify, or verify on a machine with more memory")


def verify_checkpoint(hf_dir, megatron_dir, tp: int = 1, pp: int = 1, iteration=None,
                      tolerance: float = DEFAULT_TOLERANCE, chunk_bytes: int | None = None, ep: int = 1,
                      etp: int | None = None, vpp: int | None = None) -> float:
    """Max |logit difference| between HF and the Megatron checkpoint; raises above ``tolerance``. ``ep``/``etp``:
    the expert-parallel layout of a mixture-of-experts model (a world of :func:`world_size` processes; every
    data-parallel replica runs the same batch, so the experts see every replica's tokens); ``vpp``: virtual pipeline
    stages per PP rank (the model built as its chunks, run through megatron-core's interleaved schedule; default: the
    checkpoint's own, from its ``ckpt_meta.json``).

    Peak memory: the larger of HF's fp32 model and Megatron's (:func:`megatron_weight_bytes`: TP*PP ranks hold one
    fp32 copy, an EP world's data-parallel replicas one each of the dense weights), plus one sample's activations
    and ``chunk_bytes``-sized logit slices (default :data:`CHUNK_BYTES`); never a batch's full-vocabulary logits."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.runtime.session import single_process_world

    it_dir = ckpt.resolve_iteration_dir(megatron_dir, iteration)
    spec = VLMSpec.load(it_dir)
    if vpp is None:
        vpp = ckpt.CheckpointMeta.load(it_dir).vpp if (it_dir / ckpt.META).is_file() else 1
    batch = reference_batch(spec)
    rows = chunk_rows(spec.padded_vocab_size, chunk_bytes or CHUNK_BYTES)
    beside = Path(megatron_dir).absolute().parent  # beside the checkpoint: it has room for one lm_head
    with tempfile.TemporaryDirectory(prefix=".verify-", dir=beside) as tmp:
        reference = Path(tmp) / "hf_reference.safetensors"
        write_hf_reference(hf_dir, batch, reference)
        world = world_size(tp, pp, ep, etp)
        layout = f"tp={tp} pp={pp}" + (f" vpp={vpp}" if vpp > 1 else "") + (
            f" ep={ep} etp={tp if etp is None else etp}" if spec.is_moe else "")
        _progress(f"loading the checkpoint into a {layout} Megatron model"
                  + (f" ({world} processes)" if world > 1 else ""))
        progress = log.isEnabledFor(logging.INFO)
        if world == 1:
            with single_process_world():
                diffs = _verify_worker(megatron_dir, iteration, 1, 1, batch, reference, rows, progress=progress)
        else:
            from megatron_vlm.runtime.spawn import run_world

            results = run_world(_verify_worker, world, megatron_dir, iteration, tp, pp, batch, reference, rows,
                                progress=progress, ep=ep, etp=etp, vpp=vpp)
            diffs = [d for r in results if r is not None for d in r]  # every data-parallel replica's comparison
    diff = float(torch.tensor(diffs).max())  # NaN stays NaN, and fails below
    log.info("max |logit diff| HF vs Megatron (%s, fp32): %.3g (tolerance %.1g)", layout, diff, tolerance)
    if not diff <= tolerance:
        raise VerificationError(f"logits differ by {diff:.3g} > {tolerance:g} between HF and Megatron ({layout})")
    return diff


class VerificationError(RuntimeError):
    pass
