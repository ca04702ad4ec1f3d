"""Files in places another user may write: read with checks, written through the descriptor.

A folder another user can write - world- or group-writable, or owned by someone else (``/tmp``,
``/dev/shm``, a project's shared scratch folder, a working folder the user shares) - may hold
anything under any name: a link to one of this user's private files, a FIFO that blocks a reader
for ever, a file of gigabytes, another user's planted record. So every file distmem reads or writes
outside its own private folders goes through here:

* a read pins the folder (one descriptor), opens the name in it with ``O_NOFOLLOW | O_NONBLOCK``
  (a link is refused, a FIFO never blocks) and judges the open descriptor (``fstat``): a regular
  file of at most ``max_bytes``; in a folder another user can write, also this user's own with one
  link - anything else could be theirs (:func:`read_bytes`, :func:`read_json`, :func:`folder`);
* a write creates a fresh file of an unpredictable name in the target's folder (``O_CREAT |
  O_EXCL | O_NOFOLLOW``, 0600), writes it and sets its final mode through that descriptor
  (``fchmod``), and renames it into place inside the pinned folder; nothing is re-opened, changed
  or removed by name, and a temporary file someone swapped before the rename is detected
  (:func:`atomic_file`, :func:`write_atomic`);
* a folder of the user's own in such a place is made 0700 and judged on its descriptor
  (:func:`private_folder`).

The contract test (``tests/contract``) runs the multi-rank suites under an audit hook that fails
any file distmem touches in a folder another user can write by any other code than this module's
(and the layout's :mod:`distmem.discover.private`).

A leaf: the standard library and :mod:`distmem.errors` only.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from typing import Any, Iterator, List, Optional, Tuple

from .errors import ConfigError

__all__ = ["Unsafe", "Folder", "shared", "owner_name", "read_bytes", "read_json", "folder", "atomic_file",
           "write_atomic", "private_folder", "home_folder", "creation_mode", "printable"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Unsafe(ConfigError):
    """A file or folder distmem refused to read or use: a link, not a regular file, another user's
    in a folder others can write, or too large. ``path`` and ``why`` say which and why."""

    def __init__(self, path: str, why: str, remedy: str = ""):
        self.path, self.why = path, why
        super().__init__(f"{path}: {why}" + (f"; {remedy}" if remedy else ""))


def owner_name(uid: int) -> str:
    """``uid 1001 (alice)``, or ``uid 1001`` where the name is unknown."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _shared_stat(st: os.stat_result) -> Optional[str]:
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"it belongs to {owner_name(st.st_uid)}"
    if st.st_mode & 0o022:
        return f"others can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def shared(folder: str) -> Optional[str]:
    """Why another user could write ``folder`` (it belongs to someone other than this user or root,
    or its group or everyone may write it), or None when only this user (or root) can."""
    try:
        return _shared_stat(os.stat(folder))
    except OSError:
        return None


def printable(text: Any, limit: int = 400) -> str:
    """``text`` with every control character (terminal escapes, newlines, NUL) shown as ``\\xNN`` /
    ``\\uNNNN``, cut to ``limit`` characters: someone else's text never drives the terminal."""
    out = []
    for ch in str(text)[:limit]:
        code = ord(ch)
        if code < 0x20 or 0x7f <= code < 0xa0 or code in (0x2028, 0x2029, 0x200e, 0x200f) or 0x202a <= code <= 0x202e \
                or 0x2066 <= code <= 0x2069:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


@contextlib.contextmanager
def _pinned(folder: str) -> Iterator[Tuple[int, Optional[str]]]:
    """A descriptor of ``folder`` (the path the caller chose is followed) and why others could write it."""
    fd = os.open(folder or ".", _DIR)
    try:
        yield fd, _shared_stat(os.fstat(fd))
    finally:
        os.close(fd)


