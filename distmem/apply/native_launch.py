"""Checks ``distmem-exec`` makes before it execs a command under the native cap, so that a cap
that would not load is an error and never a command run uncapped.

``LD_PRELOAD`` is honoured only by the dynamic loader, so the command must be a dynamically linked
program of the library's class and machine, not run in secure mode (set-user-ID, set-group-ID or
file capabilities make ld.so ignore preload paths); a script is judged by its interpreter
(``#!``, through ``/usr/bin/env`` too, as deep as the kernel follows). And the library must really
load: a test process started with the same ``LD_PRELOAD`` must confirm it through a pipe
(``DISTMEM_CAP_CONFIRM``), which also catches files that are not shared objects, the wrong
architecture and missing dependencies. What no launcher can see is left to the docs: a program
that clears ``LD_PRELOAD`` for its own children, or that talks to the driver without libcuda.
"""
from __future__ import annotations

import os
import secrets
import select
import shutil
import stat
import struct
import subprocess
import sys
import time
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

from .native import ABI_VERSION, ENV_GPU_BUDGET, ENV_GROUP, LIBRARY_NAME, NativeCapError

__all__ = ["ENV_CONFIRM", "check_command", "confirm_loads", "check_budget_folder"]

#: FD:NONCE of the pipe on which the library confirms it loaded (read by ``confirm_loads``).
ENV_CONFIRM = "DISTMEM_CAP_CONFIRM"

_PT_INTERP = 3
_MACHINES = {3: "x86 (32-bit)", 62: "x86-64", 183: "AArch64", 21: "PowerPC64", 243: "RISC-V", 40: "ARM"}
_MAX_INTERPRETERS = 4  # what the kernel follows (BINPRM_MAX_RECURSION)


class _Elf(NamedTuple):
    bits: int
    machine: int
    dynamic: bool


