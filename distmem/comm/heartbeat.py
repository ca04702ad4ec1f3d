"""Fail fast: every rank learns within seconds that another rank died, and stops with one line.

Without it, a rank killed by SIGKILL or the kernel's OOM killer, or one that ends on an exception
(an out-of-memory error outside the guard), leaves the others blocked in the next collective until
NCCL's watchdog, Gloo's or MPI's timeout fires - often half an hour - or forever (MPI's shared
memory transport).

How: a heartbeat on distmem's own TCP connections, apart from the training communicator. Rank 0
runs a hub (one thread, :mod:`selectors`); every other rank keeps one connection to it (one
thread). Why TCP to one hub rather than the node-local exchange's file locks: a lock tells only
the ranks of the same host, while the kernel closes a dead process's sockets on any host, so the
hub sees the connection end within a round trip of the death, however the process died; a host
that vanishes (power, network) or a stopped process is caught by silence instead: no beat for
:data:`SILENCE_SECONDS` (or ``DISTMEM_TIMEOUT`` when longer) - long, since a beat needs the GIL and a
long native call that holds it must not end a healthy job. A rank that ends on an unhandled exception sends its cause first (``sys.excepthook``), a
rank that ends cleanly says goodbye (``atexit``) and is no death.

On a death the hub tells every rank (``dead``: rank, host, cause); each prints one line::

    distmem: rank 3 (host h) died (killed: ...); stopping this rank

aborts the job's communicators where the framework allows it (torch.distributed NCCL's abort;
Horovod's shutdown; MPI_Abort), each bounded by :data:`ABORT_SECONDS`, and leaves with
:data:`EXIT_STATUS`. Rank 0's own death ends every connection at once: the others stop the same
way.

Rendezvous (where the hub listens, and a random token that every connection must present): through
the job's transport when one is up at ``init()`` (one all-gather), else through the launcher's own
store before the framework's init: torchrun's agent store (``MASTER_ADDR``/``MASTER_PORT``) before
``torch.distributed``, horovodrun's rendezvous server (``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``)
before ``hvd.init()``; else the heartbeat does not start and says so. Every wait is bounded by
``DISTMEM_TIMEOUT``. Elastic Horovod (``HOROVOD_ELASTIC=1``) recovers from a lost rank itself: no
heartbeat there.

On by default from ``distmem.init()``; ``init(fail_fast=False)`` or ``DISTMEM_FAIL_FAST=0`` turn
it off.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import settings
from ..console import say

__all__ = ["Death", "Heartbeat", "start", "stop", "current", "rendezvous_info", "EXIT_STATUS", "ABORT_SECONDS",
           "BEAT_SECONDS", "SILENCE_SECONDS", "MPI_ABORT_GRACE", "CONSEQUENCE_SECONDS", "KILLED", "abort_communicators"]

log = logging.getLogger("distmem")

#: A rank stopped by fail fast exits with this status (sysexits' EX_TEMPFAIL: the job may be restarted).
EXIT_STATUS = 75
#: How long each communicator's abort may take before the rank leaves anyway (seconds).
ABORT_SECONDS = 2.0
#: A beat every this many seconds, each way (a few bytes).
BEAT_SECONDS = 0.5
#: A rank silent this long (seconds; ``DISTMEM_TIMEOUT`` when longer) is declared lost.
SILENCE_SECONDS = 60.0
#: a hub refusing connections on every address this long has ended (it listens before its port is sent)
HUB_GONE_SECONDS = 3.0


class _HubGone(Exception):
    """Rank 0's heartbeat no longer listens: it ended before this rank connected."""
#: The cause when a connection ends without a goodbye or an exception: nothing in the process ran.
KILLED = ("died (killed: its heartbeat connection closed with no exit record - SIGKILL, the kernel's OOM "
          "killer or a crash)")
_MAX_LINE = 1 << 16


@dataclass(frozen=True)
class Death:
    """A rank that is gone: ``cause`` is what the user reads after its name."""
    rank: int
    host: str
    cause: str

    def line(self) -> str:
        return f"distmem: rank {self.rank} (host {self.host}) {self.cause}; stopping this rank"

    def to_dict(self) -> Dict[str, Any]:
        return {"t": "dead", "rank": self.rank, "host": self.host, "cause": self.cause}


