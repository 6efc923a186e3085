"""Per-rank training jobs that tests and benchmarks run in a local world (see runtime.spawn.run_world).

A job trains a few steps of a fixed sequence of global batches with the trainer's own parts
(:func:`megatron_vlm.training.build.build_training`, :func:`megatron_vlm.training.step.train_step`, checkpoint
save/resume) at one TP/PP/DP layout and precision, and returns the loss and grad norm of every step. One
world runs many jobs (megatron's parallel groups are re-initialised per job), so a 2-process world covers
TP=2, PP=2 and DP=2 in fp32 and bf16 without paying process start-up for each.

Global batches are lists of encoded samples (``VLMSample``); each job splits every global batch over its
data-parallel ranks and micro batches with the task encoder's own ``batch()``, so the same global batch is
trained whatever the layout.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import torch

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.runtime.spawn import thread_names
from megatron_vlm.model.spec import VLMSpec
from tests.support import chunk_views, sync_count

#: what every job's TrainConfig has unless the job says otherwise
BASE = dict(device="cpu", stage=2, freeze_vit=False, lr=2e-3, min_lr=0.0, lr_warmup_fraction=0.0,
            lr_decay_style="constant", clip_grad=1.0, weight_decay=0.0, seq_length=96, precision="fp32",
            deterministic=True)


#: questions and answers of different lengths (so per-token loss normalisation matters)
QUESTIONS = ["what colour is the shape ?", "describe the picture in a few words please", "what ?",
             "is there a square in the image , and what colour is it ?"]
ANSWERS = ["red", "a red square on a smooth gradient background", "a shape", "yes"]


#: image sizes (h, w) the samples cycle through: anyres models tile them differently (one tile to a 2x2 grid)
IMAGE_SIZES = [(40, 30), (20, 52), (64, 64), (12, 18)]


def encoder_for(hf_dir, seq_length: int = BASE["seq_length"], spec: VLMSpec | None = None,
                pad_to_multiple_of: int | None = None):
    """The trainer's task encoder of ``hf_dir``'s architecture (plain LLaVA or anyres); ``pad_to_multiple_of``: as
    the trainer pads batches for sequence parallelism (TP) or FP8."""
    from megatron_vlm.data.anyres_encoder import task_encoder_for

    spec = spec or VLMSpec.from_hf_dir(hf_dir)
    return task_encoder_for(spec, hf_dir, seq_length, image_token_id=spec.image_token_id,
                            pad_to_multiple_of=pad_to_multiple_of)


#: the batching encoders of this process (a world's rank runs many jobs of the same few models): building one loads
#: the model's tokenizer and image processor (~1 s for Qwen's 151k-token tokenizer, a third of a world's time)
_BATCHING: dict = {}


def batching_encoder(hf_dir, spec: VLMSpec, pad_to_multiple_of: int | None = None,
                     seq_length: int = BASE["seq_length"], packed_seq_length: int | None = None,
                     sample_multiple: int | None = None):
    """:func:`encoder_for`, made once per process for each model, spec and padding: for ``batch()`` only, which
    keeps no state between calls (its skip counters are the encoding's, which these jobs never do); with
    ``packed_seq_length`` the trainer's packing encoder (``pack_selected_samples`` and ``batch()``; each sample of a
    pack padded to ``sample_multiple``, as the trainer pads them under context parallelism)."""
    key = (str(hf_dir), spec.to_json(), pad_to_multiple_of, seq_length, packed_seq_length, sample_multiple)
    if key not in _BATCHING:
        if packed_seq_length:
            from megatron_vlm.data.packing import packing_task_encoder_for

            _BATCHING[key] = packing_task_encoder_for(spec, hf_dir, seq_length, packed_seq_length,
                                                      image_token_id=spec.image_token_id,
                                                      pad_to_multiple_of=pad_to_multiple_of,
                                                      sample_multiple=sample_multiple)
        else:
            _BATCHING[key] = encoder_for(hf_dir, seq_length, spec=spec, pad_to_multiple_of=pad_to_multiple_of)
    return _BATCHING[key]


def variable_length_batches(hf_dir, n: int, size: int = 8, seq_length: int = BASE["seq_length"],
                            uniform: bool = False, videos: int = 0, first_clip: int = 0) -> list[list]:
    """``n`` global batches of ``size`` encoded samples of different lengths (and, for anyres models, image
    sizes), the same on every call; ``uniform``: every sample has the first question and answer (one length, the
    images differ); ``videos`` (OneVision, Qwen2.5-VL): that many samples of each global batch are a video (two
    clips in turn from ``first_clip``, made with PyAV: OneVision's rule takes 3 frames and 1, Qwen2.5-VL's 4 of
    each) instead of an image."""
    from megatron.energon import VQASample
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array

    enc = encoder_for(hf_dir, seq_length)
    sizes = IMAGE_SIZES if enc.spec.is_anyres or enc.spec.is_internvl or enc.spec.is_qwen_vl else IMAGE_SIZES[:1]
    meta = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    clips = _clips() if videos else []
    out = []
    for b in range(n):
        samples = []
        for i in range(size):
            if i < videos:
                from megatron_vlm.data.conversation import vqa_messages

                j = (b + i) % len(QUESTIONS)
                messages = vqa_messages(QUESTIONS[j], ANSWERS[(j + b) % len(ANSWERS)], "video")
                samples.append(enc.sample_type(__key__=f"{b}-{i}", **meta, **enc.encode_conversation(
                    messages, [], f"{b}-{i}", [clips[(b + i + first_clip) % len(clips)]])))
                continue
            j = 0 if uniform else (b + i) % len(QUESTIONS)
            image = Image.fromarray(image_array(sizes[0 if uniform else (b + i) % len(sizes)], 8 * b + i))
            s = VQASample(__key__=f"{b}-{i}", image=image, context=QUESTIONS[j],
                          answers=ANSWERS[0 if uniform else (j + b) % len(ANSWERS)], answer_weights=None, **meta)
            samples.append(enc.encode_sample(s))
        out.append(samples)
    return out


def long_video_batch(hf_dir, frames: int = 32, seq_length: int = 256, side: int = 24, others: bool = True) -> list:
    """One global batch of a OneVision (or any model with a video token): a video of ``frames`` frames (one a
    second of a ``frames``-second clip, ``side`` pixels square) and, with ``others``, a video with an image, an
    image and a text-only sample, encoded by the trainer's task encoder at ``seq_length`` (at the tiny test model's
    20-px tiles a frame is 4 positions; at 384 px and patch 14, 196)."""
    from PIL import Image

    from megatron_vlm.data.anyres_encoder import AnyresSample
    from megatron_vlm.data.conversation import vqa_messages
    from megatron_vlm.data.synthetic import image_array
    from tests.support.videos import make_video

    enc = encoder_for(hf_dir, seq_length)
    enc.video_frames = frames
    clip, short = make_video(2 * frames, side, side, fps=2), make_video(5, 48, 32, fps=7)
    answer = [{"type": "text", "text": ANSWERS[1]}]
    video_image = [{"type": "video"}, {"type": "text", "text": QUESTIONS[0]}, {"type": "image"}]
    fields = [enc.encode_conversation(vqa_messages(QUESTIONS[1], ANSWERS[1], "video"), [], "video", [clip])]
    fields += [] if not others else [
        enc.encode_conversation([{"role": "user", "content": video_image}, {"role": "assistant", "content": answer}],
                                [Image.fromarray(image_array(IMAGE_SIZES[0], 1))], "video-image", [short]),
        enc.encode_conversation(vqa_messages(QUESTIONS[3], ANSWERS[3]), [Image.fromarray(image_array(
            IMAGE_SIZES[1], 2))], "image"),
        enc.encode_conversation([{"role": "user", "content": [{"type": "text", "text": QUESTIONS[2]}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[2]}]}], [],
                                "text"),
    ]
    meta = dict(__restore_key__=(), __subflavors__=None, __sources__=None)
    return [AnyresSample(__key__=f"{i}", **meta, **f) for i, f in enumerate(fields)]


def _clips() -> list[bytes]:
    """Two clips: 25 frames at 10 fps (OneVision's rule picks 3) and 5 at 7 fps (it picks 1)."""
    from tests.support.videos import make_video

    return [make_video(25, 33, 21, fps=10), make_video(5, 48, 32, fps=7)]


def _packing(encoder):
    """A packing encoder's collate of a list of samples: one pack of them (``pack_selected_samples``), batched."""
    return lambda samples: encoder.batch([encoder.pack_selected_samples(samples)])


def job_config(job: dict, n_steps: int, global_batch_size: int):
    from megatron_vlm.training.config import TrainConfig

    fields = {k: v for k, v in job.items()
              if k not in ("name", "steps", "start", "save", "save_after", "resume", "reload_weights",
                           "grads", "megatron_dir", "hf_dir", "batches", "refused", "count_syncs", "count_step_syncs",
                           "unchecked_expert_layout", "evaluate", "count_vision_tiles",
                           "wrong_vision_gather", "pack", "answer_after")}
    cfg = TrainConfig(**{**BASE, "train_iters": max(n_steps, 1), "global_batch_size": global_batch_size, **fields})
    cfg.precision = cfg.precision or "fp32"
    # a resume job trains fewer steps than the job that saved (another --train-iters): keep the checkpoint's
    # schedule, as megatron-core's scheduler did by default before the two Megatron-LM flags were adopted
    cfg.use_checkpoint_opt_param_scheduler = bool(job.get("resume"))
    return cfg


def micro_batches(collate, samples: list, dp: int, dp_rank: int, micro_batch_size: int) -> list:
    """This DP rank's micro batches of one global batch (a contiguous 1/dp slice, in micro batches)."""
    per_rank = len(samples) // dp
    mine = samples[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [collate(mine[i:i + micro_batch_size]) for i in range(0, len(mine), micro_batch_size)]


def _setup(cfg, spec: VLMSpec | None = None):
    """The job's parallel groups (``spec``: the model's, which decides the virtual pipeline stages, if any)."""
    from megatron_vlm.runtime import distributed

    return distributed.setup(cfg.tp, cfg.pp, device="cpu", seed=cfg.seed, ep=cfg.ep, etp=cfg.etp, cp=cfg.cp,
                             vpp=cfg.vpp_size(spec) if spec is not None else 1)


def weights_digest(model) -> str:
    """sha256 of this rank's parameters (names, dtypes and bytes, in the model's order; ``model``: a module or a
    ``Training``, all of its chunks): equal digests are bit-identical weights."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _save(job, step: int, cfg, rt, spec, training, iter_dir, global_batch_size: int) -> None:
    from megatron_vlm.training import checkpointing, resume

    meta = ckpt.CheckpointMeta("torch_dist", cfg.tp, cfg.pp, spec.check_parallelism(cfg.tp, cfg.pp, cfg.pp_layers),
                               dtype=str(training.dtype).replace("torch.", ""), ep=cfg.ep, etp=cfg.etp,
                               vpp=len(training.models))
    meta.extra.update(resume.layout_extra(cfg, rt.dp, step * global_batch_size))
    overlap = training.overlapping_param_gather()
    if overlap:  # as the trainer saves: the parameters gathered first
        training.disable_forward_pre_hook()
    checkpointing.save(Path(job["save"]), step, training.models, training.optimizer, training.scheduler, None,
                       spec=spec, meta=meta, side_src=iter_dir, with_optim=cfg.save_optim, total_limit=None)
    if overlap:
        training.enable_forward_pre_hook()


#: what makes the host wait for the device: a value read back (``item``, ``tolist``, a tensor's ``bool``, ``float``,
#: ``int``) or positions computed from values (``nonzero``)
HOST_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")


@contextlib.contextmanager
def moe_host_syncs(training, counts: dict):
    """Counts into ``counts`` what a mixture-of-experts model's per-router path does (``count_syncs`` jobs): the host
    syncs (:data:`HOST_SYNCS`, by name) made inside every router's routing (as the trainer wraps it, megatron-core's
    own routing inside), inside the HF term's backward and inside the trainer's per-micro-batch calls
    (``MoETraining.begin`` / ``forward_done``); and ``router_calls``, ``micro_batches`` (``begin`` calls of a
    rank's first model chunk), ``position_builds`` (the positions of samples built for a router:
    ``held_positions``) and ``exchange_ranks`` (the ranks of the pipeline stages' exchange group; None without
    one)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_vlm.training.moe import hf_objective, micro_batch

    inside = [0]
    counts.update({k: 0 for k in ("syncs", "router_calls", "micro_batches", "position_builds")})
    exchange = getattr(training.moe.hf, "exchange", None)  # the stage exchange's group: its ranks
    counts["exchange_ranks"] = None if exchange is None else \
        torch.distributed.get_process_group_ranks(exchange.group)

    def scoped(f, key=None, first_chunk_only=False):
        def g(*args, **kwargs):
            if key and not (first_chunk_only and len(moe_training.wrapped) > 1 and
                            args[1:2] and args[1] is not moe_training.wrapped[0]):
                counts[key] += 1
            inside[0] += 1
            try:
                return f(*args, **kwargs)
            finally:
                inside[0] -= 1
        return g

    def counted(name, f):
        def g(self, *args, **kwargs):
            if inside[0]:
                counts["syncs"] += 1
                counts[name] = counts.get(name, 0) + 1
            return f(self, *args, **kwargs)
        return g

    moe_training = training.moe
    saved = {name: getattr(torch.Tensor, name) for name in HOST_SYNCS}
    grad_fn = hf_objective._LoadBalancingGradient.backward
    positions = micro_batch.held_positions
    own = {"begin": moe_training.begin, "forward_done": moe_training.forward_done}
    routers = [(m, m.routing) for chunk in training.models for m in chunk.modules() if isinstance(m, TopKRouter)]
    for m, routing in routers:
        m.routing = scoped(routing, "router_calls")
    moe_training.begin = scoped(own["begin"], "micro_batches", first_chunk_only=True)
    moe_training.forward_done = scoped(own["forward_done"])
    hf_objective._LoadBalancingGradient.backward = staticmethod(scoped(grad_fn))
    micro_batch.held_positions = scoped(positions, "position_builds")
    for name, f in saved.items():
        setattr(torch.Tensor, name, counted(name, f))
    try:
        yield counts
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)
        hf_objective._LoadBalancingGradient.backward = staticmethod(grad_fn)
        micro_batch.held_positions = positions
        for name in own:
            delattr(moe_training, name)
        for m, routing in routers:
            m.routing = routing


