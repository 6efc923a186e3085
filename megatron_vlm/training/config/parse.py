"""The command line and YAML: the argument parser built from the field table, and the coercion of YAML values
(and of the flags' text) into field values. Errors are :class:`ConfigError` naming the file and setting."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from pathlib import Path
from typing import Any

from megatron_vlm.training.config.fields import GROUPS, FIELDS, ConfigError, ConfigFields


def parse_int_list(text: str) -> list[int]:
    """``"3,1"`` -> ``[3, 1]``."""
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def parse_range(text) -> tuple[int, int]:
    """``"1000-1010"`` (or ``[1000, 1010]``) -> ``(1000, 1010)``."""
    if isinstance(text, (list, tuple)) and len(text) == 2:
        return int(text[0]), int(text[1])
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an iteration range A-B such as 1000-1010")
    return int(m.group(1)), int(m.group(2))


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if f.default not in (None, dataclasses.MISSING) and f.metadata["kind"] not in ("tristate",):
        shown = "on" if f.default is True else "off" if f.default is False else f.default
        text += f" (default: {shown})"
    return text.replace("%", "%%")


class _DeprecatedFlag(argparse.Action):
    """A deprecated spelling of a ``flag`` field (``deprecated={flag: why}`` in its metadata): sets the field and
    prints a warning naming the replacement."""

    def __init__(self, option_strings, dest, why: str = "", **kw):
        kw.pop("nargs", None)
        super().__init__(option_strings, dest, nargs=0, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        print(f"{parser.prog}: warning: {option_string} is deprecated: {self.why}", file=sys.stderr, flush=True)


class _IntLists(argparse.Action):
    """An ``intlist`` field that also takes Megatron-LM's space-separated form (``nargs=True`` in its metadata):
    ``--profile-ranks 0 1`` and ``--profile-ranks 0,1`` give the same list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [x for part in values for x in part])


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser. Only flags the user gave appear in the parsed namespace."""
    parser = argparse.ArgumentParser(allow_abbrev=False, 
        prog="train/run.py",
        description="Launch LLaVA-style VLM training on megatron-core: validates the request, writes the "
        "resolved config to <save-dir>/<name>/config.yaml and starts train/pretrain_vlm.py on every rank "
        "through torchrun (optionally inside Apptainer/Docker, or as a SLURM batch job).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="RUN.yaml", help="YAML file with any of the settings below under "
                        "their field names (e.g. micro_batch_size: 4); command-line flags override it.")
    groups = {k: parser.add_argument_group(v) for k, v in GROUPS.items()}
    for f in dataclasses.fields(ConfigFields):
        m = f.metadata
        g = groups[m["group"]]
        kind, flags = m["kind"], m["flags"]
        kw: dict[str, Any] = dict(dest=f.name, help=_help(f))
        if "metavar" in m or kind in ("int", "float"):
            kw["metavar"] = m.get("metavar", "N" if kind == "int" else "X")
        if kind == "bool":
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif kind == "flag":
            g.add_argument(*flags, action="store_true", **kw)
            for old, why in m.get("deprecated", {}).items():
                g.add_argument(old, action=_DeprecatedFlag, dest=f.name, why=why, help=argparse.SUPPRESS)
        elif kind == "tristate":
            ex = g.add_mutually_exclusive_group()
            ex.add_argument(*flags, action="store_const", const=True, **kw)
            negatives = m["negative"] if isinstance(m["negative"], tuple) else (m["negative"],)
            ex.add_argument(*negatives, action="store_const", const=False, dest=f.name,
                            help=f"The opposite of {flags[0]}.")
        elif kind == "choice":
            choices = m["choices"]
            typ = type(choices[0])
            g.add_argument(*flags, type=typ, choices=choices, **kw)
        elif kind == "intlist" and m.get("nargs"):
            g.add_argument(*flags, type=parse_int_list, nargs="+", action=_IntLists, **kw)
        elif kind == "intlist":
            g.add_argument(*flags, type=parse_int_list, **kw)
        elif kind == "ranges":
            g.add_argument(*flags, type=parse_range, nargs="+", **kw)
        elif kind == "strlist":
            g.add_argument(*flags, action="append", **kw)
        else:
            g.add_argument(*flags, type={"int": int, "float": float}.get(kind, str), **kw)
    return parser


def to_argv(cfg: ConfigFields) -> list[str]:
    """The command-line flags that give ``cfg`` (every field that differs from its default), so that
    ``build_parser().parse_args(to_argv(cfg))`` builds the same config: what ``--dry-run`` prints instead of a
    ``--config`` file it does not write."""
    argv: list[str] = []
    for f in dataclasses.fields(ConfigFields):
        m, v = f.metadata, getattr(cfg, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if v == default or v is None:
            continue
        kind, flag = m["kind"], m["flags"][0]
        if kind in ("bool", "flag", "tristate"):
            if v:
                argv.append(flag)
            elif kind == "bool":
                argv.append("--no-" + flag[2:])
            elif kind == "tristate":
                argv.append(m["negative"][0] if isinstance(m["negative"], tuple) else m["negative"])
        elif kind == "intlist":
            argv += [flag, ",".join(map(str, v))]
        elif kind == "ranges":
            argv += [flag, *(f"{a}-{b}" for a, b in v)]
        elif kind == "strlist":
            for item in v:
                argv += [flag, item]
        else:
            argv += [flag, str(v)]
    return argv


# ---- YAML -------------------------------------------------------------------------------------------
def read_yaml_values(path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of setting: value, got {type(data).__name__}")
    return coerce_mapping(data, str(path))


_ALIASES = {"unfreeze_vit": "freeze_vit", "unfreeze_lm": "freeze_lm", "mbs": "micro_batch_size",
            "gbs": "global_batch_size", "debug": "smoke_test"}


def coerce_mapping(data: dict[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key == "derived":
            continue
        negate = key.startswith("unfreeze_")
        key = _ALIASES.get(key, key)
        if key not in FIELDS:
            close = difflib.get_close_matches(key, list(FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown setting {raw_key!r}{hint}")
        try:
            v = _coerce(FIELDS[key], value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{source}: {raw_key}: {e}") from None
        if negate and v is not None:
            v = not v
        out[key] = v
    return out


def _coerce(f: dataclasses.Field, value):
    kind = f.metadata["kind"]
    if value is None:
        if kind in ("ranges", "strlist"):
            return []
        if f.default is not None and f.default is not dataclasses.MISSING:
            raise ValueError(f"must not be empty (default {f.default})")
        return None
    if kind in ("bool", "flag", "tristate"):
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "on", "1"):
            return True
        if str(value).lower() in ("false", "no", "off", "0"):
            return False
        raise ValueError(f"{value!r} is not true/false")
    if kind == "int" or (kind == "choice" and isinstance(f.metadata["choices"][0], int)):
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{value!r} is not an integer")
        v = int(value)
        if kind == "choice" and v not in f.metadata["choices"]:
            raise ValueError(f"{value!r} is not one of {list(f.metadata['choices'])}")
        return v
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number")
        return float(value)  # YAML reads 1e-3 as a string; float() takes it
    if kind == "choice":
        if value not in f.metadata["choices"]:
            raise ValueError(f"{value!r} is not one of {list(f.metadata['choices'])}")
        return value
    if kind == "intlist":
        if isinstance(value, (list, tuple)):
            return [int(x) for x in value]
        return parse_int_list(value)
    if kind == "ranges":
        if isinstance(value, (str, int)):
            value = [value]
        return [parse_range(x) for x in value]
    if kind == "strlist":
        if isinstance(value, str):
            return [value]
        return [str(x) for x in value]
    return str(value)