def _send(sock: socket.socket, msg: Dict[str, Any]) -> bool:
    try:
        sock.sendall((json.dumps(msg) + "\n").encode())
        return True
    except OSError:
        return False


class _Lines:
    """Newline-delimited JSON messages from one socket (a partial line waits for its end)."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> List[Dict[str, Any]]:
        self.buf += data
        if len(self.buf) > _MAX_LINE:
            self.buf = b""
            return [{"t": "garbage"}]
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                msg = {"t": "garbage"}
            out.append(msg if isinstance(msg, dict) else {"t": "garbage"})
        return out


def abort_communicators() -> List[str]:
    """Abort the job's communicators this process holds, each bounded by :data:`ABORT_SECONDS`, so
    that nothing of this rank waits on the dead one. Returns what was aborted (for the log)."""
    done: List[str] = []
    actions: List[Tuple[str, Callable[[], None]]] = []
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                actions.append(("torch.distributed NCCL abort", lambda: abort()))
            else:
                import torch

                pg = dist.distributed_c10d._get_default_group()
                actions.append(("torch.distributed NCCL abort",
                                lambda: pg._get_backend(torch.device("cuda")).abort()))
        # Gloo has no abort; destroy_process_group would wait on the collective in flight. The
        # process's exit closes its sockets, which ends the other ranks' Gloo calls at once.
    except Exception:  # noqa: BLE001 - a half-initialised group: nothing to abort
        pass
    for name in ("horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras"):
        hvd = sys.modules.get(name)
        try:
            if hvd is not None and hvd.is_initialized():
                actions.append((f"{name}.shutdown", hvd.shutdown))
                break
        except Exception:  # noqa: BLE001
            continue
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            actions.append(("MPI_Abort", lambda: _mpi_abort(mpi)))
    except Exception:  # noqa: BLE001
        pass
    for what, fn in actions:
        t = threading.Thread(target=_quietly, args=(fn,), name="distmem-abort", daemon=True)
        t.start()
        t.join(ABORT_SECONDS + (MPI_ABORT_GRACE if what == "MPI_Abort" else 0.0))
        done.append(what if not t.is_alive() else f"{what} (still running after {ABORT_SECONDS:g} s: left)")
    return done


#: Seconds a rank waits, its line printed, before MPI_Abort: MPI_Abort ends every rank of the job at
#: once, and each of the others, told by the heartbeat too, should print its own line first. The
#: abort stays as the backstop for a rank that cannot act on the news (a native call holding the GIL).
MPI_ABORT_GRACE = 1.0


def _mpi_abort(mpi: Any) -> None:
    time.sleep(MPI_ABORT_GRACE)
    mpi.COMM_WORLD.Abort(EXIT_STATUS)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - aborting is best effort; the exit follows
        pass


def _stop_rank(death: Death, exit_now: Callable[[int], None]) -> None:
    try:
        os.write(2, (death.line() + "\n").encode())
    except OSError:
        pass
    abort_communicators()
    exit_now(EXIT_STATUS)


class Heartbeat:
    """One rank's side of the heartbeat: the hub on rank 0, a connection to it elsewhere.

    ``info`` is rank 0's :func:`rendezvous_info` (``host``, ``addrs``, ``port``, ``token``); rank 0
    passes its own ``server`` socket. ``on_death`` runs on the heartbeat's thread (default: print
    the line, abort the communicators, ``os._exit``)."""

    def __init__(self, rank: int, size: int, host: str, info: Dict[str, Any],
                 server: Optional[socket.socket] = None, silence: Optional[float] = None,
                 on_death: Optional[Callable[[Death], None]] = None):
        self.rank, self.size, self.host = rank, size, host
        self.info = info
        self.silence = max(SILENCE_SECONDS, settings.timeout()) if silence is None else silence
        self.on_death = on_death or (lambda d: _stop_rank(d, os._exit))
        self.server = server
        self.death: Optional[Death] = None
        self.died = threading.Event()  #: set once a death is known (before ``on_death`` runs)
        self._lock = threading.Lock()
        self._closing = False
        self._failed = False
        self._sock: Optional[socket.socket] = None
        self._clients: Dict[socket.socket, Dict[str, Any]] = {}
        self._gone: Dict[int, str] = {}  # rank -> "bye" | "dead" (hub)
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ start / stop

    def start(self, timeout: float, join_timeout: Optional[float] = None) -> "Heartbeat":
        """Start the thread: a rank connects within ``timeout`` seconds; on rank 0, every other rank
        must have connected within ``join_timeout`` (default ``timeout``)."""
        self.join_timeout = timeout if join_timeout is None else join_timeout
        if self.rank == 0:
            assert self.server is not None
            self.server.setblocking(False)
            self._thread = threading.Thread(target=self._hub, name="distmem-heartbeat-hub", daemon=True)
        else:
            try:
                self._sock = self._connect(timeout)
            except _HubGone as exc:
                # Rank 0 listened before it sent its port: a hub that refuses on every address has
                # ended (a short job whose rank 0 finished first). Nothing to watch: run without.
                self._closing = True
                log.warning("distmem: %s", exc)
                return self
            _send(self._sock, {"t": "hello", "token": self.info["token"], "rank": self.rank, "host": self.host,
                               "pid": os.getpid()})
            self._thread = threading.Thread(target=self._client, name="distmem-heartbeat", daemon=True)
        self._thread.start()
        os.register_at_fork(after_in_child=self._forget_in_child)
        atexit.register(self.close)
        return self

    def _forget_in_child(self) -> None:
        # A forked child (a data loader worker) must not hold this rank's connection open after the
        # rank dies: the hub would never see it end.
        self._closing = True
        for s in [self._sock, self.server, *self._clients]:
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        addrs: List[str] = list(self.info["addrs"])
        if self.info.get("host") == self.host:
            addrs = ["127.0.0.1"] + addrs
        errors = []
        refused_since: Optional[float] = None
        while True:
            refused = True
            for addr in addrs:
                try:
                    sock = socket.create_connection((addr, int(self.info["port"])),
                                                    timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.settimeout(2.0)
                    return sock
                except OSError as exc:
                    refused = refused and isinstance(exc, ConnectionRefusedError)
                    errors.append(f"{addr}: {exc}")
            now = time.monotonic()
            refused_since = (refused_since or now) if refused else None
            if refused_since is not None and now - refused_since > HUB_GONE_SECONDS:
                raise _HubGone(f"rank {self.rank}: rank 0's fail-fast heartbeat (port {self.info['port']}) refuses on "
                               f"every address ({'; '.join(errors[-2:])}): rank 0 has ended; fail fast is off on "
                               "this rank")
            if time.monotonic() > deadline:
                from ..errors import GatherTimeoutError

                raise GatherTimeoutError(
                    f"rank {self.rank} could not reach rank 0's fail-fast heartbeat at port {self.info['port']} of "
                    f"{', '.join(addrs)} within {timeout:.1f} s ({'; '.join(errors[-3:])}); open the port range "
                    "between the job's hosts, or turn fail fast off (init(fail_fast=False) or "
                    "DISTMEM_FAIL_FAST=0)")
            time.sleep(0.2)

    def close(self) -> None:
        """A clean end of this rank (atexit): a goodbye, so that its leaving is no death."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.rank == 0:
            for s in list(self._clients):
                _send(s, {"t": "bye"})
                try:
                    s.close()
                except OSError:
                    pass
            if self.server is not None:
                self.server.close()
        elif self._sock is not None and not self._failed:
            _send(self._sock, {"t": "bye"})
            try:
                self._sock.close()
            except OSError:
                pass

    def failed(self, cause: str) -> None:
        """This rank ends on an exception: tell the others why before the connection closes."""
        with self._lock:
            if self._closing or self._failed:
                return
            self._failed = True
        if self.rank == 0:
            self._broadcast(Death(0, self.host, cause))
        elif self._sock is not None:
            _send(self._sock, {"t": "fail", "cause": cause})

    # ------------------------------------------------------------------ the hub (rank 0)

    def _broadcast(self, death: Death) -> None:
        for s, peer in list(self._clients.items()):
            if peer.get("rank") != death.rank:
                _send(s, death.to_dict())
        # Close the writing side after the message, read what is left: the others read the message
        # before the end of the connection (no reset that could drop it).
        for s in list(self._clients):
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _hub(self) -> None:
        sel = selectors.DefaultSelector()
        assert self.server is not None
        sel.register(self.server, selectors.EVENT_READ, None)
        parsers: Dict[socket.socket, _Lines] = {}
        last_beat = 0.0
        joined = set()
        join_by = time.monotonic() + self.join_timeout
        while not self._closing:
            try:
                events = sel.select(BEAT_SECONDS / 2)
            except (OSError, ValueError):
                return
            now = time.monotonic()
            for key, _ in events:
                if key.data is None:
                    try:
                        conn, _ = self.server.accept()
                    except OSError:
                        continue
                    conn.setblocking(True)
                    conn.settimeout(2.0)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._clients[conn] = {"rank": None, "seen": now}
                    parsers[conn] = _Lines()
                    sel.register(conn, selectors.EVENT_READ, "client")
                    continue
                conn = key.fileobj  # type: ignore[assignment]
                peer = self._clients.get(conn)  # type: ignore[arg-type]
                if peer is None:
                    continue
                try:
                    data = conn.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                death = None
                if data:
                    peer["seen"] = now
                    for msg in parsers[conn].feed(data):  # type: ignore[index]
                        kind = msg.get("t")
                        if peer["rank"] is None:
                            if kind != "hello" or not secrets.compare_digest(str(msg.get("token", "")),
                                                                            self.info["token"]):
                                data = b""  # not one of the job's ranks: drop the connection
                                break
                            peer.update(rank=int(msg["rank"]), host=str(msg.get("host", "?")), pid=msg.get("pid"))
                            joined.add(peer["rank"])
                        elif kind == "bye":
                            self._gone[peer["rank"]] = "bye"
                        elif kind == "fail":
                            peer["cause"] = str(msg.get("cause", "failed"))[:400]
                if not data:
                    sel.unregister(conn)
                    self._clients.pop(conn, None)  # type: ignore[call-overload]
                    try:
                        conn.close()  # type: ignore[union-attr]
                    except OSError:
                        pass
                    r = peer.get("rank")
                    if r is not None and self._gone.get(r) != "bye":
                        death = Death(r, peer.get("host", "?"), peer.get("cause") or KILLED)
                if death is not None:
                    self._declare(death)
                    return
            if join_by is not None and now > join_by:
                never = sorted(set(range(1, self.size)) - joined)
                join_by = None
                if never:
                    self._declare(Death(never[0], "?", f"never connected to the fail-fast heartbeat within "
                                        f"{self.join_timeout:.0f} s of init() (ranks {never} did not)"))
                    return
            if now - last_beat >= BEAT_SECONDS:
                last_beat = now
                for s, peer in list(self._clients.items()):
                    if peer["rank"] is not None:
                        _send(s, {"t": "beat"})
                    if now - peer["seen"] > self.silence and self._gone.get(peer["rank"]) != "bye":
                        r = peer["rank"]
                        if r is None:
                            continue
                        self._declare(Death(r, peer.get("host", "?"),
                                            f"stopped answering (no heartbeat for {self.silence:.0f} s: its host is "
                                            "down, the network is cut, or the process is stopped)"))
                        return

    def _declare(self, death: Death) -> None:
        with self._lock:
            if self._closing or self.death is not None:
                return
            self.death = death
        self.died.set()
        self._broadcast(death)
        self.on_death(death)

    # ------------------------------------------------------------------ a rank's connection

    def _client(self) -> None:
        sock = self._sock
        assert sock is not None
        parser = _Lines()
        last_sent = last_heard = time.monotonic()
        hub = Death(0, str(self.info.get("host", "?")), KILLED)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        while not self._closing:
            try:
                ready = sel.select(BEAT_SECONDS / 2)
            except (OSError, ValueError):
                return
            now = time.monotonic()
            if ready:
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    if not self._closing:
                        self._client_death(hub)
                    return
                last_heard = now
                for msg in parser.feed(data):
                    if msg.get("t") == "dead":
                        self._client_death(Death(int(msg.get("rank", -1)), str(msg.get("host", "?")),
                                                 str(msg.get("cause", "died"))[:400]))
                        return
                    if msg.get("t") == "bye":
                        self._closing = True  # rank 0 ended cleanly: nothing left to watch
                        return
            if now - last_sent >= BEAT_SECONDS:
                last_sent = now
                if not self._closing and not _send(sock, {"t": "beat"}):
                    if not self._closing:
                        self._client_death(hub)
                    return
            if now - last_heard > self.silence:
                self._client_death(Death(hub.rank, hub.host,
                                         f"stopped answering (no heartbeat for {self.silence:.0f} s: its host is "
                                         "down, the network is cut, or the process is stopped)"))
                return

    def _client_death(self, death: Death) -> None:
        with self._lock:
            if self._closing or self._failed or self.death is not None:
                return
            self.death = death
        self.died.set()
        self.on_death(death)


