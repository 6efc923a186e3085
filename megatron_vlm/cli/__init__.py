"""Shared command-line plumbing: logging set-up, range-checked argparse types, and the error boundary.

Every command calls ``run_cli(main)``. Bad input and known faults (a missing or corrupt file, a read-only
or full disk, a checkpoint with a missing or truncated shard) end as ONE line, ``error: <what>: <why>;
<what to do>``, and exit code 2; Ctrl-C exits 130. The Python traceback is shown only with ``-v``/``--verbose``
/``--debug`` on the command line (or ``MVLM_DEBUG=1`` in the environment). Numeric flags use the types
below, so an out-of-range value is refused by argparse before anything runs, with the flag's name.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import sys
import traceback
import warnings

DEBUG_FLAGS = ("-v", "--verbose", "--debug")


def progress_bars() -> bool:
    """Whether progress bars may draw: only on a terminal. In a log file their ``\\r`` redraws pile up on one
    line. When stderr is not a TTY, Hugging Face's own bars (transformers' "Loading weights", hub downloads) are
    switched off too; megatron-vlm's tqdm bars use ``disable=None``, which is tqdm's same rule."""
    if sys.stderr.isatty():
        return True
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()
    return False


def setup_logging(verbose: bool = False) -> None:
    progress_bars()
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


def stderr_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in ONE write. Ranks of a torchrun job share the launcher's
    stderr pipe; ``print`` writes the text and the newline separately, so two ranks' lines could interleave
    mid-line. A pipe write of at most PIPE_BUF (4096) bytes is atomic."""
    sys.stderr.flush()
    data = (text + "\n").encode(errors="replace")
    while data:
        data = data[os.write(2, data):]


# ---- argparse types: the range is checked at parse time, the message names the value --------------------
def _number(kind, low=None, high=None, low_open=False, what=""):
    def convert(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if kind is float and v - v != 0:  # nan, inf
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (v <= low if low_open else v < low) or high is not None and v > high:
            raise argparse.ArgumentTypeError(f"{text} {what}")
        return v

    convert.__name__ = kind.__name__  # argparse names the type in "invalid <name> value"
    return convert


positive_int = _number(int, 1, what="must be at least 1")
nonneg_int = _number(int, 0, what="must not be negative")
positive_float = _number(float, 0.0, low_open=True, what="must be positive")
nonneg_float = _number(float, 0.0, what="must not be negative")
fraction = _number(float, 0.0, 1.0, what="must be within [0, 1]")


def iteration(text: str):
    """``--iteration``: a non-negative integer or ``release``."""
    if text == "release":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an iteration number or 'release'") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text} must not be negative")
    return v


