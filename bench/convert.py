#!/usr/bin/env python
"""Conversion memory and speed benchmark (not a test): marginal memory and time per extra model byte.

Builds two random bf16 LLaVAs of one shape family (a Llama-like LM of hidden 2048 with --small-layers and
--large-layers layers, even for PP=2, and a CLIP-L/14-336-shaped ViT; ~1.06 GB and ~3.17 GB by default) as sharded
safetensors, like hub models, then runs on each, in one go:

  cp -r of the HF files (the reference) | HF->Megatron TP=2 PP=2 torch_dist | the same, legacy torch |
  Megatron->HF from the torch_dist checkpoint | Megatron->HF from the legacy one

Each step runs as its own process tree at each size once for its memory, then --repeat times for its time (the
fastest run counts). Its peak memory is the sum over the tree of each process's anonymous
memory with shared pages counted in proportion (``Pss_Anon`` of /proc/PID/smaps_rollup), sampled every
--interval seconds: not ``ru_maxrss`` of one child, and not the memory-mapped input files or the page cache. The
sampling run is not timed (reading smaps_rollup walks the process's page tables: 3.4-5.9 s of a core during one
export of the large model, on a 2-core machine). Its time runs until its output is on disk: the machine is synced
before the step, and its output files are flushed (fsync) before the clock stops (the converters flush their own;
a copy is not done while its pages are dirty).
Its CPU time is the user + system time of the tree (``RUSAGE_CHILDREN``), which a busy machine inflates far less
than the time itself.

The printed table gives, per step, the peak at each size and, between the two sizes, the extra peak memory per
extra model byte (target <= 0.10), the extra time per extra byte relative to ``cp``'s (target <= 1.5, aim 1.2) and
the extra CPU time per extra byte relative to ``cp``'s: fixed costs (Python start-up, imports, the tiny tensors)
cancel out. Beside the time ratio, "per repeat" gives the range of the same ratio taken from each timed repeat's
own pair of runs: a converter's process pays 7-10 s of fixed costs whose time moves by a second or more between
identical runs on a shared machine, against a marginal of 1-3 s between the default sizes, and that range shows how
far one run of the bench can be trusted. The page cache is set the same way before every run of every step
(``--cache``): ``warm`` (the default) evicts the bench's other files from the cache and reads the step's input files
once, so every step copies from memory and finds free memory for its output; ``cold`` drops the kernel's page
cache (root: /proc/sys/vm/drop_caches), so every step reads its input from the disk. Left to itself, what the cache
holds depends on which step ran before (the bench's files, ~17 GB, about fill a 24 GB machine's cache), and a
time ratio against ``cp`` then measures that. With every run it prints the cores other work kept busy meanwhile
(the machine's busy CPU time from /proc/stat less the run's own; a load average counts the run's processes too);
the time ratios are a measurement only where that stays under half a core in every run:
``python bench/convert.py --repeat 3`` (add ``--cache cold`` as root). On a virtual machine that hands free pages
back to its host, first writes wait for the host; the bench prints their cost at its start and end, and with every
run the memory handed back meanwhile, since that moves ``cp``'s time as much as a converter's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: a run counts as a measurement of time only while other work kept fewer cores than this busy (the kernel's
#: writeback of the run's own output counts as other work: ~0.2 cores measured with nothing else running)
IDLE_CORES = 0.5
#: a virtual machine's free page reporting: what its kernel has handed back to the host, whose next write to such a
#: page waits for the host to back it again (absent on physical machines and kernels without it)
REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")
#: seconds per GB of first writes above which the bench says the host's backing is in its time ratios
SLOW_FRESH_MEMORY = 1.0


def _reported_kib() -> int | None:
    try:
        return int(REPORTED_KIB.read_text())
    except (OSError, ValueError):
        return None


def fresh_memory_cost(nbytes: int = 256 << 20) -> float:
    """Seconds per GB to write pages nothing has touched yet (one byte per page of a fresh anonymous mapping; a
    second write of the same pages took 0.13-0.22 s per GB here). A virtual machine whose free pages go back to its
    host waits for the host at each first write: 0.7-1.6 s per GB by this probe on 2026-11-28, and `cp` into such
    pages 4-7 s per GB at times. Every run's output and working memory pay it, cp's included, so the bench prints it:
    it moves every time ratio (docs/performance.md)."""
    import mmap

    m = mmap.mmap(-1, nbytes)
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, mmap.PAGESIZE):
            m[off] = 1
        return (time.perf_counter() - t) / nbytes * 1e9
    finally:
        m.close()


def make_model(out: Path, layers: int, hidden: int, vision_layers: int) -> int:
    """Write a random bf16 LLaVA as 1 GiB safetensors shards; returns the weight bytes."""
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from megatron_vlm.data.chat_template import llava_chat_template
    from megatron_vlm.convert.hf_io import SafetensorsWriter
    from megatron_vlm.convert.mapping import canonical_hf_name
    from tests.support.tiny import text_config, train_tokenizer
    from megatron_vlm.model.tokenizer import add_vlm_tokens

    out.mkdir(parents=True)
    tok = train_tokenizer(out, family="llama")
    add_vlm_tokens(tok)
    tok.chat_template = llava_chat_template()
    tok.save_pretrained(str(out))
    text = text_config("llama", vocab_size=32064, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                       rope_scaling=None, rope_theta=500000.0)
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=vision_layers,
                              num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
    cfg = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                      image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                      vision_feature_select_strategy="default", image_seq_length=576, dtype="bfloat16")
    cfg.save_pretrained(str(out))
    with torch.device("meta"):
        meta_model = LlavaForConditionalGeneration(cfg)
    tensors = {canonical_hf_name(n): p for n, p in meta_model.state_dict().items()}
    writer = SafetensorsWriter(out, [(n, torch.bfloat16, tuple(p.shape)) for n, p in tensors.items()],
                               max_shard_bytes=2**30)
    g = torch.Generator().manual_seed(0)
    for name, p in tensors.items():
        writer.write(name, (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.close()
    return writer.total


def _evict(paths) -> None:
    """Drop the clean page-cache pages of ``paths`` (``POSIX_FADV_DONTNEED``: any user, only these files)."""
    os.sync()  # dirty pages are not dropped
    for f in paths:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def set_cache(how: str, inputs: Path, work: Path) -> None:
    """Put the page cache in the state ``how`` names before a run: ``cold`` syncs and drops the kernel's clean page
    cache; ``warm`` evicts the bench's other files under ``work`` from the cache, then reads every file under
    ``inputs`` (16 MiB at a time into one buffer). The eviction matters: with the bench's ~17 GB of files filling a
    24 GB machine's cache, a run's output pages otherwise come from reclaiming the cache, in the run's own time and
    as much as the free memory left by the runs before says (the same export of the large model measured 2.9 to
    7.9 s of system time, the whole bench's torch_dist export 1.0x to 6.6x `cp`)."""
    if how == "cold":
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as e:
            raise SystemExit(f"--cache cold drops the page cache through /proc/sys/vm/drop_caches, which this user "
                             f"cannot write ({e.strerror}): run as root, or use --cache warm") from None
        return
    _evict(p for p in work.rglob("*") if p.is_file() and inputs not in p.parents)
    buf = bytearray(16 << 20)
    for f in sorted(p for p in inputs.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (each of its threads may have started some)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def tree_anon(root: int) -> int:
    """Sum of Pss_Anon over ``root`` and its descendants (bytes)."""
    from megatron_vlm.convert.streaming import anon_bytes

    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += anon_bytes(pid) or 0
        todo += _children(pid)
    return total


def _busy_cpu() -> float:
    """CPU seconds the whole machine has been busy (every process: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(cmd: list[str], interval: float, output: Path) -> tuple[float, int, float, float, float | None]:
    """(seconds until ``output`` is on disk, peak Pss_Anon of the process tree, CPU seconds of the tree, cores that
    other work kept busy meanwhile, GB the kernel handed back to a virtual machine's host meanwhile) of ``cmd``. The
    fourth is the machine's busy CPU time over the run less the tree's (and this script's sampler), per second: what
    a load average cannot tell, since it counts the tree itself."""
    from megatron_vlm.files.atomic import fsync_tree

    os.sync()
    reported = _reported_kib()
    cpu, busy = _children_cpu(), _busy_cpu()
    t = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_anon(proc.pid))
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True) if interval else None
    if sampler:
        sampler.start()
    out = proc.communicate()[0]
    done.set()
    if sampler:
        sampler.join()
    fsync_tree(output)  # (the converters flushed their own files already: a metadata check each)
    secs = time.time() - t
    if proc.returncode:
        sys.stderr.write(out[-4000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    tree = _children_cpu() - cpu
    after = _reported_kib()
    to_host = None if reported is None or after is None else (after - reported) * 1024 / 1e9
    return secs, peak[0], tree, max(0.0, _busy_cpu() - busy - tree) / secs, to_host


def per_repeat(runs: list[dict], step: str, extra: int, cp_marginal: float) -> list[float]:
    """The extra time per extra byte, x ``cp``'s (the fastest runs' marginal), from each timed repeat's own pair of
    runs of ``step`` (small, then large, consecutive): the spread of one bench run's ratio."""
    timed = [r for r in runs if r["step"] == step and r["timed"]]
    pairs = zip(timed[0::2], timed[1::2])
    return [(lg["seconds"] - sm["seconds"]) / extra / cp_marginal for sm, lg in pairs
            if sm["size"] == "small" and lg["size"] == "large"]


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/mvlm-bench-convert", help="scratch directory (replaced, then removed)")
    p.add_argument("--small-layers", type=int, default=2, help="LM layers of the small model (~1.06 GB)")
    p.add_argument("--large-layers", type=int, default=26, help="LM layers of the large model (~3.2 GB)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vision-layers", type=int, default=24)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between memory samples")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each step at each size; the fastest counts (a shared machine's load comes in spikes)")
    p.add_argument("--cache", choices=("warm", "cold"), default="warm",
                   help="the page cache before every run: warm (the bench's other files evicted, the step's inputs "
                        "read once: copies from memory) or cold (dropped, root only: every step reads its input from "
                        "the disk)")
    p.add_argument("--steps", default=None,
                   help="comma-separated substrings of the names of the steps to run (e.g. 'torch_dist': its import "
                        "and export); cp, the reference, always runs; an export needs the import that writes its input")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--reuse-models", action="store_true",
                   help="use the models an earlier run left in --work with --keep (building them takes minutes)")
    a = p.parse_args(argv)
    py = sys.executable
    steps = [  # (name, input, output, command)
        ("cp -r (reference)", "hf", "hf_copy", lambda d: ["cp", "-r", str(d / "hf"), str(d / "hf_copy")]),
        ("HF->Megatron torch_dist tp2 pp2", "hf", "meg_dist", lambda d: [
            py, "convert/hf_to_megatron.py", "--hf-dir", str(d / "hf"), "--megatron-dir", str(d / "meg_dist"),
            "--tp", "2", "--pp", "2"]),
        ("HF->Megatron legacy torch tp2 pp2", "hf", "meg_legacy", lambda d: [
            py, "convert/hf_to_megatron.py", "--hf-dir", str(d / "hf"), "--megatron-dir", str(d / "meg_legacy"),
            "--tp", "2", "--pp", "2", "--ckpt-format", "torch"]),
        ("Megatron->HF from torch_dist", "meg_dist", "hf_dist", lambda d: [
            py, "convert/megatron_to_hf.py", "--megatron-dir", str(d / "meg_dist"), "--hf-dir",
            str(d / "hf_dist")]),
        ("Megatron->HF from legacy torch", "meg_legacy", "hf_legacy", lambda d: [
            py, "convert/megatron_to_hf.py", "--megatron-dir", str(d / "meg_legacy"), "--hf-dir",
            str(d / "hf_legacy")]),
    ]
    if a.steps:
        wanted = [w.strip() for w in a.steps.split(",") if w.strip()]
        chosen = [s for s in steps if s[0].startswith("cp") or any(w in s[0] for w in wanted)]
        if len(chosen) == 1:
            raise SystemExit(f"--steps {a.steps!r} names no step; the steps are: "
                             + ", ".join(repr(s[0]) for s in steps[1:]))
        steps = chosen
    work = Path(a.work)
    if a.reuse_models:
        for size in ("small", "large"):
            for d in (work / size).iterdir() if (work / size).is_dir() else ():
                if d.name != "hf":
                    shutil.rmtree(d)
    else:
        shutil.rmtree(work, ignore_errors=True)
    sizes, rows, runs = {}, {}, []
    load = [os.getloadavg()]
    fresh = [fresh_memory_cost()]
    try:
        for size, layers in (("small", a.small_layers), ("large", a.large_layers)):
            t = time.time()
            if a.reuse_models and (work / size / "hf" / "config.json").is_file():
                from megatron_vlm.convert.hf_io import HFReader

                reader = HFReader(work / size / "hf")
                sizes[size] = sum(reader.info(n).nbytes for n in reader.names())
                print(f"{size} model: {sizes[size] / 1e9:.2f} GB of bf16 weights (reused)", flush=True)
                continue
            sizes[size] = make_model(work / size / "hf", layers, a.hidden, a.vision_layers)
            print(f"{size} model: {sizes[size] / 1e9:.2f} GB of bf16 weights ({layers} LM layers), built in "
                  f"{time.time() - t:.0f} s", flush=True)
        for name, inp, out, cmd in steps:
            # one run samples the memory, --repeat runs are timed: the sampler's reads of smaps_rollup walk the
            # process's page tables (mapped checkpoints: 3.4-5.9 s of a core during one export here), which on a
            # small machine slowed the run it measured
            for timed in [False] + [True] * a.repeat:
                for size in ("small", "large"):
                    shutil.rmtree(work / size / out, ignore_errors=True)  # each run writes a fresh output
                    set_cache(a.cache, work / size / inp, work)
                    secs, peak, cpu, others, to_host = measured(cmd(work / size), None if timed else a.interval,
                                                                work / size / out)
                    best = rows.setdefault(name, {}).get(size, (float("inf"), 0, float("inf")))
                    rows[name][size] = ((min(secs, best[0]), best[1], min(cpu, best[2])) if timed
                                        else (best[0], max(peak, best[1]), best[2]))
                    runs.append({"step": name, "size": size, "timed": timed, "seconds": secs, "cpu_seconds": cpu,
                                 "peak": peak, "load": os.getloadavg()[0], "other_cores": others,
                                 "to_host_gb": to_host})
                    what = (f"{secs:7.1f} s  cpu {cpu:6.1f} s" if timed else f"peak {peak / 1e9:6.3f} GB (memory run)")
                    host = "" if to_host is None else f"; {to_host:.1f} GB handed to the host"
                    print(f"  {name:36s} {size:5s} {what}  (other work: {others:.2f} cores; load "
                          f"{os.getloadavg()[0]:.1f}{host})", flush=True)
            if name.startswith("cp"):  # the copy's output is not needed again
                for size in ("small", "large"):
                    shutil.rmtree(work / size / out, ignore_errors=True)
        load.append(os.getloadavg())
        fresh.append(fresh_memory_cost())
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    extra = sizes["large"] - sizes["small"]
    cp = rows["cp -r (reference)"]
    cp_marginal = (cp["large"][0] - cp["small"][0]) / extra
    cp_cpu = (cp["large"][2] - cp["small"][2]) / extra
    busiest = max(r["load"] for r in runs)
    others = max(r["other_cores"] for r in runs if r["timed"])  # the memory runs count the sampler
    print(f"\nmodels: {sizes['small'] / 1e9:.2f} GB and {sizes['large'] / 1e9:.2f} GB (+{extra / 1e9:.2f} GB); cp: "
          f"{cp_marginal * 1e9:.2f} s and {cp_cpu * 1e9:.2f} CPU-s per extra GB, page cache {a.cache} before "
          f"every run; load average {load[0][0]:.1f} at "
          f"the start, {load[-1][0]:.1f} at the end, at most {busiest:.1f} after a run (1 min, the runs' own "
          f"processes included); other work kept at most {others:.2f} cores busy during a run"
          + ("" if others < IDLE_CORES else ": NOT an idle machine, the time ratios are no measurement"))
    print(f"first writes to fresh memory: {fresh[0]:.2f} s per GB at the start, {fresh[-1]:.2f} at the end"
          + (f" (above {SLOW_FRESH_MEMORY} s: this machine hands free pages back to its host, and every run waits "
             f"for them again at its first writes, cp's included: the time ratios compare those waits too)"
             if max(fresh) > SLOW_FRESH_MEMORY else ""))
    print(f"{'step':36s} {'peak small':>11s} {'peak large':>11s} {'x model (large)':>16s} "
          f"{'extra mem / extra byte':>23s} {'extra time / extra byte, x cp':>30s} {'per repeat':>12s} "
          f"{'extra CPU, x cp':>16s}")
    results = {"model_bytes": sizes, "cache": a.cache, "load_average": load, "max_load_after_a_run": busiest,
               "max_other_cores": others, "fresh_memory_s_per_gb": fresh, "runs": runs, "rows": {}}
    for name, r in rows.items():
        (ts, ps, cs), (tl, pl, cl) = r["small"], r["large"]
        mem = (pl - ps) / extra
        tim = (tl - ts) / extra / cp_marginal
        cpu = (cl - cs) / extra / cp_cpu if cp_cpu > 0 else float("nan")
        spread = per_repeat(runs, name, extra, cp_marginal)
        span = f"{min(spread):.2f}-{max(spread):.2f}" if spread else "-"
        print(f"{name:36s} {ps / 1e9:9.3f} GB {pl / 1e9:8.3f} GB {pl / sizes['large']:16.2f} {mem:23.3f} "
              f"{tim:30.2f} {span:>12s} {cpu:16.2f}")
        results["rows"][name] = {"seconds": [ts, tl], "cpu_seconds": [cs, cl], "peak_pss_anon": [ps, pl],
                                 "marginal_memory": mem, "marginal_time_x_cp": tim, "marginal_cpu_x_cp": cpu,
                                 "marginal_time_x_cp_per_repeat": spread}
    print("(per repeat: the same ratio from each timed repeat's own pair of runs, small then large, one after the "
          "other: how far one run's fixed costs, which do not cancel within a pair, move it)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
