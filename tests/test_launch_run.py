"""Real launches on CPU (gloo) with a stand-in trainer: one node x 2 processes, two "nodes" on loopback,
exit codes and signal forwarding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from .launch_helpers import IMAGE_ID, REPO, base_args, kill9_tree, launcher, signal_when_ready

from megatron_vlm.launch.process import AGENT_SIGNALS, run_agent_here, run_forwarding_signals
from megatron_vlm.launch.torchrun import free_port
from megatron_vlm.training.config import TrainConfig

pytestmark = pytest.mark.slow


def _records(out_dir, n):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


#: how torchrun's agent starts the ranks (launch/elastic.py): a new interpreter, as users' GPU runs do, or forked
#: from the agent (the suite's CPU launches); both must give the ranks the same world, exit codes and signals
RANK_STARTS = pytest.mark.parametrize("rank_start", ["exec", "fork"], indirect=True)


@pytest.fixture
def rank_start(request, monkeypatch):
    monkeypatch.setenv("MVLM_RANK_START", request.param)
    return request.param


@RANK_STARTS
def test_one_node_two_processes(tmp_path, rank_start):
    out = tmp_path / "seen"
    out.mkdir()
    p = launcher([*base_args(tmp_path), "-g", "2", "--gbs", "8", "--mbs", "2"], out)
    log, _ = p.communicate(timeout=120)
    assert p.returncode == 0, log
    recs = _records(out, 2)
    assert [r["allreduce"] for r in recs] == [3.0, 3.0]  # 1 + 2 over the gloo group torchrun set up
    assert [r["env"]["LOCAL_RANK"] for r in recs] == ["0", "1"] and recs[0]["env"]["WORLD_SIZE"] == "2"
    assert recs[0]["env"]["CUDA_VISIBLE_DEVICES"] == ""
    cfg = recs[1]["cfg"]  # what the trainer reads back with TrainConfig.from_yaml
    assert (cfg["image_token_id"], cfg["grad_accum"], cfg["device"], cfg["precision"], cfg["gpus"]) == (
        IMAGE_ID, 2, "cpu", "fp32", 2)
    written = TrainConfig.from_yaml(tmp_path / "out" / "llava-stage1" / "config.yaml")
    assert written.master_port == int(recs[0]["env"]["MASTER_PORT"])
    assert written.resolved() == written


def test_two_nodes_on_loopback(tmp_path):
    out = tmp_path / "seen"
    out.mkdir()
    port = free_port()
    common = [*base_args(tmp_path), "-g", "1", "--node", "2", "--master-addr", "127.0.0.1", "--master-port",
              str(port), "--gbs", "4", "--mbs", "1", "--interface", "lo"]
    procs = [launcher([*common, "--rank", str(r)], out) for r in (0, 1)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    recs = _records(out, 2)
    assert [r["env"]["GROUP_RANK"] for r in recs] == ["0", "1"]
    assert [r["allreduce"] for r in recs] == [3.0, 3.0]
    assert {r["env"]["MASTER_PORT"] for r in recs} == {str(port)}
    assert recs[0]["env"]["GLOO_SOCKET_IFNAME"] == "lo"
    assert [r["cfg"]["node_rank"] for r in recs] == [0, 1] and recs[0]["cfg"]["grad_accum"] == 2
    run_dir = tmp_path / "out" / "llava-stage1"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "config.node1.yaml").is_file()


@RANK_STARTS
def test_trainer_failure_gives_nonzero_exit(tmp_path, rank_start):
    out = tmp_path / "seen"
    out.mkdir()
    p = launcher([*base_args(tmp_path), "-g", "1", "--gbs", "16"], out, mode="fail")
    log, _ = p.communicate(timeout=120)
    assert p.returncode == 1, log  # torchrun's code for a failed rank, passed through
    assert "training exited with code 1" in log


@RANK_STARTS
def test_sigterm_reaches_every_rank(tmp_path, rank_start):
    out = tmp_path / "seen"
    out.mkdir()
    p = launcher([*base_args(tmp_path), "-g", "2", "--gbs", "32"], out, mode="signal")
    log = signal_when_ready(p, out, signal.SIGTERM)
    assert [(out / f"signal{r}.txt").read_text() for r in (0, 1)] == ["SIGTERM", "SIGTERM"], log
    assert p.returncode != 0


CHILD = """
import signal, sys, time
def h(s, f):
    print("child got", signal.Signals(s).name, flush=True); sys.exit(5)
