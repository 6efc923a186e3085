"""Where tests find the real hub files (tokenizers, processors, configs copied verbatim from the Hugging Face hub).

They live OUTSIDE the repository, in ``<repo>/../shared/hub`` (``MVLM_HUB_DIR`` overrides it); their sources are
in that folder's ``SOURCES.md``. The repository never contains copies of them. A test that needs one calls
:func:`hub_model_dir`: where the folder is absent (a user's clone) the test skips with the reason; under CI
(``CI=true``) absence is a failure, so CI always shows that the real-artifact tests ran.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LLAVA_15 = "llava-hf__llava-1.5-7b-hf"
ONEVISION_QWEN2 = "lmms-lab__llava-onevision-qwen2-7b-ov"
SIGLIP_SO400M = "google__siglip-so400m-patch14-384"
VICUNA_15 = "lmsys__vicuna-7b-v1.5"
QWEN3_4B = "Qwen__Qwen3-4B-Instruct-2507"  # config + tokenizer_config; vocab/merges are ONEVISION_QWEN2's


def hub_root() -> Path:
    return Path(os.environ.get("MVLM_HUB_DIR") or REPO.parent / "shared" / "hub")


def hub_model_dir(name: str) -> Path:
    """The folder of hub model ``name`` (e.g. :data:`LLAVA_15`); skips the calling test where it is absent,
    fails under CI."""
    import pytest

    d = hub_root() / name
    if (d / "config.json").is_file() or (d / "tokenizer_config.json").is_file():
        return d
    reason = f"real hub files {d} are absent (set MVLM_HUB_DIR to the shared hub folder)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; under CI they are required")
    pytest.skip(reason)
