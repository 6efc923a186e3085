"""FP8 training choices: recipes and formats (Megatron-LM's ``--fp8-recipe`` / ``--fp8-format``), which GPUs can
run each recipe, and the token alignment FP8 GEMMs need.

Recipes are megatron-core 0.16's ``Fp8Recipe`` names, each mapped by megatron-core to a Transformer Engine recipe:
delayed (DelayedScaling), tensorwise (Float8CurrentScaling), blockwise (Float8BlockScaling), mxfp8
(MXFP8BlockScaling). :data:`RECIPES` records the compute capabilities Transformer Engine 2.x accepts for each;
:func:`recipe_problem` applies it from facts alone (the launcher's preflight, tests), and
:func:`check_recipe_runs` asks Transformer Engine itself on the GPU at model build. Both refuse with a message
that names the recipe, the GPU and what to use instead.

This module imports neither torch nor Transformer Engine at import time (the launcher reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Recipe:
    min_capability: tuple[int, int]
    below_capability: tuple[int, int] | None  # first capability that cannot run it (None: no upper bound)
    min_cuda: tuple[int, int] | None
    te_check: str  # Transformer Engine's own support check (transformer_engine.pytorch.quantization)
    align: int  # token-count multiple the FP8 GEMMs need (megatron.core.fp8_utils.get_fp8_align_size)
    needs: str  # for messages


RECIPES: dict[str, Recipe] = {
    "delayed": Recipe((8, 9), None, None, "check_fp8_support", 16, "compute capability 8.9+ (Ada, Hopper, Blackwell)"),
    "tensorwise": Recipe((8, 9), None, None, "check_fp8_support", 16,
                         "compute capability 8.9+ (Ada, Hopper, Blackwell)"),
    "blockwise": Recipe((9, 0), None, (12, 9), "check_fp8_block_scaling_support", 16,
                        "compute capability 9.0+ (Hopper or newer) and CUDA 12.9+"),
    "mxfp8": Recipe((10, 0), (12, 0), None, "check_mxfp8_support", 32,
                    "compute capability 10.x or 11.x (Blackwell data-centre GPUs)"),
}


def align_size(recipe: str) -> int:
    """Multiple the token count of an FP8 GEMM must be padded to (16; 32 for mxfp8)."""
    return RECIPES[recipe].align


def _version(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    parts = str(text).split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def _fits(r: Recipe, cap: tuple[int, int], cuda: tuple[int, int] | None) -> bool:
    return cap >= r.min_capability and (r.below_capability is None or cap < r.below_capability) and \
        (r.min_cuda is None or cuda is None or cuda >= r.min_cuda)


def runnable(capability: tuple[int, int], cuda_version: str | None = None) -> list[str]:
    """The recipes a GPU of ``capability`` (with torch's CUDA ``cuda_version``) can run, by :data:`RECIPES`."""
    return [n for n, r in RECIPES.items() if _fits(r, tuple(capability), _version(cuda_version))]


def recipe_problem(recipe: str, capability: tuple[int, int], cuda_version: str | None = None,
                   gpu: str = "this GPU") -> str | None:
    """Why ``recipe`` cannot run on a GPU of compute ``capability`` (with torch's CUDA ``cuda_version``), or None."""
    if recipe not in RECIPES:
        return f"--fp8-recipe {recipe}: must be one of {', '.join(RECIPES)}"
    r = RECIPES[recipe]
    cap = tuple(capability)
    if _fits(r, cap, _version(cuda_version)):
        return None
    ok = runnable(cap, cuda_version)
    alt = f"use --fp8-recipe {' or '.join(ok)}" if ok else "drop --fp8"
    cuda_txt = f", CUDA {cuda_version}" if cuda_version else ""
    return f"--fp8-recipe {recipe} needs {r.needs}; {gpu} is sm_{cap[0]}{cap[1]}{cuda_txt}: {alt}"


def _te_check(name: str):
    try:
        from transformer_engine.pytorch import quantization as q  # Transformer Engine 2.8+
    except ImportError:
        from transformer_engine.pytorch import fp8 as q  # older 2.x
    return getattr(q, name, None)


def check_recipe_runs(recipe: str) -> None:
    """Raise ValueError if ``recipe`` cannot run on the current CUDA device: by :data:`RECIPES`, then by
    Transformer Engine's own support check."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--fp8 needs a CUDA GPU")
    cap = torch.cuda.get_device_capability()
    gpu = f"GPU {torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    problem = recipe_problem(recipe, cap, torch.version.cuda, gpu)
    if problem:
        raise ValueError(problem)
    check = _te_check(RECIPES[recipe].te_check)
    if check is not None:
        ok, why = check()
        if not ok:
            raise ValueError(f"--fp8-recipe {recipe}: Transformer Engine says it cannot run on {gpu}: {why}")
