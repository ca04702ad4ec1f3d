"""Who may speak on the fail-fast heartbeat, and where it listens (:mod:`distmem.comm.heartbeat`).

**The secret.** Every connection to rank 0's hub proves it knows the job's heartbeat key before a
single byte of it is parsed, and the hub proves the same back; the key is never put where another
user can read it. Where it comes from, per launcher (the first that applies):

1. **the job's transport**, when one is up at ``init()`` (mpirun or srun with mpi4py; Horovod or
   torch.distributed initialised before ``distmem.init()``): rank 0 draws a random key and hands
   it to every rank in the same all-gather that carries the hub's address - from process to
   process of the job, never stored;
2. ``DISTMEM_HEARTBEAT_SECRET``, when the user sets it (the same on every rank: a job script's
   ``export``; the environment of a process is readable only by its user);
3. **the launcher's own secret**, where it hands one to its workers: Horovod's Spark runner sets
   ``_HOROVOD_SECRET_KEY`` (horovodrun 0.28.1 itself does not: its workers get none);
4. **this user's key file**, ``$XDG_CONFIG_HOME/distmem/heartbeat.key`` (default
   ``~/.config/distmem``): 32 random bytes made on first use, 0600 in a 0700 folder, read with the
   checks of :mod:`distmem.untrusted` and refused when others could read it. Every rank of one host
   reads the same file; ranks on several hosts need a shared home (else set
   ``DISTMEM_HEARTBEAT_SECRET``).

With 2-4, rank 0's address goes through the launcher's store (torchrun's TCPStore, horovodrun's
HTTP key-value store), which anyone may read or write: what it holds is the address, a random
nonce and a MAC over them - the key itself is derived (HMAC of the secret and the nonce) and
never leaves the ranks, and a rank believes an entry only when its MAC is right (a forged one is
waited past). Without any of them, fail fast is off for the job, with one line saying why and how
to turn it on.

**The handshake** is fixed-size and checked before anything is parsed: the hub sends a challenge
(:data:`MAGIC` and a random nonce); the rank answers with its rank, pid, its own nonce and an
HMAC-SHA256 of all of it under the key (:func:`hello`); the hub answers with an HMAC of both nonces
(:func:`proof`), so that a rank believes only rank 0's hub. A connection that does not complete the
handshake within :data:`HANDSHAKE_SECONDS`, or sends anything else, is dropped; at most
:data:`MAX_PENDING` unauthenticated connections are held (the oldest goes first).

**Where the hub listens**: every rank on one host - the loopback address only; several hosts - the
address of the interface that routes to the other hosts (learnt over the transport where one is
up), else to the launcher's address (``MASTER_ADDR``, horovodrun's rendezvous address, mpirun's or
srun's launch address), never every interface.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import settings, untrusted

__all__ = ["MAGIC", "NONCE_BYTES", "MAC_BYTES", "CHALLENGE_BYTES", "HELLO_BYTES", "PROOF_BYTES", "HANDSHAKE_SECONDS",
           "MAX_PENDING", "StoredSecret", "challenge", "read_challenge", "hello", "check_hello", "proof", "check_proof",
           "stored_secret", "derive", "sign_info", "check_info", "fingerprint", "key_file", "listen_addresses",
           "host_addresses", "route_source"]

#: The hub's first bytes on every connection: what this is, and which version of the handshake.
MAGIC = b"distmem-hb/1\n"
NONCE_BYTES = 16
MAC_BYTES = 32
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
#: A rank's hello: rank (4 bytes), pid (4 bytes), its nonce, the MAC.
HELLO_BYTES = 4 + 4 + NONCE_BYTES + MAC_BYTES
PROOF_BYTES = MAC_BYTES
#: A connection must finish the handshake within this many seconds of being accepted.
HANDSHAKE_SECONDS = 5.0
#: At most this many connections that have not finished the handshake are held (the oldest is dropped).
MAX_PENDING = 32
_KEY_FILE = "heartbeat.key"
_KEY_BYTES = 32


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def challenge(server_nonce: bytes) -> bytes:
    return MAGIC + server_nonce


def read_challenge(data: bytes) -> Optional[bytes]:
    """The hub's nonce, or None when ``data`` is not a heartbeat hub's challenge."""
    if len(data) != CHALLENGE_BYTES or not data.startswith(MAGIC):
        return None
    return data[len(MAGIC):]


def hello(key: bytes, server_nonce: bytes, rank: int, pid: int, client_nonce: bytes) -> bytes:
    head = struct.pack(">II", rank, pid & 0xFFFFFFFF) + client_nonce
    return head + _mac(key, b"hello", server_nonce, head)


def check_hello(key: bytes, server_nonce: bytes, data: bytes) -> Optional[Tuple[int, int, bytes]]:
    """``(rank, pid, client nonce)`` of a hello made with ``key`` for this challenge, else None."""
    if len(data) != HELLO_BYTES:
        return None
    head, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, b"hello", server_nonce, head)):
        return None
    rank, pid = struct.unpack(">II", head[:8])
    return rank, pid, head[8:]


def proof(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(key, b"hub", client_nonce, server_nonce)


def check_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, data: bytes) -> bool:
    return len(data) == PROOF_BYTES and hmac.compare_digest(data, proof(key, client_nonce, server_nonce))


# ---------------------------------------------------------------------- the secret without a transport

@dataclass(frozen=True)
class StoredSecret:
    """A secret every rank holds without talking to the others: its bytes and where it came from."""
    secret: bytes
    source: str


def derive(secret: bytes, nonce: str) -> bytes:
    """The heartbeat key of one hub: HMAC of the secret and the hub's random nonce."""
    return _mac(secret, b"distmem heartbeat key ", nonce.encode())


