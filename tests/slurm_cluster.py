"""A real SLURM cluster on this machine for the tests: one slurmctld and one slurmd per "node", all on loopback.

Debian's slurm-wlm (``apt-get install slurm-wlm``; .ci/run installs it) runs several slurmd daemons on one host
(``slurmd -N NAME``), so a batch job gets two nodes whose tasks are two processes here. The node names must
resolve to a loopback address, since the launcher takes node 0's address from SLURM_JOB_NODELIST: they are
this host's name and another loopback name from /etc/hosts (one node where there is none). Authentication is ``auth/none`` (no munge key to set up): a test
cluster, not a template for a real one. Without the SLURM binaries the fixture skips, unless
``MVLM_REQUIRE_SLURM=1`` (set by .ci/run) turns that into a failure.
"""

from __future__ import annotations

import getpass
import ipaddress
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_vlm.launch.torchrun import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo")


@dataclass
class SlurmCluster:
    conf: Path
    nodes: list[str]
    log_dir: Path

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str) -> str:
        res = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60)
        if res.returncode:
            raise RuntimeError(f"{argv[0]} failed ({res.returncode}): {res.stderr}\n{self.logs()}")
        return res.stdout

    def wait_job(self, job_id: str, timeout: float = 600) -> None:
        """Until the job has left the queue (finished, failed or cancelled)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.run("squeue", "-h", "-j", job_id, "-o", "%i").strip():
                return
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env)
        raise TimeoutError(f"SLURM job {job_id} still queued or running after {timeout:.0f} s\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.log_dir.glob("*.log")))


def _loopback_names() -> list[str]:
    """Up to two host names that resolve to a loopback address: this host's name, then other names /etc/hosts
    gives a 127.x address. ``localhost`` is no use: SLURM reads NodeName=localhost as this host's name."""
    names = []
    candidates = [socket.gethostname()]
    try:
        for line in Path("/etc/hosts").read_text().splitlines():
            fields = line.split("#")[0].split()
            candidates += fields[1:] if fields and fields[0].startswith("127.") else []
    except OSError:
        pass
    for name in dict.fromkeys(candidates):
        if name == "localhost" or "." in name or len(names) == 2:
            continue
        try:
            if ipaddress.ip_address(socket.gethostbyname(name)).is_loopback:
                names.append(name)
        except (OSError, ValueError):
            pass
    return names


def start_cluster(root: Path) -> tuple[SlurmCluster, list[subprocess.Popen]]:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        msg = f"SLURM not installed ({', '.join(missing)} missing; apt-get install slurm-wlm)"
        if os.environ.get("MVLM_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    names = _loopback_names()
    if not names:
        pytest.skip(f"this host's name {socket.gethostname()!r} does not resolve to a loopback address")
    host = socket.gethostname()
    user = getpass.getuser()
    for d in ("state", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    # slurmstepd binds Unix sockets under the spool directory, whose paths may not exceed 108 bytes: pytest's
    # tmp_path (longer still under pytest-xdist, .../popen-gw0/...) is too deep, so the spool is a short /tmp dir
    # (a few KB of sockets and job scripts, left to the OS's /tmp cleaning)
    spool = Path(tempfile.mkdtemp(prefix="mvlm-slurm-", dir="/tmp"))
    ctld, slurmd_ports = free_port(), [free_port() for _ in names]
    lines = [
        "ClusterName=mvlmtest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/none",
        "CredType=cred/none",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={spool}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd'}-%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "SchedulerType=sched/builtin",
        "KillWait=5",
    ]
    cpus = max(1, (os.cpu_count() or 1) // len(names))
    for name, port in zip(names, slurmd_ports):
        lines.append(f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN")
    lines.append(f"PartitionName=test Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP")
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    cluster = SlurmCluster(conf, names, root / "log")
    env = cluster.env
    procs = [subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    procs += [subprocess.Popen(["slurmd", "-D", "-N", n, "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL) for n in names]
    deadline = time.time() + 60
    while time.time() < deadline:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True)
        states = res.stdout.split()
        if res.returncode == 0 and len(states) == len(names) and all(s == "idle" for s in states):
            return cluster, procs
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    stop(procs)
    pytest.fail(f"the test SLURM cluster did not come up (sinfo: {res.stdout.strip() or res.stderr.strip()})\n"
                f"{cluster.logs()}")


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop the daemons, and any slurmstepd they left behind (step daemons detach from slurmd; one still
    reporting a finished job when slurmd goes would otherwise outlive the test)."""
    import psutil

    alive = [p for p in procs if p.poll() is None]
    started = min((psutil.Process(p.pid).create_time() for p in alive), default=time.time())
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    stepds = [q for q in psutil.process_iter(["name", "create_time"])
              if q.info["name"] == "slurmstepd" and q.info["create_time"] >= started]
    for q in stepds:
        q.kill()
    psutil.wait_procs(stepds, timeout=10)
