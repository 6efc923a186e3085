"""Training checkpoints that cross the megatron-core lanes (0.16 on Python 3.11, 0.19 on Python 3.12).

One lane cannot run the other's megatron-core, so each lane writes a tiny fixture that the other lane reads:

    python -m tests.support.cross_version tests/fixtures/mcore-<major.minor>

writes, with this environment's megatron-core,

- ``run/``: a training run directory whose ``iter_0000001`` was saved after one step (model, optimizer,
  scheduler, RNG), with the tokenizer next to it;
- ``expected.json``: the loss and grad norm of steps 2 and 3 when training continues from that checkpoint
  (asserted here to equal an uninterrupted run's), and the SHA-256 of every tensor the checkpoint exports to
  HF, with the versions that wrote it and the CPU kernels it ran (``cpu_capability``, torch's
  ``torch.backends.cpu.get_cpu_capability()``: AVX2, AVX512, ..., and the processor model).

A grad norm is a long fp32 reduction whose summation order follows the vector width of those kernels: the
same weights and gradients give norms that differ in the 7th digit on an AVX2 and an AVX-512 machine (measured:
2.842548158 against 2.842547823), while the losses and the exported bytes are equal. :func:`same_kernels` tells
the tests when the recorded grad norms can be asked for bit for bit.

The tests (``tests/test_cross_version.py``) resume the other lane's fixture and compare with those numbers, or,
where this megatron-core cannot read it, assert the error that says so.

``--moe`` writes the mixture-of-experts fixture instead (``tests/fixtures/mcore-0.16-moe``, written by the 3.11
lane as megatron-vlm's previous release trained): a tiny Qwen3-MoE LLaVA saved after one step at TP2 x EP1 with the
experts unsplit (ETP1), with its optimizer state. megatron-core 0.16 keeps the experts' optimizer state with the other
parameters' there, 0.19 apart (ETP differs from TP): 0.19 must refuse that optimizer state naming both rules
(``tests/test_moe.py``). 0.16 no longer trains the layout (it sums the experts' gradients over the data-parallel
ranks only there: :func:`megatron_vlm.runtime.mcore_version.expert_layout_problem`), so the fixture is written with that
refusal lifted (the job's ``unchecked_expert_layout``), and records no numbers to continue with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

#: what the fixture trains: three global batches of four samples, one micro batch each
N_BATCHES, BATCH = 3, 4
SAVED_AT = 1
RUN, EXPECTED = "run", "expected.json"


def batches(tokenizer_dir) -> list[list]:
    from tests.support.train_jobs import variable_length_batches

    return variable_length_batches(tokenizer_dir, N_BATCHES, BATCH)


def cpu_capability() -> str:
    """The CPU kernel set torch dispatches to on this machine (``AVX2``, ``AVX512``, ...) and the processor's
    model name: the same kernel set on another processor can still reduce in another order (measured: a fixture
    written on an AVX512 machine resumed on an AVX512 AMD EPYC gives its grad norm 1.9e-7 apart, 2.746722436
    against 2.746722956, with equal losses)."""
    import torch

    model = ""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    kernels = torch.backends.cpu.get_cpu_capability()
    return f"{kernels} ({model})" if model else kernels


def same_kernels(expected: dict) -> bool:
    """Whether ``expected`` was recorded with this machine's CPU kernels (a fixture written before the
    capability was recorded counts as another machine's)."""
    return expected.get("cpu_capability") == cpu_capability()


def continue_job(run_dir) -> dict:
    """The job that resumes ``run_dir``'s checkpoint and trains the steps after it."""
    return dict(name="resume", micro_batch_size=BATCH, start=SAVED_AT, steps=N_BATCHES - SAVED_AT,
                resume=str(Path(run_dir) / f"iter_{SAVED_AT:07d}"))