def _judge(fd: int, path: str, shared_why: Optional[str], max_bytes: int, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(path, f"{what} is not a regular file (a FIFO, device or folder); refused")
    if st.st_size > max_bytes:
        raise Unsafe(path, f"{what} is {st.st_size} bytes, more than the {max_bytes} bytes one can be; refused")
    if shared_why is not None:
        if st.st_uid != os.geteuid():
            raise Unsafe(path, f"{what} belongs to {owner_name(st.st_uid)}, not to this user, in a folder another "
                               f"user can write ({shared_why}); ignored as not this user's",
                         "write to, and read from, a folder of your own")
        if st.st_nlink != 1:
            raise Unsafe(path, f"{what} has {st.st_nlink} links in a folder another user can write ({shared_why}); "
                               "refused")
    return st


def _read_fd(fd: int, max_bytes: int) -> bytes:
    chunks: List[bytes] = []
    left = max_bytes + 1
    while left > 0:
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    return data


def _open_in(dfd: int, name: str, path: str, what: str) -> int:
    try:
        return os.open(name, _READ, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unsafe(path, f"{what} is a symbolic link; distmem never follows one there") from None
        raise


def _read_checked(dfd: int, name: str, path: str, why: Optional[str], max_bytes: int, what: str) -> bytes:
    fd = _open_in(dfd, name, path, what)
    try:
        _judge(fd, path, why, max_bytes, what)
        data = _read_fd(fd, max_bytes)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise Unsafe(path, f"{what} grew past {max_bytes} bytes while read; refused")
    return data


def _parse_json(data: bytes, path: str, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{path}: {what} is not JSON ({printable(exc, 160)})") from None


def read_bytes(path: str, *, max_bytes: int, what: str = "the file") -> bytes:
    """The bytes of ``path`` read as the module docstring says; :class:`Unsafe` for a link, a
    non-regular file, a file over ``max_bytes``, or another user's in a folder others can write.
    ``FileNotFoundError`` where it does not exist."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    with _pinned(folder) as (dfd, why):
        return _read_checked(dfd, name, path, why, max_bytes, what)


def read_json(path: str, *, max_bytes: int, what: str = "the file") -> Any:
    """:func:`read_bytes` parsed as JSON; :class:`ConfigError` naming the file when it is not JSON
    (nesting too deep for the parser included)."""
    return _parse_json(read_bytes(path, max_bytes=max_bytes, what=what), path, what)


class Folder:
    """A folder pinned by one descriptor (:func:`folder`): its names, and its files read with the
    checks of :func:`read_bytes` relative to that descriptor (never by path again)."""

    def __init__(self, fd: int, path: str, why: Optional[str]):
        self.fd, self.path, self.why = fd, path, why

    def names(self, max_entries: int = 4096) -> List[str]:
        """The entries' names, sorted, at most ``max_entries``."""
        return sorted(os.listdir(self.fd))[:max_entries]

    def read(self, name: str, *, max_bytes: int, what: str = "the file") -> bytes:
        return _read_checked(self.fd, name, os.path.join(self.path, name), self.why, max_bytes, what)

    def read_json(self, name: str, *, max_bytes: int, what: str = "the file") -> Any:
        return _parse_json(self.read(name, max_bytes=max_bytes, what=what), os.path.join(self.path, name), what)

    def create_once(self, name: str, data: bytes, mode: int = 0o600) -> bool:
        """Give ``name`` the content ``data`` unless it exists already (several processes racing: one
        wins, the others read the winner's); True when this call made it."""
        with _atomic_in(self.fd, self.path, f".{name}.new", "", mode, keep=True) as (f, tmp):
            f.write(data)
        try:
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileExistsError:
            return False
        finally:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass

    def write(self, name: str, data: bytes, mode: int = 0o600, suffix: str = "") -> str:
        """Write ``data`` to ``name`` in this folder atomically (as :func:`atomic_file`); its path."""
        with _atomic_in(self.fd, self.path, name, suffix, mode) as f:
            f.write(data)
        return os.path.join(self.path, name)


@contextlib.contextmanager
def folder(path: str, *, what: str = "the folder", follow: bool = False) -> Iterator[Folder]:
    """``path`` pinned as a :class:`Folder`. Unless ``follow``, the last part is never a link, and
    inside a folder another user can write it must be this user's own (:class:`Unsafe` otherwise:
    nothing in another user's folder there is taken as this user's). ``FileNotFoundError`` where
    it does not exist."""
    path = os.fspath(path)
    if follow:
        fd = os.open(path, _DIR)
    else:
        parent, name = os.path.split(os.path.abspath(path))
        with _pinned(parent) as (pfd, parent_why):
            try:
                fd = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=pfd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Unsafe(path, f"{what} is a symbolic link or not a folder; refused") from None
                raise
        st = os.fstat(fd)
        if parent_why is not None and st.st_uid != os.geteuid():
            os.close(fd)
            raise Unsafe(path, f"{what} belongs to {owner_name(st.st_uid)}, in a folder another user can write "
                               f"({parent_why}); nothing in it is taken as this user's")
    try:
        yield Folder(fd, path, _shared_stat(os.fstat(fd)))
    finally:
        os.close(fd)


def creation_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0666 less the umask (0644 under the usual
    022, 0600 under 077), read without changing the umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o077)  # the tightest value for the moment it is read
    os.umask(old)
    return 0o666 & ~old


@contextlib.contextmanager
def _atomic_in(dfd: int, folder_path: str, name: str, suffix: str, mode: Optional[int],
               keep: bool = False) -> Iterator[Any]:
    """A fresh temporary file in the pinned folder, renamed onto ``name`` once written (``keep``:
    left under its temporary name, which is yielded with the file, for the caller to link)."""
    path = os.path.join(folder_path, name)
    fd, tmp = -1, ""
    for _ in range(16):
        tmp = f".distmem-{secrets.token_hex(8)}{suffix}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            break
        except FileExistsError:
            continue
    if fd < 0:
        raise OSError(errno.EEXIST, f"no fresh temporary name in {folder_path}")
    f = os.fdopen(fd, "wb")
    try:
        yield (f, tmp) if keep else f
        f.flush()
        os.fchmod(fd, creation_mode() if mode is None else mode)
        if keep:
            return
        mine = os.fstat(fd)
        for stage in ("before", "as"):  # checked before the rename (nothing of someone else's is moved) and after
            if stage == "as":
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            now = os.stat(tmp if stage == "before" else name, dir_fd=dfd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                raise Unsafe(path, f"the file written was replaced before it took its name ({folder_path} can be "
                                   "written by another user)", "write to a folder of your own")
    except BaseException:
        _remove_if_mine(dfd, tmp, fd)
        raise
    finally:
        f.close()


def _remove_if_mine(dfd: int, name: str, fd: int) -> None:
    """Remove ``name`` only while it is still the file ``fd`` holds (never someone else's)."""
    try:
        mine = os.fstat(fd)
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(name, dir_fd=dfd)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def atomic_file(path: str, suffix: str = "", mode: Optional[int] = None) -> Iterator[Any]:
    """A binary file object on a fresh temporary file in ``path``'s folder; once the body wrote it,
    its mode is set (``mode``, default :func:`creation_mode`) and it is renamed onto ``path``.
    Readers never see half a file; on an error the temporary file is removed. The temporary name
    starts with a dot and ends in ``suffix + ".tmp"``, so collectors that glob (``*.prom``) skip it.
    Raises :class:`Unsafe` when the temporary file was replaced by someone else before the rename."""
    path = os.fspath(path)
    folder_path, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder_path, exist_ok=True)
    with _pinned(folder_path) as (dfd, _):
        with _atomic_in(dfd, folder_path, name, suffix, mode) as f:
            yield f


def write_atomic(path: str, data: bytes | str, suffix: str = "", mode: Optional[int] = None) -> str:
    """Write ``data`` (text as UTF-8) to ``path`` through :func:`atomic_file`; returns ``path``."""
    with atomic_file(path, suffix, mode) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path


@contextlib.contextmanager
def private_folder(path: str, create: bool = True) -> Iterator["Folder"]:
    """``path`` as this user's own 0700 folder, pinned as a :class:`Folder`; made when absent
    (``create``; its parents as the user's umask gives them), a looser mode of the user's own
    folder tightened. :class:`Unsafe` for a link, a non-folder or someone else's folder;
    FileNotFoundError when absent and not ``create``."""
    path = os.fspath(path)
    parent, name = os.path.split(os.path.abspath(path))
    if create:
        os.makedirs(parent, exist_ok=True)
    with _pinned(parent) as (pfd, _):
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=pfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Unsafe(path, "it is a symbolic link or not a folder; distmem never follows one there",
                             "remove it, or choose another folder") from None
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise Unsafe(path, f"it belongs to {owner_name(st.st_uid)} (mode {stat.S_IMODE(st.st_mode):04o}), not to "
                               "this user", "remove it (as its owner or root), or choose another folder")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        yield Folder(fd, path, None)
    finally:
        os.close(fd)


def home_folder(*parts: str) -> str:
    """``$XDG_CACHE_HOME/distmem/...`` (default ``~/.cache/distmem/...``): where a folder of this
    user's own goes when the usual place belongs to someone else (make it with :func:`private_folder`)."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "distmem", *parts)
