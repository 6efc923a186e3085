#!/usr/bin/env python
"""Write the table of each test module's time per lane into docs/development.md, from the lanes' last runs.

Every whole-suite run (`make test`, `make test PYTHON=python3.12`, and so `.ci/run`) records its modules' times in
``.suite-times/py311.json`` / ``py312.json`` (tests/suite_times.py: pytest's own per-test durations, set-up + call +
tear-down, added up per module). This command turns those two files into the table between the
``<!-- suite-times -->`` markers of docs/development.md, with each module's lane (tests/lanes.py: both, or the one a
``one_lane`` marker names) so the split is visible beside the times:

    make test && make test PYTHON=python3.12 && .venv-py311/bin/python tools/suite_times.py

``--check`` only says whether the table matches the files (exit 1 if not). Run it with a lane's venv python
(it reads the markers with tests/lanes.py, which imports pytest).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "development.md"
BEGIN, END = "<!-- suite-times -->", "<!-- /suite-times -->"
LANES = ("3.11", "3.12")


def load(times_dir: Path) -> dict[str, dict]:
    """lane -> its record, for the lanes whose file exists."""
    out = {}
    for lane in LANES:
        path = times_dir / f"py{lane.replace('.', '')}.json"
        if path.exists():
            out[lane] = json.loads(path.read_text())
    return out


def table(records: dict[str, dict]) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.lanes import marked_modules

    marks = {m: lane for m, (lane, *_) in marked_modules(ROOT / "tests").items()}
    modules = sorted({m for r in records.values() for m in r["modules"]},
                     key=lambda m: -max(r["modules"].get(m, 0.0) for r in records.values()))
    lines = ["| module | lanes | " + " | ".join(f"{lane} (s)" for lane in LANES) + " |",
             "|---|---|" + "---:|" * len(LANES)]
    for m in modules:
        cells = []
        for lane in LANES:
            secs = records.get(lane, {}).get("modules", {}).get(m)
            cells.append("-" if secs is None else f"{secs:.0f}")
        lines.append(f"| {m} | {marks.get(m, 'both')} | " + " | ".join(cells) + " |")
    total = " | ".join(f"**{sum(records[lane]['modules'].values()):.0f}**" if lane in records else "-"
                       for lane in LANES)
    lines.append(f"| **all modules** (sum of their times) | | {total} |")
    walls = "; ".join(f"{lane}: {records[lane]['wall'] / 60:.1f} min of wall on {records[lane].get('workers', 1)} "
                      f"worker(s), {records[lane].get('when', '?')}{'' if records[lane].get('passed') else ' (failed)'}"
                      for lane in LANES if lane in records)
    return ("\n".join(lines) + f"\n\nMeasured by `make test` per lane ({walls}); written by "
            "`python tools/suite_times.py`.")


def render(doc: str, body: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"error: {DOC} has no {BEGIN} ... {END} block: add one where the table goes")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--times-dir", type=Path, default=ROOT / ".suite-times",
                        help="where the lanes' runs wrote py311.json / py312.json (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="only compare the table with the files; exit 1 if they differ")
    args = parser.parse_args(argv)
    records = load(args.times_dir)
    if not records:
        print(f"error: no lane has recorded its times in {args.times_dir}: run `make test` (and "
              "`make test PYTHON=python3.12`) first", file=sys.stderr)
        return 2
    doc = DOC.read_text()
    new = render(doc, table(records))
    if args.check:
        return 0 if new == doc else 1
    if new != doc:
        tmp = DOC.with_suffix(".md.tmp")
        tmp.write_text(new)
        tmp.replace(DOC)
    print(f"{DOC.relative_to(ROOT)}: the table of {len({m for r in records.values() for m in r['modules']})} "
          f"modules from lane(s) {', '.join(records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
