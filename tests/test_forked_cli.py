"""tests.support.forked_cli: a script forked from the fork server ends like the same script started with
subprocess (exit code, stdout, stderr, environment, working directory, signals, session)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.support import forked_cli

pytestmark = [pytest.mark.slow, pytest.mark.one_lane(
    "3.11",
    reason="a forked command's process semantics (exit code, output, environment, signals) on tiny scripts")]


SCRIPT = textwrap.dedent("""
    import os, sys, time
    mode = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("FORKED_CLI_X"), "path0",
          os.path.basename(sys.path[0]), "stdin", repr(sys.stdin.read()), "main", __name__,
          "file", os.path.basename(__file__))
    print("to stderr", file=sys.stderr)
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "message":
        sys.exit("a message")
    if mode == "raise":
        raise ValueError("boom")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "session":
        print("sid", os.getsid(0) == os.getpid(), flush=True)
    if mode == "wait":
        import atexit
        atexit.register(lambda: print("atexit ran"))
        open(sys.argv[2], "w").close()
        time.sleep(60)
    """)
CASES = [("exit", "0"), ("exit", "3"), ("message",), ("raise",), ("interrupt",), ("session",)]


def both(tmp_path, *argv, **kwargs):
    script = tmp_path / "bin" / "script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    env = {**os.environ, "FORKED_CLI_X": "from the caller"}
    real = subprocess.run([sys.executable, str(script), *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, **kwargs)
    forked = forked_cli.run([sys.executable, str(script), *argv], cwd=tmp_path, env=env, capture_output=True,
                            text=True, **kwargs)
    return real, forked


def test_a_forked_script_ends_like_a_started_one(tmp_path):
    for case in CASES:
        real, forked = both(tmp_path, *case, start_new_session=case[0] == "session")
        assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout), case
        # a traceback names the file and line either way; runpy adds its own frames above the script's
        assert forked.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:], (case, forked.stderr, real.stderr)
        assert forked.stderr.startswith("to stderr"), forked.stderr
    assert real.returncode == 0 and "sid True" in forked.stdout
    exit3 = both(tmp_path, "exit", "3")[1]
    assert exit3.returncode == 3 and "'from the caller'" not in exit3.stdout and "from the caller" in exit3.stdout
    assert f"cwd {tmp_path}" in exit3.stdout and "path0 bin" in exit3.stdout and "stdin ''" in exit3.stdout
    assert "main __main__" in exit3.stdout
    interrupted = both(tmp_path, "interrupt")[1]
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in interrupted.stderr


def test_signals_reach_the_forked_process_and_its_atexit_runs(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    p = forked_cli.start([sys.executable, str(script), "wait", str(ready)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert isinstance(p, forked_cli.Popen)
    deadline = time.time() + 60
    while not ready.exists():
        assert p.poll() is None and time.time() < deadline
        time.sleep(0.02)
    assert psutil.Process(p.pid).cmdline()  # a real process, its pid the caller's to signal
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGINT and "KeyboardInterrupt" in out and "atexit ran" in out


def test_output_not_captured_goes_where_the_callers_goes(tmp_path, capfd):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    subprocess.run([sys.executable, str(script), "exit", "0"], stdin=subprocess.DEVNULL, cwd=tmp_path, check=True)
    real = capfd.readouterr()
    forked_cli.run([sys.executable, str(script), "exit", "0"], cwd=tmp_path, check=True)
    assert capfd.readouterr() == real and "argv ['exit', '0']" in real.out and real.err == "to stderr\n"
    forked_cli.run([sys.executable, str(script), "exit", "0"], cwd=tmp_path, stderr=subprocess.STDOUT, check=True)
    merged = capfd.readouterr()  # the order of the two streams' lines depends on stdout's buffering
    assert merged.err == "" and sorted(merged.out.splitlines()) == sorted((real.out + real.err).splitlines())


def test_output_to_a_file_or_devnull_is_written_as_a_started_process_writes_it(tmp_path, capfd):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    logs = {}
    for how, run in (("real", subprocess.run), ("forked", forked_cli.run)):
        with open(tmp_path / f"{how}.log", "w") as log:
            log.write("opened by the caller\n")
            log.flush()
            p = run([sys.executable, str(script), "exit", "3"], cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT)
        assert p.returncode == 3
        run([sys.executable, str(script), "exit", "0"], cwd=tmp_path, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        logs[how] = sorted((tmp_path / f"{how}.log").read_text().splitlines())
    assert logs["forked"] == logs["real"] and "opened by the caller" in logs["real"] and "to stderr" in logs["real"]
    assert capfd.readouterr() == ("", "")  # DEVNULL: nothing reached the caller's stdout or stderr


def test_anything_else_is_a_subprocess(tmp_path):
    p = forked_cli.start([sys.executable, "-c", "print(1)"], stdout=subprocess.PIPE, text=True)
    assert isinstance(p, subprocess.Popen) and p.communicate()[0] == "1\n"
    assert forked_cli.run([sys.executable, "-c", "print(2)"], capture_output=True, text=True).stdout == "2\n"
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    p = forked_cli.start([sys.executable, str(script), "exit", "0"], stdin=subprocess.PIPE)  # stdin: subprocess's
    p.stdin.close()
    assert isinstance(p, subprocess.Popen) and p.wait() == 0

