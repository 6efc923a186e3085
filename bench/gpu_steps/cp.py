"""The ``cp`` step of bench/gpu.py: context parallelism, one step of ONE long sample (``--cp-images`` images) at CP1 and
at CP2 (TE's p2p attention, or local layers' reference attention on CPU), each in its own local world from the
same weights: equal losses and the peak memory per rank; CP2 needs two GPUs."""

from __future__ import annotations

from pathlib import Path


def cp_sample(a, hf: Path):
    """One long sample of the set-up's LLaVA: ``--cp-images`` images (576 positions each at the default 336 px), a
    question between them and a one-word answer; its positions, rounded up to a multiple of 64, are the run's
    ``--seq-length``."""
    from PIL import Image

    from megatron_vlm.data.synthetic import image_array
    from megatron_vlm.data.task_encoder import VLMSample
    from tests.support.train_jobs import encoder_for

    enc = encoder_for(hf, 1 << 20)
    images = [Image.fromarray(image_array(a.image_size, i)) for i in range(a.cp_images)]
    content = [p for _ in images for p in ({"type": "image"}, {"type": "text", "text": "what colour is the square ?"})]
    fields = enc.encode_conversation([{"role": "user", "content": content},
                                      {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], images,
                                     "cp")
    sample = VLMSample(__key__="cp", __restore_key__=(), __subflavors__=None, __sources__=None, **fields)
    return sample, -(-int(sample.num_tokens) // 64) * 64


def check_cp(a, hf: Path, meg: Path) -> list[dict]:
    """The context-parallel rows: CP1 and CP2 (``cp_comm_type`` p2p with Transformer Engine) on one long sample."""
    import torch

    from megatron_vlm.runtime.spawn import run_world
    from tests.support.memory_jobs import step_peak_jobs

    te = "transformer_engine" in a.impls
    impl = "transformer_engine" if te else "local"
    try:
        sample, seq = cp_sample(a, hf)
    except Exception as e:  # report and go on
        return [dict(part="cp", impl=f"{impl}, CP1", dtype=a.precision, ok=False,
                     note=f"{type(e).__name__}: {e}"[:300])]
    gpus = torch.cuda.device_count() if a.device == "cuda" else 2
    base = dict(seq_length=seq, micro_batch_size=1, stage=2, device=a.device, precision=a.precision,
                transformer_impl=impl, seed=a.seed)
    runs = {}
    for cp in (1, 2):
        label = f"{'TE p2p' if te and cp > 1 else impl}, CP{cp}"
        if cp > gpus:
            runs[cp] = dict(part="cp", impl=label, dtype=a.precision, ok=None,
                            note=f"not measured: CP{cp} needs {cp} GPUs, this machine has {gpus} (NCCL runs one rank "
                                 "per GPU and refuses two ranks on one device: 'Duplicate GPU detected')")
            continue
        job = dict(base, name=f"cp{cp}", cp=cp, **(dict(cp_comm_type="p2p") if te and cp > 1 else {}))
        try:
            r = run_world(step_peak_jobs, cp, str(meg), str(hf), [sample], [job])[0][0]
        except Exception as e:  # report and go on
            runs[cp] = dict(part="cp", impl=label, dtype=a.precision, ok=False, note=f"{type(e).__name__}: {e}"[:300])
            continue
        peak = max(m["peak"] for m in r["ranks"])
        runs[cp] = dict(part="cp", impl=label, dtype=a.precision, loss_first=r["loss"], loss_last=r["loss"],
                        peak_gib=peak / 2 ** 30,
                        peak_extra_gib=max(m["peak"] - m["before"] for m in r["ranks"]) / 2 ** 30,
                        s_per_iter=max(m["seconds"] for m in r["ranks"]), positions=int(sample.num_tokens), ok=None,
                        note=f"one sample of {int(sample.num_tokens)} positions ({a.cp_images} images); peak per rank "
                             f"{peak / 2 ** 30:.2f} GiB" + (" (allocated)" if a.device == "cuda" else " (resident)"))
    one, two = runs[1], runs[2]
    if "loss_first" in one and "loss_first" in two:
        diff = abs(two["loss_first"] - one["loss_first"]) / abs(one["loss_first"])
        two.update(diff=diff, tolerance=a.loss_tolerance, ok=diff <= a.loss_tolerance,
                   memory_ratio=two["peak_extra_gib"] / one["peak_extra_gib"])
        two["note"] += f"; the step's peak above its start x{two['memory_ratio']:.2f} of CP1's"
        one["ok"] = True
    return [one, two]
