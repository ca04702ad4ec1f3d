"""The recorder of the "nobody else's job" contract test: a Python audit hook (``sys.addaudithook``)
installed at start-up in every Python process the test suite starts (through a ``sitecustomize``
on ``PYTHONPATH``, see :func:`site_folder`), recording what distmem's own code does to the world.

For every audited event raised by distmem's own code (the innermost frame outside Python's standard
library is in the distmem package: ``open()`` in distmem, or ``tempfile`` on its behalf - not a
library distmem called, such as TensorFlow's autograph), it writes one JSON line to
``<records>/<pid>-<token>.jsonl``:

* files opened or created (``open``), and made, renamed, removed, re-moded, linked by name
  (``os.mkdir``, ``os.rename``, ``os.remove``, ``os.chmod``, ``os.symlink``, ...): the path, the
  flags or mode, whether its folder is one another user can write (owner not this user or root, or
  group/world-writable), and whether the work was done by one of the checked modules
  (:data:`CHECKED`: :mod:`distmem.untrusted`, the layout's :mod:`distmem.discover.private`);
* sockets bound or connected (``socket.bind``, ``socket.connect``): the address;
* subprocesses (``subprocess.Popen``, ``os.exec``, ``os.posix_spawn``, ``os.system``): the argv;
* at exit, the modules imported from outside the environment (not under ``sys.prefix``, the
  base prefix or the project's tree), and whether any came from the working folder through an
  entry the user did not name (``''``, a relative entry, the working folder ``python -m`` adds).

A leaf of the test suite: the standard library only; it must never raise into the process.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import stat
import sys
import threading

__all__ = ["install", "site_folder", "SITECUSTOMIZE"]

#: The modules that do distmem's file work in folders another user may write, with their checks
#: (links, types, owners, sizes; descriptors, never names): anything else there is a violation.
CHECKED = ("distmem/untrusted.py", "distmem/discover/private.py")

_FILE_EVENTS = {"open": 0, "os.mkdir": 0, "os.rename": 0, "os.remove": 0, "os.rmdir": 0, "os.chmod": 0,
                "os.chown": 0, "os.symlink": 1, "os.link": 1, "os.truncate": 0, "os.utime": 0, "os.mkfifo": 0,
                "os.mknod": 0, "shutil.copyfile": 1, "shutil.move": 1, "shutil.rmtree": 0}
_SOCKET_EVENTS = {"socket.bind", "socket.connect"}
_PROCESS_EVENTS = {"subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

#: What the sitecustomize a session writes runs (``{hook!r}`` and ``{records!r}`` filled in).
SITECUSTOMIZE = '''import sys
sys.path.insert(0, {folder!r})
try:
    import hook as _distmem_contract_hook
    _distmem_contract_hook.install({records!r})
except Exception as _exc:  # never stop a process over the recorder
    sys.stderr.write("distmem contract hook not installed: %r\\n" % (_exc,))
finally:
    del sys.path[0]
'''


def site_folder(folder: str, records: str) -> str:
    """Write a ``sitecustomize.py`` into ``folder`` that installs the hook with ``records``; put
    ``folder`` first on ``PYTHONPATH`` and every Python started with it is recorded."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE.format(folder=os.path.dirname(os.path.abspath(__file__)), records=records))
    return folder


