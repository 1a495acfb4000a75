"""Files this user's tools trust: their own, in folders nobody else can write.

The CLI, the magics and the manager decide things from files: where the background
manager listens and its token (its state file), what this user's other managers hold (the
peer board), the key that proves a client is this user's own. On a shared machine another
user can make a folder before us (``/tmp/...``, a runtime folder set to a shared path) and
plant such a file, or a link where we are about to write (a log, a state file), so that we
send a prompt to their process or append to a file of their choosing. So:

- a folder that holds such files is this user's, a real folder (not a link), and nobody
  else may write to it (:func:`trusted_folder`); one that holds a secret (a token, a key)
  is not readable by others either (``secret=True``);
- such a file is read only when it is a regular file of this user's that nobody else may
  write (:func:`read_trusted`), opened without following a link;
- such files are written without following links: a new file (``O_EXCL``) then renamed
  into place (:func:`write_private`), a log opened for appending (:func:`open_log`).

Anything else is an :class:`UntrustedFile`, a sentence that names the file and why.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from .config import ConfigError

__all__ = ["UntrustedFile", "open_log", "read_trusted", "trusted_folder", "write_private"]


class UntrustedFile(ConfigError):
    """A file or folder that is not this user's alone; the message names it and says why."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def _why_not_ours(st: os.stat_result, what: str, path: str | os.PathLike, secret: bool) -> str | None:
    if st.st_uid != os.getuid():
        return f"{what} {path} belongs to {_owner(st.st_uid)}, not to you ({_owner(os.getuid())})"
    if st.st_mode & 0o022:
        return f"{what} {path} can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if secret and st.st_mode & 0o077:
        return (f"{what} {path} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}), "
                "and it would hold a secret")
    return None


def trusted_folder(path: str | os.PathLike, *, secret: bool = False, make: bool = True, purpose: str = "") -> Path:
    """``path`` as a folder this user trusts: made (mode 0700, with its parents) when it is
    missing and ``make``; UntrustedFile when it is a link, another user's, or writable by
    others (``secret``: or readable by others); OSError when it cannot be had at all (missing,
    a file in its place: ``FileExistsError``). ``purpose`` finishes the sentence (what the
    folder is for, and the setting that chooses it)."""
    p = Path(path)
    if make and not os.path.lexists(p):
        try:
            p.mkdir(parents=True, mode=0o700)
        except FileExistsError:  # (made by someone meanwhile: checked below)
            pass
    st = os.lstat(p)
    why: str | None
    if stat.S_ISLNK(st.st_mode):
        why = f"{p} is a link, not a folder of yours"
    elif not stat.S_ISDIR(st.st_mode):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(p))
    else:
        why = _why_not_ours(st, "the folder", p, secret)
    if why:
        fix = (f"remove it, or make it yours with mode 0700 (chmod 700 {p})" if st.st_uid == os.getuid()
               else "use a folder of your own")
        raise UntrustedFile(f"{why}: another user could put files there that this would trust, so it is not used; "
                            f"{fix}" + (f" ({purpose})" if purpose else ""))
    return p


def read_trusted(path: str | os.PathLike, *, secret: bool = False, limit: int = 1 << 20) -> str | None:
    """The text of ``path`` when it is a regular file of this user's that nobody else may
    write (``secret``: nor read), opened without following a link; None when there is no
    such file; UntrustedFile, naming it, when it is there but not this user's alone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(path):
            raise UntrustedFile(f"{path} is a link, not a file of yours: it is not read; remove it") from None
        raise UntrustedFile(f"{path} cannot be read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        why = ("it is not a regular file" if not stat.S_ISREG(st.st_mode)
               else _why_not_ours(st, "the file", path, secret))
        if why:
            raise UntrustedFile(f"{why if why.startswith('the file') else f'{path}: {why}'}: it is not trusted, so "
                                "it is not read; remove it (another user may have put it there)")
        return f.read(limit).decode("utf-8", "replace")


def write_private(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` (mode 0600) through a new file in the same folder, made with
    ``O_EXCL`` and without following links, then renamed over ``path``: a link planted at
    either name is never written through, and a reader sees the old file or the new one.
    ``fsync``: the file's bytes are on disk before it is renamed."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_log(path: str | os.PathLike):
    """``path`` opened for appending (binary; made with mode 0600 when missing), never
    through a link, and only when it is this user's regular file that others cannot write;
    UntrustedFile otherwise."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600)
    except OSError as e:
        if os.path.islink(path):
            raise UntrustedFile(f"the log {path} is a link: it is not written through (another user may have "
                                "put it there); remove it") from None
        raise UntrustedFile(f"the log {path} cannot be opened: {e.strerror or e}") from None
    f = os.fdopen(fd, "ab")
    st = os.fstat(fd)
    why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _why_not_ours(st, "the log", path, False)
    if why:
        f.close()
        raise UntrustedFile(f"{why if why.startswith('the log') else f'the log {path}: {why}'}: it is not written "
                            "to; remove it")
    return f
