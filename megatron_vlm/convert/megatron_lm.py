"""Checkpoints that Megatron-LM wrote (``examples/multimodal``, ``pretrain_vlm.py``): their description.

Such a checkpoint has no ``vlm_spec.json`` or ``ckpt_meta.json``: the architecture comes from the HF LLaVA config
the user names (``--hf-config``), and this module checks it against what the checkpoint holds before anything
is exported: the tensors' shapes (layers, hidden size, heads and query groups, FFN size, vocab and its padding,
ViT depth against ``vision_feature_layer``, patch and image geometry) and Megatron-LM's ``args`` where the
checkpoint carries them (``common.pt`` of torch_dist, every legacy rank file). Each disagreement is an error
that names both values.

What it returns is what a megatron-vlm checkpoint carries in its side files (spec, format/TP/PP/dtype meta and
the HF-only tensors), so :mod:`megatron_vlm.convert.to_hf` reads both kinds the same way. HF-only tensors
(vision layers after ``vision_feature_layer``, the vision tower's post layernorm, SigLIP's head) come from the HF
directory's weights when it has them, else they are initialised, with a warning: LLaVA's outputs never use them.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.convert import mapping
from megatron_vlm.model.spec import SPEC_FILE, VLMSpec

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^(language_model|vision_model)\.decoder\.layers\.(\d+)\.")
# make_vocab_size_divisible_by x TP values that Megatron-LM pads the vocab to (128 x TP by default)
_VOCAB_MULTIPLES = [1] + [2**k for k in range(6, 15)]


class MismatchError(ValueError):
    """The HF config and the Megatron-LM checkpoint describe different models."""


def _config_path(hf_config) -> Path:
    p = Path(hf_config)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"--hf-config {hf_config}: no such HF LLaVA directory or config.json")
    return p


def tokenizer_dir(hf_config, given=None) -> Path | None:
    """Where the tokenizer and processor files come from: ``given``, else the HF config's directory."""
    if given:
        return Path(given)
    d = _config_path(hf_config).parent
    if not any(p.name.startswith(("tokenizer", "processor", "preprocessor", "chat_template")) for p in d.iterdir()):
        log.warning("%s has no tokenizer or processor files; the exported model will have none "
                    "(pass --tokenizer-dir HF_DIR)", d)
    return d


def _spec_from_hf_config(hf_config) -> VLMSpec:
    from transformers import AutoTokenizer, LlavaConfig

    path = _config_path(hf_config)
    cfg = LlavaConfig.from_pretrained(str(path.parent)) if path.name == "config.json" else \
        LlavaConfig.from_json_file(str(path))
    tok, image_token, src = None, None, None
    if (path.parent / "tokenizer_config.json").is_file():
        from megatron_vlm.model.tokenizer import directory_sources

        tok = AutoTokenizer.from_pretrained(str(path.parent))
        src = directory_sources(path.parent)
        image_token = src.pop("image_token")
        src.pop("image_token_id")  # the config's (also for a config.json given by path), read by from_hf
        src["config_src"] = str(path)
    return VLMSpec.from_hf(cfg, tok, image_token, src)


_ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "tie_word_embeddings", "vision_num_layers", "vision_hidden_size",
                "vision_feature_layer", "image_size", "patch_size")


def check_spec_against_hf_config(spec: VLMSpec, hf_config, where) -> None:
    """A megatron-vlm checkpoint carries its spec; a ``--hf-config`` given with it must describe the same model."""
    other = _spec_from_hf_config(hf_config)
    for name in _ARCH_FIELDS:
        if getattr(spec, name) != getattr(other, name):
            raise MismatchError(f"--hf-config {hf_config} gives {name}={getattr(other, name)}, but {where} holds "
                                f"{name}={getattr(spec, name)} (its {SPEC_FILE}); drop --hf-config or name the "
                                "model this checkpoint holds")


# ---- what the checkpoint holds ---------------------------------------------------------------------------
def _args_of(obj) -> dict:
    if obj is None:
        return {}
    return dict(vars(obj)) if hasattr(obj, "__dict__") else dict(obj)


