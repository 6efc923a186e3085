"""Shared command-line plumbing: logging set-up and turning known errors into one clear line."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not verbose:
        warnings.filterwarnings("ignore")
        for noisy in ("megatron", "transformers", "torch"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run_cli(main, argv=None) -> int:
    """Run ``main(argv)``; user errors (bad input) print one ``error:`` line and exit 2."""
    try:
        main(argv)
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        if os.environ.get("MVLM_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def parse_pp_layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--pp-layers {text!r} must be comma-separated integers, e.g. 3,1") from None
