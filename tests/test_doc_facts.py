"""What the docs quote from the code: the error messages of docs/troubleshooting.md's tables, and flag defaults
written in prose (`--flag` (1000), `--flag`, default 0.01, ... (default 9,1,0)), checked against the code.

A quoted message is matched against every string literal of the commands and the library (f-strings with their
placeholders as wildcards): the quote is cut at what is an example (a path, a number, a quoted name, '...',
'X') and the literal pieces between must appear, in order, in one message of the code. A default is compared
with the argparse default of every command that has the flag (train/run.py: its field table)."""

import argparse
import ast
import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="the docs' quoted messages and defaults against the code's text: no model code runs")

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ["megatron_vlm", "convert", "data_prep", "train", "eval"]
COMMANDS = ["convert/build_llava.py", "convert/hf_to_megatron.py", "convert/megatron_to_hf.py",
            "data_prep/make_wds.py", "data_prep/stats.py", "eval/generate.py", "eval/evaluate.py", "eval/plot.py"]
HOLE = "\x00"


def _module_strings(tree) -> dict[str, str]:
    """Module-level string constants (``NAME = "..."``, ``A, B = "x", "y"``) of a file."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for n, v in zip(names, values):
                    if isinstance(n, ast.Name) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                        out[n.id] = v.value
    return out


_PERCENT = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdifrgx]")


def _template(node, consts: dict[str, str]) -> str | None:
    """The text of a string expression, placeholders as HOLE (f-strings, ``+``, a module constant, the string
    branch of ``x if c else ''``); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _PERCENT.sub(HOLE, node.value)  # a log call's %s / %d placeholders
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(v.value)
            elif isinstance(v.value, ast.Name) and v.value.id in consts and v.format_spec is None:
                parts.append(consts[v.value.id])
            else:
                parts.append(HOLE)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left, consts), _template(node.right, consts)
        if left is not None or right is not None:
            return (left if left is not None else HOLE) + (right if right is not None else HOLE)
    if isinstance(node, ast.IfExp):
        return _template(node.body, consts)
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    return None


def _literals() -> list[str]:
    """Every string expression of the code (see :func:`_template`)."""
    out = []
    for d in CODE_DIRS:
        for f in (ROOT / d).rglob("*.py"):
            tree = ast.parse(f.read_text(), str(f))
            consts = _module_strings(tree)
            for node in ast.walk(tree):
                if isinstance(node, (ast.JoinedStr, ast.BinOp, ast.Constant)):
                    t = _template(node, consts)
                    if t is not None:
                        out.append(t)
    return out


#: quotes of messages assembled from parts that no single string expression holds: the parts must exist
COMPOSED = {
    "--megatron-dir X is the same as --hf-dir X": ["is the same as", "contains", "lies inside",
                                                  f"{HOLE} {HOLE} {HOLE} {HOLE} {HOLE}; {HOLE}: choose another "],
    "--verify: ...; the new checkpoint was deleted (nothing was written to ...)": [
        "--verify: \x00; the new checkpoint was deleted (\x00).", "nothing was written to \x00"],
    "...mp_rank_01_000/model_optim_rng.pt: missing rank file (no rank file holds tensor-parallel rank 1's shards "
    "...); ... Megatron-LM before NVIDIA/Megatron-LM#4678 ...": [
        ": missing rank file (no rank file holds ", "; Megatron-LM before NVIDIA/Megatron-LM#4678 (May 2026) wrote"],
    "--megatron-dir X: the model in float32 needs about ... of memory, more than 80% of the ... available; pass "
    "--dtype bf16 (about ...)": [": the model in ", " of memory, more than ", "; pass --dtype bf16 (about "],
}


def _example(word: str) -> bool:
    """A doc word that shows an example (a path, a number, a name, a flag that the code fills in)."""
    return bool(re.search(r"\d|/|\.\.\.|^[XNLR][,:;)]?$|^'.*'[,:;)]?$|^--", word)) or not re.search(r"[A-Za-z]", word)