def _read_dist(iter_dir) -> tuple[dict, dict, dict, dict]:
    """torch_dist: (full shapes by local-spec name, with layer 0 standing for every layer; layer counts per
    model; Megatron-LM's args; elements per dtype)."""
    from megatron.core import dist_checkpointing

    layout = ckpt.dist_key_layout(iter_dir)  # (first: it refuses a format this megatron-core cannot read)
    metadata = dist_checkpointing.load_tensors_metadata(str(iter_dir))
    shapes, counts, dtypes = {}, {}, {}
    for key, sh in metadata.items():
        if not key.startswith(layout.prefix) or key.endswith("_extra_state"):
            continue
        name = ckpt.local_norm_name(key[len(layout.prefix):])
        shape = tuple(sh.global_shape)
        m = re.match(r"^(language_model|vision_model)\.decoder\.layers\.(\d+\.)?", name)
        if m and m.group(2):  # one key per layer (a model whose layers differ: dense layers among MoE layers)
            counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)[:-1]) + 1)
            name = name.replace(f"decoder.layers.{m.group(2)}", "decoder.layers.0.", 1)
        elif m:  # megatron stacks the layers of a model along a leading axis
            counts[m.group(1)] = shape[0]
            name, shape = name.replace("decoder.layers.", "decoder.layers.0.", 1), shape[1:]
        shapes[name] = shape
        dtypes[sh.dtype] = dtypes.get(sh.dtype, 0) + math.prod(sh.global_shape)
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    return shapes, counts, _args_of(common.get("args")), dtypes


_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _read_legacy(iter_dir, tp: int, pp: int, spec: VLMSpec, ep: int = 1,
                 etp: int | None = None) -> tuple[dict, dict, dict, dict, list[int], int]:
    """Legacy rank files: as :func:`_read_dist`, plus the language layers of each pipeline stage and the model chunks
    per rank (``model0``, ``model1``, ... entries with virtual pipeline stages, each numbering its layers from 0; 1
    with a ``model`` entry). With expert parallelism each EP rank's experts are renumbered to their global index;
    every shard is read from the file :class:`megatron_vlm.checkpoint.legacy_ranks.Sources` names (Megatron-LM writes
    only some (TP, EP) files at ETP < TP)."""
    from megatron_vlm.checkpoint import legacy_ranks

    # each tensor's split, under the layer-0 names shapes are kept by (layer 0 may be an MoE layer while a later one
    # holds the dense MLP: mlp_only_layers)
    split = {_LAYER.sub(lambda m: f"{m.group(1)}.decoder.layers.0.", r.mcore): r.split for r in mapping.rules(spec)}
    shapes, dtypes, args, per_stage, vit, vpp = {}, {}, {}, [], 0, None
    per_rank = spec.num_moe_experts // ep if spec.is_moe else 0
    sources = legacy_ranks.Sources(iter_dir, legacy_ranks.present(iter_dir, ep > 1), tp, pp, ep, etp, spec.is_moe)
    for stage in range(pp):
        chunks: dict[str, dict] = {}
        files: dict = {}

        def rank_state(t, e):
            nonlocal vpp
            if (t, e) not in files:
                f = ckpt.load_legacy_rank(iter_dir, t, stage, pp, ep_rank=e, ep=ep)
                keys = _model_entries(f, ckpt.legacy_rank_file(iter_dir, t, stage, pp, e, ep))
                if vpp is None:
                    vpp = len(keys)
                elif len(keys) != vpp:
                    raise ckpt.CheckpointLayoutError(
                        f"{ckpt.legacy_rank_file(iter_dir, t, stage, pp, e, ep)} holds {len(keys)} model chunk(s) "
                        f"({', '.join(keys)}), other rank files {vpp}; the checkpoint is inconsistent")
                files[(t, e)] = (_args_of(f.get("args")), {k: ckpt.normalize_legacy_names(f[k]) for k in keys})
            return files[(t, e)]

        # the dense tensors of each TP rank, then each EP rank's experts at each expert TP rank
        wanted = [(t, sources.dense(t, stage), False) for t in range(tp)]
        wanted += [(sources.experts(x, stage, e), e, True) for e in range(ep if spec.is_moe else 0)
                   for x in range(etp or tp)]
        for t, e, experts in wanted:
            file_args, states = rank_state(t, e)
            args = args or file_args
            for key, state in states.items():
                local = chunks.setdefault(key, {})
                for k, v in state.items():
                    expert = _EXPERT.search(k)
                    if bool(expert) != experts:
                        continue
                    if expert:
                        k = _EXPERT.sub(f".local_experts.{int(expert.group(1)) + e * per_rank}.", k)
                    if isinstance(v, torch.Tensor):
                        local.setdefault(k, []).append(v)
        counts = [len({int(m.group(2)) for k in local if (m := _LAYER.match(k)) and m.group(1) == "language_model"})
                  for local in chunks.values()]
        if len(set(counts)) > 1:
            raise MismatchError(f"{iter_dir}: the model chunks of pipeline rank {stage} hold {counts} language layers; "
                                "megatron-core gives every chunk of a rank the same number")
        per_stage.append(sum(counts))
        for c, local in enumerate(chunks.values()):
            if stage == 0 and c == 0:
                vit = len({int(m.group(2)) for k in local if (m := _LAYER.match(k)) and m.group(1) == "vision_model"})
            for k, ts in local.items():
                if (stage > 0 or c > 0) and not k.startswith("language_model.decoder.layers.") and k in shapes:
                    continue
                shape = list(ts[0].shape)
                full_name = _LAYER.sub(lambda m: f"{m.group(1)}.decoder.layers.0.", k)
                rule = split.get(full_name, "replicated")
                if rule in ("column", "gated"):
                    shape[0] = sum(t.shape[0] for t in ts)
                elif rule == "row":
                    shape[1] = sum(t.shape[1] for t in ts)
                shapes[full_name] = tuple(shape)
                if ts[0].is_floating_point():
                    dtypes[ts[0].dtype] = dtypes.get(ts[0].dtype, 0) + ts[0].numel()
    counts = {"language_model": sum(per_stage), "vision_model": vit}
    return shapes, counts, args, dtypes, per_stage, vpp or 1