def fingerprint(secret: bytes) -> str:
    """A short name of the secret that gives nothing of it away (said when two ranks' differ)."""
    return _mac(secret, b"distmem heartbeat fingerprint").hex()[:12]


def _canonical(info: Dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in info.items() if k != "mac"}, sort_keys=True, separators=(",", ":")).encode()


def sign_info(secret: bytes, info: Dict[str, Any]) -> Dict[str, Any]:
    """``info`` with its MAC under ``secret`` (what rank 0 puts in the launcher's store)."""
    return dict(info, mac=_mac(secret, b"distmem heartbeat info ", _canonical(info)).hex())


def check_info(secret: bytes, info: Any) -> bool:
    """True when ``info`` is a hub's info signed with ``secret`` (anything else is someone else's)."""
    if not isinstance(info, dict) or not isinstance(info.get("mac"), str):
        return False
    try:
        want = _mac(secret, b"distmem heartbeat info ", _canonical(info)).hex()
    except (TypeError, ValueError):
        return False
    return hmac.compare_digest(info["mac"], want)


def key_file(env: Optional[Mapping[str, str]] = None) -> str:
    """This user's heartbeat key file: ``$XDG_CONFIG_HOME/distmem/heartbeat.key`` (default
    ``~/.config/distmem/heartbeat.key``)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or ""
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "distmem", _KEY_FILE)


def _read_key_file(path: str) -> bytes:
    """The key in ``path`` (made on first use), read with the checks of :mod:`distmem.untrusted`;
    :class:`distmem.untrusted.Unsafe` or OSError saying why it cannot be used."""
    import stat

    folder = os.path.dirname(path)
    with untrusted.private_folder(folder) as f:
        try:
            data = f.read(_KEY_FILE, max_bytes=1024, what="the heartbeat key file")
        except FileNotFoundError:
            f.create_once(_KEY_FILE, secrets.token_hex(_KEY_BYTES).encode() + b"\n", mode=0o600)
            data = f.read(_KEY_FILE, max_bytes=1024, what="the heartbeat key file")
        st = os.stat(_KEY_FILE, dir_fd=f.fd, follow_symlinks=False)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise untrusted.Unsafe(path, f"others could read it (mode {stat.S_IMODE(st.st_mode):04o}, owner "
                                         f"{untrusted.owner_name(st.st_uid)})", "chmod 600 it, or remove it")
    text = data.decode("ascii", errors="replace").strip()
    if len(text) < 32:
        raise untrusted.Unsafe(path, f"it holds {len(text)} characters, fewer than the 32 a key has",
                               "remove it (distmem makes a new one)")
    return text.encode()


def stored_secret(env: Optional[Mapping[str, str]] = None) -> Tuple[Optional[StoredSecret], str]:
    """The secret a rank holds without a transport (the module docstring's 2-4), or None and why not."""
    env = os.environ if env is None else env
    given = settings.heartbeat_secret(env)
    if given is not None:
        return StoredSecret(given.encode(), "DISTMEM_HEARTBEAT_SECRET"), ""
    if env.get("_HOROVOD_SECRET_KEY"):
        try:
            from horovod.runner.common.util import codec  # the launcher's own encoding of its key

            key = codec.loads_base64(env["_HOROVOD_SECRET_KEY"])
            if isinstance(key, bytes) and len(key) >= 16:
                return StoredSecret(key, "Horovod's launcher secret (_HOROVOD_SECRET_KEY)"), ""
        except Exception:  # noqa: BLE001 - not a key we can read: the next source
            pass
    path = key_file(env)
    try:
        return StoredSecret(_read_key_file(path), f"this user's key file {path}"), ""
    except (OSError, ValueError) as exc:
        why = untrusted.printable(exc, 300) if isinstance(exc, ValueError) else f"{path}: {exc.strerror or exc}"
        return None, f"this user's heartbeat key file cannot be used ({why})"


# ---------------------------------------------------------------------- where to listen

def route_source(peer: str) -> Optional[str]:
    """This host's address on the route towards ``peer`` (nothing is sent), None when there is none."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((peer, 1))
        return probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()


def _launcher_addresses(env: Mapping[str, str]) -> List[str]:
    """The launcher's addresses every host of the job reaches: torchrun's ``MASTER_ADDR``,
    horovodrun's rendezvous address, srun's launch node, mpirun's (from its URI)."""
    out = [env.get(k, "") for k in ("MASTER_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "SLURM_LAUNCH_NODE_IPADDR")]
    uri = env.get("OMPI_MCA_orte_hnp_uri") or env.get("PMIX_SERVER_URI2") or ""
    for part in uri.split(";")[1:]:  # "jobid;tcp://10.0.0.1,172.17.0.1:port"
        addrs = part.split("://", 1)[-1].rsplit(":", 1)[0]
        out += addrs.split(",")
    return [a.strip("[]") for a in out if a]


def host_addresses(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """This host's addresses the other hosts may reach it at (for rank 0 to pick its route): the
    source of the route towards the launcher, then the host name's addresses; loopback left out."""
    env = os.environ if env is None else env
    out = [route_source(a) for a in _launcher_addresses(env)]
    try:
        out += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    seen: List[str] = []
    for a in out:
        if a and not a.startswith("127.") and a not in seen:
            seen.append(a)
    return seen


def listen_addresses(single_host: bool, peers: Sequence[str] = (),
                     env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Where rank 0's hub listens: the loopback address when every rank is on its host; else the
    source of the route towards each other host (``peers``: one address of each, where the
    transport told them), or towards the launcher; the default route's as the last resort."""
    if single_host:
        return ["127.0.0.1"]
    env = os.environ if env is None else env
    out: List[str] = []
    for peer in list(peers) or _launcher_addresses(env):
        src = route_source(peer)
        if src and not src.startswith("127.") and src not in out:
            out.append(src)
    if not out:
        src = route_source("10.255.255.255")  # the default route (nothing is sent)
        out = [src] if src else []
    return out or ["127.0.0.1"]
