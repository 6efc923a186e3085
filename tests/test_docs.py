"""The documentation holds together: README.md and docs/*.md.

- every relative link resolves to a file of the repository, and every ``#anchor`` to a heading of its target
  (GitHub's heading slugs);
- every command a page shows -- ``python SCRIPT.py --flag ...`` in a code block, or an inline code span such as
  ``train/run.py --device cpu`` -- names an existing script whose argparse parser defines each flag shown (the
  parser its ``main`` builds, captured while ``--help`` runs in this process: the scripts import their heavy
  libraries only after parsing, so that costs milliseconds; a flag only mentioned in the ``--help`` text does not
  count, :mod:`tests.parser_helpers`); ``python -m MODULE`` names an importable module and ``make TARGET`` a target
  of the Makefile;
- no page sends the reader outside the repository for the architecture (``docs/architecture.md`` replaced the
  design card in ``../shared/DESIGN.md``).

Nothing here starts a process, so it runs in the fast set.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest

from .conftest import CI, ROOT
from .parser_helpers import command_flags, command_parser, scripts

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="links and every command's flags against its argparse parser: no model code runs")

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Pages the guides link to that other work in progress writes (issue 38: the model support table, the packing
#: guide). While one is absent the link check skips naming it, and under CI (``CI=true``) fails: the lead removes an
#: entry once its page is in. An anchor into a pending page is checked as soon as the page exists.
PENDING: dict[str, str] = {}  # page -> what it will hold, for a link that lands before its page

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FLAG = re.compile(r"^\[?(--?[A-Za-z][\w-]*)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _split(text: str) -> tuple[list[tuple[int, str]], list[list[tuple[int, str]]]]:
    """(prose lines, fenced code blocks), each line with its number."""
    prose, blocks, block = [], [], None
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
        elif block is None:
            prose.append((n, line))
        else:
            block.append((n, line))
    return prose, blocks


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (letters, digits, '_', '-' and spaces
    stay; markup such as backticks goes with it), spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    return _anchors_of(path.read_text())


def _anchors_of(text: str) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _split(text)[0]:
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def links(page: Path, text: str | None = None) -> list[tuple[int, str]]:
    found = []
    for n, line in _split(page.read_text() if text is None else text)[0]:
        line = _CODE_SPAN.sub("", line)  # `[x](y)` inside code is text, not a link
        found += [(n, target) for target in _LINK.findall(line)]
    return found


def link_problems(page: Path, text: str | None = None) -> tuple[list[str], list[str]]:
    """(broken links and anchors, links to a :data:`PENDING` page not written yet) of one page (``text``: its
    content, when it is not on disk)."""
    text = page.read_text() if text is None else text
    problems, pending = [], []
    for n, target in links(page, text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        where = f"{_rel(page)}:{n}: ({target})"
        if not file:  # an anchor on the same page
            if anchor not in _anchors_of(text):
                problems.append(f"{where}: {_rel(page)} has no heading whose anchor is #{anchor}")
            continue
        dest = (page.parent / file).resolve()
        if not dest.exists() and _rel(dest) in PENDING:
            pending.append(f"{where}: {_rel(dest)} ({PENDING[_rel(dest)]}) is not written yet")
        elif not dest.exists():
            problems.append(f"{where}: {file} does not exist")
        elif not dest.is_relative_to(ROOT.resolve()):
            problems.append(f"{where}: {file} lies outside the repository, which a user's clone does not have")
        elif anchor:
            if dest.suffix != ".md":
                problems.append(f"{where}: an anchor into {file}, which is not a Markdown page")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: {_rel(dest)} has no heading whose anchor is #{anchor}")
    return problems, pending


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_and_anchors_resolve(page):
    problems, pending = link_problems(page)
    assert not problems, "\n".join(problems)
    if pending:
        if CI:
            pytest.fail("\n".join(pending), pytrace=False)
        pytest.skip("; ".join(pending))


def test_no_page_points_outside_the_repository_for_the_design():
    for page in PAGES:
        assert "shared/DESIGN.md" not in page.read_text(), f"{_rel(page)}: the architecture is docs/architecture.md"


def test_the_readme_stays_short_and_keeps_the_two_first_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md is the front page: move details into a guide under docs/"
    # .ci/run runs the README's test command; the demo comes first
    first = [line.split("#")[0].strip() for _, line in _split(text)[1][0]]
    assert first[:2] == ["make demo", "make test"], first


# ---- commands ------------------------------------------------------------------------------------------------
def _code_commands(page: Path) -> list[tuple[int, str]]:
    """Commands in code blocks (continuation lines joined, comments dropped) and in inline code spans."""
    prose, blocks = _split(page.read_text())
    out = []
    for block in blocks:
        pending, start = "", 0
        for n, line in block:
            line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
            if not pending:
                start = n
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            out.append((start, pending + line))
            pending = ""
    for n, line in prose:
        out += [(n, m.group(2)) for m in _CODE_SPAN.finditer(line)]
    return out


SCRIPTS = scripts()


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an unbalanced quote in an example: whitespace is good enough to find flags
        return command.split()


def parse_command(command: str) -> tuple[str, str, list[str]] | None:
    """('script', path, flags) / ('module', name, []) / ('make', target, []) for a command, else None."""
    toks = _tokens(command)
    while toks and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", toks[0]):  # VAR=value before the command
        toks = toks[1:]
    if not toks:
        return None
    head = toks[0]
    if head == "make":
        target = next((t for t in toks[1:] if not t.startswith("-") and "=" not in t), None)
        return ("make", target, []) if target else None
    if re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", head):
        rest = toks[1:]
        if not rest or rest[0] == "-c":
            return None
        if rest[0] == "-m":
            return ("module", rest[1], []) if len(rest) > 1 else None
        script, args = rest[0], rest[1:]
    elif head.endswith(".py") and head in SCRIPTS:  # inline `train/run.py --device cpu` and the like
        script, args = head, toks[1:]
        if not any(_FLAG.match(a) for a in args):
            return None
    else:
        return None
    if not script.endswith(".py"):
        return None
    flags = [m.group(1) for a in args for m in [_FLAG.match(a.split("|")[0])] if m]
    return ("script", script, flags)


def page_commands(page: Path) -> list[tuple[int, tuple[str, str, list[str]]]]:
    found = []
    for n, command in _code_commands(page):
        parsed = parse_command(command)
        if parsed:
            found.append((n, parsed))
    return found


def help_text(path: Path) -> str:
    """``path --help``, from the script's main() in this process (its ``__main__`` block never runs)."""
    return command_parser(path)[1]


