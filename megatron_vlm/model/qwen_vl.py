"""Qwen2.5-VL and Qwen3-VL on megatron-core: this rank's model, and the 3-D (M-RoPE) positions of its tokens.

:class:`QwenVLModel` is what :func:`megatron_vlm.model.build.build_model` builds for a spec of arch ``qwen2_5_vl``:
the vision encoder and patch merger of :mod:`megatron_vlm.model.qwen_vit` (first pipeline stage only) and
megatron-core's ``GPTModel`` with ``position_embedding_type='mrope'`` (its ``MultimodalRotaryEmbedding`` over the
spec's ``mrope_section``) as the language model. Qwen2.5-VL's processor already writes one ``<|image_pad|>`` token per
merged patch (a count that varies with each image's size), so megatron-core's ``LLaVAModel`` and its one-token-per-
image expansion do not fit: the merged vision embeddings are scattered at the image-pad (and video-pad) positions, in
order, as HF's ``masked_scatter`` does, and the LM runs on that sequence with the given ``position_ids`` ``[3, b, s]``.
A video comes as one more item of ``images`` / ``image_grid_thw`` (its frames' patches and its ``[t, h, w]`` grid),
in token order with the images: the ViT attends within each frame, so one call on all of them equals HF's two.

It keeps the interface the trainer and the converters expect of a built model: ``pre_process`` / ``post_process`` /
``add_encoder``, ``set_input_tensor``, ``freeze``, ``vision_model`` / ``vision_projection`` / ``language_model``,
megatron-core's ``sharded_state_dict`` (names under those three prefixes), and ``forward`` in megatron-core's
``LLaVAModel`` argument order (the training step's positional call: images, tokens, positions, mask, labels, loss
mask), the image grids by keyword, returning ``(output, loss_mask)``. With pipeline parallelism every micro batch
(its embeddings, positions, labels and loss mask) is padded to the model's sequence length, as megatron-core's LLaVA
pads for its fixed point-to-point shapes.

Under context parallelism (``--cp N``) every CP rank runs the ViT on all of the micro batch's images and scatters
them into the whole sequence; then it keeps its part of every per-position input (the embeddings, labels, loss mask,
the DeepStack features and, for a padded batch, the positions): chunks ``r`` and ``2N - 1 - r`` of ``2N`` of the row,
or of each packed sample (:func:`megatron_vlm.model.cp_attention.partition_index`, megatron-core's load-balanced
order), and the language attention is :class:`~megatron_vlm.model.cp_attention.ContextParallelAttention`. A packed
row's rotary table stays whole (:class:`QwenMRoPE`): megatron-core's rotary for 'thd' picks each sample's chunks of
it, where megatron-core's own M-RoPE would first cut the row as a padded batch and give every packed sample the wrong
angles (loss 12.44 against HF's 12.08 in tests/test_qwen_vl's packed TP2 x CP2 job).

Qwen3-VL (arch 'qwen3_vl') adds two things to the language model:

- DeepStack: the features of the ViT's DeepStack mergers are added, at the image tokens, to the outputs of language
  layers 0, 1, ... (HF's ``Qwen3VLTextModel._deepstack_process``), through a forward hook on each of those layers of
  megatron-core's ``TransformerBlock``; they must sit on the first pipeline stage (the one that runs the ViT).
- Interleaved M-RoPE (:class:`QwenMRoPE` with ``interleaved``): the rotary frequencies take the temporal, height
  and width positions in turn (t, h, w, t, h, w, ...; the sections say how many of each), where megatron-core's
  ``MultimodalRotaryEmbedding`` gives them in three blocks (Qwen2.5-VL's layout).

:func:`mrope_position_ids` gives the positions of a token sequence: transformers' own ``get_rope_index`` of the
family (text positions continue after each image's grid).
"""

from __future__ import annotations

import functools
import types

import torch


def _hf_model_class(hf_config):
    """transformers' ``Qwen2_5_VLModel`` or ``Qwen3VLModel``, after ``hf_config``'s model_type."""
    if getattr(hf_config, "model_type", None) == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

        return Qwen3VLModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    return Qwen2_5_VLModel