def _vision_probes(training, seen: list, job: dict) -> contextlib.ExitStack:
    """A job's probes of its vision encoders: with ``count_vision_tiles``, the tiles each forward of this rank's
    encoder takes (after :mod:`megatron_vlm.model.vision_share` has cut its share) appended to ``seen``; with
    ``wrong_vision_gather``, the control: the CP gather's shares put back in reverse rank order. Closed after the steps."""
    from unittest import mock

    from megatron_vlm.model import vision_share

    stack = contextlib.ExitStack()
    if job.get("count_vision_tiles"):
        for model in training.models:
            for name, module in model.named_modules():
                if name.split(".")[-1] == "vision_model":
                    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(int(args[0].shape[0])))
                    stack.callback(handle.remove)
    if job.get("wrong_vision_gather"):
        right = vision_share.gather_rows
        stack.enter_context(mock.patch.object(vision_share, "gather_rows",
                                              lambda counts, width: right(counts, width)[::-1]))
    return stack


def _start(job: dict, cfg, spec, iter_dir, rt):
    """The job's Training, fresh from ``iter_dir``'s weights or resumed as the trainer resumes."""
    from megatron_vlm.training import checkpointing, resume
    from megatron_vlm.training.build import build_training

    if job.get("resume"):  # as the trainer: the plan (which fixes the loss objective) before the model
        plan = resume.plan(cfg, job["resume"], rt.tp, rt.pp, rt.dp)
        plan.load_data = False  # the job feeds its own batches
    training = build_training(cfg, spec, init_from=None if job.get("resume") else iter_dir)
    if job.get("resume"):
        if job.get("reload_weights", True):
            resume.restore(training, plan)
        else:  # the defect: weights loaded, the optimizer's fp32 main params left as they were
            checkpointing.load(plan.iter_dir, training.models, training.optimizer, training.scheduler, False,
                               with_rng=False, with_data=False)
    return training


