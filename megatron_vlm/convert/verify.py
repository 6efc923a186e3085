"""Numerical verification: HF LLaVA logits vs the Megatron model loaded from a checkpoint, in fp32.

The reference batch holds images at different positions of the text (a OneVision model with a video token:
also a video of 3 frames, and a sample with an image and a 2-frame video). HF takes the image (video) token
expanded to its number of tokens and videos as ``pixel_values_videos``; Megatron's LLaVAModel takes one token
per image or video and expands it itself. The Megatron side runs in a world of TP*PP processes, through
megatron-core's pipeline schedule (forward only), and gathers the vocab-parallel logits; logits are compared on
the true vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_vlm.spec import VLMSpec

log = logging.getLogger(__name__)
DEFAULT_TOLERANCE = 1e-4


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

    @property
    def combined_length(self) -> int:
        return self.hf_input_ids.shape[1]

    def model_kwargs(self) -> dict:
        """Extra keyword arguments of the Megatron model's forward (none for plain LLaVA)."""
        if self.image_sizes is None:
            return {}
        return dict(image_sizes=self.image_sizes, num_image_tiles=self.num_image_tiles,
                    num_image_tokens=self.num_image_tokens)

    def items(self, b: int) -> tuple[int, list[bool]]:
        """Index of sample ``b``'s first image/video item, and for each of its items whether it is a video."""
        ids = (self.image_token_id, self.video_token_id)
        media = [[int(t) for t in row if int(t) in ids] for row in self.tokens]
        return sum(len(m) for m in media[:b]), [t == self.video_token_id for t in media[b]]

    def length(self, b: int) -> int:
        """Positions of sample ``b`` with its images and videos expanded."""
        first, kinds = self.items(b)
        return int(self.tokens.shape[1] - len(kinds) + self.num_image_tokens[first:first + len(kinds)].sum())

    def hf_sample(self, b: int) -> dict:
        """HF forward inputs of sample ``b`` alone (anyres samples differ in length)."""
        first, kinds = self.items(b)
        starts = [0] + self.num_image_tiles.cumsum(0).tolist()
        out = dict(input_ids=self.hf_input_ids[b:b + 1, :self.length(b)])
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


def reference_batch(spec: VLMSpec, text_len: int = 12, positions=(1, 7), seed: int = 0) -> ReferenceBatch:
    """A fixed batch: one image per sample at ``positions[b]`` among random text tokens (anyres models: four
    samples with images of different sizes)."""
    if spec.is_anyres:
        return _anyres_reference_batch(spec, text_len, seed)
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

    from megatron_vlm import spec as spec_mod

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
        if batch.image_sizes is None:
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
        out, _ = chunk(images=b.images.to(device), input_ids=b.tokens.to(device), position_ids=None,
                       attention_mask=None, **b.model_kwargs())

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


def _verify_worker(megatron_dir, iteration, tp: int, pp: int, batch: ReferenceBatch, device=None):
    from megatron.core import parallel_state as ps

    from megatron_vlm import checkpoint as ckpt
    from megatron_vlm.model import ModelOptions, build_model
    from megatron_vlm.runtime import distributed

    distributed.setup(tp, pp, device=device)
    iter_dir = ckpt.resolve_iteration_dir(megatron_dir, iteration)
    spec = VLMSpec.load(iter_dir)
    meta = ckpt.CheckpointMeta.load(iter_dir)
    pp_layers = meta.pp_layers if meta.pp == pp else None
    opts = ModelOptions(tp=tp, pp=pp, pp_layers=pp_layers, seq_length=batch.combined_length, perform_initialization=False)
    model = build_model(spec, opts)
    if torch.cuda.is_available():
        model.cuda()
    ckpt.load_model_weights(model, iter_dir)
    model.eval()
    logits = megatron_forward_logits(model, batch)
    return logits if ps.get_tensor_model_parallel_rank() == 0 else None


def megatron_checkpoint_logits(megatron_dir, batch: ReferenceBatch, tp: int = 1, pp: int = 1, iteration=None):
    """Logits of the checkpoint loaded into a TP x PP Megatron model (spawns TP*PP processes)."""
    from megatron_vlm.runtime.spawn import run_world

    results = run_world(_verify_worker, tp * pp, megatron_dir, iteration, tp, pp, batch)
    return next(r for r in results if r is not None)


def max_logit_diff(a: torch.Tensor, b: torch.Tensor, vocab: int, batch: ReferenceBatch | None = None) -> float:
    """Max |a - b| over the true vocabulary (and, with ``batch``, over its samples' valid positions only)."""
    d = (a[..., :vocab].float() - b[..., :vocab].float()).abs()
    if batch is not None:
        d = d[valid_positions(batch)[:, : d.shape[1]]]
    return d.max().item()


def verify_checkpoint(hf_dir, megatron_dir, tp: int = 1, pp: int = 1, iteration=None,
                      tolerance: float = DEFAULT_TOLERANCE) -> float:
    """Max |logit difference| between HF and the Megatron checkpoint; raises above ``tolerance``."""
    from megatron_vlm import checkpoint as ckpt

    spec = VLMSpec.load(ckpt.resolve_iteration_dir(megatron_dir, iteration))
    batch = reference_batch(spec)
    ref = hf_logits(hf_dir, batch)
    got = megatron_checkpoint_logits(megatron_dir, batch, tp, pp, iteration)
    diff = max_logit_diff(ref, got[:, : ref.shape[1]], spec.vocab_size, batch)
    log.info("max |logit diff| HF vs Megatron (tp=%d pp=%d, fp32): %.3g (tolerance %.1g)", tp, pp, diff, tolerance)
    if not diff <= tolerance:
        raise VerificationError(f"logits differ by {diff:.3g} > {tolerance:g} between HF and Megatron (tp={tp} pp={pp})")
    return diff


class VerificationError(RuntimeError):
    pass
