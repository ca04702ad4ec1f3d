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
long native call that holds it must not end a healthy job.

A rank that ends on an unhandled exception sends its cause first - from ``sys.excepthook``, and,
where something replaced that hook, from the interpreter's first shutdown step
(``threading``'s exit hooks, before any ``atexit`` handler: before MPI's finalisation, Horovod's
shutdown, a framework's own exit work, in which the rank may wait on the others) - and the hub
declares it at once; a rank that ends cleanly says goodbye (``atexit``) and is no death.

On a death the hub tells every rank (``dead``: rank, host, cause); each prints one line::

    distmem: rank 3 (host h) died (killed: ...); stopping this rank

(its text with every control character escaped: no rank's text drives a terminal), aborts the
job's communicators where the framework allows it (torch.distributed NCCL's abort; Horovod's
shutdown; MPI_Abort), each bounded by :data:`ABORT_SECONDS`, and leaves with :data:`EXIT_STATUS`.
Rank 0's own death ends every connection at once: the others stop the same way.

Nobody else's job: a connection proves it knows the job's key before the hub parses one byte of
it (a fixed-size challenge-response, :mod:`distmem.comm.heartbeat_trust`, which also says where the
key comes from per launcher: never from a store another user can read), at most
:data:`~distmem.comm.heartbeat_trust.MAX_PENDING` connections wait for their handshake, each at most
:data:`~distmem.comm.heartbeat_trust.HANDSHAKE_SECONDS`; after it, lines are bounded
(:data:`MAX_LINE`); the hub listens on the address the job's ranks use (loopback on one host), and
nothing a connection sends - authenticated or not - can end its thread.

Rendezvous (where the hub listens, and what proves a connection is the job's): through the job's
transport when one is up at ``init()`` (one all-gather, two on several hosts), else through the
launcher's own store before the framework's init - torchrun's agent store
(``MASTER_ADDR``/``MASTER_PORT``) before ``torch.distributed``, horovodrun's rendezvous server
(``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``) before ``hvd.init()`` - holding only the address, a
nonce and a MAC; else the heartbeat does not start and says so. Every wait is bounded by
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import settings
from ..console import say
from ..untrusted import printable
from . import heartbeat_meet as meet
from . import heartbeat_trust as trust

__all__ = ["Death", "Heartbeat", "start", "stop", "current", "EXIT_STATUS", "ABORT_SECONDS",
           "BEAT_SECONDS", "SILENCE_SECONDS", "MPI_ABORT_GRACE", "CONSEQUENCE_SECONDS", "KILLED", "MAX_LINE",
           "abort_communicators"]

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
#: The longest line an authenticated connection may send (a message is a few dozen bytes).
MAX_LINE = 4096


class _HubGone(Exception):
    """Rank 0's heartbeat no longer listens: it ended before this rank connected."""


class _NotTheHub(Exception):
    """What answered at the hub's address did not prove it holds the job's key."""


#: The cause when a connection ends without a goodbye or an exception: nothing in the process ran.
KILLED = ("died (killed: its heartbeat connection closed with no exit record - SIGKILL, the kernel's OOM "
          "killer or a crash)")


@dataclass(frozen=True)
class Death:
    """A rank that is gone: ``cause`` is what the user reads after its name."""
    rank: int
    host: str
    cause: str

    def line(self) -> str:
        return (f"distmem: rank {self.rank} (host {printable(self.host, 100)}) {printable(self.cause, 500)}; "
                "stopping this rank")

    def to_dict(self) -> Dict[str, Any]:
        return {"t": "dead", "rank": self.rank, "host": self.host, "cause": self.cause}


def _send(sock: socket.socket, msg: Dict[str, Any]) -> bool:
    try:
        sock.sendall((json.dumps(msg) + "\n").encode())
        return True
    except (OSError, ValueError):
        return False


class _Lines:
    """Newline-delimited JSON messages from one authenticated socket: each line at most
    :data:`MAX_LINE` bytes (a longer one is dropped whole), each message a JSON object or nothing."""

    def __init__(self) -> None:
        self.buf = b""
        self.skipping = False

    def feed(self, data: bytes) -> List[Dict[str, Any]]:
        self.buf += data
        out: List[Dict[str, Any]] = []
        while True:
            end = self.buf.find(b"\n")
            if end < 0:
                if len(self.buf) > MAX_LINE:
                    self.buf, self.skipping = b"", True  # the rest of an overlong line is dropped too
                return out
            line, self.buf = self.buf[:end], self.buf[end + 1:]
            if self.skipping:
                self.skipping = False
                continue
            if len(line) > MAX_LINE:
                continue
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(msg, dict):
                out.append(msg)


def _text(value: Any, limit: int) -> str:
    return printable(value if isinstance(value, str) else "?", limit)


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


class _Pending:
    """A connection the hub accepted that has not finished the handshake."""

    __slots__ = ("nonce", "buf", "deadline")

    def __init__(self, nonce: bytes, deadline: float):
        self.nonce, self.buf, self.deadline = nonce, b"", deadline


class Heartbeat:
    """One rank's side of the heartbeat: the hub on rank 0, a connection to it elsewhere.

    ``info`` is rank 0's address: ``host``, ``addrs`` (tried in order), ``port``; ``key`` the job's
    heartbeat key (:mod:`distmem.comm.heartbeat_trust`). Rank 0 passes its listening sockets
    (``servers``, :func:`listen`). ``on_death`` runs on the heartbeat's thread (default: print the
    line, abort the communicators, ``os._exit``)."""

    def __init__(self, rank: int, size: int, host: str, info: Dict[str, Any], key: bytes,
                 servers: Optional[Sequence[socket.socket]] = None, silence: Optional[float] = None,
                 on_death: Optional[Callable[[Death], None]] = None):
        self.rank, self.size, self.host = rank, size, host
        self.info, self.key = info, key
        self.silence = max(SILENCE_SECONDS, settings.timeout()) if silence is None else silence
        self.on_death = on_death or (lambda d: _stop_rank(d, os._exit))
        self.servers: List[socket.socket] = list(servers or [])
        self.death: Optional[Death] = None
        self.died = threading.Event()  #: set once a death is known (before ``on_death`` runs)
        self.dropped = 0  #: connections the hub dropped before or at the handshake (strangers, late ones)
        self._lock = threading.Lock()
        self._closing = False
        self._failed = False
        self._sock: Optional[socket.socket] = None
        self._clients: Dict[socket.socket, Dict[str, Any]] = {}
        self._pending: Dict[socket.socket, _Pending] = {}
        self._gone: Dict[int, str] = {}  # rank -> "bye" | "dead" (hub)
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ start / stop

    def start(self, timeout: float, join_timeout: Optional[float] = None) -> "Heartbeat":
        """Start the thread: a rank connects within ``timeout`` seconds; on rank 0, every other rank
        must have connected within ``join_timeout`` (default ``timeout``)."""
        self.join_timeout = timeout if join_timeout is None else join_timeout
        if self.rank == 0:
            assert self.servers
            for server in self.servers:
                server.setblocking(False)
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
            _send(self._sock, {"t": "hi", "host": self.host})
            self._thread = threading.Thread(target=self._client, name="distmem-heartbeat", daemon=True)
        self._thread.start()
        os.register_at_fork(after_in_child=self._forget_in_child)
        atexit.register(self.close)
        return self

    def _forget_in_child(self) -> None:
        # A forked child (a data loader worker) must not hold this rank's connection open after the
        # rank dies: the hub would never see it end.
        self._closing = True
        for s in [self._sock, *self.servers, *self._clients, *self._pending]:
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        """Prove this rank holds the job's key, and that the other end is rank 0's hub (the key's proof)."""
        sock.settimeout(max(0.1, min(trust.HANDSHAKE_SECONDS, deadline - time.monotonic())))
        got = _recv_exactly(sock, trust.CHALLENGE_BYTES)
        server_nonce = trust.read_challenge(got)
        if server_nonce is None:
            raise _NotTheHub("what answered is not a distmem heartbeat")
        mine = secrets.token_bytes(trust.NONCE_BYTES)
        sock.sendall(trust.hello(self.key, server_nonce, self.rank, os.getpid(), mine))
        try:
            answer = _recv_exactly(sock, trust.PROOF_BYTES)
        except ConnectionResetError:
            raise _NotTheHub("the hub refused this rank's hello: its key is not the job's (another "
                             "DISTMEM_HEARTBEAT_SECRET or key file than rank 0's?), or rank "
                             f"{self.rank} is connected already") from None
        if not trust.check_proof(self.key, mine, server_nonce, answer):
            raise _NotTheHub("what answered does not hold the job's heartbeat key")

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        addrs: List[str] = [str(a) for a in self.info["addrs"]]
        errors = []
        refused_since: Optional[float] = None
        while True:
            refused = True
            for addr in addrs:
                sock = None
                try:
                    sock = socket.create_connection((addr, int(self.info["port"])),
                                                    timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._handshake(sock, deadline)
                    sock.settimeout(2.0)
                    return sock
                except (OSError, _NotTheHub) as exc:
                    refused = refused and isinstance(exc, ConnectionRefusedError)
                    errors.append(f"{addr}: {exc}")
                    if sock is not None:
                        sock.close()
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
            for s in [*self.servers, *self._pending]:
                try:
                    s.close()
                except OSError:
                    pass
        elif self._sock is not None and not self._failed:
            _send(self._sock, {"t": "bye"})
            try:
                self._sock.close()
            except OSError:
                pass

    def failed(self, cause: str) -> None:
        """This rank ends on an exception: tell the others why, now (the hub declares it at once)."""
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

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        try:
            sel.unregister(conn)
        except (KeyError, ValueError, OSError):
            pass
        if self._pending.pop(conn, None) is not None:
            self.dropped += 1
        self._clients.pop(conn, None)
        try:
            conn.close()
        except OSError:
            pass

    def _accept(self, sel: selectors.BaseSelector, server: socket.socket, now: float) -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        if len(self._pending) >= trust.MAX_PENDING:  # the oldest waits no longer: strangers cannot fill the hub
            oldest = min(self._pending, key=lambda c: self._pending[c].deadline)
            self._drop(sel, oldest)
        nonce = secrets.token_bytes(trust.NONCE_BYTES)
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.send(trust.challenge(nonce))  # a few bytes into an empty buffer: never blocks
        except OSError:
            conn.close()
            return
        self._pending[conn] = _Pending(nonce, now + trust.HANDSHAKE_SECONDS)
        sel.register(conn, selectors.EVENT_READ, "pending")

    def _hear_pending(self, sel: selectors.BaseSelector, conn: socket.socket, joined: set) -> None:
        """Bytes of a connection in its handshake: nothing is parsed before the MAC is right."""
        p = self._pending[conn]
        try:
            data = conn.recv(trust.HELLO_BYTES - len(p.buf))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, conn)
            return
        p.buf += data
        if len(p.buf) < trust.HELLO_BYTES:
            return
        got = trust.check_hello(self.key, p.nonce, p.buf)
        rank = got[0] if got is not None else -1
        if got is None or not 1 <= rank < self.size or any(c.get("rank") == rank for c in self._clients.values()):
            self._drop(sel, conn)  # not the job's (or a rank already here): gone, and nothing else happens
            return
        try:
            conn.setblocking(True)
            conn.settimeout(2.0)
            conn.sendall(trust.proof(self.key, got[2], p.nonce))
        except OSError:
            self._drop(sel, conn)
            return
        self._pending.pop(conn)
        self._clients[conn] = {"rank": rank, "pid": got[1], "host": "?", "seen": time.monotonic(), "lines": _Lines()}
        sel.modify(conn, selectors.EVENT_READ, "client")
        joined.add(rank)

    def _hear_client(self, sel: selectors.BaseSelector, conn: socket.socket, now: float) -> Optional[Death]:
        """Messages of an authenticated rank; the death its connection's end or its ``fail`` means."""
        peer = self._clients[conn]
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if data:
            peer["seen"] = now
            for msg in peer["lines"].feed(data):
                kind = msg.get("t")
                if kind == "bye":
                    self._gone[peer["rank"]] = "bye"
                elif kind == "hi":
                    peer["host"] = _text(msg.get("host"), 100)
                elif kind == "fail":  # it ends on an exception: declared now, not when its process is gone
                    return Death(peer["rank"], peer["host"], _text(msg.get("cause"), 400) or "failed")
            return None
        self._drop(sel, conn)
        r = peer["rank"]
        if self._gone.get(r) == "bye":
            return None
        return Death(r, peer["host"], KILLED)

    def _hub(self) -> None:
        sel = selectors.DefaultSelector()
        for server in self.servers:
            sel.register(server, selectors.EVENT_READ, None)
        last_beat = 0.0
        joined: set = set()
        join_by: Optional[float] = time.monotonic() + self.join_timeout
        while not self._closing:
            try:
                events = sel.select(BEAT_SECONDS / 2)
            except (OSError, ValueError):
                return
            now = time.monotonic()
            death: Optional[Death] = None
            for key, _ in events:
                conn = key.fileobj
                try:
                    if key.data is None:
                        self._accept(sel, conn, now)  # type: ignore[arg-type]
                    elif conn in self._pending:
                        self._hear_pending(sel, conn, joined)  # type: ignore[arg-type]
                    elif conn in self._clients:
                        death = self._hear_client(sel, conn, now) or death  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001 - nothing a connection sends may end the hub
                    log.debug("distmem: heartbeat connection dropped", exc_info=True)
                    if key.data is not None:
                        self._drop(sel, conn)  # type: ignore[arg-type]
                if death is not None:
                    self._declare(death)
                    return
            for conn in [c for c, p in self._pending.items() if now > p.deadline]:
                self._drop(sel, conn)  # too slow to prove itself
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
                    _send(s, {"t": "beat"})
                    if now - peer["seen"] > self.silence and self._gone.get(peer["rank"]) != "bye":
                        self._declare(Death(peer["rank"], peer["host"],
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
                        rank = msg.get("rank")
                        self._client_death(Death(rank if isinstance(rank, int) else -1, _text(msg.get("host"), 100),
                                                 _text(msg.get("cause"), 400) or "died"))
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


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("the hub closed the connection during the handshake")
        buf += chunk
    return buf


# ---------------------------------------------------------------------- the process's heartbeat

#: ``meetings``: how many times this process has met the others through a launcher's store - the
#: key's generation, so that a heartbeat started again in the same launch (``distmem.reset()`` then
#: ``init()``) never reads the earlier hub's info; every rank starts as often (it is collective).
_state: Dict[str, Any] = {"hb": None, "hook": None, "meetings": 0, "shutdown_hook": False}


def current() -> Optional[Heartbeat]:
    """This process's heartbeat, or None when fail fast is not running."""
    return _state["hb"]


#: An exception that ends a rank waits this long (seconds) for news of a peer's death before it is
#: reported as the cause: the training communicator raises ("Connection reset by peer") when a peer
#: is gone, and the dead peer, not that consequence, is what every rank must name.
CONSEQUENCE_SECONDS = 1.0


def _cause(tp: type, value: Any) -> str:
    text = str(value).strip()
    first = text.splitlines()[0][:300] if text else ""
    return f"failed ({tp.__name__}{': ' + first if first else ''})"


def _tell_failure(tp: type, value: Any) -> None:
    """This rank ends on ``value``: the others hear it now (unless a peer's death came first: then
    that death is the cause, and this rank's heartbeat thread ends the process)."""
    hb = current()
    if hb is None or isinstance(value, SystemExit):
        return
    if hb.died.wait(CONSEQUENCE_SECONDS):
        time.sleep(4 * ABORT_SECONDS)  # the heartbeat's thread prints the line and ends the process
    hb.failed(_cause(tp, value))


def _excepthook(prev: Callable[..., Any]) -> Callable[..., Any]:
    def hook(tp: type, value: BaseException, tb: Any) -> None:
        try:
            _tell_failure(tp, value)
        finally:
            prev(tp, value, tb)

    return hook


def _at_shutdown() -> None:
    """The interpreter's first shutdown step (``threading``'s exit hooks run before every ``atexit``
    handler, so before MPI's finalisation and Horovod's shutdown): a rank that ended on an
    exception whose ``sys.excepthook`` was not ours (replaced after ``init()``) says so now.
    ``sys.last_value`` is set by the interpreter before it calls whatever hook is installed."""
    value = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    hb = current()
    if value is not None and hb is not None and not hb._failed and not hb._closing:
        _tell_failure(type(value), value)


def _install_shutdown_hook() -> None:
    if _state["shutdown_hook"]:
        return
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_at_shutdown)
        else:  # pragma: no cover - every supported Python has it
            atexit.register(_at_shutdown)
        _state["shutdown_hook"] = True
    except RuntimeError:  # the interpreter is already shutting down
        pass


def _off(rank: int, verbose: bool, msg: str) -> None:
    if rank == 0 and verbose:
        say(f"[distmem] {msg}", logger=log)
    else:
        log.info("distmem: %s", msg)


def start(rank: int, size: int, host: str, comm: Any = None, timeout: Optional[float] = None,
          on_death: Optional[Callable[[Death], None]] = None, verbose: bool = True,
          local_size: Optional[int] = None) -> Optional[Heartbeat]:
    """Start this rank's heartbeat (collective over ``comm`` when given: every rank calls it).
    ``local_size``: ranks on this host (all of them: the hub listens on loopback only). Returns it,
    or None when the job has one rank or no way to meet safely was found (said, with the remedy)."""
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
    single_host = local_size is not None and local_size >= size
    if comm is None:
        where = meet.store_kind()
        if where is None:
            _off(rank, verbose, "fail fast is off for this job: no transport was up at init() to meet over (call "
                 "hvd.init() / torch.distributed.init_process_group() before distmem.init(), or launch with mpirun "
                 "and mpi4py, torchrun or horovodrun)")
            return None
        held, why = trust.stored_secret()
        if held is None:
            _off(rank, verbose, f"fail fast is off for this job: {why}, and {where} is readable by anyone, so the "
                 "heartbeat's secret cannot go there; set DISTMEM_HEARTBEAT_SECRET to the same random text on every "
                 "rank, or call hvd.init() / torch.distributed.init_process_group() before distmem.init()")
            return None
    _state["meetings"] += 1
    servers: List[socket.socket] = []
    info: Optional[Dict[str, Any]] = None
    try:
        peers: List[str] = []
        if comm is not None and not single_host:
            # Several hosts: rank 0 listens where the routes to the others leave it (one more all-gather).
            rows = comm.allgather({"host": host, "addrs": trust.host_addresses()}, timeout)
            peers = [r["addrs"][0] for r in rows if isinstance(r, dict) and r.get("host") != host and r.get("addrs")]
        if rank == 0:
            servers = meet.listen(trust.listen_addresses(single_host, peers))
            info = {"host": host, "addrs": [s.getsockname()[0] for s in servers], "port": servers[0].getsockname()[1]}
            if comm is not None:
                info["key"] = secrets.token_hex(32)  # handed over the transport, never stored
            else:
                info["nonce"] = secrets.token_hex(16)
                info["fp"] = trust.fingerprint(held.secret)
                info = trust.sign_info(held.secret, info)
        got = meet.exchange(rank, size, info, comm, timeout, _state["meetings"], None if comm is not None else held.secret)
    except Exception:
        for s in servers:
            s.close()
        raise
    if got is None:  # the store vanished between the check and the meeting
        for s in servers:
            s.close()
        _off(rank, verbose, "fail fast is off for this job: the launcher's store could not be reached")
        return None
    key = bytes.fromhex(got["key"]) if comm is not None else trust.derive(held.secret, got["nonce"])
    # Generous: through a launcher's store rank 0 does not wait for the others at init(), and a rank
    # still importing its framework is late, not dead.
    hb = Heartbeat(rank, size, host, got, key, servers=servers, on_death=on_death).start(
        timeout, join_timeout=max(2 * SILENCE_SECONDS, timeout))
    _state["hb"] = hb
    if _state["hook"] is None:
        _state["hook"] = sys.excepthook
        sys.excepthook = _excepthook(sys.excepthook)
    _install_shutdown_hook()
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
