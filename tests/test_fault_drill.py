"""Fault drills through train/run.py on CPU (2 gloo processes, context parallel: --cp 2, each sequence split over
the two ranks): ranks killed in the middle of a torch_dist save, one of them while it writes a shard, and a
checkpoint whose bytes changed after it was committed (issues 42 and 50; at CP2 for issue 49: the killed run resumes
bit for bit).

1. kill -9 both ranks while they save iteration 6, as a node failure would: rank 1 in the middle of writing its
   shard (its first item written and flushed, the rest not: the file is cut short), rank 0 right after writing its
   shards. The commit is not made: the tracker still names iteration 3; no process of the killed run is left (a
   killed rank's write-results queue server, which megatron-core's torch_dist writer starts, ends with it); the
   half-written directory holds rank 0's whole shard and rank 1's cut one, no ``.metadata``; re-running the same
   command continues from iteration 3 (its iterations 4-6 give the killed run's losses bit for bit), reports the
   half-written directory and leaves it as it was (never loaded).
2. a shard of the committed iteration 6 overwritten in place (its size unchanged, so only its bytes tell): the
   launcher's size checks pass, the ranks' checksum check (megatron-core's integrity manifest with 0.19, the
   checkpoint's checksums.json with 0.16) refuses the automatic resume in one line naming the file, ``--ckpt-step``
   and iteration 3; with ``--ckpt-step 3`` the run continues from iteration 3 (the same losses again) and its new
   iteration 6 replaces the damaged one.

The kills are made deterministic by a ``sitecustomize`` that the drill puts on the ranks' path. On the writing rank
it wraps torch.distributed.checkpoint's ``_write_item`` as megatron-core's writer calls it (in a forked writer process
with megatron-core 0.16, a writer thread with 0.19): after the first item of the chosen iteration's shard it flushes
the file, records the rank's and the writer's pid and the bytes written, and sleeps; on the other rank it wraps
megatron-core's shard writer and does the same once its shards are written. The test kill -9s them there. No
production code knows about the drill.
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
#: runs on the ranks' interpreter start (PYTHONPATH): holds the chosen ranks inside the chosen save
SITECUSTOMIZE = textwrap.dedent('''
    import os
    _RANK = os.environ.get("RANK")
    if os.environ.get("MVLM_DRILL_DIR") and _RANK in (os.environ.get("MVLM_DRILL_RANK"),
                                                     os.environ.get("MVLM_DRILL_WRITE_RANK")):
        import importlib.abc, importlib.util, json, sys, time
        from pathlib import Path

        _RANK_PID = os.getpid()  # the rank itself (a writer process forked from it inherits this)
        _MARK = ".iter_%07d." % int(os.environ["MVLM_DRILL_ITERATION"])

        def _hold(what, **info):
            d = Path(os.environ["MVLM_DRILL_DIR"])
            try:  # the first writer to get here holds (a rank may write its shard files from several)
                os.close(os.open(d / (what + ".lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
            (d / (what + ".part")).write_text(json.dumps(dict(info, rank=_RANK_PID, writer=os.getpid())))
            os.rename(d / (what + ".part"), d / what)
            time.sleep(600)

        def _hold_mid_write(module):
            import functools
            real = module._write_item
            @functools.wraps(real)  # megatron-core reads its signature
            def _write_item(*args, **kwargs):
                result = real(*args, **kwargs)
                stream = next(a for a in args if hasattr(a, "fileno") and hasattr(a, "write"))
                if _MARK in str(getattr(stream, "name", "")):
                    stream.flush()
                    os.fsync(stream.fileno())
                    _hold("in_write", file=str(stream.name), written=stream.tell())
                return result
            module._write_item = _write_item

        def _hold_after_write(module):
            import functools
            cls = module.FileSystemWriterAsync
            for name in ("write_preloaded_data_multiproc", "write_preloaded_data_multithread"):
                real = getattr(cls, name, None)
                if real is None:
                    continue
                @functools.wraps(real)
                def wrapped(*args, _real=real, **kwargs):
                    out = _real(*args, **kwargs)
                    files = [b[0] for a in args if isinstance(a, list) for b in a
                             if isinstance(b, tuple) and b and isinstance(b[0], str)]
                    if any(_MARK in f for f in files):
                        _hold("written", files={f: os.path.getsize(f) for f in files})
                    return out
                setattr(cls, name, staticmethod(wrapped))

        _HOOK = _hold_mid_write if _RANK == os.environ.get("MVLM_DRILL_WRITE_RANK") else _hold_after_write

        class _Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != "megatron.core.dist_checkpointing.strategies.filesystem_async":
                    return None
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                run = spec.loader.exec_module
                spec.loader.exec_module = lambda m: (run(m), _HOOK(m))
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
    """Iteration 6's save with rank 1 kill -9'd in the middle of writing its shard and rank 0 right after writing
    its own (iteration 3 committed before)."""
    hook = tmp_path_factory.mktemp("drill_hook")
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # the hook runs as each rank's interpreter starts: ranks started as new interpreters (launch/elastic.py)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]), "MVLM_DRILL_RANK": "0",
           "MVLM_DRILL_WRITE_RANK": "1", "MVLM_DRILL_ITERATION": "6", "MVLM_DRILL_DIR": str(hook),
           "MVLM_RANK_START": "exec"}
    p = launch(args(setup, "drill", *DRILL, iters=6), env=env)
    markers, deadline = [hook / "in_write", hook / "written"], time.time() + 400
    while not all(m.is_file() for m in markers):
        assert p.poll() is None and time.time() < deadline, (p.stdout.read() if p.poll() is not None else "")[-4000:]
        time.sleep(0.05)
    held = {m.name: json.loads(m.read_text()) for m in markers}
    for info in (held["in_write"], held["written"]):  # a node failure: the rank and the process writing for it
        for pid in {info["rank"], info["writer"]}:
            os.kill(pid, signal.SIGKILL)
    out, _ = p.communicate(timeout=300)
    return setup["root"] / "ckpt" / "drill", p.returncode, out, _left_behind(str(hook)), held


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


def test_ranks_killed_mid_save_leave_the_previous_iteration_committed(setup, killed_in_save):
    run_dir, rc, out, left, held = killed_in_save
    assert rc != 0, out[-3000:]
    assert not left, left  # nothing of the killed run keeps running
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not (run_dir / "iter_0000006").exists()
    half = sorted(run_dir.glob(".iter_0000006.tmp-*"))
    assert len(half) == 1 and list(half[0].glob("*.distcp")) and not (half[0] / "ckpt_meta.json").exists(), half
    assert not (half[0] / ".metadata").exists()  # the save never reached its index
    # rank 1's shard: its first item, flushed; the rest never written (under a temporary name where the writer opens
    # files through multi-storage-client, which renames a file when it is closed)
    named = Path(held["in_write"]["file"])
    cut = next((f for f in (named, named.with_name(f".{named.name}.tmp")) if f.exists()), None)
    assert cut is not None, (held, sorted(p.name for p in half[0].iterdir()))
    assert cut.parent == half[0] and cut.stat().st_size == held["in_write"]["written"] > 0
    whole = {Path(f): n for f, n in held["written"]["files"].items()}  # rank 0's shards, written whole
    assert whole and cut not in whole and all(f.parent == half[0] and f.stat().st_size == n for f, n in whole.items())
    assert held["in_write"]["written"] < max(whole.values())  # cut short: the shards are of about one size
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