def mrope_position_ids(hf_config, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                       image_token_id: int, video_grid_thw: torch.Tensor | None = None,
                       video_token_id: int | None = None, second_per_grid_ts=None) -> torch.Tensor:
    """``[3, b, s]`` M-RoPE positions of ``input_ids`` (``[b, s]``, images and videos already expanded to their
    tokens), from transformers' ``Qwen2_5_VLModel.get_rope_index`` / ``Qwen3VLModel.get_rope_index`` with
    ``hf_config`` (an HF ``Qwen2_5_VLConfig`` / ``Qwen3VLConfig``): the grids of the images and of the videos in
    token order, and (Qwen2.5-VL) each video's seconds per temporal grid step."""
    model = _hf_model_class(hf_config)
    host = types.SimpleNamespace(config=hf_config, get_vision_position_ids=functools.partial(
        model.get_vision_position_ids, None))
    token_types = (input_ids == image_token_id).to(torch.int32)  # mm_token_type_ids: 1 image, 2 video, 0 text
    if video_token_id is not None:
        token_types[input_ids == video_token_id] = 2
    grids = [g if g is not None and len(g) else None for g in (image_grid_thw, video_grid_thw)]
    if grids == [None, None] or not bool(token_types.any()):
        return torch.arange(input_ids.shape[1])[None, None].expand(3, input_ids.shape[0], -1).clone()
    extra = {} if second_per_grid_ts is None or grids[1] is None else dict(second_per_grid_ts=second_per_grid_ts)
    positions, _ = model.get_rope_index(host, input_ids, mm_token_type_ids=token_types, image_grid_thw=grids[0],
                                        video_grid_thw=grids[1], **extra)
    return positions


def mrope_class():
    """:class:`QwenMRoPE` (made once, after megatron-core is importable)."""
    if "mrope" not in _CLASSES:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

        class QwenMRoPE(MultimodalRotaryEmbedding):
            """megatron-core's ``MultimodalRotaryEmbedding`` as the Qwen-VL model calls it: the angles of the positions
            it is given, never cut for context parallelism here (the model hands it this CP rank's positions of a
            padded batch, and the whole row of a packed one, whose rotary megatron-core applies per sample:
            ``_apply_rotary_pos_emb_thd`` picks each sample's CP chunks of a row-long table; megatron-core's own
            cut of a row into 2 x CP chunks is right for the first layout only).

            ``interleaved`` (Qwen3-VL): frequency ``i`` rotates by the height position where ``i % 3 == 1`` and
            ``i < 3 * sections[1]``, by the width position where ``i % 3 == 2`` and ``i < 3 * sections[2]``, by the
            temporal one elsewhere (transformers' ``Qwen3VLTextRotaryEmbedding``), halves rotated as megatron-core's
            attention applies them; otherwise megatron-core's three blocks (Qwen2.5-VL)."""

            def __init__(self, *args, interleaved: bool = False, **kwargs):
                super().__init__(*args, **kwargs)
                self.interleaved = interleaved
                self.cp_group = None  # see the class docstring: no cut here

            def forward(self, position_ids, mrope_section, cp_group=None):
                if not self.interleaved:
                    return super().forward(position_ids, mrope_section)
                freqs = position_ids.to(self.inv_freq.device)[..., None].float() * self.inv_freq.float()
                angles = freqs[0].clone()  # [b, s, dim / 2]
                for axis in (1, 2):
                    pick = slice(axis, 3 * mrope_section[axis], 3)
                    angles[..., pick] = freqs[axis][..., pick]
                return torch.cat((angles, angles), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, d]

        _CLASSES["mrope"] = QwenMRoPE
    return _CLASSES["mrope"]