def weight_list(text: str) -> list[float]:
    """Comma-separated non-negative weights, at least one positive (e.g. ``3,1``)."""
    try:
        ws = [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated numbers, e.g. 3,1") from None
    if any(w < 0 or w != w or w == float("inf") for w in ws):
        raise argparse.ArgumentTypeError(f"{text}: weights must be finite and not negative")
    if not any(w > 0 for w in ws):
        raise argparse.ArgumentTypeError(f"{text}: at least one weight must be positive (the blend is empty)")
    return ws


class _DeprecatedDebug(argparse.Action):
    """``--debug``: an old spelling of ``-v`` (train/run.py's ``--debug`` shrank the run, so it is not advertised)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: --debug is deprecated, use -v/--verbose", file=sys.stderr)
        setattr(namespace, self.dest, True)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Every command's verbosity flag, ``-v``/``--verbose`` (train/run.py's too)."""
    parser.add_argument("-v", "--verbose", dest="verbose", action="store_true",
                        help="verbose logging; on an error also print the Python traceback")
    parser.add_argument("--debug", dest="verbose", nargs=0, action=_DeprecatedDebug, help=argparse.SUPPRESS)


def parse_pp_layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--pp-layers {text!r} must be comma-separated integers, e.g. 3,1") from None


# ---- the error boundary ----------------------------------------------------------------------------------
class InputError(ValueError):
    """A bad input found by a command's own checks; the message names the input, the problem and the fix."""


_ERRNO_HINTS = {
    errno.ENOSPC: "no space left on the device; free space there or write to another directory",
    errno.EDQUOT: "disk quota exceeded; free space there or write to another directory",
    errno.EACCES: "permission denied; choose a directory you can write (or fix its permissions)",
    errno.EPERM: "operation not permitted; choose a directory you can write (or fix its permissions)",
    errno.EROFS: "read-only file system; write to another directory",
    errno.ENOENT: "no such file or directory; check the path",
    errno.ENOTDIR: "a component of the path is not a directory; check the path",
    errno.EISDIR: "is a directory, a file was expected; check the path",
    errno.EIO: "input/output error; check the storage",
}


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


_SHAPE_MISMATCH = re.compile(r"Global shape mismatch for loaded \((.*?)\) and expected \((.*?)\) tensor for key (\S+)")
_KEY_MISSING = re.compile(r"""['"]?(\S+?) from model not in state dict""")


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


def errno_hint(e: BaseException) -> str | None:
    """What to do about the OS error in ``e`` or its causes (also one only quoted in a message, as
    ``[Errno 28] No space left on device``), or None."""
    for inner in _chain(e):
        if isinstance(inner, OSError) and inner.errno in _ERRNO_HINTS:
            return _ERRNO_HINTS[inner.errno]
        m = _ERRNO_TEXT.search(str(inner))
        if m and int(m.group(1)) in _ERRNO_HINTS:
            return _ERRNO_HINTS[int(m.group(1))]
    return None


def _model_mismatch(e: BaseException) -> str | None:
    """A checkpoint whose tensors do not fit the model built from its vlm_spec.json (or the run's settings)."""
    text = str(e)
    m = _SHAPE_MISMATCH.search(text)
    if m:
        have, want = (re.sub(r"torch\.Size\(\[(.*)\]\)", r"(\1)", g) for g in m.group(1, 2))
        return (f"the checkpoint's tensor {m.group(3)} has shape {have}, and the model built from its "
                f"vlm_spec.json expects {want}: vlm_spec.json does not describe these weights; restore the "
                "vlm_spec.json that was saved with them")
    m = _KEY_MISSING.search(text)
    if isinstance(e, KeyError) and m:
        return (f"the checkpoint holds no tensor {m.group(1)}, which this run needs: it was saved by another model "
                "or with other settings (e.g. another --stage with its optimizer state: pass --no-load-optim)")
    return None


def describe_error(e: BaseException) -> str | None:
    """One line for a known fault (``None``: an unexpected error, a bug worth its traceback)."""
    name = type(e).__name__
    if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, FileExistsError)) or \
            isinstance(e, FileNotFoundError) and e.filename is not None:
        if e.errno in _ERRNO_HINTS:
            where = e.filename if e.filename is not None else "writing the output"
            return f"{where}: {_ERRNO_HINTS[e.errno]}"
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON ({e.msg}: line {e.lineno} column {e.colno}); the file is corrupt: restore or " \
               "regenerate it (the file is named in the traceback: rerun with -v)"
    if name == "SafetensorError":
        text = str(e)
        if "code: 28" in text or "No space left" in text:
            return f"writing safetensors: {_ERRNO_HINTS[errno.ENOSPC]}"
        return f"safetensors file unreadable ({_first_line(text)}); it is truncated or corrupt: re-download or " \
               "re-create it"
    if name == "CheckpointException":  # torch.distributed.checkpoint: a missing/truncated shard, a full disk
        failures = getattr(e, "failures", {}) or {}
        for _rank, exc in sorted(failures.items()):
            exc = exc[0] if isinstance(exc, tuple) else exc
            for inner in _chain(exc) if isinstance(exc, BaseException) else ():
                if isinstance(inner, OSError) and inner.errno in _ERRNO_HINTS:
                    return describe_error(inner)
                line = _model_mismatch(inner)
                if line:
                    return line
                hint = errno_hint(inner)  # its writer threads pass an OSError on as text ("[Errno 28] ...")
                if hint:
                    return f"reading or writing the distributed checkpoint: {hint}"
            # which other checkpoint to pick is the command's to say (--iteration, --ckpt-step): see its caller
            return f"the distributed checkpoint could not be read or written ({type(exc).__name__}: " \
                   f"{_first_line(exc)}); a .distcp shard is missing or truncated: re-save or re-convert it"
        return f"the distributed checkpoint could not be read or written ({_first_line(e)})"
    if isinstance(e, RuntimeError) and "unexpected pos" in str(e):  # torch.save's zip writer on a full disk
        return f"writing a file failed part-way ({_first_line(e)}); most likely the disk is full: free space " \
               "there or write to another directory"
    if isinstance(e, (ValueError, OSError, RuntimeError)) and str(e).strip():
        return _first_line(e) if "\n" not in str(e).strip() else str(e).strip()
    return None


def debug_requested(argv) -> bool:
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return bool(os.environ.get("MVLM_DEBUG")) or any(a in DEBUG_FLAGS for a in args)


def run_cli(main, argv=None) -> int:
    """Run ``main(argv)`` and return its exit code (``None`` = 0). Known faults print one ``error:`` line and
    return 2 (with ``-v``/``--debug`` the traceback comes first); Ctrl-C returns 130."""
    try:
        rc = main(argv)
        return 0 if rc is None else int(rc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - this is the boundary
        line = describe_error(e)
        debug = debug_requested(argv)
        if debug:
            traceback.print_exc()
        if line is None:
            print(f"error: unexpected {type(e).__name__}: {_first_line(e)} (a bug: please report it with the "
                  + ("traceback above)" if debug else "traceback that -v prints)"), file=sys.stderr)
            return 1
        print(f"error: {line}", file=sys.stderr)
        return 2
