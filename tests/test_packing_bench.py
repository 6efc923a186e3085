"""bench/packing.py --tiny as a smoke test (issue 36): the script runs end to end through the trainer's step, packs
the mix into fewer rows with less padding than the padded micro batches, and trains the same real tokens on both
sides. Not a timed test: the speed ratio is printed by the bench, not asserted."""

import json
import sys

import pytest

from .conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.one_lane(
    "3.11",
    reason="bench/packing.py --tiny as a smoke test; packed training itself is held in both lanes by the modules"
           " named",
    covered_by=("test_packing_equivalence", "test_packing_resume"))]


def test_bench_packing_tiny(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))  # the world's process imports the bench's per-rank function by name
    try:
        import packing as bench

        r = bench.main(["--tiny", "--json", str(tmp_path / "r.json")])
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert json.loads((tmp_path / "r.json").read_text())["samples"] == r["samples"] == 8
    assert r["packed"]["rows"] < r["padded"]["rows"] and r["packed"]["padding"] < r["padded"]["padding"]
    assert r["packed"]["seconds"] > 0 and r["padded"]["seconds"] > 0
    assert "real tokens/s" in capsys.readouterr().out
