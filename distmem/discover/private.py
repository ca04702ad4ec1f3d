"""A node-local folder only this user can use, and the records ranks leave in it.

The layout exchange (:mod:`distmem.discover.layout`) meets in a shared place (``/dev/shm`` by
default), next to other users' jobs, so nothing here trusts a path:

* the user's folder ``<base>/distmem-layout-<uid>`` is created 0700; an existing one is opened
  with ``O_NOFOLLOW | O_DIRECTORY`` and checked with ``fstat`` on that descriptor (owner, type,
  mode) - a link, or a folder someone else owns, is refused with a ConfigError that names it; one
  of ours with a looser mode (an older distmem made it 0755) is tightened to 0700. Every folder
  below is handled the same way, relative to its parent's descriptor, never by path;
* a record is written to a fresh file of an unpredictable name (``O_CREAT | O_EXCL | O_NOFOLLOW``,
  0600), locked, filled, then renamed to a name no other process uses (:func:`record_name`); the
  writer holds an exclusive ``flock`` on it for its life, so the kernel drops the lock when the
  process dies - however it dies - and a reader tells a live record from a stale one without pid
  arithmetic;
* a record is read through ``O_NOFOLLOW | O_NONBLOCK`` (a planted fifo cannot block the reader),
  trusted only when it is a regular file of ours with one link and at most :data:`MAX_RECORD_BYTES`,
  parses as a JSON object, and its writer's lock is still held (:func:`read_record`); the schema
  is the caller's to check;
* stale records and empty folders are swept (:func:`sweep`), and a process removes its own
  records when it ends, the last one out its folders (:func:`remove_empty`). A rank that has read
  every record of its round says so with a marker (``done``, written and locked the same way), so
  that a rank leaving early can wait until its record was read before removing it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
from typing import Any, Dict, Iterator, Optional, Tuple

from ..errors import ConfigError

__all__ = ["ForeignFolder", "fallback_base", "open_user_folder", "open_folder", "write_record", "read_record", "record_name", "list_records",
           "sweep", "remove_empty", "remove_user_folder", "unlink", "FOLDER_MODE", "RECORD_MODE", "MAX_RECORD_BYTES", "user_folder_name",
           "KINDS", "lock_held", "parse_name"]

FOLDER_MODE = 0o700
RECORD_MODE = 0o600
#: A record is a few hundred bytes per GPU; anything this large is not one of ours.
MAX_RECORD_BYTES = 1 << 20
_TMP_PREFIX = ".tmp-"
#: At most this many entries are looked at per folder by a sweep: a sweep stays bounded in time.
_SWEEP_LIMIT = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def user_folder_name() -> str:
    """The user's folder in the shared base folder: ``distmem-layout-<effective uid>``."""
    return f"distmem-layout-{os.geteuid()}"


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


class ForeignFolder(ConfigError):
    """A layout folder that is not this user's own (another user's, a link, not a folder): refused;
    the exchange then meets in this user's own folder elsewhere (:func:`fallback_base`)."""


def fallback_base() -> str:
    """Where this user's layout folder goes when the usual one is taken by another user:
    ``~/.cache/distmem/layout`` (:func:`distmem.untrusted.home_folder`; every rank of a host has
    the same home, and its host folder keeps hosts apart where the home is shared)."""
    from ..untrusted import home_folder

    return home_folder("layout")


def _refuse(path: str, why: str) -> ConfigError:
    return ForeignFolder(
        f"distmem will not use the layout folder {path}: {why}; the ranks of a job exchange their layout only "
        f"through a folder this user ({_owner(os.geteuid())}) owns and nobody else can write. Remove it (as its "
        "owner or root), or set DISTMEM_LAYOUT_DIR to a folder of your own (e.g. $XDG_RUNTIME_DIR or a folder "
        "in your home on a node-local disk)")


def _checked(fd: int, path: str) -> int:
    """``fd`` when it is a folder of ours (mode tightened to 0700 if it was looser); else closes it
    and raises the ConfigError that names the path, owner and mode."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise _refuse(path, f"it belongs to {_owner(st.st_uid)} (mode {mode:04o}), not to this user")
    if mode != FOLDER_MODE:
        os.fchmod(fd, FOLDER_MODE)  # ours: an older distmem (or a umask of 0) left it open to others
    return fd


def open_folder(parent: Optional[int], name: str, path: str, create: bool = True) -> Optional[int]:
    """A descriptor of folder ``name`` in ``parent`` (a descriptor; None: ``name`` is a path), made
    0700 when absent and ``create``; None when absent and not ``create``. Never follows a link;
    ConfigError for a link, a non-folder or someone else's folder (:func:`_checked`)."""
    if create:
        try:
            os.mkdir(name, FOLDER_MODE, dir_fd=parent)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if create:
            raise  # removed between mkdir and open (the last rank of another job left): the caller retries
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, "it is a symbolic link or not a folder, and distmem never follows one there") from None
        raise
    return _checked(fd, path)


def open_user_folder(base: str, create: bool = True) -> Optional[int]:
    """A descriptor of this user's folder in ``base`` (:func:`user_folder_name`), created when
    absent and ``create`` (``base`` itself too, 0700, if it does not exist: it is the user's own
    setting); None when absent and not ``create``. ``base`` is the user's choice and is followed."""
    if create and not os.path.isdir(base):
        try:
            os.makedirs(base, FOLDER_MODE, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"the layout folder's base {base} does not exist and cannot be created "
                              f"({exc.strerror or exc}); set DISTMEM_LAYOUT_DIR to a node-local folder this user "
                              "can write") from None
    name = user_folder_name()
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if not create:
            return None
        raise ConfigError(f"cannot open the layout folder's base {base} ({exc.strerror or exc}); set "
                          "DISTMEM_LAYOUT_DIR to a node-local folder this user can write") from None
    try:
        return open_folder(base_fd, name, os.path.join(base, name), create)
    except PermissionError as exc:
        raise ConfigError(f"cannot create the layout folder {os.path.join(base, name)} ({exc.strerror}); set "
                          "DISTMEM_LAYOUT_DIR to a node-local folder this user can write") from None
    finally:
        os.close(base_fd)