def _words(text: str) -> list[str]:
    return text.split()


def _word_eq(doc: str, code: str) -> bool:
    if HOLE not in code:
        return doc == code
    return re.fullmatch(".*".join(re.escape(p) for p in code.split(HOLE)), doc, re.S) is not None


def _fits(doc: list[str], code: list[str]) -> bool:
    """Whether the doc's words are a run of the code's words, a placeholder standing for any words (also inside
    a word: ``({kept}).``), the doc's first and last words possibly cut (a quote can start or end inside a word),
    with at least half of the doc's own words (not examples: :func:`_example`) matched by the code's words."""
    from functools import lru_cache

    n, m = len(doc), len(code)
    NO = -1 << 20

    def own(text: str) -> int:
        return sum(not _example(w) for w in text.split())

    def credit(d: str, c: str) -> int:  # the doc's own words that the code word (placeholders aside) spells
        text = c.replace(HOLE, " ")
        return sum(1 for w in d.split() if not _example(w) and w.strip("()[],.;:'\"") in text)

    @lru_cache(maxsize=None)
    def go(i: int, j: int) -> int:  # most doc words matched by the code's own words, doc[i:] against code[j:]
        if i == n:
            return 0
        if j == m:
            return NO
        c = code[j]
        if c == HOLE:
            return max(go(i, j + 1), go(i + 1, j), go(i + 1, j + 1))
        if HOLE not in c:
            d = doc[i]
            if d == c or (i == n - 1 and c.startswith(d)):
                return own(d) + go(i + 1, j + 1)
            return NO
        best = NO
        for k in range(1, n - i + 1):  # a placeholder inside the word may stand for several doc words
            d = " ".join(doc[i:i + k])
            last = i + k == n
            prefix = c.split(HOLE)[0]
            if _word_eq(d, c) or (last and prefix and _word_eq(d, prefix + HOLE)):
                best = max(best, credit(d, c) + go(i + k, j + 1))
            elif k == 1 and last and c.startswith(HOLE):  # the quote ends inside what the placeholder writes
                best = max(best, 0)
        return best

    need = -(-sum(not _example(w) for w in doc) // 2)
    for j, c in enumerate(code):
        d0, tail = doc[0], c.split(HOLE)[-1]
        best = go(0, j)
        if HOLE not in c and c.endswith(d0) and d0 != c:  # the quote starts inside this word
            best = max(best, own(d0) + go(1, j + 1))
        if HOLE in c and tail and _word_eq(d0, HOLE + tail):
            best = max(best, credit(d0, c) + go(1, j + 1))
        if best >= need:
            return True
    return False


def _quoted_in_code(quote: str, literals: list[str]) -> bool:
    """Every '...'-separated part of ``quote`` fits one message of the code (:func:`_fits`)."""
    parts = [_words(p) for p in re.split(r"\.\.\.|…", quote) if p.strip()]
    if not parts:
        return True
    keys = [w.strip("`'\"(),.;:") for p in parts for w in p if not _example(w)]
    keys = [k for k in keys if len(k) >= 4] or [max((w for p in parts for w in p), key=len)]
    for lit in literals:
        if not any(k in lit for k in keys):
            continue
        words = _words(lit)
        if all(_fits(p, words) for p in parts):
            return True
    return False


def _troubleshooting_quotes() -> list[str]:
    quotes = []
    for line in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines():
        if line.startswith("| `"):
            cell = line.split(" | ")[0]
            quotes += [q for q in re.findall(r"`([^`]+)`", cell) if not re.fullmatch(r"--[\w-]+", q)]
    return quotes


@pytest.fixture(scope="module")
def literals():
    return _literals()


def test_troubleshooting_quotes_are_the_codes_messages(literals):
    quotes = _troubleshooting_quotes()
    assert len(quotes) > 30
    missing = [q for q in quotes if q not in COMPOSED and not _quoted_in_code(q, literals)]
    for q, parts in COMPOSED.items():
        assert q in quotes, f"{q!r} is no longer quoted: drop it from COMPOSED"
        missing += [f"{q} (its part {p!r})" for p in parts if not any(p in lit for lit in literals)]
    assert not missing, "docs/troubleshooting.md quotes messages the code does not write:\n" + "\n".join(missing)


def test_the_quote_check_can_fail(literals):
    """A quote matches its message, and a reworded one is caught."""
    assert _quoted_in_code("--megatron-load-dir X has no vlm_spec.json: not a megatron-vlm checkpoint", literals)
    assert not _quoted_in_code("--megatron-load-dir X has no vlm_spec.json: not a megatron-vlm model", literals)
    assert not _quoted_in_code("no CUDA GPU is visible; run on a GPU node, or pass --device gpu", literals)


# ---- flag defaults ---------------------------------------------------------------------------------------
class _Captured(BaseException):
    def __init__(self, parser):
        self.parser = parser


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, captured when its main() parses ``--help``."""
    out = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        for rel in COMMANDS:
            spec = importlib.util.spec_from_file_location(f"_doc_cmd_{Path(rel).stem}", ROOT / rel)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            main = getattr(mod, "_run", None) or mod.main
            try:
                main(["--help"])
            except _Captured as c:
                out[rel] = c.parser
    finally:
        argparse.ArgumentParser.parse_args = real
    from megatron_vlm.training.config.parse import build_parser

    out["train/run.py"] = build_parser()
    return out


def _defaults(parsers) -> dict[str, list]:
    from megatron_vlm.training.config.fields import FIELDS

    out: dict[str, list] = {}
    for p in parsers.values():
        for a in p._actions:
            for opt in a.option_strings:
                out.setdefault(opt, []).append(a.default)
    for f in FIELDS.values():  # the launcher's parser leaves defaults to the config: the field table has them
        for opt in f.metadata["flags"]:
            out.setdefault(opt, []).append(f.default)
    return out


_SIZE = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def _value(text: str):
    text = text.strip().strip("`")
    m = re.fullmatch(r"(\d+) (KiB|MiB|GiB)", text)
    if m:
        return int(m.group(1)) * _SIZE[m.group(2)]
    m = re.fullmatch(r"2\^(\d+)", text)
    if m:
        return 2 ** int(m.group(1))
    try:
        return float(text.replace(",", "")) if re.fullmatch(r"[\d,]*\.?\d+(e-?\d+)?", text.replace(",", "")) \
            else text
    except ValueError:
        return text


# `--flag` (VALUE)  |  `--flag`, default VALUE  |  `--flag` ... (default VALUE) within the sentence
_DEFAULT = re.compile(r"`(--[a-z0-9-]+)`(?: \(| ?, default | [^`.;]{0,60}?\(default )(`?[\w.,^/<>-]+(?: [KMG]iB)?`?)[),;]")


def _doc_defaults() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        for flag, value in _DEFAULT.findall(doc.read_text()):
            v = _value(value)
            if isinstance(v, (int, float)) or re.fullmatch(r"`?[\d,]+`?", value):
                found.append((doc.name, flag, value))
    return found


def _same(doc_value, code_value) -> bool:
    if isinstance(code_value, (list, tuple)):
        code_value = ",".join(map(str, code_value))
    v = _value(doc_value)
    if isinstance(v, (int, float)) and isinstance(code_value, (int, float)) and not isinstance(code_value, bool):
        return abs(v - code_value) <= 1e-12 * max(abs(v), 1)
    return str(v).strip("`") == str(code_value)


def test_flag_defaults_in_docs_are_the_codes():
    defaults = _defaults(_parsers())
    found = _doc_defaults()
    assert len(found) >= 6, found
    wrong = []
    for doc, flag, value in found:
        have = defaults.get(flag)
        if have is None:
            wrong.append(f"{doc}: {flag} ({value}): no command has this flag")
        elif not any(_same(value, d) for d in have):
            wrong.append(f"{doc}: {flag} ({value}): the code's default is {', '.join(map(repr, have))}")
    assert not wrong, "\n".join(wrong)
