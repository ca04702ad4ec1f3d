"""Files written atomically (a temporary file in the same folder, then a rename: readers never see
half a file) and the report's JSON form."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Dict, Iterator, Optional

from ...errors import ConfigError
from ..aggregate import Report

__all__ = ["atomic_path", "atomic_write", "write_json", "read_json", "creation_mode"]


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only be read by setting it,
    which would leave other threads a moment of umask 0)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o077)  # the tightest value for the moment it is read
    os.umask(old)
    return old


def creation_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0666 less the umask (0644 under the usual
    022, 0600 under 077). The temporary file ``mkstemp`` makes is always 0600, so the result gets this."""
    return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(path: str, suffix: str, mode: Optional[int] = None) -> Iterator[str]:
    """Yield a temporary path in ``path``'s folder; once the body wrote it, rename it onto ``path``.
    Readers never see half a file; on an error the temporary file is removed. ``mode`` (default:
    :func:`creation_mode`, what the umask allows) is the final file's."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".distmem-", suffix=suffix + ".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, creation_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str, data: str, suffix: str, mode: Optional[int] = None) -> str:
    """Write through a temporary file in the same folder, then rename: readers never see half a file.

    The temporary name starts with a dot and does not end in the final suffix, so collectors that
    glob (node_exporter reads ``*.prom``) skip it. The result gets ``mode``, by default what the
    umask gives a new file (0644 under the usual 022: readable to a collector running as another
    user; 0600 under 077, as the user asked).
    """
    with atomic_path(path, suffix, mode) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
    return path


def write_json(report: Report | Dict[str, Any], path: str) -> str:
    """Write the report as JSON atomically (temporary file in the same folder, then rename)."""
    data = report.to_dict() if isinstance(report, Report) else report
    return atomic_write(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", ".json")


def read_json(path: str) -> Report:
    """Read a report written by :func:`write_json` (or a timeline file of ``ReportEvery``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"report file {path!r} does not exist; distmem.report(path=...) or "
                          "DISTMEM_REPORT names where rank 0 writes it") from None
    except ValueError as exc:
        raise ConfigError(f"report file {path!r} is not JSON ({exc}); was the job killed while writing it?") from None
    if not isinstance(data, dict) or "world_size" not in data:
        raise ConfigError(f"{path!r} is JSON but not a distmem report (no 'world_size' key); expected the file "
                          "distmem.report(path=...) or MemoryReport(path=...) wrote")
    return Report.from_dict(data)