def resume(run_dir) -> dict:
    """Loss and grad norm of the steps after the checkpoint in ``run_dir``, resumed with this megatron-core."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.runtime.spawn import run_world
    from tests.support.train_jobs import train_jobs

    tok = Path(run_dir) / ckpt.TOKENIZER_DIR
    (result,) = run_world(train_jobs, 1, [continue_job(run_dir)], run_dir, tok, batches(tok))[0]
    return {"loss": result["loss"], "grad_norm": result["grad_norm"]}


def exported_digests(run_dir, work_dir) -> dict[str, str]:
    """SHA-256 of every tensor (its dtype, shape and bytes) of the HF export of the checkpoint in ``run_dir``."""
    import torch
    from safetensors import safe_open

    from megatron_vlm.convert.to_hf import convert_megatron_to_hf

    out = convert_megatron_to_hf(run_dir, Path(work_dir) / "hf_export", iteration=SAVED_AT, overwrite=True)
    digests = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name).contiguous()
                h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
                digests[name] = h.hexdigest()
    return digests


def _publish(run: Path, expected: dict, out_dir: Path) -> None:
    """``run`` and ``expected`` as the fixture ``out_dir`` (staged next to it, then renamed over it)."""
    staged = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    shutil.copytree(run, staged / RUN)
    (staged / EXPECTED).write_text(json.dumps(expected, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staged.rename(out_dir)


def write_fixture(out_dir) -> dict:
    """Write ``out_dir/run`` and ``out_dir/expected.json`` with this environment's megatron-core (see the
    module docstring); returns the expected numbers."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.runtime import mcore_version
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.runtime.spawn import run_world
    from tests.support.tiny import make_tiny_llava
    from tests.support.train_jobs import train_jobs

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = make_tiny_llava(tmp / "hf")
        meg = convert_hf_to_megatron(hf, tmp / "meg", tp=1)
        gbs = batches(hf)
        run = tmp / RUN
        jobs = [dict(name="save", micro_batch_size=BATCH, steps=SAVED_AT, save=str(run)),
                dict(name="full", micro_batch_size=BATCH)]
        results = {r["name"]: r for r in run_world(train_jobs, 1, jobs, meg, hf, gbs)[0]}
        ckpt.copy_tokenizer(hf, run)
        resumed = resume(run)
        full = {k: results["full"][k][SAVED_AT:] for k in ("loss", "grad_norm")}
        if resumed != full:
            raise RuntimeError(f"resuming the fixture does not continue exactly: {resumed} vs {full}")
        expected = {**resumed, "hf_export_sha256": exported_digests(run, tmp),
                    "written_by": mcore_version.writer_stamp(), "cpu_capability": cpu_capability()}
        _publish(run, expected, out_dir)
    return expected


#: the MoE fixture's layout (--tp, --ep, --etp) and micro batch size
MOE_LAYOUT, MOE_BATCH = dict(tp=2, ep=1, etp=1), 2


def moe_job(run_dir, **extra) -> dict:
    """The job that resumes the MoE fixture's checkpoint at its layout and trains the steps after it."""
    return dict(name="moe-resume", micro_batch_size=MOE_BATCH, start=SAVED_AT, steps=N_BATCHES - SAVED_AT,
                resume=str(Path(run_dir) / f"iter_{SAVED_AT:07d}"), moe_aux_loss_coeff=0.1, stage=2,
                freeze_lm=False, freeze_vit=True, **MOE_LAYOUT, **extra)


def write_moe_fixture(out_dir) -> dict:
    """Write the MoE fixture (module docstring) into ``out_dir``; returns the expected numbers."""
    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.runtime import mcore_version
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.runtime.spawn import run_world
    from tests.support.tiny import make_tiny_llava
    from tests.support.train_jobs import train_jobs

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = make_tiny_llava(tmp / "hf", "qwen3_moe", "clip", text_overrides=dict(num_hidden_layers=2))
        meg = convert_hf_to_megatron(hf, tmp / "meg", tp=1)
        gbs = batches(hf)
        run = tmp / RUN
        base = {k: v for k, v in moe_job(run).items() if k not in ("name", "start", "steps", "resume")}
        run_world(train_jobs, 2, [dict(base, name="save", steps=SAVED_AT, save=str(run), unchecked_expert_layout=True)],
                  meg, hf, gbs)
        ckpt.copy_tokenizer(hf, run)
        # no numbers to continue with: megatron-core 0.16 trains this layout wrong (its TP ranks' copies of the
        # experts drift apart, mcore_version.expert_layout_problem), which is why megatron-vlm refuses it now
        expected = {"written_by": mcore_version.writer_stamp(), "layout": MOE_LAYOUT}
        _publish(run, expected, out_dir)
    return expected


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description="Write the cross-lane checkpoint fixture with this megatron-core "
                                            "(tests/fixtures/mcore-<version>).")
    p.add_argument("out_dir", help="fixture directory to (re)write, e.g. tests/fixtures/mcore-0.16")
    p.add_argument("--moe", action="store_true", help="write the mixture-of-experts fixture (TP2 x EP1, ETP1), "
                   "e.g. into tests/fixtures/mcore-0.16-moe")
    args = p.parse_args(argv)
    expected = (write_moe_fixture if args.moe else write_fixture)(args.out_dir)
    print(json.dumps({k: expected[k] for k in ("loss", "grad_norm", "written_by") if k in expected}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
