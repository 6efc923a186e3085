"""megatron-core's ``LLaVAModel`` for anyres models (LLaVA-NeXT, LLaVA-OneVision).

``AnyresLLaVAModel`` adds HF's ``image_newline`` (a parameter of the first pipeline stage, replicated over
tensor-parallel ranks) and packs each image's tiles the way HF does (:mod:`megatron_vlm.model.anyres`) between the
projector and megatron's ``_preprocess_data``. The packed features enter ``_preprocess_data`` as tiles of
one token (``img_seq_len = 1``) with ``num_image_tiles`` = tokens per image, so megatron's own placement of
image embeddings, labels and loss mask does the rest. The per-image token counts come with the batch
(computed by the task encoder from the same geometry) and so reach every pipeline stage: the last stage, which
has no image embeddings, lays out its labels and loss mask from them. ``image_newline`` is never frozen: it
trains with the projector in every stage, as LLaVA-NeXT trains it.

Videos (OneVision, ``video_token_index``): a video is one more item of the batch's image list, in token order,
whose "tiles" are its frames and whose token count is ``frames * ceil(side/2)**2 + 1``; which items are videos
follows from the tokens (a video token instead of an image token). Its frames go through the same ViT and
projector, are pooled as HF's ``apply_pooling`` pools them and end in one ``image_newline``
(:meth:`~megatron_vlm.model.anyres.AnyresGeometry.pack_video`). Video tokens are then read as image tokens by
megatron's ``_preprocess_data``, on every stage that has tokens, so labels and loss mask follow on the last one.

Generation (``eval/sharded.py``): with megatron-core's ``inference_context`` the model runs as ``LLaVAModel`` does
under its KV cache: the prompt's pass encodes and places the images, the later passes (once megatron-core's inference
wrapper has noted the image tokens) embed the new tokens alone; the tokens then mark every item with the image token
and ``videos`` says which items are videos.
"""

from __future__ import annotations

import math

import torch

from megatron_vlm.model.host_layout import HostLayoutLLaVAModel


