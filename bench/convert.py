#!/usr/bin/env python
"""Conversion speed and memory benchmark (not a test): prints ratios measured in one run.

Builds a ~1.5B-parameter random LLaVA (Llama-like 1.2B LM + CLIP-L/14-336-shaped ViT) in bf16 as sharded
safetensors, like a hub model, then times and measures peak RSS of:
  cp -r of the HF files | HF->Megatron TP=2 PP=2 torch_dist | same, legacy torch | Megatron->HF (torch_dist)
Each step is timed until its output is on disk (sync before and after), and the fixed cost of starting
Python and importing megatron-core + transformers is printed for reference.
Targets: each conversion <= 2x the copy time; peak RSS <= 1.25x model bytes (torch_dist) and
<= 1.25x model bytes / (TP*PP) + 1 GiB (legacy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_model(out: Path, layers: int, hidden: int, vision_layers: int) -> int:
    """Write a random bf16 LLaVA as 1 GiB safetensors shards; returns the weight bytes."""
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from megatron_vlm.chat_template import llava_chat_template
    from megatron_vlm.convert.hf_io import HFShardWriter
    from megatron_vlm.convert.mapping import canonical_hf_name
    from megatron_vlm.testing.tiny import text_config, train_tokenizer
    from megatron_vlm.tokenizer import add_vlm_tokens

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
    writer = HFShardWriter(out, max_shard_bytes=2**30)
    g = torch.Generator().manual_seed(0)
    for name, p in meta_model.state_dict().items():
        writer.add(canonical_hf_name(name), (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.close()
    return writer.total


def measured(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds until ``cmd``'s output is on disk (``sync`` before and after: dist_checkpointing fsyncs its
    files, and a copy is not done while its pages are still dirty) and peak RSS (bytes) of its largest process."""
    code = ("import os,resource,subprocess,sys,time;os.sync();t=time.time();r=subprocess.run(sys.argv[1:]);os.sync();"
            "print(time.time()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss*1024);sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        sys.stderr.write(r.stderr[-4000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    secs, rss = r.stdout.strip().splitlines()[-1].split()
    return float(secs), int(rss)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/mvlm-bench-convert", help="scratch directory (replaced)")
    p.add_argument("--layers", type=int, default=22, help="LM layers (22 x hidden 2048 ~ 1.2B)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vision-layers", type=int, default=24)
    a = p.parse_args(argv)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    t = time.time()
    nbytes = make_model(work / "hf", a.layers, a.hidden, a.vision_layers)
    print(f"model: {nbytes / 1e9:.2f} GB of bf16 weights ({nbytes / 2 / 1e9:.2f} B params), built in "
          f"{time.time() - t:.0f} s")
    py = sys.executable
    rows = []
    secs, rss = measured(["cp", "-r", str(work / "hf"), str(work / "hf_copy")])
    rows.append(("cp -r (reference)", secs, rss, None))
    copy = secs
    secs, rss = measured([py, "-c", "import megatron.core, transformers, megatron_vlm.convert.to_megatron"])
    rows.append(("python start-up + imports (fixed)", secs, rss, None))
    for fmt in ("torch_dist", "torch"):
        secs, rss = measured([py, "convert/hf_to_megatron.py", "--hf-dir", str(work / "hf"), "--megatron-dir",
                              str(work / f"meg_{fmt}"), "--tp", "2", "--pp", "2", "--ckpt-format", fmt])
        limit = 1.25 * nbytes if fmt == "torch_dist" else 1.25 * nbytes / 4 + 2**30
        rows.append((f"HF->Megatron {fmt} tp2 pp2", secs, rss, limit))
    secs, rss = measured([py, "convert/megatron_to_hf.py", "--megatron-dir", str(work / "meg_torch_dist"),
                          "--hf-dir", str(work / "hf_back")])
    rows.append(("Megatron->HF (torch_dist)", secs, rss, 1.25 * nbytes))
    startup = rows[1][1]
    print(f"\n{'step':34s} {'seconds':>8s} {'x copy':>7s} {'x copy w/o start-up':>20s} {'peak RSS GB':>12s} "
          f"{'x model':>8s} {'RSS target':>11s}")
    for name, secs, rss, limit in rows:
        tgt = "" if limit is None else ("ok" if rss <= limit else "OVER") + f" {limit / 1e9:.1f}GB"
        net = f"{(secs - startup) / copy:20.2f}" if limit is not None else " " * 20
        print(f"{name:34s} {secs:8.1f} {secs / copy:7.2f} {net} {rss / 1e9:12.2f} {rss / nbytes:8.2f} {tgt:>11s}")
    (work / "results.json").write_text(json.dumps({"model_bytes": nbytes, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
