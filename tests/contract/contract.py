"""The "nobody else's job" contract (docs/security.md), asserted on what :mod:`hook` recorded.

A violation is one of:

* **unchecked** - distmem opened, created, renamed, removed or re-moded a path in a folder another
  user can write (owner not this user or root, or group/world-writable) by code other than the
  checked modules (:data:`hook.CHECKED`: no link followed, no FIFO blocking, the owner and size
  judged on the descriptor, writes through it);
* **wildcard** - distmem bound a socket on every interface (``0.0.0.0``, ``::``, ``""``);
* **working folder** - a module was imported from the working folder through an entry the user
  did not name (``''``, a relative entry, the folder ``python -m`` adds);
* **child** - distmem started a Python that is not isolated (neither :mod:`distmem.children`'s
  bootstrap nor ``-I``/``-P``), outside the places that start the user's own command as a
  launcher does (:data:`USER_COMMANDS`).

A new surface - a new place that opens, binds or starts something - is checked by the same rules
the moment the suites reach it: it fails until it holds.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, Iterable, List

__all__ = ["read", "violations", "USER_COMMANDS", "WILDCARDS"]

#: Where distmem starts the user's own command, as a launcher does (what that command imports is
#: the user's: docs/security.md, "Child processes").
USER_COMMANDS = ("distmem/cli/launch_tf.py", "distmem/cli/exec.py")
WILDCARDS = ("0.0.0.0", "::", "", "0:0:0:0:0:0:0:0")


def read(folder: str, names: Iterable[str] = ()) -> List[Dict]:
    """Every record in ``folder`` (only the files ``names`` when given)."""
    rows: List[Dict] = []
    paths = [os.path.join(folder, n) for n in names] if names else sorted(glob.glob(os.path.join(folder, "*.jsonl")))
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        continue  # a process killed in the middle of a line
        except OSError:
            continue
    return rows


def _python(argv: List[str]) -> bool:
    return bool(argv) and os.path.basename(argv[0]).startswith("python")


def violations(rows: Iterable[Dict]) -> List[str]:
    """One line per breach of the contract in ``rows`` (empty: it holds)."""
    out: List[str] = []
    seen = set()
    for r in rows:
        e = r.get("e")
        line = None
        if e in ("open",) or (e or "").startswith(("os.", "shutil.")) and "path" in r:
            if r.get("shared") and not r.get("checked"):
                line = (f"unchecked {e} of {r['path']} (its folder: {r['shared']}; "
                        f"{'a write' if r.get('writes') else 'a read'}) at {r.get('where')}")
        elif e == "socket.bind":
            address = r.get("address")
            host = address[0] if isinstance(address, list) and address else address
            if host in WILDCARDS:
                line = f"socket bound on every interface ({address}) at {r.get('where')}"
        elif e in ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system"):
            argv = r.get("argv") or []
            where = r.get("where") or ""
            isolated = len(argv) > 2 and (argv[1] in ("-I", "-P") or (argv[1] == "-c" and "_spec[\"first\"]" in argv[2]))
            if _python(argv) and not isolated and not where.startswith(USER_COMMANDS):
                line = f"a Python child that is not isolated ({' '.join(argv[:3])[:200]}) at {where}"
        elif e == "imports" and r.get("from_working_folder"):
            line = f"imported from the working folder: {', '.join(r['from_working_folder'][:5])}"
        if line is not None and line not in seen:
            seen.add(line)
            out.append(f"pid {r.get('pid')}: {line}")
    return out


# ---------------------------------------------------------------------- the native side (strace)

#: System calls that name a path, as ``strace -e trace=`` spells them.
TRACED = ("open", "openat", "creat", "mkdir", "mkdirat", "rename", "renameat", "renameat2", "link", "linkat",
          "symlink", "symlinkat", "unlink", "unlinkat", "chmod", "fchmodat", "chown", "fchownat", "mknod",
          "mknodat", "bind")


def strace_violations(text: str, shared: str) -> List[str]:
    """The contract on what ``strace -f -e trace=<TRACED>`` saw a native program do, where
    ``shared`` is a folder another user can write: inside it, nothing is done by path (only relative
    to a folder's descriptor, ``*at(fd, name)``), every open relative to a descriptor refuses links
    (``O_NOFOLLOW``), every create is ``O_EXCL``; nothing is bound. The one path-based call allowed is
    opening ``shared`` itself as a folder (the place the user chose)."""
    import re

    out: List[str] = []
    shared = shared.rstrip("/")
    for line in text.splitlines():
        m = re.match(r"^(?:\d+\s+)?(\w+)\((.*)\)\s+=\s+(-?\d+|\?)", line)
        if not m:
            continue
        call, args = m.group(1), m.group(2)
        if call == "bind":
            out.append(f"bind: {line.strip()}")
            continue
        paths = re.findall(r'"([^"]*)"', args)
        at_fd = not args.startswith(("AT_FDCWD", '"')) and call.endswith("at") or call == "renameat2"
        by_path = [p for p in paths if p.startswith(shared + "/") or p == shared]
        if by_path and not (call in ("open", "openat") and paths[-1] == shared and "O_DIRECTORY" in args):
            out.append(f"by path in the shared folder: {line.strip()}")
            continue
        if call == "openat" and at_fd:
            if "O_NOFOLLOW" not in args:
                out.append(f"an open that follows links: {line.strip()}")
            elif "O_CREAT" in args and "O_EXCL" not in args:
                out.append(f"a create that may reuse a name: {line.strip()}")
    return out