def _read_elf(path: str) -> Optional[_Elf]:
    """Class, machine and whether ``path`` asks for a program interpreter (ld.so); None if not ELF."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
                return None
            bits = 32 if head[4] == 1 else 64
            end = "<" if head[5] == 1 else ">"
            machine = struct.unpack_from(end + "H", head, 18)[0]
            if bits == 64:
                phoff, = struct.unpack_from(end + "Q", head, 32)
                phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
            else:
                phoff, = struct.unpack_from(end + "I", head, 28)
                phentsize, phnum = struct.unpack_from(end + "HH", head, 42)
            dynamic = False
            for i in range(min(phnum, 512)):
                f.seek(phoff + i * phentsize)
                raw = f.read(4)
                if len(raw) == 4 and struct.unpack(end + "I", raw)[0] == _PT_INTERP:
                    dynamic = True
                    break
            return _Elf(bits, machine, dynamic)
    except OSError:
        return None


def _describe(elf: _Elf) -> str:
    return f"{elf.bits}-bit {_MACHINES.get(elf.machine, f'machine {elf.machine}')}"


def _secure_mode(path: str, st: os.stat_result) -> Optional[str]:
    """Why exec'ing ``path`` would run in ld.so's secure mode (AT_SECURE), or None."""
    if st.st_mode & stat.S_ISUID and st.st_uid != os.geteuid():
        return f"is set-user-ID (owner uid {st.st_uid})"
    if st.st_mode & stat.S_ISGID and st.st_gid != os.getegid() and st.st_gid not in os.getgroups():
        return f"is set-group-ID (group {st.st_gid})"
    if os.geteuid() != 0:
        try:
            os.getxattr(path, "security.capability")
            return "has file capabilities (security.capability)"
        except OSError:
            pass
    return None


def _shebang(path: str) -> Optional[List[str]]:
    try:
        with open(path, "rb") as f:
            line = f.readline(256)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    return line[2:].decode(errors="replace").split()


def check_command(command: Sequence[str], env: Mapping[str, str], library: str) -> None:
    """Raise NativeCapError if ld.so would not preload ``library`` into ``command``.

    A command that cannot be found, or read, is left to exec (and its own error).
    """
    lib = _read_elf(library)
    path = shutil.which(command[0], path=env.get("PATH", os.defpath)) if "/" not in command[0] else command[0]
    chain = [command[0]]
    for _ in range(_MAX_INTERPRETERS + 1):
        if not path or not os.path.isfile(path):
            return
        path = os.path.abspath(path)
        st = os.stat(path)
        why = _secure_mode(path, st)
        if why:
            raise NativeCapError(f"{path} {why}: ld.so runs it in secure mode, where it ignores LD_PRELOAD={library}, "
                                 f"so {' -> '.join(chain)} would run uncapped. Run a program that is not privileged "
                                 "under distmem-exec")
        words = _shebang(path)
        if words:
            interp = words[0]
            if os.path.basename(interp) == "env" and len(words) > 1 and not words[1].startswith("-"):
                interp = shutil.which(words[1], path=env.get("PATH", os.defpath)) or words[1]
            chain.append(interp)
            path = interp
            continue
        elf = _read_elf(path)
        if elf is None:
            return  # not ELF, or unreadable: exec decides
        if not elf.dynamic:
            raise NativeCapError(f"{path} is statically linked: no dynamic loader runs in it, so LD_PRELOAD={library} "
                                 f"does not apply and {' -> '.join(chain)} would run uncapped. The native cap works "
                                 "for dynamically linked programs only")
        if lib is not None and (elf.bits, elf.machine) != (lib.bits, lib.machine):
            raise NativeCapError(f"{path} is a {_describe(elf)} program but {library} is {_describe(lib)}: ld.so would "
                                 f"skip the library and {' -> '.join(chain)} would run uncapped; build the library "
                                 "for that architecture (scripts/build_native.sh on it)")
        return


def confirm_loads(env: Mapping[str, str], library: str, timeout: float = 30.0) -> None:
    """Start a small program under ``env`` (its LD_PRELOAD) and require the library to say it loaded.

    Raises NativeCapError with the loader's own message when it does not, when it is another
    interface version, or when it rejected its configuration.
    """
    probe = shutil.which("true", path=os.defpath)
    argv = [probe] if probe else [sys.executable, "-I", "-S", "-c", ""]
    r, w = os.pipe()
    nonce = secrets.token_hex(8)
    penv: Dict[str, str] = dict(env)
    penv[ENV_CONFIRM] = f"{w}:{nonce}"
    try:
        try:
            proc = subprocess.run(argv, env=penv, pass_fds=(w,), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise NativeCapError(f"a test process ({argv[0]}) under LD_PRELOAD={library} did not finish within "
                                 f"{timeout:g} s; the cap's load could not be confirmed") from None
        os.close(w)
        w = -1
        line = _read_line(r, time.monotonic() + 5.0)
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)
    said = (proc.stderr or "").strip()
    if not line.startswith(nonce + " "):
        raise NativeCapError(f"{library} did not load in a test process ({argv[0]} with LD_PRELOAD={library}), so the "
                             "command would run uncapped" + (f"; the loader said: {said[-600:]}" if said else "")
                             + f". Rebuild it with scripts/build_native.sh, or point --library at a working "
                             f"{LIBRARY_NAME}")
    fields = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
    if fields.get("abi") != str(ABI_VERSION):
        raise NativeCapError(f"{library} has interface version {fields.get('abi')}, not the {ABI_VERSION} this distmem "
                             "needs (an older build: its GPU-wide budget is not safe on shared nodes); rebuild it "
                             "with scripts/build_native.sh")
    if fields.get("config_ok") != "1":
        raise NativeCapError(f"{library} loaded but rejected its configuration (every GPU allocation would be "
                             f"denied): {said[-600:]}")


def _read_line(fd: int, deadline: float) -> str:
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def check_budget_folder(env: Mapping[str, str]) -> None:
    """Refuse early what the library would refuse at the first allocation: a GPU-wide budget whose
    per-user folder someone else made, or made reachable to others."""
    if not env.get(ENV_GPU_BUDGET) or env.get(ENV_GROUP):
        return
    base = env.get("DISTMEM_CAP_SHM_DIR") or "/dev/shm"
    path = os.path.join(base, f"distmem-cap-u{os.geteuid()}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise NativeCapError(f"cannot look at {path}, the folder of the GPU-wide budget: {exc}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NativeCapError(f"{path} is not a folder (a link or a file someone may have planted): the GPU-wide "
                             "budget cannot be kept there. Remove it, or set DISTMEM_CAP_SHM_DIR to a folder only "
                             "you can write")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise NativeCapError(f"{path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, not to you "
                             f"(uid {os.geteuid()}) with 0700: another user could read or change the GPU-wide budget "
                             "there. Remove it, or set DISTMEM_CAP_SHM_DIR to a folder only you can write")