def train_jobs(jobs: list[dict], megatron_dir, hf_dir, global_batches: list[list]) -> list | None:
    """Run each job; returns per job {'loss': [...], 'grad_norm': [...] (None: a skipped fp16 step),
    'loss_scale': [...], 'readers': [global ranks that read data], 'weights':
    [every rank's :func:`weights_digest` after the last step], 'threads': [every rank's
    :func:`~megatron_vlm.runtime.spawn.thread_names` once the job's objects are dropped]} (on rank 0; None
    elsewhere).

    Job keys: TrainConfig fields (tp, pp, precision, dist_optim, micro_batch_size, overlap_grad_reduce, ...),
    plus ``steps`` (default: all global batches), ``start`` (the first global batch, default 0), ``save`` (a
    run dir to save a checkpoint to after the last step, or after step ``save_after`` of the job, with optimizer
    state unless save_optim=False) and
    ``resume`` (an iteration dir to restore before the first step, the way the trainer resumes; with
    ``reload_weights=False`` the optimizer's main params are deliberately not refreshed, the defect the resume
    must avoid); with ``refused=True`` the job's set-up (build, resume) must fail: the job returns only
    ``{'name', 'error'}``, the exception's type and message, or None if nothing refused it;
    ``unchecked_expert_layout=True`` lifts the refusal of an expert layout the installed megatron-core trains wrong
    (:func:`megatron_vlm.runtime.mcore_version.expert_layout_problem`), to write a fixture of what an older release did.
    ``evaluate`` (a number of micro batches): the trainer's evaluation (:func:`megatron_vlm.training.step.evaluate`)
    of that many micro batches of the first global batch after the last step, as 'val_loss' (every one of them, with
    virtual pipeline stages too).
    ``answer_after`` (a step; with the job's ``eval_generate_*`` fields and ``tokenizer_load_dir``): the trainer's
    held-out answers (:class:`megatron_vlm.training.answers.InLoopAnswers`) after that step, their rows as 'answers'.
    ``count_step_syncs``: count the host syncs of the second step (:mod:`tests.support.sync_count`, the batches
    the ranks read on the host), every rank's counts by site as 'step_syncs'.
    ``count_syncs``: count a mixture-of-experts model's per-router path in the first step (:func:`moe_host_syncs`),
    every rank's counts as 'host_syncs'.
    ``count_vision_tiles``: every rank's tiles per vision-encoder forward, as 'vision_tiles' (its CP share);
    ``wrong_vision_gather``: the CP share's control, its gather in the wrong order (:func:`_vision_probes`).
    ``pack`` (with ``packing_buffer_size``, ``packed_seq_length`` and micro batch size 1): each micro batch is one pack
    of that many consecutive samples of the DP rank's slice, made by the trainer's packing encoder.
    ``grads``: also return, as 'grads', every model chunk's (coordinates, local gradients) of the first step, and
    as 'layout' the keyword arguments of :func:`tests.support.grad_reference.assemble` (tp, pp, layers, ep,
    etp), which turns them into HF-named gradients (with virtual pipeline stages each chunk is a stage of a
    ``pp x vpp``-stage pipeline, :mod:`tests.support.chunk_views`); an MoE model's routing numbers of each
    step come as 'moe'.
    ``megatron_dir``, ``hf_dir`` and ``batches`` give a job its own model and global batches (default: the
    arguments), so one world trains several models: ``global_batches`` is then a dict and ``batches`` names one;
    a value of that dict may be a recipe, ``(hf_dir, n, uniform, repeat[, videos])``, which every rank makes with
    :func:`variable_length_batches` (``repeat`` times over), so that no tensor crosses to the ranks. ``batches``
    may also be such a recipe itself, or the job's own list of global batches.
    """
    from megatron_vlm.model.context_parallel import length_multiple
    from megatron_vlm.model.host_layout import HostLayoutLLaVAModel
    from megatron_vlm.training import batch_feed
    from megatron_vlm.training.build import release
    from megatron_vlm.training.config.resolve import settle_with_spec
    from megatron_vlm.training.step import train_step
    from megatron_vlm.training.trainer import pad_multiple

    out = []
    default, made = (megatron_dir, hf_dir, global_batches), {}
    for job in jobs:
        megatron_dir, hf_dir = job.get("megatron_dir", default[0]), job.get("hf_dir", default[1])
        own = job.get("batches")  # a key of the global_batches dict, a recipe, or the job's own global batches
        global_batches = default[2] if own is None else own if isinstance(own, (tuple, list)) else default[2][own]
        if isinstance(global_batches, tuple):
            recipe, global_batches = global_batches, made.get(global_batches)
            if global_batches is None:
                global_batches = made[recipe] = variable_length_batches(
                    recipe[0], recipe[1], uniform=recipe[2], videos=recipe[4] if len(recipe) > 4 else 0) * recipe[3]
        iter_dir = ckpt.resolve_iteration_dir(megatron_dir)
        spec = VLMSpec.load(iter_dir)
        steps = job.get("steps", len(global_batches) - job.get("start", 0))
        cfg = job_config(job, steps, len(global_batches[0]))
        settle_with_spec(cfg, spec)  # as the trainer: e.g. sequence parallelism for an MoE LM at TP > 1
        # for batch() only; sequence and context parallelism split the image-expanded length, as the trainer pads it
        packed = dict(packed_seq_length=cfg.packed_seq_length, sample_multiple=length_multiple(cfg.cp)) \
            if job.get("pack") else {}
        encoder = batching_encoder(hf_dir, spec, pad_multiple(cfg), **packed)
        collate, group = encoder.batch, cfg.micro_batch_size
        if job.get("pack"):  # each micro batch one pack of that many consecutive samples, as the loader packs them
            collate = _packing(encoder)
            group = job["pack"]
        rt = _setup(cfg, spec)
        if job.get("refused"):  # the set-up must fail, on every rank alike, before a step
            try:
                training = _start(job, cfg, spec, iter_dir, rt)
                error = None
            except Exception as e:  # noqa: BLE001 - the refusal is the result
                training, error = None, f"{type(e).__name__}: {e}"
            out.append({"name": job.get("name"), "error": error})
            if training is not None:
                release(training)
            del training
            gc.collect()
            continue
        if job.get("unchecked_expert_layout"):  # a fixture of what an older release trained at a refused layout
            from unittest import mock

            with mock.patch("megatron_vlm.runtime.mcore_version.expert_layout_problem", return_value=None):
                training = _start(job, cfg, spec, iter_dir, rt)
        else:
            training = _start(job, cfg, spec, iter_dir, rt)
        views = chunk_views.views(training, rt, cfg, spec)  # VPP: each chunk as a stage of a wider pipeline
        if job.get("grads"):
            from tests.support import grad_reference

            captured = [grad_reference.capture(v.training) for v in views]
        losses, norms, scales, moe = [], [], [], []
        first = job.get("start", 0)
        # as the trainer: only the ranks batch_feed.reads_data names read (batch) the data; distribute() hands
        # it to the other TP ranks of the first/last stage
        reads = batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp)
        save_after = job.get("save_after", steps) if job.get("save") else None
        syncs: dict = {}
        probe = moe_host_syncs(training, syncs) if job.get("count_syncs") else contextlib.nullcontext()
        step_syncs = None
        tiles_seen: list[int] = []
        vision = _vision_probes(training, tiles_seen, job)
        answers = None
        for k, gb in enumerate(global_batches[first:first + steps], 1):
            mine = micro_batches(collate, gb, rt.dp, rt.dp_rank, group) if reads else \
                [None] * (len(gb) // rt.dp // group)
            batches = batch_feed.distribute(mine, rt.device)
            counting = job.get("count_step_syncs") and k == min(2, steps)  # a steady step: the second
            # the host batches: a reader's own, a TP rank's received one but its pixels (batch_feed.distribute)
            host = sync_count.batch_tensors(mine) + sync_count.batch_tensors(batches, skip=("images",))
            counter = sync_count.SyncCounter(host=host + sync_count.optimizer_host_state(training.optimizer),
                                             host_functions=[(HostLayoutLLaVAModel, "host_layout")]) \
                if counting else None
            with probe if k == 1 else contextlib.nullcontext():  # the first step: the one the gradients are of
                with counter if counter is not None else contextlib.nullcontext():
                    r = train_step(training, batches, cfg, rt.device)
            if counter is not None:
                step_syncs = counter.by_site()
            losses.append(r.loss)
            norms.append(r.grad_norm)
            scales.append(r.loss_scale)
            moe.append(r.moe)
            if k == save_after:
                _save(job, first + k, cfg, rt, spec, training, iter_dir, len(gb))
            if k == job.get("answer_after"):  # the trainer's held-out answers between two steps
                from megatron_vlm.training.answers import InLoopAnswers

                answers = InLoopAnswers(cfg, spec, training)(first + k, progress=False)[0]
        vision.close()
        val = None
        if job.get("evaluate"):  # the trainer's evaluation (forward only) of the first global batch, weights as now
            from megatron_vlm.training.step import evaluate

            gb = global_batches[first]
            mine = micro_batches(encoder.batch, gb, rt.dp, rt.dp_rank, cfg.micro_batch_size) if reads else \
                [None] * (len(gb) // rt.dp // cfg.micro_batch_size)
            val = evaluate(training, batch_feed.distribute(mine[:job["evaluate"]], rt.device), cfg, rt.device)
        world = torch.distributed.get_world_size()
        vals: list = [None] * world
        torch.distributed.all_gather_object(vals, val)
        readers: list = [None] * world
        torch.distributed.all_gather_object(readers, reads)
        digests: list = [None] * world
        torch.distributed.all_gather_object(digests, weights_digest(training))
        vals: list = [None] * world
        torch.distributed.all_gather_object(vals, val)
        if job.get("count_syncs"):
            every: list = [None] * world
            torch.distributed.all_gather_object(every, syncs)
        result = {"name": job.get("name"), "loss": losses, "grad_norm": norms, "loss_scale": scales,
                  "readers": [r for r, x in enumerate(readers) if x], "weights": digests, "moe": moe,
                  "val_loss": next((v for v in vals if v is not None), None), "answers": answers}
        if job.get("count_syncs"):  # every rank's counts of its per-router path in the first step
            result["host_syncs"] = every
        if job.get("count_vision_tiles"):  # every rank's tiles per vision-encoder forward
            result["vision_tiles"] = [None] * world
            torch.distributed.all_gather_object(result["vision_tiles"], tiles_seen)
        if job.get("count_step_syncs"):  # every rank's syncing calls of the second step, by site
            result["step_syncs"] = [None] * world
            torch.distributed.all_gather_object(result["step_syncs"], step_syncs)
        if job.get("grads"):  # each chunk's (coordinates, first step's gradients); pp: its stage of the views' pipeline
            mine = [(dict(grad_reference.coordinates(), pp=v.stage), c[0]) for v, c in zip(views, captured)]
            # to rank 0 only (the tests read rank 0's results): every tensor's gradient pickled once, unpickled once
            ranks = [None] * world if torch.distributed.get_rank() == 0 else None
            torch.distributed.gather_object(mine, ranks, dst=0)
            result.update(grads=[chunk for rank in ranks for chunk in rank] if ranks is not None else None,
                          layout=dict(tp=cfg.tp, pp=cfg.pp * len(views), ep=cfg.ep, etp=cfg.etp,
                                      layers=chunk_views.stage_layers(training, cfg, spec)))
        out.append(result)
        release(training)
        del training, views
        gc.collect()
        threads: list = [None] * world
        torch.distributed.all_gather_object(threads, thread_names())
        out[-1]["threads"] = threads
    return out if torch.distributed.get_rank() == 0 else None