# ---------------------------------------------------------------------- the process's heartbeat

#: ``meetings``: how many times this process has met the others through a launcher's store - the
#: key's generation, so that a heartbeat started again in the same launch (``distmem.reset()`` then
#: ``init()``) never reads the earlier hub's info; every rank starts as often (it is collective).
_state: Dict[str, Any] = {"hb": None, "hook": None, "meetings": 0}


def current() -> Optional[Heartbeat]:
    """This process's heartbeat, or None when fail fast is not running."""
    return _state["hb"]


def _addresses() -> List[str]:
    """This host's addresses the other hosts may reach it at: the interface of the route towards
    ``MASTER_ADDR`` (or any outside address: nothing is sent), the host name's addresses, the name."""
    out: List[str] = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((os.environ.get("MASTER_ADDR") or "10.255.255.255", 1))
        out.append(probe.getsockname()[0])
    except OSError:
        pass
    finally:
        probe.close()
    name = socket.gethostname()
    try:
        out.extend(socket.gethostbyname_ex(name)[2])
    except OSError:
        pass
    out.append(name)
    seen: List[str] = []
    for a in out:
        if a and not a.startswith("127.") and a not in seen:
            seen.append(a)
    return seen


def rendezvous_info(host: str) -> Tuple[socket.socket, Dict[str, Any]]:
    """Rank 0's listening socket (every interface, a port the kernel picks) and what the other ranks
    need to reach it: ``host``, ``addrs`` (tried in order), ``port`` and a random ``token``."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(1024)
    return server, {"host": host, "addrs": _addresses(), "port": server.getsockname()[1],
                    "token": secrets.token_hex(16)}


def _exchange(rank: int, size: int, info: Optional[Dict[str, Any]], comm: Any, timeout: float,
              generation: int = 1) -> Optional[Dict[str, Any]]:
    """Rank 0's info on every rank: through ``comm`` when given, else torchrun's agent store, else
    horovodrun's rendezvous server (under a key of this ``generation``); None when none is there."""
    if comm is not None:
        rows = comm.allgather(info if rank == 0 else None, timeout)
        return rows[0]
    env = os.environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT") and env.get("TORCHELASTIC_RUN_ID") is not None:
        import datetime

        from torch.distributed import TCPStore

        store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))
        key = (f"distmem/heartbeat/{env.get('TORCHELASTIC_RUN_ID')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
               f"/{generation}")
        if rank == 0:
            store.set(key, json.dumps(info))
            return info
        return json.loads(store.get(key))
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "")
    if addr and port.isdigit():
        return _horovod_store(rank, info, addr, int(port), timeout, generation)
    return None


