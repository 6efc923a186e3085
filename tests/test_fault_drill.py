"""Fault drills through train/run.py on CPU (2 gloo processes, context parallel: --cp 2, each sequence split over
the two ranks), a rank killed in the middle of a torch_dist save, and a checkpoint whose bytes changed after it was
committed (issue 42; at CP2 for issue 49: the killed run resumes bit for bit).

1. kill -9 one rank while it saves iteration 6: both ranks' shards are written, the commit is not. The tracker
   still names iteration 3; no process of the killed run is left (the killed rank's write-results queue server,
   which megatron-core's writer forks, ends with it); re-running the same command continues from iteration 3 (its
   iterations 4-6 give the killed run's losses bit for bit), reports the half-written directory and leaves it as it
   was (never loaded).
2. a shard of the committed iteration 6 overwritten in place (its size unchanged, so only its bytes tell): the
   launcher's size checks pass, the ranks' checksum manifest check refuses the automatic resume in one line naming
   the file, ``--ckpt-step`` and iteration 3; with ``--ckpt-step 3`` the run continues from iteration 3 (the same
   losses again) and its new iteration 6 replaces the damaged one.

The kill is made deterministic by a ``sitecustomize`` that the drill puts on the ranks' path: on the chosen rank,
right after ``megatron_vlm.checkpoint.save_sharded`` wrote its shards of the chosen iteration, it records its pid
and sleeps, and the test kill -9s it there. No production code knows about the drill.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from .train_helpers import args, launch, run, setup  # noqa: F401 (setup: fixture)

pytestmark = pytest.mark.slow

DRILL = ("--stage", "2", "--global-batch-size", "8", "--save-interval", "3", "--log-interval", "1",
         "--deterministic", "--cp", "2")
#: runs on the ranks' interpreter start (PYTHONPATH): holds the chosen rank inside the chosen save
SITECUSTOMIZE = textwrap.dedent('''
    import os
    if os.environ.get("MVLM_DRILL_RANK") == os.environ.get("RANK") and os.environ.get("MVLM_DRILL_DIR"):
        import importlib.abc, importlib.util, sys, time
        from pathlib import Path

        def _hold(module):
            real = module.save_sharded

            def save_sharded(sharded_state_dict, iter_dir):
                real(sharded_state_dict, iter_dir)
                if Path(str(iter_dir)).name.startswith(".iter_%07d." % int(os.environ["MVLM_DRILL_ITERATION"])):
                    Path(os.environ["MVLM_DRILL_DIR"], "in_save").write_text(str(os.getpid()))
                    time.sleep(600)
            module.save_sharded = save_sharded

        class _Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != "megatron_vlm.checkpoint":
                    return None
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                run = spec.loader.exec_module
                spec.loader.exec_module = lambda m: (run(m), _hold(m))
                return spec

        sys.meta_path.insert(0, _Finder())
''')


def metrics(run_dir) -> list[dict]:
    """Every logged training row, in order (a resumed run appends the iterations after its checkpoint)."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def killed_in_save(setup, tmp_path_factory):
    """Iteration 6's save with rank 1 kill -9'd after writing its shards (iteration 3 committed before)."""
    hook = tmp_path_factory.mktemp("drill_hook")
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # the hook runs as each rank's interpreter starts: ranks started as new interpreters (launch/elastic.py)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]), "MVLM_DRILL_RANK": "1",
           "MVLM_DRILL_ITERATION": "6", "MVLM_DRILL_DIR": str(hook), "MVLM_RANK_START": "exec"}
    p = launch(args(setup, "drill", *DRILL, iters=6), env=env)
    marker, deadline = hook / "in_save", time.time() + 400
    while not marker.is_file():
        assert p.poll() is None and time.time() < deadline, (p.stdout.read() if p.poll() is not None else "")[-4000:]
        time.sleep(0.05)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    out, _ = p.communicate(timeout=300)
    return setup["root"] / "ckpt" / "drill", p.returncode, out, _left_behind(str(hook))


def _left_behind(mark: str, wait_s: float = 10.0) -> list[str]:
    """Processes of the drilled run still alive (they carry its MVLM_DRILL_DIR): a killed rank's children, such as
    the write-results queue server megatron-core's torch_dist writer forks, must end with it."""
    import psutil

    deadline = time.time() + wait_s
    while True:
        alive = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.environ().get("MVLM_DRILL_DIR") == mark:
                    alive.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])[:120]}")
            except (psutil.Error, OSError):
                pass
        if not alive or time.time() > deadline:
            for line in alive:  # do not leave them to the rest of the suite
                psutil.Process(int(line.split(":")[0])).kill()
            return alive
        time.sleep(0.2)


def test_a_rank_killed_mid_save_leaves_the_previous_iteration_committed(setup, killed_in_save):
    run_dir, rc, out, left = killed_in_save
    assert rc != 0, out[-3000:]
    assert not left, left  # nothing of the killed run keeps running
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not (run_dir / "iter_0000006").exists()
    half = sorted(run_dir.glob(".iter_0000006.tmp-*"))
    assert len(half) == 1 and list(half[0].glob("*.distcp")) and not (half[0] / "ckpt_meta.json").exists(), half
    before = _tree(half[0])

    out = run(args(setup, "drill", *DRILL, iters=6))  # the same command again
    assert "resumed from" in out and "at iteration 3" in out, out[-3000:]
    assert f"an interrupted save left {half[0]}" in out and "never loaded" in out, out[-3000:]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert _tree(half[0]) == before  # left for the user, as it was
    rows = metrics(run_dir)
    killed = {r["iteration"]: r for r in rows[:6]}
    resumed = {r["iteration"]: r for r in rows[6:]}
    assert sorted(killed) == list(range(1, 7)) and sorted(resumed) == [4, 5, 6], [r["iteration"] for r in rows]
    for i in (4, 5, 6):  # the resumed run repeats what the killed one computed after iteration 3
        assert (resumed[i]["loss"], resumed[i]["grad_norm"]) == (killed[i]["loss"], killed[i]["grad_norm"])


def test_bytes_changed_after_the_commit_are_refused_and_ckpt_step_resumes_before_them(setup, killed_in_save):
    run_dir = killed_in_save[0]
    if (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() != "6":
        pytest.fail("the drill above did not commit iteration 6", pytrace=False)
    shard = max((run_dir / "iter_0000006").glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, the size unchanged
    shard.write_bytes(bytes(data))

    # the automatic resume (of a run extended to 8 iterations) would pick iteration 6
    p = launch(args(setup, "drill", *DRILL, "--use-checkpoint-opt-param-scheduler", iters=8))
    out, _ = p.communicate(timeout=300)
    last = out.strip().splitlines()[-1]
    assert p.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert str(shard) in last and "its bytes changed after the save" in last, last
    assert "resume from its newest complete iteration with --ckpt-step 3" in last, last

    before = metrics(run_dir)
    out = run(args(setup, "drill", *DRILL, "--ckpt-step", "3", iters=6))
    assert "at iteration 3" in out and "(--ckpt-step) while the tracker names 6" in out, out[-3000:]
    again = {r["iteration"]: r for r in metrics(run_dir)[len(before):]}
    first = {r["iteration"]: r for r in before[:6]}
    assert sorted(again) == [4, 5, 6]
    assert all(again[i]["loss"] == first[i]["loss"] for i in again)
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert shard.read_bytes() != bytes(data)  # iteration 6 saved anew
