"""Optional libraries a rank will not use, kept out of megatron-core's import.

megatron-core imports two optional libraries eagerly whenever they are installed, each inside its own
``try: import ... except ImportError`` fallback: Transformer Engine (its layers, kernels and optimizers, through
``megatron.core.utils`` and ``megatron.core.extensions``) and Weights & Biases (``megatron.core.timers``). A rank
that cannot or does not use one pays its import anyway, on every rank of every launch: about 0.6 CPU-s for
Transformer Engine and 0.3 CPU-s for wandb per process in the 3.12 lane (its CPU log also gains two lines of
Transformer Engine and torch warnings about the missing CUDA runtime).

``skip_unused(device, wandb)`` marks them as not installed (``None`` in ``sys.modules``, Python's own "this
import fails" marker) before megatron-core is imported, so megatron-core takes the same path as on a machine
without them:

- Transformer Engine on a CPU rank: its layers and kernels need CUDA, and ``layer_impl.choose`` picks megatron-core's
  local layers there whether it is installed or not;
- wandb when the run does not log to it (no ``--wandb``; ``megatron_vlm.training.metrics`` imports it only then).

It does nothing once megatron-core is imported (a process that already paid for them keeps them). The rank entry
point (``train/pretrain_vlm.py``) calls it: a GPU rank, or a run with ``--wandb``, imports both exactly as before.
The converters (``convert/hf_to_megatron.py``, ``convert/megatron_to_hf.py``), which never log, mark wandb alone
(:func:`mark_not_installed`): Transformer Engine stays importable there, as a checkpoint's layers may be its.

It changes what megatron-core's import sees, so each marker is an entry of the registry of megatron-core patches
(:mod:`megatron_vlm.runtime.mcore_patches`: ``lean-import-transformer-engine``, ``lean-import-wandb``), checked
against the megatron-core releases whose fallbacks it relies on, for the process.
"""

from __future__ import annotations

import sys

from megatron_vlm.runtime import mcore_patches

TRANSFORMER_ENGINE = "transformer_engine"
WANDB = "wandb"
#: each library's entry in the registry of megatron-core patches
ENTRIES = {TRANSFORMER_ENGINE: "lean-import-transformer-engine", WANDB: "lean-import-wandb"}


def unused(device: str, wandb: bool) -> list[str]:
    """The optional libraries a rank on ``device`` ('cpu' or 'cuda') with ``--wandb`` = ``wandb`` will not use."""
    return ([TRANSFORMER_ENGINE] if device == "cpu" else []) + ([] if wandb else [WANDB])


def skip_unused(device: str, wandb: bool) -> list[str]:
    """Mark :func:`unused` libraries as not installed for this process; returns the ones marked (none once
    megatron-core is imported, or for a library already imported)."""
    return mark_not_installed(unused(device, wandb))


def mark_not_installed(names: list[str]) -> list[str]:
    """Mark the optional libraries ``names`` as not installed for this process, unless megatron-core (which
    imports them) or the library itself is imported already; returns the ones marked."""
    if "megatron.core" in sys.modules:
        return []
    marked = [name for name in names if name not in sys.modules]
    for name in marked:
        mcore_patches.apply(ENTRIES[name])
    return marked


def _marker(name: str):
    def not_installed(originals: dict) -> dict:
        return {f"sys.modules:{name}": None}  # Python's own "this import fails" marker

    return not_installed


for _name, _entry in ENTRIES.items():
    mcore_patches.implements(_entry)(_marker(_name))
