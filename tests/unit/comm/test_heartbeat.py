"""The fail-fast heartbeat in one process: rank 0's hub and the other ranks' connections over real
loopback sockets, each death delivered to a recorder instead of ending the process."""
from __future__ import annotations

import socket
import time
from typing import Dict, List

import pytest

from distmem.comm import heartbeat as hbm
from distmem.comm import heartbeat_meet as meet


KEY = bytes(range(32))


def hub(size: int, key: bytes = KEY, **kw):
    """Rank 0's heartbeat on loopback (as on one host), and the info the other ranks get."""
    servers = meet.listen(["127.0.0.1"])
    info = {"host": "h0", "addrs": ["127.0.0.1"], "port": servers[0].getsockname()[1]}
    return hbm.Heartbeat(0, size, "h0", info, key, servers=servers, **kw), info


class Job:
    """``size`` heartbeats of one job; ``deaths[rank]`` lists what each rank was told."""

    def __init__(self, size: int, silence: float = 30.0):
        self.deaths: Dict[int, List[hbm.Death]] = {r: [] for r in range(size)}
        first, info = hub(size, silence=silence, on_death=self.deaths[0].append)
        self.info = info
        self.beats = [first.start(5.0)]
        for r in range(1, size):
            self.beats.append(hbm.Heartbeat(r, size, f"h{r % 2}", info, KEY, silence=silence,
                                            on_death=self.deaths[r].append).start(5.0))
        time.sleep(0.3)  # every hello reached the hub

    def wait(self, ranks, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(self.deaths[r] for r in ranks):
            time.sleep(0.02)

    def close(self) -> None:
        for b in self.beats:
            b._closing = True


def _kill(hb: hbm.Heartbeat) -> None:
    """What SIGKILL does to a rank's connection: it ends, with nothing sent."""
    hb._closing = True
    hb._sock.close()


def test_a_rank_whose_connection_ends_is_named_dead_on_every_other_rank():
    job = Job(4)
    try:
        _kill(job.beats[2])
        job.wait([0, 1, 3])
        for r in (0, 1, 3):
            assert [(d.rank, d.host, d.cause) for d in job.deaths[r]] == [(2, "h0", hbm.KILLED)], r
        assert job.deaths[0][0].line() == f"distmem: rank 2 (host h0) {hbm.KILLED}; stopping this rank"
    finally:
        job.close()


def test_an_exception_is_the_cause_the_others_read():
    job = Job(3)
    try:
        job.beats[1].failed("failed (OutOfMemoryError: CUDA out of memory)")
        _kill(job.beats[1])
        job.wait([0, 2])
        assert [d.cause for d in job.deaths[2]] == ["failed (OutOfMemoryError: CUDA out of memory)"]
        assert [d.rank for d in job.deaths[0]] == [1]
    finally:
        job.close()


def test_a_clean_exit_is_no_death():
    job = Job(3)
    try:
        job.beats[1].close()
        time.sleep(1.0)
        assert job.deaths == {0: [], 1: [], 2: []}
        job.beats[0].close()  # rank 0 leaves cleanly: the others stop watching
        time.sleep(1.0)
        assert job.deaths == {0: [], 1: [], 2: []}
    finally:
        job.close()


def test_rank_0_dying_ends_every_connection():
    job = Job(3)
    try:
        hub = job.beats[0]
        hub._closing = True
        time.sleep(0.5)  # the hub's loop has stopped
        for s in list(hub._clients):
            s.close()
        for s in hub.servers:
            s.close()
        job.wait([1, 2])
        assert [(d.rank, d.cause) for d in job.deaths[1]] == [(0, hbm.KILLED)]
        assert [d.rank for d in job.deaths[2]] == [0]
    finally:
        job.close()


def test_a_silent_rank_is_declared_after_the_silence():
    job = Job(2, silence=1.5)
    try:
        job.beats[1]._closing = True  # its thread stops beating; the connection stays open
        job.wait([0], timeout=6.0)
        assert [d.rank for d in job.deaths[0]] == [1]
        assert job.deaths[0][0].cause.startswith("stopped answering (no heartbeat for 2 s")
    finally:
        job.close()


def _stranger(port: int, payload: bytes, read: bool = True) -> bytes:
    """Another process that connects, reads the challenge, sends ``payload`` and hangs up."""
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.settimeout(2)
    got = s.recv(100) if read else b""
    try:
        s.sendall(payload)
        rest = s.recv(100)
    except OSError:
        rest = b""
    s.close()
    return got + rest


@pytest.mark.parametrize("payload", [
    b'{"t": "hello", "token": "guess", "rank": 1, "host": "x"}\n',
    '{"t": "hello", "token": "\u00e9\u00e9", "rank": 1}\n'.encode(),  # compare_digest raised TypeError on it
    b"[" * 60000 + b"\n",                                                 # json.loads raised RecursionError
    b'{"t": "dead", "rank": 1}\n' * 40,
    b"\x00" * 200_000,
    hbm.trust.hello(b"x" * 32, b"0" * 16, 1, 1, b"1" * 16),                 # a well-formed hello, the wrong key
])
def test_a_stranger_is_dropped_kills_nobody_and_the_hub_still_works(payload):
    job = Job(3)
    try:
        got = _stranger(job.info["port"], payload)
        assert got.startswith(hbm.trust.MAGIC) and len(got) == hbm.trust.CHALLENGE_BYTES  # nothing but the challenge
        time.sleep(0.6)
        assert job.deaths == {0: [], 1: [], 2: []}
        assert job.beats[0]._thread.is_alive() and job.beats[0].dropped >= 1
        _kill(job.beats[2])  # the hub still watches the job
        job.wait([0, 1])
        assert [d.rank for d in job.deaths[1]] == [2]
    finally:
        job.close()


def test_idle_strangers_never_fill_the_hub_and_a_rank_still_joins():
    deaths: List[hbm.Death] = []
    first, info = hub(2, on_death=deaths.append)
    first.start(5.0)
    idle = [socket.create_connection(("127.0.0.1", info["port"]), timeout=2) for _ in range(200)]
    try:
        time.sleep(0.5)
        assert len(first._pending) <= hbm.trust.MAX_PENDING
        late = hbm.Heartbeat(1, 2, "h1", info, KEY, on_death=deaths.append).start(10.0)
        time.sleep(0.5)
        assert [c["rank"] for c in first._clients.values()] == [1] and deaths == []
        late._closing = True
    finally:
        for s in idle:
            s.close()
        first._closing = True


def test_a_rank_believes_only_the_hub_that_proves_the_key():
    # Something else listening where the rank was told rank 0's hub is (a forged store entry, a port
    # reused after rank 0 ended) sends what it wants - "dead" lines - after a challenge: never heard.
    import threading

    from distmem.errors import GatherTimeoutError

    impostor = socket.socket()
    impostor.bind(("127.0.0.1", 0))
    impostor.listen(8)

    def serve():
        while True:
            try:
                c, _ = impostor.accept()
            except OSError:
                return
            c.sendall(hbm.trust.challenge(b"n" * 16))
            c.recv(100)
            c.sendall(b"p" * 32 + b'{"t": "dead", "rank": 3, "cause": "owned"}\n')

    threading.Thread(target=serve, daemon=True).start()
    deaths: List[hbm.Death] = []
    info = {"host": "h0", "addrs": ["127.0.0.1"], "port": impostor.getsockname()[1]}
    try:
        with pytest.raises(GatherTimeoutError, match="does not hold the job's heartbeat key"):
            hbm.Heartbeat(1, 2, "h1", info, KEY, on_death=deaths.append).start(1.5)
        assert deaths == []
    finally:
        impostor.close()


def test_a_failing_rank_is_declared_at_once_with_its_text_escaped():
    job = Job(3)
    try:
        job.beats[1].failed("failed (MemoryError: out of memory \x1b]0;owned\x07\x1b[31mred)")
        job.wait([0, 2], timeout=3.0)  # no need for its connection to end (MPI's finalisation may hold it)
        line = job.deaths[2][0].line()
        assert job.deaths[2][0].rank == 1 and "\x1b" not in line and "\x07" not in line
        assert "MemoryError: out of memory \\x1b]0;owned\\x07\\x1b[31mred" in line
    finally:
        job.close()


def test_the_hub_listens_where_the_ranks_are():
    from distmem.comm import heartbeat_trust as trust

    assert trust.listen_addresses(True) == ["127.0.0.1"]
    several = trust.listen_addresses(False, env={"MASTER_ADDR": "127.0.0.1"})
    assert "0.0.0.0" not in several and "" not in several


def test_no_heartbeat_for_one_rank_and_none_without_a_meeting_place(monkeypatch):
    assert hbm.start(0, 1, "h") is None
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                "HOROVOD_GLOO_RENDEZVOUS_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert hbm.start(0, 4, "h") is None  # no transport, no launcher's store: off, and says so
    assert hbm.current() is None


def test_the_setting():
    from distmem import settings
    from distmem.errors import ConfigError

    assert settings.fail_fast({}) is True
    assert settings.fail_fast({"DISTMEM_FAIL_FAST": "0"}) is False
    with pytest.raises(ConfigError, match="DISTMEM_FAIL_FAST='maybe'"):
        settings.validate({"DISTMEM_FAIL_FAST": "maybe"})
    with pytest.raises(ConfigError, match="DISTMEM_HEARTBEAT_SECRET has 6 characters; give at least 16"):
        settings.validate({"DISTMEM_HEARTBEAT_SECRET": "secret"})
    assert settings.heartbeat_secret({"DISTMEM_HEARTBEAT_SECRET": " " + "s" * 16 + " "}) == "s" * 16


def test_without_a_usable_secret_fail_fast_is_off_for_the_job_and_says_how_to_turn_it_on(tmp_path, monkeypatch, caplog):
    import os

    for key in ("DISTMEM_HEARTBEAT_SECRET", "_HOROVOD_SECRET_KEY", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_ELASTIC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    blocked = tmp_path / "config"
    blocked.write_text("a file where the key's folder would go")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocked))
    said = []
    monkeypatch.setattr(hbm, "say", lambda msg, **kw: said.append(msg))
    assert hbm.start(0, 2, "h", verbose=True, local_size=2) is None and hbm.current() is None
    assert len(said) == 1 and "fail fast is off for this job" in said[0] and "heartbeat.key" in said[0]
    assert "torchrun's store is readable by anyone" in said[0] and "DISTMEM_HEARTBEAT_SECRET" in said[0]
    assert os.path.isfile(blocked)


