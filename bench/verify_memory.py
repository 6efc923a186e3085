#!/usr/bin/env python
"""Peak memory of `convert/hf_to_megatron.py --verify` at real OneVision geometry (benchmark, not a test).

Builds a random-weight LLaVA-OneVision with the real Qwen2 vocabulary and tokenizer (lmms-lab's
llava-onevision-qwen2-7b-ov files in ../shared/hub), SigLIP so400m's 384/14 geometry shrunk in width and depth,
the 36 pinpoints and anyres_max_9, and a 64-wide, 2-layer LM; converts it with --verify and samples the RSS of
the whole process tree (converter, verification ranks, helpers) every 50 ms. Prints the peak of the sum and of
each process. --cap-gb kills the tree above that sum (the machine may be shared).

    python bench/verify_memory.py [--tp 2 --pp 2] [--work /tmp/verify_mem] [--cap-gb 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OV = "lmms-lab__llava-onevision-qwen2-7b-ov"
SIGLIP = "google__siglip-so400m-patch14-384"


def build(hub: Path, work: Path) -> Path:
    """The HF OneVision directory (built once per --work)."""
    import torch
    from transformers import (AutoConfig, AutoModelForCausalLM, Qwen2Tokenizer, SiglipImageProcessor,
                              SiglipVisionConfig, SiglipVisionModel)

    from megatron_vlm.convert.build import build_llava

    out = work / "ov-hf"
    if (out / "config.json").is_file():
        return out
    ov = json.loads((hub / OV / "config.json").read_text())
    tok = Qwen2Tokenizer.from_pretrained(hub / OV)
    text = AutoConfig.for_model("qwen2", vocab_size=ov["vocab_size"], hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=32768, rms_norm_eps=ov["rms_norm_eps"],
                                rope_theta=ov["rope_theta"], tie_word_embeddings=False,
                                bos_token_id=ov["bos_token_id"], eos_token_id=ov["eos_token_id"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(text, dtype=torch.float32).save_pretrained(work / "text")
    tok.save_pretrained(work / "text")
    sig = json.loads((hub / SIGLIP / "config.json").read_text())["vision_config"]
    torch.manual_seed(1)
    SiglipVisionModel(SiglipVisionConfig(image_size=sig["image_size"], patch_size=sig["patch_size"], hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
                      ).save_pretrained(work / "vision")
    SiglipImageProcessor.from_pretrained(hub / SIGLIP).save_pretrained(work / "vision")
    build_llava(work / "text", work / "vision", out, arch="llava_onevision", vision_feature_layer=-1, max_grid=6,
                vision_aspect_ratio="anyres_max_9")
    # Older megatron-vlm took the first extra special token as the image token: put <image> first (harmless now)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if isinstance(cfg.get(key), list) and "<image>" in cfg[key]:
            cfg[key] = ["<image>"] + [t for t in cfg[key] if t != "<image>"]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def sample_tree(cmd: list[str], cap_bytes: float) -> tuple[int, float, dict, bool]:
    """Run ``cmd``; (exit code, peak RSS sum of its process tree, peak per process, killed at the cap)."""
    import psutil

    proc = subprocess.Popen(cmd, start_new_session=True)
    root = psutil.Process(proc.pid)
    peak, each, killed = 0, {}, False
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        total = 0
        for p in procs:
            try:
                rss = p.memory_info().rss
                name = " ".join(p.cmdline()[1:3])[-50:]
            except psutil.Error:
                continue
            total += rss
            each[(p.pid, name)] = max(each.get((p.pid, name), 0), rss)
        peak = max(peak, total)
        if total > cap_bytes:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    return proc.wait(), peak, each, killed


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--hub", type=Path, default=ROOT.parent / "shared" / "hub", help="the real hub files")
    p.add_argument("--work", type=Path, default=None, help="where the model and checkpoint go (default: a temp dir)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cap-gb", type=float, default=20.0, help="kill the run when the tree's RSS sum passes this")
    a = p.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="verify_mem-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = build(a.hub, work)
    meg = work / f"meg_tp{a.tp}_pp{a.pp}"
    cmd = [sys.executable, str(ROOT / "convert" / "hf_to_megatron.py"), "--hf-dir", str(hf), "--megatron-dir",
           str(meg), "--tp", str(a.tp), "--pp", str(a.pp), "--verify", "--overwrite"]
    t0 = time.time()
    rc, peak, each, killed = sample_tree(cmd, a.cap_gb * 2**30)
    model_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    print(f"hf_to_megatron --verify tp={a.tp} pp={a.pp}: exit {rc}{' (killed at the cap)' if killed else ''}, "
          f"{time.time() - t0:.0f} s, model {model_bytes / 2**20:.0f} MiB")
    print(f"peak RSS, sum over the process tree: {peak / 2**30:.2f} GiB")
    for (pid, name), rss in sorted(each.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  pid {pid} ({name}): {rss / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
