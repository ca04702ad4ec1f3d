"""Files written atomically (a temporary file in the same folder, then a rename: readers never see
half a file) and the report's JSON form."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Dict, Iterator

from ...errors import ConfigError
from ..aggregate import Report

__all__ = ["atomic_path", "atomic_write", "write_json", "read_json"]


@contextlib.contextmanager
def atomic_path(path: str, suffix: str, mode: int = 0o644) -> Iterator[str]:
    """Yield a temporary path in ``path``'s folder; once the body wrote it, rename it onto ``path``.
    Readers never see half a file; on an error the temporary file is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".distmem-", suffix=suffix + ".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str, data: str, suffix: str, mode: int = 0o644) -> str:
    """Write through a temporary file in the same folder, then rename: readers never see half a file.

    The temporary name starts with a dot and does not end in the final suffix, so collectors that
    glob (node_exporter reads ``*.prom``) skip it; ``mode`` makes the result readable to them (a
    temporary file is created 0600).
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


