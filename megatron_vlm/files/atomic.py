"""Atomic outputs: everything megatron-vlm writes goes to a temporary sibling and is renamed at the end.

A crash, a bad input or Ctrl-C never leaves an output directory (or file) that looks complete but is not. A file,
and a directory asked to (``flush``), is flushed to disk before the rename and the rename after it
(:func:`fsync_tree`, :func:`fsync_dir`), so a power loss does not either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


class OutputExistsError(FileExistsError):
    pass


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = False, what: str = "output directory",
               flush: bool = False):
    """Yield a fresh temporary directory next to ``final``; rename it to ``final`` when the block succeeds.

    ``final`` must not exist unless ``overwrite`` (then it is replaced only after the new one is complete).
    On any exception the temporary directory is removed and ``final`` is untouched. ``flush``: every file and
    directory is flushed to disk before the rename, and the rename after it (the converters' checkpoints and
    exports, whose large files their writers flushed already).
    """
    final = Path(final).absolute()
    if final.exists() and not overwrite:
        raise OutputExistsError(f"{what} {final} already exists; remove it or pass --overwrite")
    _check_parent(final, what)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output should have normal permissions
    try:
        yield tmp
        if flush:
            fsync_tree(tmp)  # every file and directory on disk before the rename makes them the output
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        if flush:
            fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_parent(final: Path, what: str) -> None:
    """The nearest existing ancestor of ``final`` must be a directory (not a file)."""
    for parent in final.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{what} {final}: {parent} is a file, not a directory; choose another "
                                         "location")
            return


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and an atomic rename."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and an atomic rename."""
    path = Path(path)
    _check_parent(path, "output file")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush directory ``path``'s entries to disk (a rename or a new file in it persists only then)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """Flush every file under ``path``, then every directory from the deepest up to ``path`` itself: the files a
    writer already flushed cost a metadata check each."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)
