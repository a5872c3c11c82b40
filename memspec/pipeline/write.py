"""Writing files atomically: a temp file in the same folder, then rename.

An interrupted write never leaves a half-written spec, graph or compiled module.  The
file gets the mode any file the user writes gets (``0o666`` less the umask), not
``mkstemp``'s ``0o600``.  Temp files are named ``.<name>.<pid>.<random>.tmp``: one
left by a process that was killed (``kill -9`` gives no chance to clean up) is removed
by the next write of the same file, once its process is gone.
"""
from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Union


class WriteError(Exception):
    """The file could not be written (``reason``: the OS's words); nothing was left behind."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot write {path}: {reason}")
        self.path, self.reason = path, reason


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True      # someone else's process: leave its file alone
    return True


def _remove_stale(folder: Path, name: str) -> None:
    """Remove temp files of ``name`` whose writing process no longer exists."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]+\.tmp")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m and not _alive(int(m.group(1))):
            try:
                if e.is_file(follow_symlinks=False):
                    os.unlink(e.path)
            except OSError:
                pass


def write_atomic(path: Union[str, Path], data: Union[str, bytes]) -> None:
    """Write ``data`` (text as UTF-8 with ``\\n`` line ends, or bytes) to ``path`` atomically;
    raises :class:`WriteError`."""
    path = Path(path)
    folder = path.parent
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteError(folder, err.strerror or str(err)) from None
    _remove_stale(folder, path.name)
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        # mode 0o666: the kernel applies the umask, as for any file the user writes
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as err:
        raise WriteError(path, err.strerror or str(err)) from None
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise WriteError(path, err.strerror or str(err)) from None
        raise
