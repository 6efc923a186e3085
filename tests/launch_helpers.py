"""Shared helpers of the launcher tests: tiny on-disk inputs the launcher validates (no GPU, no network)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from megatron_vlm.model.spec import VLMSpec
from tests.support import forked_cli

REPO = Path(__file__).resolve().parents[1]
RUN_PY = REPO / "train" / "run.py"
STANDIN = Path(__file__).resolve().parent / "launch_standin.py"
IMAGE_ID, PAD_ID = 301, 302


@pytest.fixture(autouse=True)
def no_slurm_env(monkeypatch):
    """Tests run the launcher in-process: a CI job running under SLURM must not leak its job into them."""
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)


def tiny_spec(**overrides) -> VLMSpec:
    """A spec shaped like testing.tiny's llama+clip model, built without transformers."""
    kw = dict(text_family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
              num_query_groups=2, kv_channels=16, norm_epsilon=1e-5, rotary_base=5e5,
              max_position_embeddings=512, vocab_size=303, vision_num_layers=3, vision_hidden_size=32,
              vision_ffn_hidden_size=64, vision_num_attention_heads=4, image_size=32, patch_size=8,
              image_token_id=IMAGE_ID, pad_token_id=PAD_ID)
    kw.update(overrides)
    return VLMSpec(**kw)


def make_data(root: Path, prepared: bool = True) -> Path:
    d = root / "data"
    d.mkdir(parents=True, exist_ok=True)
    (d / "shard_000000.tar").write_bytes(b"")
    if prepared:
        (d / ".nv-meta").mkdir(exist_ok=True)
        (d / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: VQASample\n")
    return d


def make_tokenizer_dir(root: Path) -> Path:
    d = root / "tok"
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer_config.json").write_text("{}")
    return d


def make_ckpt(root: Path, spec: VLMSpec | None = None, tracker: str = "release") -> Path:
    d = root / "ckpt"
    d.mkdir(parents=True, exist_ok=True)
    (spec or tiny_spec()).save(d)
    (d / "latest_checkpointed_iteration.txt").write_text(tracker)
    (d / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")).mkdir(exist_ok=True)
    return d


def base_args(root: Path, ids: bool = True) -> list[str]:
    """A valid CPU request on tiny inputs under ``root``."""
    args = ["--device", "cpu", "--data-path", str(make_data(root)), "--tokenizer-load-dir",
            str(make_tokenizer_dir(root)), "--megatron-load-dir", str(make_ckpt(root)),
            "--train-iters", "2", "--save-dir", str(root / "out"), "--seq-length", "64"]
    return args + (["--image-token-id", str(IMAGE_ID), "--pad-token-id", str(PAD_ID)] if ids else [])


def launcher(args: list[str], out_dir: Path, mode: str = "", **popen) -> subprocess.Popen:
    """Start ``train/run.py`` with the stand-in trainer writing into ``out_dir``."""
    env = dict(os.environ, MEGATRON_VLM_ENTRYPOINT=str(STANDIN), STANDIN_OUT=str(out_dir), STANDIN_MODE=mode)
    for k in list(env):
        if k.startswith("SLURM_"):
            del env[k]
    return forked_cli.start([sys.executable, str(RUN_PY), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def signal_when_ready(p: subprocess.Popen, out_dir: Path, sig: int, ranks=(0, 1)) -> str:
    """Wait until every stand-in rank wrote ``ready<r>.txt`` (mode="signal"), send ``sig`` to the launcher and
    return its output after it exits."""
    import time

    deadline = time.time() + 60
    while not all((out_dir / f"ready{r}.txt").exists() for r in ranks):
        assert time.time() < deadline and p.poll() is None, p.stdout.read() if p.poll() is not None else "timeout"
        time.sleep(0.05)
    p.send_signal(sig)
    log, _ = p.communicate(timeout=60)
    return log


def kill9_tree(pid: int) -> None:
    """kill -9 the launcher, torchrun and every rank at once (torchrun starts its own process groups)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