class AnyresLLaVAModel(HostLayoutLLaVAModel):
    def __init__(self, *args, anyres, video_token_index=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.anyres = anyres
        self.video_token_index = video_token_index
        self.img_seq_len = 1  # one packed token per "tile" in _preprocess_data
        if self.add_encoder:
            cfg = kwargs["language_transformer_config"]
            # HF's initialisation (randn / sqrt(hidden)); conversion overwrites it with the model's values.
            self.image_newline = torch.nn.Parameter(
                (torch.randn(cfg.hidden_size) / math.sqrt(cfg.hidden_size)).to(cfg.params_dtype))

    def image_embeddings(self, images, image_sizes, num_image_tiles, num_image_tokens, videos=None):
        """Packed image features ``[1, sum tokens, h]`` of a batch's tiles ``[sum tiles, 3, H, W]`` (``videos[i]``:
        item ``i`` is a video, its tiles are frames)."""
        x = self.vision_model(images)  # [tiles, seq, h_vision]
        if self._drop_vision_class_token:
            x = x[:, self.vision_model.class_token_len:, :]
        x = self.vision_projection(x.permute(1, 0, 2).contiguous())  # [seq, tiles, h]
        packed = self.anyres.pack_batch(x.permute(1, 0, 2), image_sizes, num_image_tiles, self.image_newline,
                                        videos)
        want = int(num_image_tokens.sum()) if self._host_layout is None else self._host_layout.extra["tokens"]
        if packed.shape[0] != want:
            raise ValueError(f"the batch's {len(num_image_tiles)} images pack into {packed.shape[0]} tokens, but "
                             f"num_image_tokens says {want}; count tokens with megatron_vlm.model.anyres")
        return packed.unsqueeze(0)

    def forward(self, images, input_ids, position_ids, attention_mask, labels=None, loss_mask=None,
                inference_context=None, num_image_tiles=None, image_token_index=None, runtime_gather_output=None,
                packed_seq_params=None, *, image_sizes=None, num_image_tokens=None, inference_params=None,
                host_layout=None, videos=None):
        """As ``LLaVAModel.forward``, with ``images`` the tiles of all images ``[sum tiles, 3, H, W]`` (base
        tile first for each image), ``num_image_tiles`` tiles per image and ``image_sizes`` ``[n, 2]`` (h, w)
        on the first stage, and ``num_image_tokens`` (tokens per image) on the first and last stage (a middle stage
        needs no inputs). ``host_layout``: the micro batch's :meth:`host_layout` (the expanded sequence, which items
        are videos, the tiles and tokens per image, all from the host batch: no host sync). ``videos``: which items
        are videos where the tokens mark every item with the image token (generation, eval/sharded.py).
        ``inference_context``: megatron-core's KV cache, as ``LLaVAModel`` takes it (the images are encoded at the
        prompt's pass only)."""
        with self._laid_out(host_layout):
            return self._forward(images, input_ids, attention_mask, labels, loss_mask, num_image_tiles,
                                 image_token_index, runtime_gather_output, packed_seq_params, image_sizes,
                                 num_image_tokens, inference_context, inference_params, position_ids, videos)

    def layout_inputs(self, batch) -> tuple:
        """The tokens with video tokens read as image tokens, and the tokens per image as megatron's tiles."""
        tokens = batch.tokens
        if self.video_token_index is not None:
            tokens = torch.where(tokens == self.video_token_index, self.image_token_index, tokens)
        return tokens, torch.as_tensor(batch.num_image_tokens, dtype=torch.int)

    def layout_extra(self, batch) -> dict:
        media = (batch.tokens == self.image_token_index)
        videos = None
        if self.video_token_index is not None:
            is_video = batch.tokens == self.video_token_index
            videos = is_video[media | is_video].tolist()
        return dict(videos=videos, tokens=int(torch.as_tensor(batch.num_image_tokens).sum()),
                    tiles=torch.as_tensor(batch.num_image_tiles).tolist())

    def _forward(self, images, input_ids, attention_mask, labels, loss_mask, num_image_tiles, image_token_index,
                 runtime_gather_output, packed_seq_params, image_sizes, num_image_tokens, inference_context,
                 inference_params, position_ids, given_videos=None):
        if inference_params is not None:
            raise TypeError("inference_params: pass megatron-core's inference_context")
        # megatron-core's inference wrapper notes the image tokens after the prompt's pass: later passes use the cache
        use_cache = inference_context is not None and "image_tokens_count" in inference_context.key_value_memory_dict
        if not self.add_encoder and not self.pre_process and not self.post_process:
            # a middle pipeline stage: its decoder layers run on the received hidden states, nothing else
            output = self.language_model(input_ids=None, position_ids=None, attention_mask=attention_mask,
                                         decoder_input=None, labels=None, runtime_gather_output=runtime_gather_output,
                                         packed_seq_params=packed_seq_params, inference_context=inference_context)
            return output, loss_mask
        if num_image_tokens is None:
            raise ValueError("anyres models need num_image_tokens (tokens per image) on every pipeline stage that "
                             "embeds or computes the loss")
        device = input_ids.device
        num_image_tokens = torch.as_tensor(num_image_tokens, dtype=torch.int, device=device)  # as megatron's tiles
        image_token_index = image_token_index if image_token_index is not None else self.image_token_index
        videos = given_videos
        layout = self._host_layout
        if self.video_token_index is not None and videos is None:  # a video is an image item, packed as a video
            is_video = input_ids == self.video_token_index
            videos = layout.extra["videos"] if layout is not None else \
                is_video[(input_ids == image_token_index) | is_video].tolist()  # items in token order
            input_ids = torch.where(is_video, image_token_index, input_ids)
        if use_cache:
            image_embeddings = None
        elif self.add_encoder:
            if num_image_tokens.numel():
                if image_sizes is None or num_image_tiles is None:
                    raise ValueError("anyres models need image_sizes and num_image_tiles with the images")
                tiles = layout.extra["tiles"] if layout is not None else torch.as_tensor(num_image_tiles).tolist()
                image_embeddings = self.image_embeddings(images, torch.as_tensor(image_sizes).tolist(), tiles,
                                                         num_image_tokens, videos)
            else:
                image_embeddings = torch.zeros(0, 0, 0, dtype=images.dtype, device=device)
        else:
            image_embeddings = self.encoder_hidden_state
        if not self.add_decoder:
            return image_embeddings, loss_mask

        language_embeddings = None
        if self.pre_process:
            ids = input_ids.clone()
            ids[ids == image_token_index] = 0
            language_embeddings = self.language_model.embedding(input_ids=ids, position_ids=position_ids)
            language_embeddings = language_embeddings.transpose(1, 0).contiguous()  # [b, s, h]
        combined, new_labels, new_loss_mask = self._preprocess_data(
            image_embeddings, language_embeddings, input_ids, loss_mask, labels, use_cache, inference_context,
            image_token_index, num_image_tokens)
        if self.context_parallel_lm > 1 or self.sequence_parallel_lm:
            combined, new_labels, new_loss_mask, packed_seq_params = self._process_embedding_token_parallel(
                combined, new_labels, new_loss_mask, packed_seq_params)
        output = self.language_model(input_ids=None, position_ids=None, attention_mask=attention_mask,
                                     decoder_input=combined, labels=new_labels,
                                     runtime_gather_output=runtime_gather_output,
                                     packed_seq_params=packed_seq_params, inference_context=inference_context)
        return output, new_loss_mask