def record_name(local_rank: int, round_: int, kind: str = "json") -> str:
    """``<local rank>.<round>.<token>.<kind>``: a record (``json``) or the marker a rank leaves once
    it has read every record of its round (``done``). The token (random, per process) keeps a live
    entry's name from ever being a stale one's, so a sweep can never remove a live entry by name."""
    assert kind in KINDS
    return f"{int(local_rank)}.{int(round_)}.{_TOKEN}.{kind}"


_TOKEN = secrets.token_hex(8)
#: What an entry of a host folder can be: a rank's record, or its "read them all" marker.
KINDS = ("json", "done")


def parse_name(name: str) -> Optional[Tuple[int, int, str]]:
    """``(local rank, round, kind)`` of an entry's file name, None for anything else."""
    parts = name.split(".")
    if len(parts) != 4 or parts[3] not in KINDS or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    if len(parts[0]) > 9 or len(parts[1]) > 9:
        return None
    return int(parts[0]), int(parts[1]), parts[3]


def write_record(folder: int, name: str, data: Dict[str, Any]) -> int:
    """Write ``data`` as record ``name`` in ``folder`` and return the descriptor that holds its lock
    (keep it open for the process's life; closing it marks the record stale). Atomic: readers see
    the whole record, locked, or nothing."""
    body = json.dumps(data, sort_keys=True).encode()
    for _ in range(8):
        tmp = _TMP_PREFIX + secrets.token_hex(12)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, RECORD_MODE,
                         dir_fd=folder)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # before the record has its name: nobody sees it unlocked
            os.fchmod(fd, RECORD_MODE)
            os.write(fd, body)
            os.rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            return fd
        except FileNotFoundError:
            os.close(fd)  # a sweep took the unlocked temporary file in the instant before flock: again
            continue
        except BaseException:
            os.close(fd)
            unlink(folder, tmp)
            raise
    raise OSError(errno.EEXIST, "could not create a layout record under a fresh name")


def lock_held(fd: int) -> bool:
    """True while the record's writer (any process but through another open file) holds its lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def read_record(folder: int, name: str) -> Tuple[Optional[Dict[str, Any]], bool]:
    """``(record, live)``: the JSON object in ``name`` and whether its writer still holds the lock;
    ``(None, False)`` for anything that is not a record of ours (a link, a fifo, someone else's
    file, a hard link, too large, not JSON, not an object). Never raises for the file's content."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None, False
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1
                or st.st_size > MAX_RECORD_BYTES):
            return None, False
        live = lock_held(fd)
        raw = os.read(fd, MAX_RECORD_BYTES + 1)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None, live
        return (data, live) if isinstance(data, dict) else (None, live)
    except OSError:
        return None, False
    finally:
        os.close(fd)


def list_records(folder: int) -> Iterator[Tuple[str, int, int, str]]:
    """``(name, local rank, round, kind)`` of every entry of ``folder`` named like a record or a
    marker (at most a bounded number)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names[:_SWEEP_LIMIT]:
        parsed = parse_name(name)
        if parsed is not None:
            yield (name,) + parsed


def unlink(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass


def _is_stale(folder: int, name: str) -> bool:
    """True for an entry nobody holds: a record or temporary file whose lock is free, or anything
    that is not a file of ours (which no distmem writes)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError as exc:
        return exc.errno in (errno.ELOOP, errno.ENXIO, errno.EACCES)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return False  # a folder: the sweep goes into it instead
        return not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not lock_held(fd)
    finally:
        os.close(fd)


def sweep(folder: int, depth: int = 2, path: str = "") -> None:
    """Remove the stale entries of ``folder`` and of its folders ``depth`` levels down (:func:`_is_stale`),
    then the folders left empty. Live records (their locks held) are never touched."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names[:_SWEEP_LIMIT]:
        try:
            st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and depth > 0:
            try:
                sub = open_folder(folder, name, os.path.join(path, name), create=False)
            except (ConfigError, OSError):
                continue  # not ours: left alone (nothing of it is ever read)
            if sub is None:
                continue
            try:
                sweep(sub, depth - 1, os.path.join(path, name))
            finally:
                os.close(sub)
            remove_empty(folder, name)
        elif not stat.S_ISDIR(st.st_mode) and _is_stale(folder, name):
            unlink(folder, name)


def remove_user_folder(base: str) -> bool:
    """Remove this user's folder in ``base`` when it is empty and still this user's own (never a
    folder someone put at its name); True when it was removed."""
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = open_folder(base_fd, user_folder_name(), os.path.join(base, user_folder_name()), create=False)
        if fd is None:
            return False
        os.close(fd)
        return remove_empty(base_fd, user_folder_name())
    except (ConfigError, OSError):
        return False
    finally:
        os.close(base_fd)


def remove_empty(parent: int, name: str) -> bool:
    """Remove folder ``name`` of ``parent`` if it is empty (the last rank out removes it)."""
    try:
        os.rmdir(name, dir_fd=parent)
        return True
    except OSError:
        return False
