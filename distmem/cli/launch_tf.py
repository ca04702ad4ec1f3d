"""``distmem launch-tf -n 4 script.py args...``: start N local tf.distribute workers with TF_CONFIG.

Each worker gets a ``TF_CONFIG`` naming every worker at ``host:port`` (ports found free on this
machine) and its own task index, so ``MultiWorkerMirroredStrategy()`` and ``distmem.init()`` see a
job of N ranks. The launcher prefixes every line a worker prints with ``[rank i]``, stops the
others as soon as one fails (SIGTERM to the worker's process group, SIGKILL after ``--grace``
seconds), kills everything at the hard ``--timeout`` (exit 124), and exits non-zero if any worker
failed: with the first failing worker's exit code (128 + signal for a worker killed by a signal).

``launch/tf_config.py`` is this same launcher as a standalone script.

Free ports are found by binding port 0 and releasing it just before the workers start; another
program can take one in between (rare on a quiet machine). A worker that cannot bind fails and
stops the job, so a retry is the remedy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Dict, List, Optional, Sequence

from .. import settings
from ..errors import ConfigError
from ..units import plural

__all__ = ["add_arguments", "run", "main", "launch", "tf_configs", "free_ports", "worker_command",
           "DEFAULT_TIMEOUT", "TIMEOUT_EXIT"]

#: Seconds the whole job may run before every worker is killed (``--timeout``, ``DISTMEM_LAUNCH_TIMEOUT``).
DEFAULT_TIMEOUT = 3600.0
#: Exit code when the hard timeout stopped the job (the ``timeout`` command's convention).
TIMEOUT_EXIT = 124
_POLL = 0.05  # seconds between checks of the workers: short next to any worker's lifetime


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct TCP ports free on ``host`` right now (all bound at once, so never the same twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_configs(addresses: Sequence[str], chief: bool = False) -> List[str]:
    """The TF_CONFIG of each task, in rank order: workers 0..n-1, or a chief then workers 0..n-2."""
    addrs = list(addresses)
    if not addrs:
        raise ConfigError("a tf.distribute job needs at least one worker (-n 1 or more)")
    cluster: Dict[str, List[str]] = {"chief": addrs[:1], "worker": addrs[1:]} if chief else {"worker": addrs}
    if chief and not cluster["worker"]:
        del cluster["worker"]
    out = []
    for rank in range(len(addrs)):
        task = {"type": "chief", "index": 0} if chief and rank == 0 else \
            {"type": "worker", "index": rank - 1 if chief else rank}
        out.append(json.dumps({"cluster": cluster, "task": task}))
    return out


def worker_command(command: Sequence[str], python: str = sys.executable) -> List[str]:
    """``script.py args`` runs under ``python``; anything else (``python -m x``, a binary) runs as given."""
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("nothing to launch: give a script and its arguments, e.g. "
                          "distmem launch-tf -n 4 examples/tf_distribute.py --steps 5")
    return [python] + cmd if cmd[0].endswith(".py") else cmd


def check_command(cmd: Sequence[str], python_flag: bool) -> None:
    """ConfigError naming the program (or script) of ``cmd`` when it cannot be started: checked
    before any worker starts, so a typo is one line, not N tracebacks."""
    program = cmd[0]
    if os.sep in program:
        if not os.path.isfile(program) or not os.access(program, os.X_OK):
            what = "--python" if python_flag else "the command"
            raise ConfigError(f"{what} {program!r}: no such executable file; give the path of an interpreter "
                              "or program (e.g. --python $(command -v python3))")
    elif shutil.which(program) is None:
        raise ConfigError(f"the command {program!r} is not on PATH ({os.environ.get('PATH', '')}); give its full "
                          "path, or a script ending in .py to run under --python")
    if python_flag and len(cmd) > 1 and cmd[1].endswith(".py") and not os.path.isfile(cmd[1]):
        raise ConfigError(f"the script {cmd[1]!r} does not exist (relative to {os.getcwd()}); check the path")


def _check_host(host: str) -> str:
    try:
        socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({exc}); give one the workers can "
                          "listen on, e.g. localhost or this machine's IP address") from None
    return host


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    reader: threading.Thread
    stopped: bool = False  # stopped by the launcher, not failed on its own
    returncode: Optional[int] = None


def _pump(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock, rank: Optional[int] = None) -> None:
    # distmem's own lines name their rank ("[distmem rank 1] ..."); under this launcher's "[rank 1] "
    # prefix that would say it twice, so they keep only "[distmem] ".
    own = f"[distmem rank {rank}] " if rank is not None else None
    mine = f"[rank {rank}] " if rank is not None else None
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if own and text.startswith(own):
            text = "[distmem] " + text[len(own):]
        elif mine and text.startswith(mine):
            text = text[len(mine):]  # the worker named its rank as this prefix does: say it once
        with lock:
            out.write(f"{prefix}{text}\n")
            out.flush()
    stream.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Send ``sig`` to the worker's process group (its own session); False when no process is left in it."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _stop(workers: List[_Worker], grace: float) -> None:
    """SIGTERM every worker's process group (a finished worker's too: what it started must not
    outlive the job), then SIGKILL whatever is still there after ``grace`` seconds."""
    for w in workers:
        if w.proc.poll() is None:
            w.stopped = True
        _signal_group(w.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and any(_signal_group(w.proc, 0) for w in workers):
        time.sleep(_POLL)
    for w in workers:
        _signal_group(w.proc, signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def launch(command: Sequence[str], num_workers: int, *, timeout: Optional[float] = None, host: str = "localhost",
           chief: bool = False, python: str = sys.executable, grace: float = 5.0,
           env: Optional[Dict[str, str]] = None, out: IO[str] = sys.stdout, log: IO[str] = sys.stderr) -> int:
    """Run ``command`` as ``num_workers`` tf.distribute workers; return the job's exit code.

    0 when every worker exited 0; the first failing worker's code (128 + signal when killed);
    :data:`TIMEOUT_EXIT` when ``timeout`` seconds passed first. Output lines go to ``out`` with a
    ``[rank i]`` prefix; the launcher's own lines go to ``log``.
    """
    if num_workers < 1:
        raise ConfigError(f"-n {num_workers}: a job needs at least one worker")
    if timeout is None:
        timeout = settings.launch_timeout()
    elif not timeout > 0:
        raise ConfigError(f"--timeout {timeout}: every launch needs a positive hard timeout in seconds")
    if not grace >= 0:
        raise ConfigError(f"--grace {grace}: give the seconds between SIGTERM and SIGKILL, 0 or more")
    cmd = worker_command(command, python)
    check_command(cmd, python_flag=cmd[:1] == [python] and cmd[1:2] != [] and cmd[1].endswith(".py"))
    bind = "127.0.0.1" if host in ("localhost", "127.0.0.1") else _check_host(host)
    try:
        addrs = [f"{host}:{p}" for p in free_ports(num_workers, bind)]
    except OSError as exc:
        raise ConfigError(f"--host {host!r}: cannot listen there ({exc.strerror or exc}); give an address of this "
                          "machine, e.g. localhost") from None
    configs = tf_configs(addrs, chief)
    lock = threading.Lock()
    workers: List[_Worker] = []
    base = dict(os.environ if env is None else env)
    base.setdefault("PYTHONUNBUFFERED", "1")
    width = len(str(num_workers - 1))

    def say(msg: str) -> None:
        with lock:
            log.write(f"[launch-tf] {msg}\n")
            log.flush()

    say(f"{plural(num_workers, 'worker')} on {', '.join(addrs)}; hard timeout {timeout:.0f} s: {' '.join(cmd)}")
    t0 = time.monotonic()
    failed: Optional[_Worker] = None
    timed_out = False
    interrupted: Optional[int] = None

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signum)

    old_term = signal.signal(signal.SIGTERM, on_signal) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        for rank, cfg in enumerate(configs):
            wenv = dict(base, TF_CONFIG=cfg)
            proc = subprocess.Popen(cmd, env=wenv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            reader = threading.Thread(target=_pump, args=(proc.stdout, f"[rank {rank:>{width}}] ", out, lock, rank),
                                      daemon=True)
            reader.start()
            workers.append(_Worker(rank, proc, reader))
        deadline = t0 + timeout
        while True:
            live = 0
            for w in workers:
                rc = w.proc.poll()
                if rc is None:
                    live += 1
                elif w.returncode is None:
                    w.returncode = rc
                    if rc != 0 and failed is None:
                        failed = w
            if failed is not None or live == 0:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(_POLL)
    except KeyboardInterrupt as exc:
        interrupted = int(exc.args[0]) if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
    finally:
        _stop(workers, grace)
        for w in workers:
            w.reader.join(5)
            if w.returncode is None:
                w.returncode = w.proc.returncode
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    took = time.monotonic() - t0
    stopped = [w.rank for w in workers if w.stopped]
    if interrupted is not None:
        say(f"interrupted by signal {interrupted} after {took:.1f} s; stopped {plural(len(stopped), 'rank', bare=True)} {stopped}")
        return 128 + interrupted
    if timed_out:
        say(f"hard timeout: the job ran past {timeout:.0f} s; killed {plural(len(stopped), 'rank', bare=True)} {stopped} (raise --timeout if the "
            "job needs longer)")
        return TIMEOUT_EXIT
    if failed is not None:
        assert failed.returncode is not None
        how = f"signal {-failed.returncode}" if failed.returncode < 0 else f"exit code {failed.returncode}"
        say(f"rank {failed.rank} failed with {how} after {took:.1f} s"
            + (f"; stopped {plural(len(stopped), 'rank', bare=True)} {stopped}" if stopped else ""))
        return _exit_code(failed.returncode) or 1
    say(f"{'the worker' if num_workers == 1 else f'all {num_workers} workers'} exited 0 in {took:.1f} s")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers (ranks) to start")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"hard limit in seconds for the whole job; then every worker is killed and the exit code "
                        f"is {TIMEOUT_EXIT} (default {DEFAULT_TIMEOUT:.0f}, or DISTMEM_LAUNCH_TIMEOUT)")
    p.add_argument("--host", default="localhost", help="address the workers listen on (default localhost)")
    p.add_argument("--chief", action="store_true", help="make task 0 a 'chief' instead of worker 0")
    p.add_argument("--python", default=sys.executable, help="interpreter for a .py script (default: this one)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="script.py and its arguments (or any command)")


def run(args: argparse.Namespace) -> int:
    return launch(args.command, args.num_workers, timeout=args.timeout, host=args.host, chief=args.chief,
                  python=args.python, grace=args.grace)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``launch/tf_config.py``: the same options as ``distmem launch-tf``."""
    parser = argparse.ArgumentParser(prog="tf_config.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as exc:
        print(f"tf_config.py: error: {exc}", file=sys.stderr)
        return 2