#: Where rank 0 leaves its info in horovodrun's rendezvous server: a scope of distmem's own (Horovod
#: clears only the scopes of its host plan - ``global``, ``local_*``, ``cross_*`` - when its ranks
#: finish their rendezvous; the server lives for the launch, so no earlier launch's key is there).
HOROVOD_SCOPE = "distmem-heartbeat"


def _horovod_store(rank: int, info: Optional[Dict[str, Any]], addr: str, port: int, timeout: float,
                   generation: int = 1) -> Dict[str, Any]:
    """Rank 0's info through horovodrun's HTTP key-value store (``PUT``/``GET /scope/key``, 404
    until set), which serves the launch before ``hvd.init()``. Plain ``http.client``: no proxy from
    the environment may stand between a rank and its own launcher."""
    import http.client

    path = f"/{HOROVOD_SCOPE}/hub-{generation}"
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        conn = http.client.HTTPConnection(addr, port, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
        try:
            if rank == 0:
                body = json.dumps(info).encode()
                conn.request("PUT", path, body=body, headers={"Content-Length": str(len(body))})
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    assert info is not None
                    return info
                last = f"PUT answered {resp.status}"
            else:
                conn.request("GET", path)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status == 200:
                    got = json.loads(data)
                    if isinstance(got, dict) and {"addrs", "port", "token"} <= set(got):
                        return got
                    last = "an answer that is not rank 0's info"
                else:
                    last = f"GET answered {resp.status} (rank 0 has not put its info yet)"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            last = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        if time.monotonic() > deadline:
            from ..errors import GatherTimeoutError

            raise GatherTimeoutError(
                f"rank {rank} could not meet rank 0's fail-fast heartbeat through horovodrun's rendezvous server "
                f"at {addr}:{port} within {timeout:.1f} s ({last}); check that every rank runs distmem.init(), "
                "or turn fail fast off (init(fail_fast=False) or DISTMEM_FAIL_FAST=0)")
        time.sleep(0.1)


#: An exception that ends a rank waits this long (seconds) for news of a peer's death before it is
#: reported as the cause: the training communicator raises ("Connection reset by peer") when a peer
#: is gone, and the dead peer, not that consequence, is what every rank must name.
CONSEQUENCE_SECONDS = 1.0


def _excepthook(prev: Callable[..., Any]) -> Callable[..., Any]:
    def hook(tp: type, value: BaseException, tb: Any) -> None:
        hb = current()
        if hb is not None and hb.died.wait(CONSEQUENCE_SECONDS):
            time.sleep(4 * ABORT_SECONDS)  # the heartbeat's thread prints the line and ends the process
        if hb is not None:
            first = str(value).strip().splitlines()[0][:300] if str(value).strip() else ""
            hb.failed(f"failed ({tp.__name__}{': ' + first if first else ''})")
        prev(tp, value, tb)

    return hook


def start(rank: int, size: int, host: str, comm: Any = None, timeout: Optional[float] = None,
          on_death: Optional[Callable[[Death], None]] = None, verbose: bool = True) -> Optional[Heartbeat]:
    """Start this rank's heartbeat (collective over ``comm`` when given: every rank calls it). Returns
    it, or None when the job has one rank or no way to meet was found (logged)."""
    if _state["hb"] is not None:
        return _state["hb"]
    if size <= 1:
        return None
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        # Elastic Horovod carries on without a lost rank (its reset): stopping the others would undo that.
        log.info("distmem: fail fast is off under elastic Horovod (HOROVOD_ELASTIC=1), which recovers from a "
                 "lost rank itself")
        return None
    timeout = settings.timeout() if timeout is None else timeout
    server, info = rendezvous_info(host) if rank == 0 else (None, None)
    _state["meetings"] += 1
    try:
        got = _exchange(rank, size, info, comm, timeout, _state["meetings"])
    except Exception:
        if server is not None:
            server.close()
        raise
    if got is None:
        if server is not None:
            server.close()
        msg = ("fail fast is off for this job: no transport was up at init() to meet over (call hvd.init() / "
               "torch.distributed.init_process_group() before distmem.init(), or launch with mpirun and mpi4py, "
               "torchrun or horovodrun)")
        if rank == 0 and verbose:
            say(f"[distmem] {msg}", logger=log)
        else:
            log.info("distmem: %s", msg)
        return None
    # Generous: through torchrun's store rank 0 does not wait for the others at init(), and a rank
    # still importing its framework is late, not dead.
    hb = Heartbeat(rank, size, host, got, server=server, on_death=on_death).start(
        timeout, join_timeout=max(2 * SILENCE_SECONDS, timeout))
    _state["hb"] = hb
    if _state["hook"] is None:
        _state["hook"] = sys.excepthook
        sys.excepthook = _excepthook(sys.excepthook)
    return hb


def stop() -> None:
    """End this rank's heartbeat cleanly (a goodbye; tests, ``distmem.reset()``)."""
    hb = _state["hb"]
    if hb is not None:
        hb.close()
    _state["hb"] = None
    if _state["hook"] is not None:
        sys.excepthook = _state["hook"]
        _state["hook"] = None
