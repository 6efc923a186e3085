#!/usr/bin/env python
"""Core attention backends on CPU (a benchmark, not a test): the forward and backward seconds of one micro batch
through the LLaVA that :mod:`megatron_vlm.model.build` builds (local layers, stage 2: the language model and the
projector train, the ViT is frozen), once per ``--attention-backend``, in one process. Prints the numbers.

The model is a tiny HF LLaVA (Llama + CLIP, grouped-query attention) made by ``tests.support.tiny`` and converted
with ``convert/hf_to_megatron.py``'s function, so every backend starts from the same weights; the batch is random
tokens with one image per sample. Each backend's first iteration is left out of the best time; the loss and the
gradient norm are printed to show the backends compute the same step.

  python bench/attention.py [--hidden 256 --layers 4 --heads 8 --kv-heads 2 --seq-length 1024 --image-size 224]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=256, help="LM hidden size")
    p.add_argument("--layers", type=int, default=4, help="LM layers")
    p.add_argument("--heads", type=int, default=8, help="LM attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="LM key/value heads (grouped-query attention)")
    p.add_argument("--vision-hidden", type=int, default=128, help="ViT hidden size (4 heads)")
    p.add_argument("--vision-layers", type=int, default=4, help="ViT layers")
    p.add_argument("--image-size", type=int, default=224, help="image side (patch 14)")
    p.add_argument("--seq-length", type=int, default=1024, help="image-expanded positions per sample")
    p.add_argument("--mbs", type=int, default=2, help="samples per micro batch")
    p.add_argument("--iters", type=int, default=5, help="forward + backward passes per backend")
    p.add_argument("--backends", default="local,sdpa", help="comma-separated --attention-backend choices")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    import torch

    from megatron_vlm.checkpoint import layout as ckpt
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.model.build import ModelOptions, build_model
    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.runtime import distributed
    from tests.support.tiny import make_tiny_llava

    a = parse(argv)
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="bench_attention_"))
    hf = make_tiny_llava(root / "hf", "llama", "clip",
                         text_overrides=dict(hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                                             num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                             num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                                             max_position_embeddings=max(4096, a.seq_length)),
                         vision_overrides=dict(hidden_size=a.vision_hidden, intermediate_size=4 * a.vision_hidden,
                                               num_hidden_layers=a.vision_layers, num_attention_heads=4,
                                               image_size=a.image_size, patch_size=14))
    iter_dir = ckpt.resolve_iteration_dir(convert_hf_to_megatron(hf, root / "meg"))
    spec = VLMSpec.load(iter_dir)
    distributed.setup(1, 1, device="cpu")
    image_tokens = (a.image_size // 14) ** 2
    tokens = torch.randint(10, spec.vocab_size - 10, (a.mbs, a.seq_length - image_tokens + 1))
    tokens[tokens == spec.image_token_id] = 11
    tokens[:, 5] = spec.image_token_id
    images = torch.randn(a.mbs, 3, a.image_size, a.image_size)
    out = {}
    for backend in a.backends.split(","):
        model = build_model(spec, ModelOptions(seq_length=a.seq_length, perform_initialization=False,
                                               attention_backend=backend))
        ckpt.load_model_weights(model, iter_dir)
        model.freeze(freeze_language_model=False, freeze_vision_model=True, freeze_vision_projection=False)
        times, loss = [], None
        for _ in range(a.iters):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            logits, _ = model(images=images, input_ids=tokens, position_ids=None, attention_mask=None)
            step_loss = logits.float().logsumexp(-1).mean()
            step_loss.backward()
            times.append(time.perf_counter() - t0)
            loss = step_loss.item() if loss is None else loss
        grad_norm = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()
        best = min(times[1:] or times)
        out[backend] = dict(best_s=best, times=times, loss=loss, grad_norm=grad_norm)
        print(f"{backend:>6}: best {best:.3f} s per forward + backward ({', '.join(f'{t:.3f}' for t in times)}); "
              f"first loss {loss:.6f}, grad norm {grad_norm:.6f}", flush=True)
        del model
    if "local" in out:
        for backend, r in out.items():
            print(f"{backend:>6}: {out['local']['best_s'] / r['best_s']:.2f}x local")
    return out


if __name__ == "__main__":
    main()
