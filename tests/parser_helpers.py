"""The argparse parser of every command, and the flags a text names: what test_docs and test_bad_inputs hold the
documentation and the error messages to.

:func:`command_parser` runs a script's ``main(["--help"])`` in this process and keeps the ``ArgumentParser`` it
parses with (the scripts build their parser inside ``main`` and import their heavy libraries only after parsing,
so this costs milliseconds). A flag counts only if that parser defines it: text that merely appears somewhere in
``--help`` (a word in a help string, another command's flag quoted there) does not.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT_DIRS = ("convert", "data_prep", "train", "eval", "demo", "bench", "tools")

_FLAG_IN_TEXT = re.compile(r"(?<![\w./-])(--?[A-Za-z][\w-]*)")
_SCRIPT_IN_TEXT = re.compile(r"(?<![\w.-])((?:[\w-]+/)*[\w-]+\.py)\b")


class _Captured(Exception):
    pass


@functools.lru_cache(maxsize=None)
def command_parser(path: Path) -> tuple[argparse.ArgumentParser, str]:
    """(the parser ``path``'s ``main`` parses its command line with, its ``--help`` text)."""
    name = f"_parser_of_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the script executes
    saved_argv, saved_path = sys.argv, list(sys.path)
    parsers: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_known_args

    def recording(self, args=None, namespace=None):
        parsers.append(self)
        return real(self, args, namespace)

    out = io.StringIO()
    try:
        spec.loader.exec_module(mod)
        params = inspect.signature(mod.main).parameters
        sys.argv = [str(path), "--help"]
        argparse.ArgumentParser.parse_known_args = recording
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                if "repo_root" in params:
                    mod.main(["--help"], repo_root=ROOT)
                elif params:
                    mod.main(["--help"])
                else:
                    mod.main()  # reads sys.argv
            except SystemExit as e:
                assert e.code in (0, None), f"{path} --help exited {e.code}"
    finally:
        argparse.ArgumentParser.parse_known_args = real
        sys.argv = saved_argv
        sys.path[:] = saved_path
        sys.modules.pop(name, None)
    assert parsers and "usage:" in out.getvalue(), f"{path} --help parsed nothing or printed no usage"
    return parsers[0], out.getvalue()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    flags = set(parser._option_string_actions)
    for action in parser._actions:  # sub-commands: their flags too
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _options(sub)
    return flags


@functools.lru_cache(maxsize=None)
def command_flags(path: Path) -> frozenset[str]:
    """Every option string ``path``'s parser defines (``-g``, ``--tp``, ``--no-wandb``, ...)."""
    return frozenset(_options(command_parser(path)[0]))


def scripts() -> dict[str, Path]:
    """Script name as a text may write it (``convert/build_llava.py`` or ``build_llava.py``) -> its path."""
    paths = [p for d in SCRIPT_DIRS for p in sorted((ROOT / d).glob("*.py"))]
    names: dict[str, list[Path]] = {}
    for p in paths:
        names.setdefault(str(p.relative_to(ROOT)), []).append(p)
        names.setdefault(p.name, []).append(p)
    return {k: v[0] for k, v in names.items() if len(v) == 1}


def flags_in_text(text: str, command: Path) -> list[tuple[str, Path]]:
    """The flags ``text`` (an error message) names, each with the command it belongs to: ``command``, or the
    script the same clause (up to a ';', ': ', 'or', 'and' or 'then') names before it ("... write it with
    data_prep/make_wds.py --output URL"). Flags written together (``--save-dir/--name``, ``-g/--node/--tp/--pp``) are each returned."""
    known = scripts()
    out = []
    for line in text.splitlines():
        for m in _FLAG_IN_TEXT.finditer(line):
            clause = re.split(r"[;:]\s|,?\s(?:or|and|then)\s", line[: m.start()])[-1]
            named = [known[s] for s in _SCRIPT_IN_TEXT.findall(clause) if s in known]
            out.append((m.group(1), named[-1] if named else command))
    return out


def unknown_flags(text: str, command: Path) -> list[str]:
    """``flag (command)`` for each flag of ``text`` its command's parser does not define."""
    return [f"{flag} ({cmd.relative_to(ROOT)})" for flag, cmd in flags_in_text(text, command)
            if flag not in command_flags(cmd)]
