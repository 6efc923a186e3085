"""Facts about the runtime that will train, asked of that runtime itself (host python or the container).

``python -m megatron_vlm.launch.probe [--cuda] [--fp8] [--te] [--tokenizer DIR]`` prints one JSON line: the visible
CUDA devices, their memory and their compute capabilities, whether Transformer Engine imports, and the image/pad token ids
of a tokenizer. The launcher runs it as a subprocess (``run_probe``) whenever CUDA or a container is involved, so
that the launcher never initialises CUDA itself, and so that a container's torch/Transformer Engine is what gets
checked. A CPU run on the host asks only for the tokenizer's ids: the launcher calls :func:`probe` itself then
(a subprocess would import torch and transformers a second time, ~5 s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Mapping


def probe(cuda: bool, fp8: bool, tokenizer: str | None, te: bool = False) -> dict:
    facts: dict = {}
    if cuda or fp8:
        import torch

        facts["torch"] = torch.__version__
        facts["device_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        facts["memory"] = [torch.cuda.get_device_properties(i).total_memory for i in range(facts["device_count"])]
        if fp8 and facts["device_count"]:
            facts["capabilities"] = [list(torch.cuda.get_device_capability(i))
                                     for i in range(facts["device_count"])]
    if fp8 or te:
        try:
            import transformer_engine.pytorch  # noqa: F401

            facts["transformer_engine"] = True
        except Exception as e:  # ImportError, or a broken build raising anything
            facts["transformer_engine"] = False
            facts["transformer_engine_error"] = f"{type(e).__name__}: {e}"[:300]
    if tokenizer:
        try:
            from megatron_vlm.model.tokenizer import read_special_token_ids

            ids = read_special_token_ids(tokenizer)  # the model config's image token, checked in the tokenizer
            facts["tokenizer"] = {"image": ids.image, "pad": ids.pad}
        except Exception as e:
            facts["tokenizer"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return facts


class ProbeError(RuntimeError):
    pass


def run_probe(prefix: list[str], env: Mapping[str, str], cwd: str, cuda: bool, fp8: bool,
              tokenizer: str | None, te: bool = False) -> dict:
    """Run the probe as ``prefix + ['-m', 'megatron_vlm.launch.probe', ...]``; return its facts."""
    argv = list(prefix) + ["-m", "megatron_vlm.launch.probe"]
    argv += (["--cuda"] if cuda else []) + (["--fp8"] if fp8 else []) + (["--te"] if te and not fp8 else [])
    argv += ["--tokenizer", tokenizer] if tokenizer else []
    try:
        res = subprocess.run(argv, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProbeError(f"could not run {argv[0]} to inspect the runtime: {e}") from None
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ProbeError(
        f"inspecting the runtime with `{' '.join(argv)}` failed (exit {res.returncode}):\n{res.stderr[-2000:]}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="count CUDA devices")
    ap.add_argument("--fp8", action="store_true", help="also report capabilities and Transformer Engine")
    ap.add_argument("--te", action="store_true", help="report whether Transformer Engine imports")
    ap.add_argument("--tokenizer", help="report image/pad token ids of this tokenizer directory")
    a = ap.parse_args(argv)
    print(json.dumps(probe(a.cuda, a.fp8, a.tokenizer, a.te)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
