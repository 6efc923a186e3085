"""Training metrics: throughput, timers, ETA, console lines, TensorBoard events and (optionally) Weights & Biases.

``<run_dir>/metrics.jsonl`` gets one record per iteration (loss, lr, grad norm, samples, tokens, images and model
FLOPs of the global batch, wall-clock ``time`` when the iteration ended, the step's ``timers`` in seconds,
:mod:`.timers`), one per evaluation (``val_loss``) and one per answering of held-out samples
(``--eval-generate-interval``, :mod:`.answers`: ``eval_exact`` and ``eval_vqa`` accuracies in [0, 1],
``eval_samples``, ``eval_seconds``); benchmarks and the demo read their curves and throughput from it. The records
are written at each log interval and before each evaluation and checkpoint: a step leaves its numbers on the device
(:class:`~megatron_vlm.training.step.StepResult`) and one host read takes those of all the iterations since the
last write, so the loop syncs once per log interval, not per step.

Throughput counts real work: ``tokens`` are the image-expanded positions of the samples themselves (never the
padding of a row or of a pack), samples are samples (a pack counts the samples in it), and the model FLOPs behind
TFLOP/s and MFU are those of the real samples (:mod:`.flops`). With sequence packing the record and the console line
also give the padding fraction (pad positions / positions the language model ran: global batch x
``--packed-seq-length``) and the packing efficiency (samples per pack).

A mixture-of-experts model's records also carry its routing numbers (:mod:`.moe`): the load-balancing
loss (and z-loss) per MoE layer and their mean, each layer's expert-load imbalance and tokens per expert; the
console line gives the mean loss and the worst layer's imbalance, TensorBoard the same under ``moe/`` (each layer
too with ``--moe-per-layer-logging``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("megatron_vlm.train")


class MetricsLogger:
    """Collects per-iteration numbers and writes them at a log interval or a checkpoint (:meth:`flush`).

    Every rank makes one (``enabled`` on the logging rank only): all ranks read their step timers at the log
    intervals and meet in :func:`~megatron_vlm.training.timers.over_ranks`; the logging rank also keeps each
    iteration's :class:`~megatron_vlm.training.step.StepResult` (device tensors) until a flush reads them all with
    one host sync."""

    def __init__(self, cfg, total_iters: int, enabled: bool, start_iter: int = 0, flops=None, world_size: int = 1,
                 peak_flops: float | None = None, timers=None, device=None):
        """``flops``: a :class:`~megatron_vlm.training.flops.StepFlops` (model FLOPs of an iteration); TFLOP/s are
        per process (``world_size`` processes), MFU against ``peak_flops`` per process where it is known.
        ``timers``: the loop's :class:`~megatron_vlm.training.timers.StepTimers` (``device``: where their
        cross-rank numbers meet)."""
        self.cfg = cfg
        self.flops = flops
        self.world_size = world_size
        self.peak_flops = peak_flops
        self.total = total_iters
        self.enabled = enabled
        self.start_iter = start_iter
        self.timers, self.device = timers, device
        self.t_start = time.time()
        self.t_last = time.time()
        self.window = self._empty_window()
        self.pending: list = []  # (iteration, StepResult or None when skipped, lr, time)
        self.last_grad_norm = self.last_lr = self.last_moe = None  # of the newest record
        self.tb = None
        self.wandb = None
        self.history_path = Path(cfg.run_dir) / "metrics.jsonl" if enabled else None
        if not enabled:
            return
        tb_dir = cfg.tensorboard_dir or str(Path(cfg.run_dir) / "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(tb_dir)
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.name, dir=str(cfg.run_dir),
                                    config=cfg.to_dict(), resume="allow")

    @staticmethod
    def _empty_window() -> dict:
        return {"loss_sum": 0.0, "tokens_loss": 0.0, "samples": 0, "tokens": 0, "flops": 0.0, "iters": 0,
                "positions": 0, "timed": 0, "timers": {}}

    def step(self, iteration: int, result, lr: float, skipped: bool = False) -> None:
        """Iteration ``iteration`` ended: ``result`` is its :class:`~megatron_vlm.training.step.StepResult` (None
        when ``skipped``); nothing is read from the device here."""
        if self.enabled:
            self.pending.append((iteration, None if skipped else result, lr, time.time()))

    def flush(self) -> None:
        """Write the pending iterations' records (one host sync for all of them) and add them to the log window;
        every rank reads its timers here. The loop calls it at each log interval, before an evaluation or a
        checkpoint, and at the end."""
        times = self.timers.read() if self.timers is not None else []
        if self.timers is not None:
            w = self.window
            for t in times:
                if t is not None:  # None: a skipped iteration (--skip-train-iteration-range)
                    for k, v in t.items():
                        w["timers"][k] = w["timers"].get(k, 0.0) + v
                    w["timed"] += 1
        if not self.enabled or not self.pending:
            self.pending = []
            return
        pending, self.pending = self.pending, []
        values = _read([r for _, r, _, _ in pending if r is not None])
        timed = times if len(times) == len(pending) else [None] * len(pending)  # one per iteration (the loop's)
        with open(self.history_path, "a") as f:
            for (iteration, r, lr, t), timers in zip(pending, timed):
                f.write(json.dumps(self._record(iteration, r, values, lr, t, timers)) + "\n")

    def _record(self, iteration: int, r, values, lr: float, t: float, timers: dict | None) -> dict:
        if r is None:  # --skip-train-iteration-range
            loss_sum, loss_tokens, samples, tokens, images, squares, grad_norm, moe = 0.0, 0.0, 0, 0, 0, 0, None, None
        else:
            loss_sum, loss_tokens, samples, tokens, images, squares, grad_norm = next(values)
            moe = r.moe
        flops = self.flops(samples, tokens, images, squares) if self.flops is not None and samples else 0.0
        w = self.window
        w["flops"] += flops
        w["loss_sum"] += loss_sum
        w["tokens_loss"] += loss_tokens
        w["samples"] += samples
        w["tokens"] += tokens
        w["iters"] += 1
        self.last_grad_norm, self.last_lr, self.last_moe = grad_norm, lr, moe
        record = {"iteration": iteration, "loss": loss_sum / max(loss_tokens, 1.0), "lr": lr,
                  "grad_norm": grad_norm, "skipped": r is None, "samples": samples, "tokens": tokens,
                  "images": images, "flops": flops, "time": t}
        packs = packing_numbers(self.cfg, samples, tokens)
        if packs is not None:
            w["positions"] += packs["positions"]
            record.update(padding_fraction=packs["padding_fraction"], samples_per_pack=packs["samples_per_pack"])
        record.update(moe or {})
        if timers:
            record["timers"] = timers
        return record

    def log(self, iteration: int) -> None:
        """The log interval (every rank, collective when the timers are reported over ranks): flush, then the
        console line, TensorBoard and W&B for the window since the last one."""
        self.flush()
        w = self.window
        stats = None
        if self.timers is not None and w["timed"]:
            from megatron_vlm.training.timers import over_ranks

            stats = over_ranks({k: v / w["timed"] for k, v in sorted(w["timers"].items())},
                               self.cfg.timing_log_option, self.device)
        if not self.enabled or not w["iters"]:
            self.window = self._empty_window()
            return
        now = time.time()
        dt = max(now - self.t_last, 1e-9)
        avg_loss = w["loss_sum"] / max(w["tokens_loss"], 1.0)
        sps, tps = w["samples"] / dt, w["tokens"] / dt
        tflops = w["flops"] / dt / self.world_size / 1e12
        done = iteration - self.start_iter
        eta = (now - self.t_start) / max(done, 1) * (self.total - iteration)
        grad_norm, lr, moe = self.last_grad_norm, self.last_lr, self.last_moe
        gn = "n/a" if grad_norm is None else f"{float(grad_norm):.3f}"
        scalars = {"train/loss": avg_loss, "train/lr": lr}
        throughput = ""
        if self.cfg.log_throughput:
            perf = f"{tflops:.3g} TFLOP/s per {'GPU' if self.cfg.device == 'cuda' else 'process'}"
            scalars.update({"perf/samples_per_s": sps, "perf/tokens_per_s": tps, "perf/tflops_per_gpu": tflops})
            if self.peak_flops:
                scalars["perf/mfu"] = tflops * 1e12 / self.peak_flops
                perf += f" | MFU {100 * scalars['perf/mfu']:.1f}%"
            packed = ""
            if w["positions"]:
                pad = 1.0 - w["tokens"] / w["positions"]
                per_pack = w["samples"] / (w["iters"] * self.cfg.global_batch_size)
                scalars.update({"perf/padding_fraction": pad, "perf/samples_per_pack": per_pack})
                packed = f" | padding {100 * pad:.1f}% | {per_pack:.2f} samples/pack"
            throughput = f" | {sps:.1f} samples/s | {tps:.0f} real tokens/s{packed} | {perf}"
        routing = self._moe_scalars(moe or {}, scalars)
        timing = ""
        if stats:
            from megatron_vlm.training.timers import describe

            timing = " | " + describe(stats, self.cfg.timing_log_option)
            for k, v in stats.items():
                if isinstance(v, list):
                    scalars[f"timers/{k}-max"] = max(v)
                    scalars[f"timers/{k}-min"] = min(v)
                else:
                    scalars[f"timers/{k}-max"] = v
        scalars["perf/iteration_ms"] = 1e3 * dt / w["iters"]
        log.info("iter %d/%d | loss %.4f | lr %.3e | grad norm %s%s%s | %.1f ms/iter | ETA %s%s", iteration,
                 self.total, avg_loss, lr, gn, routing, throughput, scalars["perf/iteration_ms"], _fmt_eta(eta),
                 timing)
        if grad_norm is not None:
            scalars["train/grad_norm"] = float(grad_norm)
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, iteration)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)
        self.window = self._empty_window()
        self.t_last = now

    def _moe_scalars(self, moe: dict, scalars: dict) -> str:
        """Add an MoE step's routing numbers to ``scalars``; return their part of the console line."""
        if not moe:
            return ""
        text = []
        for key, value in moe.items():
            if key.endswith("_per_layer"):
                if self.cfg.moe_per_layer_logging:
                    for layer, v in zip(self.moe_layer_numbers(len(value)), value):
                        scalars[f"moe/{key[4:-10]}_layer_{layer}"] = v
            elif isinstance(value, float):
                scalars[f"moe/{key[4:]}"] = value
                if key != "moe_load_imbalance":
                    text.append(f"{key[4:].replace('_', ' ')} {value:.4g}")
        per_layer = moe["moe_load_imbalance_per_layer"]
        worst = self.moe_layer_numbers(len(per_layer))[per_layer.index(max(per_layer))]
        text.append(f"expert load max/mean {moe['moe_load_imbalance']:.2f} (layer {worst})")
        return " | " + " | ".join(text)

    def moe_layer_numbers(self, n: int) -> list[int]:
        """The language-layer indices of the first ``n`` MoE layers (per-layer lists follow the MoE layers)."""
        layers = getattr(self.flops.spec, "moe_layers", None) if self.flops is not None else None
        return list(layers[:n]) if layers else list(range(n))

    def validation(self, iteration: int, loss: float | None) -> None:
        self.flush()  # the iterations before it first, in order
        if not self.enabled or loss is None:
            return
        log.info("iter %d | validation loss %.4f", iteration, loss)
        with open(self.history_path, "a") as f:
            f.write(json.dumps({"iteration": iteration, "val_loss": loss}) + "\n")
        self.tb.add_scalar("val/loss", loss, iteration)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({"val/loss": loss}, step=iteration)

    def answers(self, iteration: int, rows: list[dict], seconds: float) -> None:
        """The held-out answers of ``--eval-generate-interval`` (:mod:`.answers`): their file, record, console
        lines, TensorBoard and W&B. Their time is left out of the throughput window it falls in."""
        from megatron_vlm.eval.evaluate import scores, write_rows
        from megatron_vlm.training.answers import SHOWN

        self.t_last += seconds
        if not self.enabled:
            return
        s = scores(rows)
        out = Path(self.cfg.run_dir) / "eval_generate" / f"iter_{iteration:07d}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_rows(out, rows)
        log.info("iter %d | held-out answers: accuracy %.1f%% (exact match), %.1f%% (VQA-normalised) over %d samples "
                 "in %.1f s; all in %s", iteration, 100 * s["exact"], 100 * s["vqa"], s["samples"], seconds, out)
        for r in rows[:SHOWN]:
            log.info("  %s %r -> %r (reference %r)", "ok   " if r["vqa_correct"] else "wrong", r["question"][:80],
                     r["prediction"][:80], r["reference"][:80])
        with open(self.history_path, "a") as f:
            f.write(json.dumps({"iteration": iteration, "eval_exact": s["exact"], "eval_vqa": s["vqa"],
                                "eval_samples": s["samples"], "eval_seconds": seconds}) + "\n")
        scalars = {"eval/accuracy_exact": s["exact"], "eval/accuracy_vqa": s["vqa"], "eval/answer_seconds": seconds}
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, iteration)
        table = "| question | reference | answer |\n|---|---|---|\n" + "".join(
            f"| {r['question']} | {r['reference']} | {r['prediction']} |\n" for r in rows[:SHOWN])
        self.tb.add_text("eval/answers", table, iteration)
        self.tb.flush()
        if self.wandb is not None:
            import wandb

            scalars["eval/answers"] = wandb.Table(columns=["question", "reference", "answer"],
                                                  data=[[r["question"], r["reference"], r["prediction"]]
                                                        for r in rows[:SHOWN]])
            self.wandb.log(scalars, step=iteration)

    def close(self) -> None:
        self.flush()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def packing_numbers(cfg, samples: int, tokens: int) -> dict | None:
    """With sequence packing: the positions the language model ran in an iteration (global batch x
    ``--packed-seq-length``: every pack has that fixed shape), the padding fraction of them and the samples per
    pack; None without packing or for an iteration that trained nothing."""
    if not getattr(cfg, "packing", False) or not samples:
        return None
    positions = int(cfg.global_batch_size) * int(cfg.packed_seq_length)
    return {"positions": positions, "padding_fraction": 1.0 - tokens / positions,
            "samples_per_pack": samples / cfg.global_batch_size}


def _fmt_eta(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _read(results: list):
    """The host numbers of ``results`` (StepResults of trained iterations), as an iterator of (loss sum, loss tokens,
    samples, tokens, images, squares, grad norm) per result: every device tensor among them read with one copy."""
    import torch

    if not results:
        return iter(())
    rows = torch.stack([r.values for r in results]).tolist()  # the one sync of a flush
    norms = [r.grad_norm for r in results]
    if any(torch.is_tensor(g) for g in norms):
        at = [i for i, g in enumerate(norms) if torch.is_tensor(g)]
        for i, v in zip(at, torch.stack([norms[i].reshape(()) for i in at]).tolist()):
            norms[i] = v
    return iter((row[0], row[1], int(row[2]), int(row[3]), int(row[4]), row[5], None if g is None else float(g))
                for row, g in zip(rows, norms))
