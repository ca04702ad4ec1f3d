"""Where the fail-fast heartbeat's ranks meet (:mod:`distmem.comm.heartbeat`): rank 0's listening
sockets, and rank 0's address (with the job's key, over a transport) handed to every rank - through
the job's transport when one is up at ``init()``, else through the launcher's own store
(torchrun's TCPStore, horovodrun's HTTP rendezvous server), where only an entry signed with the
job's secret (:mod:`distmem.comm.heartbeat_trust`) is believed. Every wait is bounded."""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

from ..untrusted import printable
from . import heartbeat_trust as trust

__all__ = ["listen", "exchange", "store_kind", "HOROVOD_SCOPE"]


def listen(addresses: Sequence[str]) -> List[socket.socket]:
    """Rank 0's listening sockets: one per address (a port the kernel picks on the first, the same
    port on the others where it is free), never on every interface."""
    out: List[socket.socket] = []
    port = 0
    for addr in addresses:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((addr, port))
            server.listen(128)
        except OSError:
            server.close()
            if not out:
                raise
            continue
        port = server.getsockname()[1]
        out.append(server)
    return out


def exchange(rank: int, size: int, info: Optional[Dict[str, Any]], comm: Any, timeout: float,
              generation: int = 1, secret: Optional[bytes] = None) -> Optional[Dict[str, Any]]:
    """Rank 0's info on every rank: through ``comm`` when given, else torchrun's agent store, else
    horovodrun's rendezvous server (under a key of this ``generation``; only an entry signed with
    ``secret`` is believed); None when none is there."""
    if comm is not None:
        rows = comm.allgather(info if rank == 0 else None, timeout)
        return rows[0]
    env = os.environ
    assert secret is not None
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT") and env.get("TORCHELASTIC_RUN_ID") is not None:
        return _torch_store(rank, info, timeout, generation, secret)
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "")
    if addr and port.isdigit():
        return _horovod_store(rank, info, addr, int(port), timeout, generation, secret)
    return None


def store_kind(env: Any = None) -> Optional[str]:
    """The launcher's store this rank can meet the others through before a transport is up."""
    env = os.environ if env is None else env
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT") and env.get("TORCHELASTIC_RUN_ID") is not None:
        return "torchrun's store"
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") and env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "").isdigit():
        return "horovodrun's rendezvous server"
    return None


def _believed(got: Any, secret: bytes) -> Optional[Dict[str, Any]]:
    """Rank 0's info when ``got`` is signed with the secret; None for anything else (someone else's)."""
    if trust.check_info(secret, got) and isinstance(got.get("addrs"), list) and isinstance(got.get("port"), int) \
            and isinstance(got.get("nonce"), str):
        return got
    return None


def _unbelieved(got: Any, secret: bytes) -> str:
    if isinstance(got, dict) and got.get("fp") and got.get("fp") != trust.fingerprint(secret):
        return (f"an entry signed with another secret (fingerprint {printable(got.get('fp'), 16)}, this rank's "
                f"{trust.fingerprint(secret)}: rank 0's key file is not this rank's - homes not shared? - or someone "
                "else wrote it)")
    return "an entry that is not rank 0's signed info"


def _torch_store(rank: int, info: Optional[Dict[str, Any]], timeout: float, generation: int,
                 secret: bytes) -> Dict[str, Any]:
    """Rank 0's signed info through torchrun's agent store (``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``)."""
    import datetime

    from torch.distributed import TCPStore

    env = os.environ
    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout))
    key = (f"distmem/heartbeat/{env.get('TORCHELASTIC_RUN_ID')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
           f"/{generation}")
    if rank == 0:
        assert info is not None
        store.set(key, json.dumps(info))
        return info
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            got = json.loads(store.get(key))
        except (ValueError, RecursionError):
            got = None
        mine = _believed(got, secret)
        if mine is not None:
            return mine
        last = _unbelieved(got, secret)
        if time.monotonic() > deadline:
            from ..errors import GatherTimeoutError

            raise GatherTimeoutError(
                f"rank {rank} could not meet rank 0's fail-fast heartbeat through torchrun's store within "
                f"{timeout:.1f} s ({last}); give every rank the same DISTMEM_HEARTBEAT_SECRET, or turn fail fast "
                "off (init(fail_fast=False) or DISTMEM_FAIL_FAST=0)")
        time.sleep(0.2)


#: Where rank 0 leaves its info in horovodrun's rendezvous server: a scope of distmem's own (Horovod
#: clears only the scopes of its host plan - ``global``, ``local_*``, ``cross_*`` - when its ranks
#: finish their rendezvous; the server lives for the launch, so no earlier launch's key is there).
HOROVOD_SCOPE = "distmem-heartbeat"


def _horovod_store(rank: int, info: Optional[Dict[str, Any]], addr: str, port: int, timeout: float,
                   generation: int = 1, secret: Optional[bytes] = None) -> Dict[str, Any]:
    """Rank 0's signed info through horovodrun's HTTP key-value store (``PUT``/``GET /scope/key``,
    404 until set), which serves the launch before ``hvd.init()``. Plain ``http.client``: no proxy
    from the environment may stand between a rank and its own launcher. An entry not signed with
    ``secret`` is someone else's: waited past, never used."""
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
                data = resp.read(1 << 16)
                if resp.status == 200:
                    try:
                        got = json.loads(data)
                    except (ValueError, RecursionError):
                        got = None
                    mine = _believed(got, secret) if secret is not None else None
                    if mine is not None:
                        return mine
                    last = _unbelieved(got, secret) if secret is not None else "no secret to check it with"
                else:
                    last = f"GET answered {resp.status} (rank 0 has not put its info yet)"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            last = f"{type(exc).__name__}: {printable(exc, 200)}"
        finally:
            conn.close()
        if time.monotonic() > deadline:
            from ..errors import GatherTimeoutError

            raise GatherTimeoutError(
                f"rank {rank} could not meet rank 0's fail-fast heartbeat through horovodrun's rendezvous server "
                f"at {addr}:{port} within {timeout:.1f} s ({last}); check that every rank runs distmem.init() with "
                "the same DISTMEM_HEARTBEAT_SECRET (or key file), or turn fail fast off (init(fail_fast=False) or "
                "DISTMEM_FAIL_FAST=0)")
        time.sleep(0.1)
