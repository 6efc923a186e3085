"""Run a command-line script as its own process, forked instead of started: the tests' ``subprocess`` for
``python train/run.py ...`` and the like.

A script started with ``subprocess`` imports torch and transformers again (train/run.py's launcher: ~3.5 s of
CPU of its ~4 on a 2-core machine, in every one of the suite's ~50 launches). Here the process is forked from
the fork server of :mod:`megatron_vlm.runtime.spawn`, which imported them once per test worker and never ran a
kernel. The child is still a separate process with its own pid, session, environment, working directory,
stdin (``/dev/null``), stdout and stderr; it runs the script file as ``__main__`` with ``sys.argv`` set, and
ends like an interpreter would: ``SystemExit``'s code, 1 with a traceback on an exception, killed by SIGINT
on an uncaught ``KeyboardInterrupt``, atexit handlers run. What a test reads (exit code, output, the
process tree it signals) is what a started process gives.

:func:`run` and :class:`Popen` take ``subprocess``'s arguments. A command that is not ``[sys.executable,
SCRIPT.py, ...]``, or a machine with CUDA (whose ranks are spawned, see spawn.py), gets a real subprocess.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

#: The keyword arguments of ``subprocess`` that a forked command honours; any other one starts a subprocess.
_KNOWN = {"cwd", "env", "stdout", "stderr", "text", "start_new_session", "stdin"}


def _forkable(args, kwargs: dict) -> bool:
    import torch

    if (torch.cuda.is_available() or set(kwargs) - _KNOWN or kwargs.get("stdin") not in (None, subprocess.DEVNULL)
            or not _writable(kwargs.get("stdout")) or not _writable(kwargs.get("stderr"), subprocess.STDOUT)):
        return False
    args = [str(a) for a in args]
    return len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py")


def _writable(stream, *also) -> bool:
    """Whether a forked command can write to ``stream`` (a ``subprocess`` stdout/stderr argument)."""
    return stream in (None, subprocess.PIPE, subprocess.DEVNULL, *also) or callable(getattr(stream, "fileno", None))


def _destination(stream, captured: str | None, inherited: int) -> str:
    """The path a forked command opens (for appending) to write ``stream``: the capture file, /dev/null, an open
    file of this process (``stdout=f``), or where this process's own fd ``inherited`` goes now."""
    if captured:
        return captured
    if stream == subprocess.DEVNULL:
        return os.devnull
    fd = inherited if stream is None else stream.fileno()
    return f"/proc/{os.getpid()}/fd/{fd}"


class Popen:
    """``subprocess.Popen`` for ``[sys.executable, SCRIPT.py, *argv]``, forked (see the module docstring).
    Output the caller asked to capture (``stdout=PIPE``, ``stderr=PIPE`` or ``STDOUT``) is collected in files
    and readable once the process ended (``communicate``, or ``.stdout.read()`` after ``poll()``); ``DEVNULL``
    and open files are written to as a started process would."""

    def __init__(self, args, *, cwd=None, env=None, stdout=None, stderr=None, text=False, start_new_session=False,
                 stdin=None):
        import torch.multiprocessing as mp

        from megatron_vlm.runtime.spawn import _start_method

        self.args = [str(a) for a in args]
        self._text = text
        self._dir = tempfile.TemporaryDirectory(prefix="mvlm-forked-")
        out = err = None
        if stdout == subprocess.PIPE:
            out = os.path.join(self._dir.name, "stdout")
        if stderr == subprocess.PIPE:
            err = os.path.join(self._dir.name, "stderr")
        elif stderr == subprocess.STDOUT:
            err = out
        for path in {out, err} - {None}:
            Path(path).touch()
        # not captured: the child writes where this process's stdout/stderr go now, as a started one would
        to_stdout = _destination(stdout, out, 1)
        to_stderr = to_stdout if stderr == subprocess.STDOUT else _destination(stderr, err, 2)
        request = dict(script=self.args[1], argv=self.args[1:], cwd=str(cwd or os.getcwd()),
                       env=dict(os.environ if env is None else env), stdout=to_stdout, stderr=to_stderr,
                       new_session=start_new_session)
        self._proc = mp.get_context(_start_method()).Process(target=_child, args=(request,), name="forked-cli")
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode = None
        self.stdout = self._reader(out) if out else None
        self.stderr = self._reader(err) if err and err != out else None

    def _reader(self, path):
        return open(path, "r" if self._text else "rb")

    def poll(self):
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout=None):
        assert input is None, "a forked command reads /dev/null"
        self.wait(timeout)
        out = self.stdout.read() if self.stdout else None
        err = self.stderr.read() if self.stderr else None
        return out, err

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.poll() is None:
            self.kill()
            self.wait()
        self.__del__()

    def __del__(self):  # the captured output's readers (the files go with the temporary directory)
        for f in (getattr(self, "stdout", None), getattr(self, "stderr", None)):
            if f:
                f.close()


def start(args, **kwargs):
    """``subprocess.Popen(args, **kwargs)``, forked where it can be (see the module docstring)."""
    return Popen(args, **kwargs) if _forkable(args, kwargs) else subprocess.Popen(args, **kwargs)


def run(args, *, capture_output=False, timeout=None, check=False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run``, forked where it can be (see the module docstring)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not _forkable(args, kwargs):
        return subprocess.run(args, timeout=timeout, check=check, **kwargs)
    with Popen(args, **kwargs) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
    done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if check:
        done.check_returncode()
    return done


_KEEP = []  # the fork server's stdio objects: never finalized in a child (their buffers are the server's)


def _stdio(fd: int, old, unbuffered: bool, stderr: bool):
    """A new text stream on ``fd``, set up as a fresh interpreter would (stderr line-buffered)."""
    _KEEP.append(old)
    raw = io.FileIO(fd, "w", closefd=False)
    buffered = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding=getattr(old, "encoding", None) or "utf-8",
                            errors="backslashreplace" if stderr else getattr(old, "errors", "strict"),
                            line_buffering=stderr, write_through=unbuffered)


def _child(request: dict) -> None:
    """In the forked process: become ``python SCRIPT ARGV...`` and exit with its status."""
    import atexit
    import runpy
    import traceback

    if request["new_session"]:
        os.setsid()
    for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                         (signal.SIGCHLD, signal.SIG_DFL), (signal.SIGPIPE, signal.SIG_IGN)):
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        try:
            target = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError:  # the caller's stream is a socket: keep the fork server's
            continue
        os.dup2(target, fd)
        os.close(target)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _stdio(1, sys.stdout, unbuffered, stderr=False)
    sys.stderr = sys.__stderr__ = _stdio(2, sys.stderr, unbuffered, stderr=True)
    from tests.lanes import child_guard

    child_guard()  # under a one-lane test: this command may not import what differs between the lanes either
    script = request["script"]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