def accepted_flags(path: Path) -> frozenset[str]:
    """The flags ``path``'s argparse parser defines."""
    return command_flags(path)


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_commands_exist_and_accept_the_flags_shown(page):
    problems = []
    for n, (kind, name, flags) in page_commands(page):
        where = f"{_rel(page)}:{n}"
        if kind == "make":
            if name not in make_targets():
                problems.append(f"{where}: make {name}: no such target in the Makefile")
        elif kind == "module":
            if importlib.util.find_spec(name) is None:
                problems.append(f"{where}: python -m {name}: no such module")
        else:
            path = SCRIPTS.get(name) or ROOT / name
            if not path.is_file():
                problems.append(f"{where}: {name}: no such script")
                continue
            unknown = [f for f in flags if f not in accepted_flags(path)]
            if unknown:
                problems.append(f"{where}: {name} does not accept {', '.join(unknown)} (see its --help)")
    assert not problems, "\n".join(problems)


def test_the_guides_show_commands():
    """The check above has something to check: every guide's command lines are found (a parser that finds none
    would pass vacuously)."""
    counts = {_rel(p): sum(k == "script" for _, (k, _, _) in page_commands(p)) for p in PAGES}
    for page in ("README.md", "docs/building-and-converting.md", "docs/data.md", "docs/training.md",
                 "docs/clusters.md"):
        assert counts[page] >= 2, counts
    flags = {f for p in PAGES for _, (k, _, fl) in page_commands(p) if k == "script" for f in fl}
    assert {"--tp", "--megatron-load-dir", "--format", "--verify", "--hf-config"} <= flags


def test_the_checker_catches_what_it_should():
    """Negative controls: a flag a script lacks, a missing anchor, a slug with punctuation."""
    run = ROOT / "train" / "run.py"
    assert "--tp" in accepted_flags(run) and "--no-such-flag" not in accepted_flags(run)
    # a flag --help only mentions is not one the command takes: stats.py's help names make_wds/train's --data-path
    stats = ROOT / "data_prep" / "stats.py"
    assert "--data-path" in help_text(stats) and "--data-path" not in accepted_flags(stats)
    assert parse_command("python train/run.py -g 8 --tp 2 [--dry-run] \\") == ("script", "train/run.py",
                                                                                ["-g", "--tp", "--dry-run"])
    assert parse_command("python convert/hf_to_megatron.py [--ckpt-format torch_dist|torch]")[2] == ["--ckpt-format"]
    assert parse_command("make_wds.py --output") == ("script", "make_wds.py", ["--output"])
    assert parse_command('python -c "import x"') is None
    assert github_slug("`--verify`") == "--verify"
    assert github_slug("Remote storage (S3 / object stores)") == "remote-storage-s3--object-stores"
    assert github_slug("LLaVA-NeXT and LLaVA-OneVision (anyres)") == "llava-next-and-llava-onevision-anyres"



def test_the_link_check_reports_broken_links(tmp_path):
    """Negative control: a page (as if it were docs/x.md) with one good link of each kind and four bad ones."""
    outside = tmp_path / "elsewhere.md"
    outside.write_text("# Elsewhere\n")
    text = ("# A title\n\n[ok](#a-title) [ok](training.md#the-loss-objective) [ok](../README.md) "
            "[web](https://example.com/x.md) `[in code](nope.md)`\n\n"
            f"[gone](missing.md) [no anchor](training.md#no-such-heading) [self](#nothing-here) "
            f"[outside]({os.path.relpath(outside, ROOT / 'docs')})\n")
    problems, pending = link_problems(ROOT / "docs" / "x.md", text)
    assert len(problems) == 4 and not pending, problems
    assert "missing.md does not exist" in problems[0], problems
    assert "#no-such-heading" in problems[1] and "#nothing-here" in problems[2], problems
    assert "outside the repository" in problems[3], problems
