"""Reading a spec file: a regular file only, its size bounded while reading.

``st_size`` is never trusted (``/dev/zero`` and FIFOs report 0, a file can grow): the
file is opened without blocking (a FIFO with no writer does not hang), checked to be a
regular file on the open descriptor, and read at most ``limit + 1`` bytes.
"""
from __future__ import annotations

import errno
import os
import stat

from .limits import MAX_SPEC_BYTES


class NotReadable(Exception):
    """The file cannot be a spec: ``reason`` says why (one line)."""

    def __init__(self, reason: str, missing: bool = False, head: bytes = b""):
        super().__init__(reason)
        self.reason = reason
        self.missing = missing   # no such file (as opposed to unreadable or not a file)
        self.head = head         # the first bytes of a too-large regular file (to quote line 1)


_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    for test, word in _KINDS:
        if test(mode):
            return word
    return "not a regular file"


def _limit_text(limit: int) -> str:
    return f"{limit // 1024} KB" if limit % 1024 == 0 else f"{limit} bytes"


def read_regular(path: str | os.PathLike, limit: int = MAX_SPEC_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (symlinks followed), at most ``limit``;
    raises :class:`NotReadable` for anything else."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ENOENT:
            raise NotReadable("no such file", missing=True) from None
        if err.errno == errno.ELOOP:
            raise NotReadable("a loop of symbolic links") from None
        if err.errno == errno.EISDIR:
            raise NotReadable("is a directory, not a spec file") from None
        raise NotReadable(os.strerror(err.errno).lower() if err.errno else str(err)) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise NotReadable("is a directory, not a spec file")
        if not stat.S_ISREG(st.st_mode):
            raise NotReadable(f"is {_kind(st.st_mode)}, not a regular file")
        chunks, n = [], 0
        while n <= limit:
            try:
                b = os.read(fd, min(1 << 16, limit + 1 - n))
            except OSError as err:
                raise NotReadable(f"cannot read: {os.strerror(err.errno).lower()}") from None
            if not b:
                break
            chunks.append(b)
            n += len(b)
        data = b"".join(chunks)
        if n > limit:
            size = f"{st.st_size / 1e6:.1f} MB" if st.st_size > limit else f"more than {_limit_text(limit)}"
            raise NotReadable(f"file too large ({size}); a spec is at most {_limit_text(limit)}", head=data[:4096])
        return data
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, limit: int = MAX_SPEC_BYTES) -> str | None:
    """The UTF-8 text of a regular spec file, or None if it cannot be read as one."""
    try:
        return read_regular(path, limit).decode("utf-8")
    except (NotReadable, UnicodeDecodeError):
        return None


__all__ = ["NotReadable", "read_regular", "read_text"]