class _Recorder:
    def __init__(self, records: str):
        here = os.path.dirname(os.path.abspath(__file__))
        self.project = os.path.dirname(os.path.dirname(here))
        self.package = os.path.join(self.project, "distmem") + os.sep
        self.prefixes = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
                              | {p + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
        import sysconfig

        self.stdlib = tuple({sysconfig.get_paths()["stdlib"] + os.sep, os.path.dirname(os.__file__) + os.sep})
        self.site = tuple({sysconfig.get_paths()["purelib"] + os.sep, sysconfig.get_paths()["platlib"] + os.sep})
        self.records = records
        self.local = threading.local()
        self.lock = threading.Lock()
        self.cwd = os.getcwd()
        self.named = {os.path.normpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                      if p and os.path.isabs(p)}
        self.out = None
        self.pid = os.getpid()

    # ---------------------------------------------------------------- writing

    def write(self, row: dict) -> None:
        row["pid"] = os.getpid()
        with self.lock:
            if self.out is None or self.pid != os.getpid():  # a forked child writes its own file
                self.pid = os.getpid()
                os.makedirs(self.records, exist_ok=True)
                name = os.path.join(self.records, f"{os.getpid()}-{secrets.token_hex(4)}.jsonl")
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                self.out = fd
                os.write(fd, (json.dumps({"e": "process", "argv": sys.argv[:6], "cwd": self.cwd,
                                          "pid": os.getpid()}) + "\n").encode())
            os.write(self.out, (json.dumps(row, default=repr) + "\n").encode())

    # ---------------------------------------------------------------- attribution

    def distmem_frame(self):
        """The frame that did the work, when it is distmem's (None otherwise), and whether it is one
        of the checked modules (:data:`CHECKED`). The work is the innermost frame outside Python's
        standard library (``open()`` called by distmem, or ``tempfile``/``shutil`` on its behalf, is
        distmem's; a temporary file TensorFlow's autograph writes while distmem calls it is
        TensorFlow's own)."""
        f = sys._getframe(3)
        while f is not None:
            name = f.f_code.co_filename
            if not (name.startswith("<") or (name.startswith(self.stdlib) and not name.startswith(self.site))):
                break
            f = f.f_back
        if f is None or not f.f_code.co_filename.startswith(self.package):
            return None, False
        return f, f.f_code.co_filename[len(self.project) + 1:] in CHECKED

    def shared(self, folder: str):
        try:
            st = os.stat(folder)
        except (OSError, ValueError):
            return None
        if st.st_uid not in (os.geteuid(), 0):
            return f"owner uid {st.st_uid}"
        if st.st_mode & 0o022:
            return f"mode {stat.S_IMODE(st.st_mode):04o}"
        return None

    # ---------------------------------------------------------------- the hook

    def __call__(self, event: str, args: tuple) -> None:
        if event not in _FILE_EVENTS and event not in _SOCKET_EVENTS and event not in _PROCESS_EVENTS:
            return
        if getattr(self.local, "busy", False):
            return
        self.local.busy = True
        try:
            self.handle(event, args)
        except Exception:  # noqa: BLE001 - the recorder must never change what the process does
            pass
        finally:
            self.local.busy = False

    def handle(self, event: str, args: tuple) -> None:
        if event in _FILE_EVENTS:
            path = args[_FILE_EVENTS[event]] if len(args) > _FILE_EVENTS[event] else None
            if isinstance(path, int) or path is None:
                return
            path = os.fsdecode(path)
            absolute = os.path.isabs(path)
            full = os.path.normpath(path if absolute else os.path.join(os.getcwd(), path))
            if full.startswith(self.prefixes) or full.startswith(("/proc/", "/sys/", "/dev/null")):
                return
            frame, checked = self.distmem_frame()
            if frame is None:
                return
            flags = args[2] if event == "open" and len(args) > 2 and isinstance(args[2], int) else None
            mode = args[1] if event == "open" and len(args) > 1 and isinstance(args[1], str) else None
            writes = event != "open" or bool(flags is not None and flags & _WRITE_FLAGS) or \
                bool(mode and any(c in mode for c in "wax+"))
            if full.startswith(self.package) and not writes:
                return  # distmem's own modules, read as it imports them
            self.write({"e": event, "path": full, "relative": not absolute, "writes": writes, "flags": flags,
                        "mode": mode, "shared": self.shared(os.path.dirname(full)), "checked": checked,
                        "where": _where(frame, self.project)})
        elif event in _SOCKET_EVENTS:
            frame, _ = self.distmem_frame()
            if frame is None:
                return
            address = args[1] if len(args) > 1 else None
            self.write({"e": event, "address": list(address) if isinstance(address, tuple) else repr(address),
                        "where": _where(frame, self.project)})
        else:
            frame, _ = self.distmem_frame()
            if frame is None:
                return
            argv = args[1] if event in ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn") else args[0]
            argv = [os.fsdecode(a) if isinstance(a, (bytes, str)) else repr(a) for a in (argv or [])] \
                if not isinstance(argv, (str, bytes)) else [os.fsdecode(argv)]
            self.write({"e": event, "argv": argv[:4] + [f"... {len(argv) - 4} more"] if len(argv) > 4 else argv,
                        "python_flags": argv[1:3], "where": _where(frame, self.project)})

    # ---------------------------------------------------------------- at exit: the imports

    def imports(self) -> None:
        outside, from_cwd = [], []
        implicit = self.cwd not in self.named
        script = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] not in ("", "-c", "-m") \
            else None
        for name, module in list(sys.modules.items()):
            origin = getattr(module, "__file__", None)
            if not isinstance(origin, str) or "." in name:
                continue
            origin = os.path.abspath(origin)
            if origin.startswith(self.prefixes) or origin.startswith(self.project + os.sep):
                continue
            outside.append(f"{name}: {origin}")
            top = os.path.dirname(os.path.dirname(origin)) if origin.endswith("__init__.py") else os.path.dirname(origin)
            if implicit and top == self.cwd and top != script:
                from_cwd.append(f"{name}: {origin}")
        if outside or from_cwd:
            self.write({"e": "imports", "outside": outside[:50], "from_working_folder": from_cwd})


def _where(frame, project: str) -> str:
    name = frame.f_code.co_filename
    if name.startswith(project + os.sep):
        name = name[len(project) + 1:]
    return f"{name}:{frame.f_lineno} {frame.f_code.co_name}"


_installed = []


def install(records: str) -> None:
    """Record this process (once)."""
    if _installed:
        return
    rec = _Recorder(records)
    _installed.append(rec)
    sys.addaudithook(rec)
    atexit.register(rec.imports)