def _model_class():
    from megatron.core.transformer.module import MegatronModule

    class QwenVLModel(MegatronModule):
        """Qwen2.5-VL or Qwen3-VL on megatron-core (see the module docstring)."""

        def __init__(self, language_config, language_spec, vocab_size: int, max_sequence_length: int,
                     vision_config, vision_spec, projection_config, projection_spec, geometry: dict,
                     image_token_id: int, norm, pre_process: bool = True, post_process: bool = True,
                     tie_word_embeddings: bool = False, rotary_base: float = 10000.0, vp_stage: int | None = None,
                     video_token_id: int | None = None, mrope_interleaved: bool = False, deepstack_layers: int = 0):
            super().__init__(config=language_config)
            from megatron.core.models.gpt import GPTModel

            from megatron_vlm.model import qwen_vit

            self.pre_process, self.post_process = pre_process, post_process
            self.add_encoder, self.add_decoder = pre_process, True
            self.image_token_id, self.video_token_id = image_token_id, video_token_id
            self.max_sequence_length = max_sequence_length
            self.pad_to_max = language_config.pipeline_model_parallel_size > 1
            self.vision_model = self.vision_projection = None
            if self.add_encoder:
                self.vision_model = qwen_vit.vit_class()(vision_config, vision_spec, **geometry)
                merged = vision_config.hidden_size * geometry["spatial_merge_size"] ** 2
                self.vision_projection = qwen_vit.merger_class()(projection_config, projection_spec, merged, norm,
                                                                 vision_config.hidden_size,
                                                                 vision_config.layernorm_epsilon,
                                                                 deepstack=deepstack_layers)
            extra = {} if vp_stage is None else dict(vp_stage=vp_stage)
            self.language_model = GPTModel(
                config=language_config, transformer_layer_spec=language_spec, vocab_size=vocab_size,
                max_sequence_length=max_sequence_length, pre_process=pre_process, post_process=post_process,
                parallel_output=True, share_embeddings_and_output_weights=tie_word_embeddings,
                position_embedding_type="mrope", rotary_base=rotary_base, **extra)
            self.share_embeddings_and_output_weights = tie_word_embeddings
            self.language_model.rotary_pos_emb = mrope_class()(
                kv_channels=language_config.kv_channels, rotary_percent=1.0, rotary_base=rotary_base,
                interleaved=mrope_interleaved)
            self._deepstack = None  # (image-token mask [b, s], features per layer, CP positions) during a forward
            self._deepstack_hooks(deepstack_layers)

        def _deepstack_hooks(self, layers: int) -> None:
            """Hook language layers ``0 .. layers - 1`` to add the DeepStack features; refuse a layout that puts any of
            them off the first pipeline stage."""
            if not layers:
                return
            here = {layer.layer_number - 1: layer for layer in self.language_model.decoder.layers}
            wanted = set(range(layers))
            if (self.pre_process and not wanted <= set(here)) or (not self.pre_process and wanted & set(here)):
                raise ValueError(f"Qwen3-VL's DeepStack adds vision features to the outputs of language layers 0-"
                                 f"{layers - 1}, which must all be on the first pipeline stage (with the ViT); give "
                                 f"that stage at least {layers} layers (fewer --pp stages, or --pp-layers), and no "
                                 "virtual pipeline split among them")
            for i in sorted(wanted) if self.pre_process else ():
                here[i].register_forward_hook(functools.partial(self._add_deepstack, i))

        def _add_deepstack(self, index: int, module, args, output):
            if self._deepstack is None:
                return output
            where, features, mine = self._deepstack
            hidden, context = output
            add = hidden.new_zeros(where.shape[0], where.shape[1], hidden.shape[2])  # [b, s, h], HF's order
            add = add.masked_scatter(where[..., None], features[index].to(hidden.dtype))
            if mine is not None:  # context parallelism: this rank's positions of the sequence
                add = add[:, mine]
            return hidden + add.transpose(0, 1), context

        def shared_embedding_or_output_weight(self):
            return self.language_model.shared_embedding_or_output_weight()

        def set_input_tensor(self, input_tensor) -> None:
            if isinstance(input_tensor, (list, tuple)):
                if len(input_tensor) != 1:
                    raise ValueError(f"QwenVLModel takes one input tensor from the previous stage, got "
                                     f"{len(input_tensor)}")
                input_tensor = input_tensor[0]
            self.language_model.set_input_tensor(input_tensor)

        def media_positions(self, input_ids: torch.Tensor) -> torch.Tensor:
            """``[b, s]``: True at the image and video tokens (where the vision embeddings go, in token order)."""
            where = input_ids == self.image_token_id
            return where if self.video_token_id is None else where | (input_ids == self.video_token_id)

        def image_embeddings(self, images: torch.Tensor, image_grid_thw: torch.Tensor):
            """The merged vision embeddings ``[tokens, hidden]`` of every image, in image order, and the DeepStack
            features (one such tensor per DeepStack layer; none for Qwen2.5-VL)."""
            hidden, window_index, taps = self.vision_model(images, image_grid_thw)
            deep = [None] * len(taps)
            for k, states in taps:
                deep[k] = self.vision_projection.deepstack[k](states, window_index)
            return self.vision_projection(hidden, window_index), deep

        def freeze(self, freeze_language_model: bool, freeze_vision_model: bool,
                   freeze_vision_projection: bool) -> None:
            """Stop the gradients of the named parts (as megatron-core's ``LLaVAModel.freeze``): the ViT, the patch
            merger (the projector), the language model."""
            parts = [(freeze_language_model, self.language_model), (freeze_vision_model, self.vision_model),
                     (freeze_vision_projection, self.vision_projection)]
            for frozen, module in parts:
                if frozen and module is not None:
                    for p in module.parameters():
                        p.requires_grad = False

        def _context_parallel_positions(self, length: int, packed_seq_params) -> torch.Tensor | None:
            """The positions of a ``length``-long sequence this context-parallel rank holds, in megatron-core's
            load-balanced order (:func:`megatron_vlm.model.cp_attention.partition_index`: chunks ``r`` and
            ``2 x CP - 1 - r`` of each packed sample, or of the row); None without CP."""
            from megatron.core import parallel_state as ps

            cp = ps.get_context_parallel_world_size()
            if cp == 1:
                return None
            from megatron_vlm.model.cp_attention import partition_index

            cu = [0, length]
            if packed_seq_params is not None:
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            return partition_index(cu, cp, ps.get_context_parallel_rank())

        def _pad(self, t: torch.Tensor, dim: int) -> torch.Tensor:
            n = self.max_sequence_length - t.shape[dim]
            if not self.pad_to_max or n <= 0:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        def forward(self, images=None, input_ids=None, position_ids=None, attention_mask=None, labels=None,
                    loss_mask=None, inference_context=None, num_image_tiles=None, image_grid_thw=None,
                    packed_seq_params=None, **kwargs):
            """``images``: the processor's ``pixel_values`` ``[patches, C x T x P x P]`` of every image and video
            (``pixel_values_videos``) of the micro batch in token order, ``image_grid_thw`` ``[items, 3]`` their grids
            (a video's ``video_grid_thw``); ``input_ids`` ``[b, s]`` with each one's tokens expanded (the ViT attends
            within each frame, so one call on them all equals HF's two; the embeddings go to the image and video
            tokens in order, as HF's two ``masked_scatter`` calls put them);
            ``position_ids`` ``[3, b, s]`` (:func:`mrope_position_ids`; every pipeline stage needs them: each layer's
            rotary reads them; packed: each sample's own, ``[3, 1, S]``, with ``packed_seq_params``' boundaries).
            ``num_image_tiles`` (one per image) is the trainer's count and not needed here.
            Returns ``(logits or loss, loss_mask)``, padded to the sequence length under pipeline parallelism."""
            if inference_context is not None:
                raise ValueError("generation of Qwen-VL with an inference context is not supported yet; generate "
                                 "with HF's model from an export (convert/megatron_to_hf.py)")
            if kwargs:
                raise TypeError(f"QwenVLModel.forward got unexpected inputs {sorted(kwargs)}; a video's patches and "
                                "grid come with the images' (images / image_grid_thw, in token order)")
            if position_ids is None or position_ids.dim() != 3 or position_ids.shape[0] != 3:
                raise ValueError("QwenVLModel needs position_ids [3, batch, seq] (M-RoPE): compute them with "
                                 "megatron_vlm.model.qwen_vl.mrope_position_ids")
            if input_ids is not None and input_ids.shape[1] > self.max_sequence_length:
                raise ValueError(f"a micro batch of {input_ids.shape[1]} tokens exceeds the model's sequence length "
                                 f"{self.max_sequence_length}; raise --seq-length")
            decoder_input, deepstack, self._deepstack = None, None, None
            if self.pre_process:
                emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
                where = self.media_positions(input_ids)
                if images is not None and image_grid_thw is not None and len(image_grid_thw):
                    vision, deep = self.image_embeddings(images, image_grid_thw)
                    if int(where.sum()) != vision.shape[0]:
                        raise ValueError(f"the tokens hold {int(where.sum())} image/video tokens but the images and "
                                         f"videos make {vision.shape[0]} embeddings; expand each to its tokens as "
                                         "the processor does")
                    emb = emb.transpose(0, 1).masked_scatter(where[..., None], vision.to(emb.dtype))
                    emb = emb.transpose(0, 1).contiguous()
                    if deep:
                        deepstack = (self._pad(where, 1), deep)
                elif bool(where.any()):
                    raise ValueError("the tokens hold image/video tokens but no images or videos were given")
                decoder_input = self._pad(emb, 0)
            position_ids = self._pad(position_ids, 2)
            if labels is not None:
                labels = self._pad(labels, 1)
            if loss_mask is not None:
                loss_mask = self._pad(loss_mask, 1)
            mine = self._context_parallel_positions(position_ids.shape[2], packed_seq_params)
            if mine is not None:  # this CP rank's part of every per-position input
                mine = mine.to(position_ids.device)
                decoder_input = decoder_input[mine] if decoder_input is not None else None
                labels = labels[:, mine] if labels is not None else None
                loss_mask = loss_mask[:, mine] if loss_mask is not None else None
                if packed_seq_params is None:  # a packed row's rotary takes the whole row (QwenMRoPE)
                    position_ids = position_ids[:, :, mine]
            if deepstack is not None:  # the features, and (CP) this rank's positions for the layers' hooks
                self._deepstack = (*deepstack, mine)
            try:
                out = self.language_model(input_ids=None, position_ids=position_ids, attention_mask=attention_mask,
                                          decoder_input=decoder_input, labels=labels,
                                          packed_seq_params=packed_seq_params)
            finally:
                self._deepstack = None
            return out, loss_mask

    return QwenVLModel


_CLASSES: dict = {}


def model_class():
    """The :class:`QwenVLModel` class (made once, after megatron-core is importable)."""
    if "model" not in _CLASSES:
        _CLASSES["model"] = _model_class()
    return _CLASSES["model"]