def test_a_rank_that_never_connects_is_named_after_the_join_timeout():
    deaths: List[hbm.Death] = []
    first, info = hub(3, on_death=deaths.append)
    first.start(1.0)
    one = hbm.Heartbeat(1, 3, "h1", info, KEY, on_death=lambda d: None).start(5.0)
    try:
        deadline = time.monotonic() + 6
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(d.rank, d.cause.split(" (")[0]) for d in deaths] == \
            [(2, "never connected to the fail-fast heartbeat within 1 s of init()")]
    finally:
        first._closing = one._closing = True


def test_a_rank_whose_hub_has_ended_runs_on_without_fail_fast():
    # A short job: rank 0 finished (its hub closed) before a slow rank connected. The rank must not
    # wait the whole timeout and then fail its init(): nothing listens there any more.
    first, info = hub(2)
    for s in first.servers:
        s.close()
    t0 = time.monotonic()
    late = hbm.Heartbeat(1, 2, "h0", info, KEY, on_death=lambda d: None).start(30.0)
    assert time.monotonic() - t0 < hbm.HUB_GONE_SECONDS + 3 and late._sock is None and late._thread is None
    late.close()  # no goodbye to send, no error


class _StandInStore:
    """horovodrun's rendezvous server as its ranks see it (horovod/runner/http/http_server.py,
    0.28.1): ``PUT /scope/key`` stores the body, ``GET`` answers it or 404 until it is set."""

    def __init__(self):
        import http.server
        import threading

        cache: Dict[str, bytes] = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self):
                cache[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):
                value = cache.get(self.path)
                self.send_response(200 if value is not None else 404)
                self.send_header("Content-Length", str(len(value or b"")))
                self.end_headers()
                self.wfile.write(value or b"")

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(params=["stand-in", "horovod"])
def horovod_store(request):
    """A rendezvous server: the stand-in, and Horovod's own where it is installed."""
    if request.param == "horovod":
        server_mod = pytest.importorskip("horovod.runner.http.http_server")
        real = server_mod.RendezvousServer()
        port = real.start()
        yield port
        real.stop()
    else:
        store = _StandInStore()
        yield store.port
        store.stop()


