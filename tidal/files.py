"""The plain files Tidal reads or appends to (configs, data files, a run's ``metrics.jsonl``),
checked to be plain files before they are opened.

A named pipe blocks its reader until a writer comes (forever, in a run that waits for nothing
else); ``/dev/zero`` or ``/dev/full`` never ends (read whole, it fills memory until the kernel
kills the process); a directory or a socket is an ``OSError`` deep inside a library; a symlink loop
is "does not exist" to ``Path.exists``. Here each is one ``ValueError`` line naming the path and
what it is, before a byte is read: :func:`check_regular` stats the path, :func:`open_regular`
opens it without blocking (``O_NONBLOCK``: a pipe put there after the check still does not block)
and checks the open descriptor again, :func:`read_bounded` reads at most a given size.

This module knows nothing about what the files hold.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str | os.PathLike, st: os.stat_result | None = None) -> str | None:
    """What ``path`` is when it is not a regular file, following symlinks (``a named pipe (FIFO)``,
    ``a symlink to /dev/full, a character device``, ``a symlink loop``, ...); None for a regular
    file. FileNotFoundError when nothing is there (a symlink to nothing is named as one)."""
    if st is None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if os.path.islink(path):
                return f"a symlink to {os.readlink(path)}, which does not exist"
            raise FileNotFoundError(errno.ENOENT, "not found", str(path)) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "a symlink loop (following its links leads back to it)"
            return f"unreadable ({e.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    kind = _kind(st.st_mode)
    return f"a symlink to {os.path.realpath(path)}, {kind}" if os.path.islink(path) else kind


def check_regular(path: str | os.PathLike, what: str = "file") -> None:
    """ValueError ``<path> is <what it is>, not a regular <what>`` unless ``path`` is a regular file
    (or a symlink to one); FileNotFoundError when nothing is there."""
    found = not_regular(path)
    if found is not None:
        raise ValueError(f"{path} is {found}" + ("" if found.endswith("does not exist") else f", not a regular {what}"))


def open_regular(path: str | os.PathLike, mode: str = "rb", *, what: str = "file", **kwargs) -> IO:
    """``open(path, mode)`` for a regular file only (modes ``r``, ``rb``, ``a``, ``ab``; an ``a``
    mode creates a missing file), checked before opening and again on the open descriptor."""
    appends = mode.startswith("a")
    if not (appends and not os.path.lexists(path)):
        check_regular(path, what)
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT) if appends else os.O_RDONLY
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.ELOOP, errno.EISDIR):  # swapped in after the check
            check_regular(path, what)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {not_regular(path, st)}, not a regular {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, *, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``; ValueError naming it when it holds more than ``limit``."""
    with open_regular(path, "rb", what=what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        size = Path(path).stat().st_size
        raise ValueError(f"{path} holds {size:,} bytes, more than the {limit:,} a {what} may hold")
    return data