signal.signal(signal.SIGINT, h)
print("ready", flush=True)
time.sleep(30)
"""


def test_exit_code_and_signal_forwarding_of_the_process_runner(tmp_path):
    assert run_forwarding_signals([sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert run_forwarding_signals([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"]) == 137
    # SIGINT to the launcher (here a python running the runner) reaches the child exactly once.
    runner = ("import sys; from megatron_vlm.launch.process import run_forwarding_signals as r; "
              f"sys.exit(r([sys.executable, '-c', {CHILD!r}]))")
    p = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    try:
        rest, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # (seen once in a full 3.12 run, not reproduced): say where the signal went
        report = _signal_states(p.pid)
        kill9_tree(p.pid)
        p.communicate()
        pytest.fail(f"SIGINT to the runner did not end its child within 30 s; signal state: {report}")
    assert rest.strip() == "child got SIGINT" and p.returncode == 5


def _signal_states(pid: int) -> str:
    """Each process of ``pid``'s tree: its state, wait channel and signal masks (pending, blocked, caught) as
    /proc shows them."""
    root = psutil.Process(pid)
    lines = []
    for q in [root, *root.children(recursive=True)]:
        try:
            status = dict(line.split(":\t", 1) for line in open(f"/proc/{q.pid}/status").read().splitlines()
                          if ":\t" in line)
            wchan = open(f"/proc/{q.pid}/wchan").read()
        except OSError as e:
            lines.append(f"{q.pid}: {e}")
            continue
        fields = ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
        lines.append(f"{q.pid} {' '.join(q.cmdline())[:60]!r}: wchan={wchan} "
                     + " ".join(f"{k}={status.get(k, '?').strip()}" for k in fields))
    return "; ".join(lines)


def test_the_agent_run_in_this_process_leaves_its_environment_and_signal_handlers_as_they_were(tmp_path):
    entry = tmp_path / "entry.py"
    entry.write_text("import os, sys\n"
                     "open(sys.argv[1], 'w').write(os.environ['MVLM_AGENT_X'] + ' ' + os.environ['LOCAL_RANK'])\n"
                     "sys.exit(int(sys.argv[2]))\n")
    handlers = {s: signal.getsignal(s) for s in AGENT_SIGNALS}
    args = ["--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "1", "--rdzv_backend", "static",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--max_restarts", "0", str(entry)]
    assert run_agent_here([*args, str(tmp_path / "seen"), "0"], {"MVLM_AGENT_X": "from the launcher"}) == 0
    assert (tmp_path / "seen").read_text() == "from the launcher 0"  # the rank inherited the environment
    assert "MVLM_AGENT_X" not in os.environ
    assert {s: signal.getsignal(s) for s in AGENT_SIGNALS} == handlers
    assert run_agent_here([*args, str(tmp_path / "seen"), "3"], {"MVLM_AGENT_X": "again"}) == 1  # a failed rank
    assert "MVLM_AGENT_X" not in os.environ and {s: signal.getsignal(s) for s in AGENT_SIGNALS} == handlers


WRITER = """
import sys, time
from megatron_vlm.cli import stderr_line
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # both start writing at once
for i in range(2000):
    stderr_line(f"error: rank {sys.argv[1]} line {i} " + sys.argv[1] * 300)
"""


def test_ranks_error_lines_on_a_shared_stderr_never_interleave():
    """Two "ranks" writing to one stderr pipe at once: every line arrives whole (``print`` writes the text and
    the newline apart, so a line could be cut by the other rank's; this failed test_data_guard once in CI)."""
    r, w = os.pipe()
    start = str(time.time() + 1.5)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, c, start], stderr=w, cwd=REPO) for c in "ab"]
    os.close(w)
    with open(r) as f:
        lines = f.read().splitlines()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    expect = {f"error: rank {c} line {i} " + c * 300 for c in "ab" for i in range(2000)}
    assert len(lines) == 4000 and set(lines) == expect