def _point_at_store(monkeypatch, port: int) -> None:
    """This rank launched by horovodrun (its rendezvous server on ``port``), not by torchrun."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "HOROVOD_ELASTIC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", str(port))


@pytest.fixture
def stand_in_store(monkeypatch):
    """The stand-in rendezvous server, this rank pointed at it."""
    store = _StandInStore()
    _point_at_store(monkeypatch, store.port)
    yield store
    store.stop()


SECRET = b"s" * 32


def _signed(port: int = 4242, nonce: str = "n" * 32):
    from distmem.comm import heartbeat_trust as trust

    return trust.sign_info(SECRET, {"host": "h0", "addrs": ["127.0.0.1"], "port": port, "nonce": nonce,
                                    "fp": trust.fingerprint(SECRET)})


def test_horovodrun_ranks_meet_through_its_rendezvous_server_before_hvd_init(monkeypatch, horovod_store):
    # horovodrun --gloo with distmem.init() before hvd.init(): no transport is up yet, and the
    # launcher's own store carries rank 0's signed address (a rank that asks first waits for it).
    import threading

    _point_at_store(monkeypatch, horovod_store)
    info = _signed()
    got: Dict[int, dict] = {}
    early = threading.Thread(target=lambda: got.__setitem__(1, meet.exchange(1, 2, None, None, 10.0, secret=SECRET)))
    early.start()
    time.sleep(0.3)
    assert meet.exchange(0, 2, info, None, 10.0, secret=SECRET) == info
    early.join(10)
    assert got == {1: info}
    assert not any(len(str(v)) >= 64 and all(c in "0123456789abcdef" for c in str(v)) and k != "mac"
                   for k, v in info.items())  # no key in the store: only the address, a nonce and a MAC


def test_an_entry_not_signed_with_the_secret_is_never_believed(stand_in_store):
    # Anyone can write horovodrun's (and torchrun's) store: a forged entry - another address, the
    # old unsigned form - is waited past until rank 0's own, or the timeout.
    import http.client
    import json as _json
    import threading

    from distmem.errors import GatherTimeoutError

    forged = dict(_signed(port=1), mac="0" * 64)
    conn = http.client.HTTPConnection("127.0.0.1", stand_in_store.port, timeout=5)
    body = _json.dumps(forged).encode()
    conn.request("PUT", f"/{meet.HOROVOD_SCOPE}/hub-1", body=body, headers={"Content-Length": str(len(body))})
    conn.getresponse().read()
    with pytest.raises(GatherTimeoutError, match="not rank 0's signed info"):
        meet.exchange(1, 2, None, None, 0.6, secret=SECRET)
    got: Dict[int, dict] = {}
    waiting = threading.Thread(target=lambda: got.__setitem__(1, meet.exchange(1, 2, None, None, 10.0, secret=SECRET)))
    waiting.start()
    time.sleep(0.3)
    meet.exchange(0, 2, _signed(), None, 5.0, secret=SECRET)
    waiting.join(10)
    assert got == {1: _signed()}


def test_a_heartbeat_started_again_in_the_same_launch_never_reads_the_earlier_hubs_info(stand_in_store):
    # distmem.reset() then init() under one horovodrun: the store still holds the first hub's info.
    from distmem.errors import GatherTimeoutError

    first = _signed()
    meet.exchange(0, 2, first, None, 5.0, generation=1, secret=SECRET)
    assert meet.exchange(1, 2, None, None, 5.0, generation=1, secret=SECRET) == first
    with pytest.raises(GatherTimeoutError, match="GET answered 404"):
        meet.exchange(1, 2, None, None, 0.5, generation=2, secret=SECRET)


def test_a_rank_that_never_meets_rank_0_in_horovodruns_store_is_told_within_the_timeout(stand_in_store):
    from distmem.errors import GatherTimeoutError

    t0 = time.monotonic()
    with pytest.raises(GatherTimeoutError, match=r"horovodrun's rendezvous server at 127\.0\.0\.1:\d+ within "
                                                 r"1\.0 s \(GET answered 404"):
        meet.exchange(2, 4, None, None, 1.0, secret=SECRET)
    assert time.monotonic() - t0 < 3


def test_the_key_file_is_made_once_private_and_refused_when_others_can_read_it(tmp_path, monkeypatch):
    import os

    from distmem.comm import heartbeat_trust as trust

    monkeypatch.delenv("DISTMEM_HEARTBEAT_SECRET", raising=False)
    monkeypatch.delenv("_HOROVOD_SECRET_KEY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    held, why = trust.stored_secret()
    again, _ = trust.stored_secret()
    path = tmp_path / "distmem" / "heartbeat.key"
    assert held is not None and held == again and str(path) in held.source
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(path.parent).st_mode & 0o777 == 0o700
    os.chmod(path, 0o644)
    held, why = trust.stored_secret()
    assert held is None and "others could read it (mode 0644" in why
    monkeypatch.setenv("DISTMEM_HEARTBEAT_SECRET", "t" * 20)
    assert trust.stored_secret()[0].source == "DISTMEM_HEARTBEAT_SECRET"


def test_no_heartbeat_under_elastic_horovod(monkeypatch):
    # Elastic Horovod carries on without a lost rank: stopping the others would undo its recovery.
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert hbm.start(0, 4, "h") is None and hbm.current() is None