def _model_entries(f: dict, path) -> list[str]:
    """The model entries of a rank file: ``["model"]``, or ``model0``, ``model1``, ... (one per virtual pipeline
    stage, in order) as Megatron-LM saves several model chunks."""
    if "model" in f:
        return ["model"]
    chunks = sorted((k for k in f if k.startswith("model") and k[5:].isdigit()), key=lambda k: int(k[5:]))
    if not chunks or chunks != [f"model{c}" for c in range(len(chunks))]:
        raise ckpt.CheckpointLayoutError(f"{path} has no 'model' entry nor model0, model1, ... (it has "
                                         f"{sorted(k for k in f if isinstance(k, str))}); it is not a Megatron-LM "
                                         "checkpoint of a model")
    return chunks


def _legacy_args(iter_dir) -> dict:
    """Megatron-LM's args from the first rank file of a legacy checkpoint ({} without any)."""
    names = sorted(p for p in Path(iter_dir).glob("mp_rank_*/model_optim_rng.pt"))
    if not names:
        raise ckpt.CheckpointLayoutError(f"{iter_dir} has no mp_rank_XX[_YYY]/model_optim_rng.pt files")
    import megatron.core  # noqa: F401  (the safe globals of Megatron-LM's files)

    return _args_of(torch.load(names[0], map_location="cpu", weights_only=True, mmap=True).get("args"))


# ---- the cross-check ------------------------------------------------------------------------------------
def _padded_vocab(spec: VLMSpec, rows: int, args: dict, tp: int | None, where: str) -> int:
    """The multiple the checkpoint padded the HF vocab to; an error when ``rows`` is no padding of it."""
    v = spec.vocab_size
    if args.get("padded_vocab_size") not in (None, rows):
        raise MismatchError(f"{where}: args.padded_vocab_size={args['padded_vocab_size']} but the embedding has "
                            f"{rows} rows; the checkpoint is inconsistent")
    if args.get("make_vocab_size_divisible_by") and (args.get("tensor_model_parallel_size") or tp):
        multiples = [args["make_vocab_size_divisible_by"] * (args.get("tensor_model_parallel_size") or tp)]
    else:
        multiples = _VOCAB_MULTIPLES
    for m in multiples:
        if math.ceil(v / m) * m == rows:
            return m
    raise MismatchError(
        f"--hf-config says vocab_size={v} (text_config.vocab_size), but the checkpoint {where} has an embedding of "
        f"{rows} rows, which is not {v} padded to a multiple of {' or '.join(map(str, multiples))}; "
        "use the HF config of the model this checkpoint was trained from"
    )


