"""Files written atomically (a fresh temporary file in the same folder, written and given its mode
through its descriptor, then renamed: readers never see half a file, and nothing is done by name
to a file someone could have swapped) and the report's JSON form, read with the checks of
:mod:`distmem.untrusted` (no link, no FIFO, bounded size, this user's own in a shared folder)."""
from __future__ import annotations

import contextlib
import json
from typing import Any, Dict, Iterator, Optional

from ... import untrusted
from ...errors import ConfigError
from ..aggregate import Report

__all__ = ["atomic_file", "atomic_write", "write_json", "read_json", "read_report_dict", "creation_mode",
           "MAX_REPORT_BYTES"]

#: The largest report (or timeline) file distmem reads: thousands of ranks and a long timeline fit.
MAX_REPORT_BYTES = 256 * 1024**2


def creation_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0666 less the umask (0644 under the usual
    022, 0600 under 077). The temporary file is always made 0600, and the result gets this."""
    return untrusted.creation_mode()


@contextlib.contextmanager
def atomic_file(path: str, suffix: str, mode: Optional[int] = None) -> Iterator[Any]:
    """A binary file object on a fresh temporary file in ``path``'s folder; once the body wrote it,
    it gets ``mode`` (default :func:`creation_mode`, what the umask allows) through its descriptor
    and is renamed onto ``path``. Readers never see half a file; on an error it is removed."""
    with untrusted.atomic_file(path, suffix, mode) as f:
        yield f


def atomic_write(path: str, data: str, suffix: str, mode: Optional[int] = None) -> str:
    """Write through a temporary file in the same folder, then rename: readers never see half a file.

    The temporary name starts with a dot and does not end in the final suffix, so collectors that
    glob (node_exporter reads ``*.prom``) skip it. The result gets ``mode``, by default what the
    umask gives a new file (0644 under the usual 022: readable to a collector running as another
    user; 0600 under 077, as the user asked).
    """
    return untrusted.write_atomic(path, data, suffix, mode)


def write_json(report: Report | Dict[str, Any], path: str) -> str:
    """Write the report as JSON atomically (temporary file in the same folder, then rename)."""
    data = report.to_dict() if isinstance(report, Report) else report
    return atomic_write(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", ".json")


def read_report_dict(path: str) -> Dict[str, Any]:
    """The plain data of a report file (or a timeline file of ``ReportEvery``), read with the checks
    of :mod:`distmem.untrusted`; :class:`ConfigError` naming the file and what is wrong with it."""
    try:
        data = untrusted.read_json(path, max_bytes=MAX_REPORT_BYTES, what="the report file")
    except FileNotFoundError:
        raise ConfigError(f"report file {path!r} does not exist; distmem.report(path=...) or "
                          "DISTMEM_REPORT names where rank 0 writes it") from None
    except IsADirectoryError:
        raise ConfigError(f"report file {path!r} is a folder; give the report JSON in it") from None
    except untrusted.Unsafe:
        raise
    except ConfigError as exc:
        raise ConfigError(f"{exc}; was the job killed while writing it?") from None
    except OSError as exc:
        raise ConfigError(f"report file {path!r} cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, dict) or "world_size" not in data:
        raise ConfigError(f"{path!r} is JSON but not a distmem report (no 'world_size' key); expected the file "
                          "distmem.report(path=...) or MemoryReport(path=...) wrote")
    return data


def read_json(path: str) -> Report:
    """Read a report written by :func:`write_json` (or a timeline file of ``ReportEvery``)."""
    data = read_report_dict(path)
    try:
        return Report.from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{path!r}: a report whose rows are not a report's ({type(exc).__name__}: "
                          f"{untrusted.printable(exc, 200)})") from None
