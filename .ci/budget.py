#!/usr/bin/env python3
"""The CI budget: how long a lane's test suite may take, and the check .ci/run makes after each lane.

The budget is one number, :data:`LANE_BUDGET_MIN`: minutes of wall for one lane's `make test` on an idle 2-core
machine (installs not counted; they are timed and printed apart). Raise it only with a note in
docs/development.md#the-ci-budget saying why (tests/test_ci_rules.py holds the page to this number).

CI machines differ from day to day. The check measures this machine's speed with a fixed pure-Python workload
(:func:`workload`, the median of five runs) and compares it with the same workload on the idle 2-core machine the
budget was set on (:data:`REFERENCE_S`): on a slower machine the budget grows by that ratio (never shrinks), so a
red lane means the suite grew, not that the day was slow.

The pure-Python workload does not follow torch's CPU kernels, which differ most between machine types (AVX-512 or
not): on 2026-12-02 an AVX2-only 2-core machine read 0.33-0.37 s (x1.00) and ran the same tree's 3.12 lane in
1793 s, 2.8x the 635 s of the previous session's machine. ``check`` therefore also times a fixed torch workload
(:data:`TORCH_PROBE`, one thread: small matmuls, layer norms, adds, as the suite's tiny models run them) with the
lane's own interpreter when .ci/run passes it, and the budget grows by the larger of the two ratios.

    python3 .ci/budget.py speed                        # this machine's workload time and its ratio to the reference
    python3 .ci/budget.py check LANE SECONDS [PYTHON]  # exit 1, with the reason, when the lane ran over its budget

Standard library only: it runs before any venv exists (the torch probe runs in ``PYTHON``, the lane's venv).
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time

#: minutes of wall for one lane's test suite on an idle 2-core machine
LANE_BUDGET_MIN = 25
#: :func:`workload`'s median time on the idle 2-core machine the budget was measured on (seconds)
REFERENCE_S = 0.44
#: the torch workload, run by the lane's interpreter: prints its best of five timed runs (seconds)
TORCH_PROBE = """
import time, torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
a, x = torch.randn(256, 256, generator=g), torch.randn(64, 256, generator=g)
def run():
    t = time.perf_counter()
    for _ in range(400):
        y = torch.nn.functional.layer_norm((x @ a).relu_(), (256,)) + x
    for _ in range(150):
        a @ a
    return time.perf_counter() - t
run()
print(min(run() for _ in range(5)))
"""
#: :data:`TORCH_PROBE`'s time on the reference machine (seconds). Derived, as that machine is gone: the probe read
#: TORCH_HERE_S on the AVX2 machine of 2026-12-02, whose 3.12 lane took 1793 s against 635 s there for the same
#: suite (less the ~40 s of issue 65's new jobs): TORCH_HERE_S x 675 / 1793.
TORCH_HERE_S = 0.13
TORCH_REFERENCE_S = TORCH_HERE_S * 675 / 1793


def workload() -> float:
    """A fixed CPU-bound job (hashing, integer arithmetic, dict and str work: what the suite's Python does);
    its time in seconds."""
    start = time.perf_counter()
    h, acc = b"megatron-vlm", 0
    for i in range(300_000):
        h = hashlib.sha256(h).digest()
        acc = (acc * 31 + h[0] + i) % 1_000_003
    table = {str(i): i * i for i in range(200_000)}
    assert acc >= 0 and len(table) == 200_000
    return time.perf_counter() - start


def slowness(runs: int = 5) -> tuple[float, float]:
    """(this machine's workload time, its ratio to :data:`REFERENCE_S`, at least 1)."""
    t = statistics.median(workload() for _ in range(runs))
    return t, max(1.0, t / REFERENCE_S)


def torch_slowness(python: str) -> tuple[float, float] | None:
    """(:data:`TORCH_PROBE`'s time in ``python``, its ratio to :data:`TORCH_REFERENCE_S`, at least 1), or None when
    that interpreter cannot run it (the check then reads the pure-Python workload alone)."""
    import subprocess

    try:
        out = subprocess.run([python, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=300, check=True)
        t = float(out.stdout.split()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
    return t, max(1.0, t / TORCH_REFERENCE_S)


def budget_s(slow: float) -> float:
    return LANE_BUDGET_MIN * 60 * slow


def check(lane: str, seconds: float, slow: float) -> str | None:
    """None when ``seconds`` is within the lane's budget on a machine ``slow`` times slower than the reference,
    else the one-line reason."""
    limit = budget_s(slow)
    if seconds <= limit:
        return None
    return (f"the {lane} lane's tests took {seconds / 60:.1f} min, over the CI budget of {limit / 60:.1f} min "
            f"({LANE_BUDGET_MIN} min on an idle 2-core machine x {slow:.2f} for this machine's speed, .ci/budget.py): "
            "the slowest modules are listed above; fold the new checks into shared worlds "
            "(docs/development.md#the-ci-budget), or raise LANE_BUDGET_MIN with a note there saying why")


def main(argv: list[str]) -> int:
    if argv[:1] == ["speed"]:
        t, slow = slowness()
        print(f"machine speed: workload {t:.3f} s (reference {REFERENCE_S:.3f} s on an idle 2-core machine): "
              f"x{slow:.2f}, lane budget {budget_s(slow) / 60:.1f} min")
        return 0
    if argv[:1] == ["check"] and len(argv) in (3, 4):
        t, slow = slowness()
        probe = torch_slowness(argv[3]) if len(argv) == 4 else None
        speed = f"workload {t:.3f} s, x{slow:.2f}"
        if probe is not None:
            speed += f"; torch probe {probe[0]:.3f} s (reference {TORCH_REFERENCE_S:.3f} s), x{probe[1]:.2f}"
            slow = max(slow, probe[1])
        why = check(argv[1], float(argv[2]), slow)
        if why:
            print(f"::error:: {why} ({speed})", file=sys.stderr)
            return 1
        print(f"the {argv[1]} lane's tests took {float(argv[2]) / 60:.1f} min, within the budget of "
              f"{budget_s(slow) / 60:.1f} min ({speed})")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