def _check(spec: VLMSpec, shapes: dict, counts: dict, args: dict, where: str, tied_once: bool) -> None:
    def need(name):
        if name not in shapes:
            raise MismatchError(f"{where} has no tensor {name}; it is not a megatron-core LLaVAModel checkpoint "
                                f"of a {spec.text_family}/{spec.vision_family} model (has e.g. {sorted(shapes)[:3]})")
        return shapes[name]

    L, V = "language_model.", "vision_model."
    lay, vlay = L + "decoder.layers.0.", V + "decoder.layers.0."
    emb = need(L + "embedding.word_embeddings.weight")
    qkv, proj = need(lay + "self_attention.linear_qkv.weight"), need(lay + "self_attention.linear_proj.weight")
    fc1 = need(lay + "mlp.linear_fc1.weight") if spec.has_dense_layers else (2 * spec.ffn_hidden_size,)
    conv, pos = need(V + "conv1.weight"), need(V + "position_embeddings.weight")
    vqkv, vfc1 = need(vlay + "self_attention.linear_qkv.weight"), need(vlay + "mlp.linear_fc1.weight")
    proj_enc = "vision_projection.encoder."
    pfc1, pfc2 = need(proj_enc + "linear_fc1.weight"), need(proj_enc + "linear_fc2.weight")
    s = spec
    h, kv, heads, groups = s.hidden_size, s.kv_channels, s.num_attention_heads, s.num_query_groups
    patches = (s.image_size // s.patch_size) ** 2 + (1 if s.has_class_token else 0)
    checks = [
        ("language layers (text_config.num_hidden_layers)", s.num_layers, counts.get("language_model"),
         "language_model.decoder.layers.*"),
        ("hidden size (text_config.hidden_size)", h, emb[1], f"word_embeddings.weight {emb}"),
        ("attention heads x head dim (num_attention_heads x head_dim)", heads * kv, proj[1],
         f"linear_proj.weight {proj}"),
        ("(heads + 2 x query groups) x head dim (num_key_value_heads)", (heads + 2 * groups) * kv, qkv[0],
         f"linear_qkv.weight {qkv}"),
        ("2 x FFN size (text_config.intermediate_size)", 2 * s.ffn_hidden_size, fc1[0], f"linear_fc1.weight {fc1}"),
        ("vision hidden size (vision_config.hidden_size)", s.vision_hidden_size, conv[0], f"conv1.weight {conv}"),
        ("patch size (vision_config.patch_size)", s.patch_size, conv[-1], f"conv1.weight {conv}"),
        ("vision positions ((image_size / patch_size)^2 + class token)", patches, pos[0],
         f"position_embeddings.weight {pos}"),
        ("3 x vision hidden size", 3 * s.vision_hidden_size, vqkv[0], f"vision linear_qkv.weight {vqkv}"),
        ("vision FFN size (vision_config.intermediate_size)", s.vision_ffn_hidden_size, vfc1[0],
         f"vision linear_fc1.weight {vfc1}"),
        ("projector input (vision hidden size)", s.vision_hidden_size, pfc1[1], f"projector linear_fc1.weight {pfc1}"),
        # HF LLaVA's projector is hidden -> hidden with biases; Megatron-LM's examples/multimodal model types
        # (e.g. mistral_7b: FFN 14336, no bias) are other architectures
        ("projector hidden size (HF LLaVA: text hidden_size)", (h, h), (pfc1[0], pfc2[1]),
         f"projector linear_fc1.weight {pfc1}, linear_fc2.weight {pfc2}"),
        ("projector biases (multimodal_projector_bias)", s.projector_bias,
         "vision_projection.encoder.linear_fc1.bias" in shapes, "vision_projection.encoder.linear_fc1.bias"),
    ]
    checks += _expert_checks(spec, shapes, need, lay)
    for what, ours, theirs, detail in checks:
        if ours != theirs:
            raise MismatchError(f"--hf-config says {what} = {ours}, but the checkpoint {where} has {theirs} "
                                f"({detail}); use the HF config of the model this checkpoint was trained from")
    vit = counts.get("vision_model")
    if vit != s.vit_num_layers:
        raise MismatchError(
            f"--hf-config's vision_feature_layer={s.vision_feature_layer} of {s.vision_num_layers} vision layers "
            f"makes LLaVA read the output of {s.vit_num_layers} layers, but the checkpoint {where} holds a ViT of "
            f"{vit} layers (megatron's LLaVA reads its last layer); set vision_feature_layer to "
            f"{vit - s.vision_num_layers - 1 if vit <= s.vision_num_layers else 'a layer the ViT has'} in the HF "
            "config, or use the HF config of the model this checkpoint was trained from"
        )
    arg_checks = [
        ("num_layers", s.num_layers), ("hidden_size", h), ("num_attention_heads", heads), ("kv_channels", kv),
        ("ffn_hidden_size", s.ffn_hidden_size),
        ("num_query_groups", groups if args.get("group_query_attention", groups != heads) else None),
    ]
    for name, ours in arg_checks:
        theirs = args.get(name)
        if ours is not None and theirs is not None and theirs != ours:
            raise MismatchError(f"--hf-config gives {name}={ours}, but the checkpoint {where} was trained with "
                                f"args.{name}={theirs}; use the HF config of the model it was trained from")
    for name, ours in (("num_experts", spec.num_moe_experts), ("moe_router_topk", spec.moe_router_topk or None),
                       ("moe_ffn_hidden_size", spec.moe_ffn_hidden_size)):
        theirs = args.get(name)
        if ours is not None and theirs is not None and theirs != ours:
            raise MismatchError(f"--hf-config gives {name}={ours}, but the checkpoint {where} was trained with "
                                f"args.{name}={theirs}; use the HF config of the model it was trained from")
        if ours is None and theirs:
            raise MismatchError(f"--hf-config is a dense {spec.text_family} language model, but the checkpoint {where} "
                                f"was trained with args.{name}={theirs} (mixture of experts); use the HF config of "
                                "the model it was trained from")
    if "swiglu" in args and not args["swiglu"]:
        raise MismatchError(f"the checkpoint {where} was trained without --swiglu, but a {s.text_family} "
                            "language model needs SwiGLU")
    qk_norm = lay + "self_attention.q_layernorm.weight" in shapes
    if qk_norm != s.qk_layernorm or args.get("qk_layernorm", qk_norm) != qk_norm:
        raise MismatchError(
            f"--hf-config is a {s.text_family} language model {'with' if s.qk_layernorm else 'without'} q/k norms "
            f"(Qwen3's per-head RMSNorm), but the checkpoint {where} {'has' if qk_norm else 'lacks'} "
            "self_attention.q_layernorm (Megatron-LM's --qk-layernorm); use the HF config of the model it was "
            "trained from")
    has_output = "language_model.output_layer.weight" in shapes
    # (a legacy last stage keeps a copy of tied embeddings as its output layer; torch_dist saves it once)
    if (not s.tie_word_embeddings and not has_output) or (s.tie_word_embeddings and has_output and tied_once):
        raise MismatchError(
            f"--hf-config says tie_word_embeddings={s.tie_word_embeddings}, but the checkpoint {where} "
            f"{'has' if has_output else 'lacks'} a separate language_model.output_layer.weight"
        )


def _expert_checks(spec: VLMSpec, shapes: dict, need, lay: str) -> list:
    """(what, ours, theirs, detail) rows for an MoE layer's router and experts: from the per-expert names of legacy
    files (``local_experts.<j>``, TEGroupedMLP's renamed) or torch_dist's expert-stacked tensor."""
    if not spec.is_moe:
        return []
    router = need(lay + "mlp.router.weight")
    stacked = shapes.get(lay + "mlp.experts.experts.linear_fc1.weight")  # torch_dist: [experts, 2 x ffn, hidden]
    if stacked is not None:
        experts, fc1 = stacked[0], stacked[1:]
    else:
        found = {int(m.group(1)) for k in shapes if k.startswith(lay) and (m := _EXPERT.search(k))}
        experts, fc1 = len(found), need(lay + "mlp.experts.local_experts.0.linear_fc1.weight")
    return [
        ("experts (text_config num_experts / num_local_experts)", spec.num_moe_experts, experts,
         "mlp.experts.*"),
        ("router rows (the experts)", spec.num_moe_experts, router[0], f"mlp.router.weight {router}"),
        ("2 x expert FFN size (moe_intermediate_size)", 2 * spec.moe_ffn_hidden_size, fc1[0],
         f"an expert's linear_fc1.weight {tuple(fc1)}"),
    ]


def describe(iter_dir, hf_config) -> tuple[VLMSpec, ckpt.CheckpointMeta, dict[str, torch.Tensor]]:
    """Spec, format meta and HF-only tensors of the Megatron-LM checkpoint in ``iter_dir``, checked against
    ``hf_config`` (an HF LLaVA dir or config.json). Raises :class:`MismatchError` naming both values."""
    spec = _spec_from_hf_config(hf_config)
    iter_dir = Path(iter_dir)
    iteration = int(iter_dir.name[5:]) if re.fullmatch(r"iter_\d+", iter_dir.name) else "release"
    if (iter_dir / "metadata.json").is_file():
        fmt, tp, pp, vpp = "torch_dist", None, None, 1
        shapes, counts, args, dtypes = _read_dist(iter_dir)
        per_stage = None
    else:
        fmt = "torch"
        first_args = _legacy_args(iter_dir)
        ep = int(first_args.get("expert_model_parallel_size") or 1)
        etp = first_args.get("expert_tensor_parallel_size")
        # the layout its args name (the files' names span it, or fewer where a rank file is missing)
        tp, pp, _ = ckpt.legacy_layout_ep(iter_dir, expert_parallel=ep > 1)
        tp = int(first_args.get("tensor_model_parallel_size") or tp)
        pp = int(first_args.get("pipeline_model_parallel_size") or pp)
        shapes, counts, args, dtypes, per_stage, vpp = _read_legacy(iter_dir, tp, pp, spec, ep, etp)
        named = args.get("virtual_pipeline_model_parallel_size")
        if named not in (None, vpp if vpp > 1 else None):
            raise ckpt.CheckpointLayoutError(f"{iter_dir} has rank files for virtual_pipeline_model_parallel_size="
                                             f"{vpp if vpp > 1 else None}, but its args say {named}; the checkpoint "
                                             "is incomplete")
    where = str(iter_dir)
    spec.make_vocab_size_divisible_by = _padded_vocab(
        spec, shapes.get("language_model.embedding.word_embeddings.weight", (0,))[0], args, tp, where)
    _check(spec, shapes, counts, args, where, tied_once=fmt == "torch_dist" or pp == 1)
    dtype = max(dtypes, key=dtypes.get) if dtypes else torch.float32
    meta = ckpt.CheckpointMeta(fmt, tp or 1, pp or 1, per_stage or [spec.num_layers], iteration,
                               str(dtype).replace("torch.", ""), extra={"source": "Megatron-LM"},
                               vpp=vpp if fmt == "torch" else 1,
                               ep=int(args.get("expert_model_parallel_size") or 1) if fmt == "torch" else 1,
                               etp=args.get("expert_tensor_parallel_size") if fmt == "torch" else None)
    log.info("Megatron-LM checkpoint %s (%s%s, %s) matches %s", iter_dir, fmt,
             f", tp={tp} pp={pp}" + (f" vpp={vpp}" if vpp > 1 else "") if tp else "", meta.dtype, _config_path(hf_config))
    return spec, meta, hf_only_tensors(spec, hf_config, dtype)


def hf_only_tensors(spec: VLMSpec, hf_config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF model's tensors that megatron's LLaVAModel lacks: from the HF dir's weights where present, else
    initialised (norm weights 1, biases 0, other weights N(0, initializer_range))."""
    from transformers import LlavaForConditionalGeneration

    from megatron_vlm.convert.hf_io import INDEX, SINGLE, HFReader

    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(spec.to_hf_config())
        # the names HF's save_pretrained writes: transformers 5 fuses an MoE layer's experts in memory only
        # (experts.gate_up_proj), the files hold them one by one (experts.N.gate_proj.weight)
        on_disk = revert_weight_conversion(model, model.state_dict())
    wanted = {mapping.canonical_hf_name(n): tuple(p.shape) for n, p in on_disk.items()}
    names = mapping.extra_hf_names(spec, wanted)
    d = _config_path(hf_config).parent
    reader = HFReader(d) if (d / SINGLE).is_file() or (d / INDEX).is_file() else None
    out, made = {}, []
    std = float(spec.hf_config.get("initializer_range", 0.02) or 0.02)
    g = torch.Generator().manual_seed(0)
    for n in names:
        if reader is not None and n in reader:
            t = reader.get(n)
            if tuple(t.shape) != wanted[n]:
                raise MismatchError(f"{n} in {d} has shape {tuple(t.shape)}, but --hf-config needs {wanted[n]}")
            out[n] = t.to(dtype) if t.is_floating_point() else t
            continue
        shape = wanted[n]
        if n.endswith(".bias"):
            t = torch.zeros(shape)
        elif "norm" in n and n.endswith(".weight"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * std
        out[n] = t.to(dtype)
        made.append(n)
    if made:
        log.warning("%d HF tensors that the Megatron checkpoint does not hold were initialised (e.g. %s): %s has "
                    "no weights for them. LLaVA never uses them (vision layers after vision_feature_layer, the "
                    "vision tower's post layernorm or head), so they do not affect its outputs",
                    len(made), made[0], d)
    return out
