"""The reference batch of Qwen2.5-VL's logits verification (:mod:`megatron_vlm.convert.verify`).

Two samples with images of different sizes, laid out as Qwen2.5-VL's processor lays them out: random text around
``<|vision_start|>``, one ``<|image_pad|>`` per merged patch, ``<|vision_end|>``; ``pixel_values`` ``[patches, C x T x P
x P]`` and ``image_grid_thw``. The sizes are chosen so that the windowed attention matters: the larger image spans
2 x 2 windows, the other a row of windows whose last one is partial. Both sides take the same expanded tokens; HF
computes its M-RoPE positions from ``mm_token_type_ids`` inside its forward, Megatron takes ``position_ids`` from
:func:`megatron_vlm.model.qwen_vl.mrope_position_ids` (transformers' ``get_rope_index``); ``flat_positions`` replaces
them with 1-D positions (the control that must fail).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

#: (rows, columns) of patches per image of each sample, in token order; multiples of the 2 x 2 merge
SAMPLES = ([(12, 16)], [(8, 22), (4, 6)])
#: text tokens before, between and after the images of a sample
TEXT = (3, 2, 4)


@dataclass
class QwenReferenceBatch:
    tokens: torch.Tensor  # [B, S] expanded tokens (right-padded), the same for HF and Megatron
    lengths: list[int]  # valid positions per sample
    images: torch.Tensor  # [patches of every image, C x T x P x P]
    grid_thw: torch.Tensor  # [images, 3]
    images_per_sample: list[int]
    position_ids: torch.Tensor  # [3, B, S] M-RoPE positions (transformers' get_rope_index)
    image_token_id: int
    merge: int = 2  # spatial_merge_size: patches per token along each side

    variable_length = True

    @property
    def num_image_tokens(self) -> torch.Tensor:
        """Tokens per image (merged patches); not None: the samples differ in length (``verify.valid_positions``)."""
        return self.grid_thw.prod(-1) // self.merge ** 2

    @property
    def num_samples(self) -> int:
        return self.tokens.shape[0]

    @property
    def hf_input_ids(self) -> torch.Tensor:
        """HF's input ids: the same expanded tokens (the processor expands the images, not the model)."""
        return self.tokens

    @property
    def combined_length(self) -> int:
        return self.tokens.shape[1]

    def valid_length(self, b: int) -> int:
        return self.lengths[b]

    def length(self, b: int) -> int:
        return self.lengths[b]

    def _image_span(self, b: int) -> tuple[slice, slice]:
        first = sum(self.images_per_sample[:b])
        last = first + self.images_per_sample[b]
        patches = self.grid_thw.prod(-1)
        start = int(patches[:first].sum())
        return slice(first, last), slice(start, start + int(patches[first:last].sum()))

    def sample(self, b: int) -> "QwenReferenceBatch":
        """Sample ``b`` alone, as a batch of one, cut to its length."""
        imgs, rows = self._image_span(b)
        n = self.lengths[b]
        return replace(self, tokens=self.tokens[b:b + 1, :n], lengths=[n], images=self.images[rows],
                       grid_thw=self.grid_thw[imgs], images_per_sample=[self.images_per_sample[b]],
                       position_ids=self.position_ids[:, b:b + 1, :n])

    def hf_inputs(self, b: int) -> dict:
        """HF's forward inputs of sample ``b`` alone (its own M-RoPE positions come from ``mm_token_type_ids``)."""
        s = self.sample(b)
        return dict(input_ids=s.tokens, pixel_values=s.images, image_grid_thw=s.grid_thw,
                    mm_token_type_ids=(s.tokens == self.image_token_id).to(torch.int32))

    hf_sample = hf_inputs

    def forward_inputs(self, device) -> dict:
        """The Megatron model's forward arguments, on ``device``."""
        return dict(images=self.images.to(device), image_grid_thw=self.grid_thw.to(device),
                    input_ids=self.tokens.to(device), position_ids=self.position_ids.to(device), attention_mask=None)

    def flat_positions(self) -> "QwenReferenceBatch":
        """The same batch with 1-D positions (0, 1, 2, ... in all three sections): what M-RoPE is not."""
        flat = torch.arange(self.combined_length)[None, None].expand(3, self.num_samples, -1).clone()
        return replace(self, position_ids=flat)


def qwen_reference_batch(spec, seed: int = 0, samples=SAMPLES) -> QwenReferenceBatch:
    """The fixed Qwen2.5-VL batch of ``samples`` (``[[(rows, columns)]]`` of patches per image)."""
    from megatron_vlm.model.qwen_vl import mrope_position_ids

    cfg = spec.to_hf_config()
    start, end = int(cfg.vision_start_token_id), int(cfg.vision_end_token_id)
    image, merge = spec.image_token_id, spec.spatial_merge_size
    g = torch.Generator().manual_seed(seed)
    text_vocab = min(start, image, spec.vocab_size)  # ordinary tokens only, below Qwen's special ones
    rows, grids, counts = [], [], []
    for sample in samples:
        ids = []
        for k, (h, w) in enumerate(sample):
            ids += torch.randint(0, text_vocab, (TEXT[min(k, 1)],), generator=g).tolist()
            ids += [start] + [image] * (h * w // merge ** 2) + [end]
            grids.append((1, h, w))
        ids += torch.randint(0, text_vocab, (TEXT[2],), generator=g).tolist()
        rows.append(ids)
        counts.append(len(sample))
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    grid = torch.tensor(grids)
    patches = int(grid.prod(-1).sum())
    row = 3 * spec.temporal_patch_size * spec.patch_size ** 2
    images = torch.randn(patches, row, generator=g)
    positions = torch.zeros(3, len(rows), width, dtype=torch.long)
    first = 0
    for b, r in enumerate(rows):
        ids = torch.tensor(r)[None]
        positions[:, b:b + 1, :len(r)] = mrope_position_ids(cfg, ids, grid[first:first + counts[b]], image)
        first += counts[b]
    return QwenReferenceBatch(tokens, [len(r) for r in rows], images, grid, counts, positions, image, merge)
