"""What a built training rank really allocates for weights, gradient buffers and optimizer state, next to
:mod:`megatron_vlm.model.memory`'s estimate of it (the memory tests; also in a multi-process world)."""

from __future__ import annotations

import torch


def measure(training) -> dict:
    """Bytes of this rank's parameters, DDP gradient buffers and optimizer state (fp32 main parameters that are
    not the model's own, Adam's moments: created by one optimizer step on zero gradients)."""
    params = [p for _, p in training.named_parameters()]  # every model chunk of the rank
    weights = sum(p.numel() * p.element_size() for p in params)
    buffers = [b for d in training.ddps for b in list(d.buffers) + list(getattr(d, "expert_parallel_buffers", []) or [])]
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    for p in params:
        if p.requires_grad:
            p.main_grad.zero_()
    training.optimizer.step()
    own = {id(p) for p in params}
    opt = 0
    for o in getattr(training.optimizer, "chained_optimizers", [training.optimizer]):
        inner = o.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    opt += p.numel() * p.element_size()
                for v in inner.state[p].values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        opt += v.numel() * v.element_size()
    return {"weights": weights, "gradients": grads, "optimizer": opt}


def measured_and_estimated(spec, cfg) -> dict:
    """Build this rank's training objects for ``cfg`` (a world already set up) and return both numbers."""
    from megatron.core import parallel_state as ps

    from megatron_vlm.model import memory
    from megatron_vlm.training.build import build_training

    training = build_training(cfg, spec)
    stage = ps.get_pipeline_model_parallel_rank()
    layout = memory.Layout.of_config(cfg, spec=spec)
    est = memory.estimate(spec, layout)[stage]
    return {"stage": stage, "measured": measure(training),
            "estimated": {"weights": est.weights, "gradients": est.gradients, "optimizer": est.optimizer}}


def memory_jobs(spec_json: str, jobs: list[dict]) -> list[dict]:
    """Each job (TrainConfig fields over :data:`~tests.support.train_jobs.BASE`) on this rank."""
    from megatron_vlm.runtime import distributed
    from megatron_vlm.model.spec import VLMSpec
    from tests.support.train_jobs import BASE
    from megatron_vlm.training.config import TrainConfig

    spec = VLMSpec.from_json(spec_json)
    out = []
    for job in jobs:
        cfg = TrainConfig(**{**BASE, "train_iters": 1, "micro_batch_size": 1, **job})
        distributed.setup(cfg.tp, cfg.pp, device="cpu", seed=cfg.seed, ep=cfg.ep, etp=cfg.etp, cp=cfg.cp,
                          vpp=cfg.vpp_size(spec))
        cfg.gpus = torch.distributed.get_world_size()
        cfg.global_batch_size = cfg.dp
        out.append(measured_and_estimated(spec, cfg))
    return out


# ---- peak memory of a training step per rank (context parallelism: bench/context_parallel.py, bench/gpu.py) ------
def _rss() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process (Linux ``/proc/self/status``: VmRSS, VmHWM)."""
    values = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:  # Linux: writing 5 to clear_refs resets the peak resident set (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


class _VisionClock:
    """The vision encoder's forward passes on this rank: tiles, wall seconds and this process's CPU seconds (from
    its input, cut to the rank's share under --vision-cp-split, to its output, gathered over the CP ranks)."""

    def __init__(self, modules):
        import time

        self.tiles, self.wall, self.cpu, self._t = 0, 0.0, 0.0, None
        self._handles = []
        for m in modules:
            def before(_m, args):
                self.tiles += int(args[0].shape[0])
                self._t = (time.perf_counter(), time.process_time())

            def after(_m, _args, _out):
                self.wall += time.perf_counter() - self._t[0]
                self.cpu += time.process_time() - self._t[1]

            self._handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]

    def result(self) -> dict:
        for h in self._handles:
            h.remove()
        return {"vision_tiles": self.tiles, "vision_s": self.wall, "vision_cpu_s": self.cpu}


def _vision_clock(training) -> _VisionClock:
    return _VisionClock([mod for model in training.models for name, mod in model.named_modules()
                         if name.split(".")[-1] == "vision_model"])


def step_peak_jobs(megatron_dir, hf_dir, samples: list, jobs: list[dict]) -> list | None:
    """Per job (TrainConfig fields over :data:`~tests.support.train_jobs.BASE`: cp, tp, precision,
    transformer_impl, device, ...): one training step on every rank of one global batch, ``samples`` (encoded
    samples; each data-parallel rank takes its share), from the checkpoint's weights. Returns per job (rank 0) every
    rank's memory (bytes) and the step's loss and seconds: on CUDA ``peak`` is ``max_memory_allocated`` during the
    step and ``before`` what was allocated when it began; on CPU ``peak`` is the process's peak resident set during
    the step (VmHWM, reset when it began) and ``before`` its resident set then (the model, optimizer and libraries).
    ``time_vision``: each rank also reports its vision encoder's forward passes (:class:`_VisionClock`)."""
    import time

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.runtime import distributed
    from tests.support.train_jobs import batching_encoder, job_config, micro_batches
    from megatron_vlm.training import batch_feed
    from megatron_vlm.training.build import build_training, release
    from megatron_vlm.training.step import train_step
    from megatron_vlm.training.trainer import pad_multiple

    out = []
    iter_dir = ckpt.resolve_iteration_dir(megatron_dir)
    spec = VLMSpec.load(iter_dir)
    for job in jobs:
        cfg = job_config({k: v for k, v in job.items() if k not in ("name", "time_vision")}, 1, len(samples))
        rt = distributed.setup(cfg.tp, cfg.pp, device=cfg.device, seed=cfg.seed, ep=cfg.ep, etp=cfg.etp, cp=cfg.cp)
        encoder = batching_encoder(hf_dir, spec, pad_multiple(cfg), cfg.seq_length)
        training = build_training(cfg, spec, init_from=iter_dir)
        reads = batch_feed.reads_data(rt.tp_rank, rt.pp_rank, rt.pp)
        mine = micro_batches(encoder.batch, samples, rt.dp, rt.dp_rank, cfg.micro_batch_size) if reads else \
            [None] * (len(samples) // rt.dp // cfg.micro_batch_size)
        fed = batch_feed.distribute(mine, rt.device)
        if rt.device.type == "cuda":
            before = torch.cuda.memory_allocated()
        else:
            before = _rss()[0]
        vision = _vision_clock(training) if job.get("time_vision") else None
        _reset_peak(rt.device)
        t0 = time.perf_counter()
        r = train_step(training, fed, cfg, rt.device)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if rt.device.type == "cuda" else _rss()[1]
        mem: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(mem, {"before": before, "peak": peak, "seconds": seconds,
                                                  **(vision.result() if vision else {})})
        out.append({"name": job.get("name"), "loss": r.loss, "grad_norm": r.grad_norm, "ranks": mem,
                    "positions": max(int(s.num_tokens) for s in samples)})
        release(training)
        del training
    return out if torch.distributed.get_rank() == 0 else None

