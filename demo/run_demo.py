#!/usr/bin/env python
"""megatron-vlm demo on an embedded default (no downloads, CPU): every step is the user-facing command.

Current steps: build tiny HF text + vision models from configs (own tokenizer) -> convert/build_llava.py ->
convert/hf_to_megatron.py --tp 2 --verify -> convert/megatron_to_hf.py -> HF generate on the exported model.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(cmd: list[str]) -> None:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    t = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    print(f"  ({time.time() - t:.1f} s)", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(ROOT / "demo_out"), help="output directory (replaced)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the Megatron checkpoint")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the Megatron checkpoint")
    a = p.parse_args(argv)
    import shutil

    from megatron_vlm.testing.tiny import make_text_model, make_vision_model

    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    print("building a tiny Llama-style LM (own BPE tokenizer) and a tiny CLIP from configs ...")
    text = make_text_model(out / "parts" / "text", "llama")
    vision = make_vision_model(out / "parts" / "vision", "clip")
    py = sys.executable
    run([py, "convert/build_llava.py", "--text-model", str(text), "--vision-model", str(vision),
         "--save-dir", str(out / "hf")])
    run([py, "convert/hf_to_megatron.py", "--hf-dir", str(out / "hf"), "--megatron-dir", str(out / "megatron"),
         "--tp", str(a.tp), "--pp", str(a.pp), "--verify"])
    run([py, "convert/megatron_to_hf.py", "--megatron-dir", str(out / "megatron"), "--hf-dir", str(out / "hf_back")])

    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    proc = AutoProcessor.from_pretrained(str(out / "hf_back"))
    model = LlavaForConditionalGeneration.from_pretrained(str(out / "hf_back"))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape ?"}]}]
    inputs = proc(images=Image.new("RGB", (64, 64), (220, 30, 30)),
                  text=proc.apply_chat_template(msgs, add_generation_prompt=True), return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    print("\ngenerate on the exported model (random weights, so the words are random):",
          repr(proc.decode(gen[0, inputs["input_ids"].shape[1]:])))
    print(f"\ndemo finished in {time.time() - t0:.0f} s; outputs under {out}")


if __name__ == "__main__":
    main()
