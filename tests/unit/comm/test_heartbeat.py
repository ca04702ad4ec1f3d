"""The fail-fast heartbeat in one process: rank 0's hub and the other ranks' connections over real
loopback sockets, each death delivered to a recorder instead of ending the process."""
from __future__ import annotations

import socket
import time
from typing import Dict, List

import pytest

from distmem.comm import heartbeat as hbm


class Job:
    """``size`` heartbeats of one job; ``deaths[rank]`` lists what each rank was told."""

    def __init__(self, size: int, silence: float = 30.0):
        self.deaths: Dict[int, List[hbm.Death]] = {r: [] for r in range(size)}
        server, info = hbm.rendezvous_info("h0")
        self.info = info
        self.beats = [hbm.Heartbeat(0, size, "h0", info, server=server, silence=silence,
                                    on_death=self.deaths[0].append).start(5.0)]
        for r in range(1, size):
            self.beats.append(hbm.Heartbeat(r, size, f"h{r % 2}", info, silence=silence,
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
        hub.server.close()
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


def test_a_connection_without_the_token_is_dropped_and_kills_nobody():
    job = Job(2)
    try:
        s = socket.create_connection(("127.0.0.1", job.info["port"]), timeout=2)
        s.sendall(b'{"t": "hello", "token": "guess", "rank": 1, "host": "x"}\n')
        s.settimeout(2)
        assert s.recv(100) == b""  # the hub closed it
        s.close()
        s = socket.create_connection(("127.0.0.1", job.info["port"]), timeout=2)
        s.sendall(b'{"t": "dead", "rank": 1}\n')
        s.close()
        time.sleep(1.0)
        assert job.deaths == {0: [], 1: []}
    finally:
        job.close()


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


def test_a_rank_that_never_connects_is_named_after_the_join_timeout():
    deaths: List[hbm.Death] = []
    server, info = hbm.rendezvous_info("h0")
    hub = hbm.Heartbeat(0, 3, "h0", info, server=server, on_death=deaths.append).start(1.0)
    one = hbm.Heartbeat(1, 3, "h1", info, on_death=lambda d: None).start(5.0)
    try:
        deadline = time.monotonic() + 6
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(d.rank, d.cause.split(" (")[0]) for d in deaths] == \
            [(2, "never connected to the fail-fast heartbeat within 1 s of init()")]
    finally:
        hub._closing = one._closing = True


def test_a_rank_whose_hub_has_ended_runs_on_without_fail_fast():
    # A short job: rank 0 finished (its hub closed) before a slow rank connected. The rank must not
    # wait the whole timeout and then fail its init(): nothing listens there any more.
    server, info = hbm.rendezvous_info("h0")
    server.close()
    t0 = time.monotonic()
    late = hbm.Heartbeat(1, 2, "h0", info, on_death=lambda d: None).start(30.0)
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


def test_horovodrun_ranks_meet_through_its_rendezvous_server_before_hvd_init(monkeypatch, horovod_store):
    # horovodrun --gloo with distmem.init() before hvd.init(): no transport is up yet, and the
    # launcher's own store carries rank 0's info (a rank that asks first waits for it).
    import threading

    _point_at_store(monkeypatch, horovod_store)
    info = {"host": "h0", "addrs": ["10.0.0.1"], "port": 4242, "token": "t" * 32}
    got: Dict[int, dict] = {}
    early = threading.Thread(target=lambda: got.__setitem__(1, hbm._exchange(1, 2, None, None, 10.0)))
    early.start()
    time.sleep(0.3)
    assert hbm._exchange(0, 2, info, None, 10.0) == info
    early.join(10)
    assert got == {1: info}


def test_a_heartbeat_started_again_in_the_same_launch_never_reads_the_earlier_hubs_info(stand_in_store):
    # distmem.reset() then init() under one horovodrun: the store still holds the first hub's info.
    from distmem.errors import GatherTimeoutError

    first = {"host": "h0", "addrs": ["10.0.0.1"], "port": 4242, "token": "a" * 32}
    hbm._exchange(0, 2, first, None, 5.0, generation=1)
    assert hbm._exchange(1, 2, None, None, 5.0, generation=1) == first
    with pytest.raises(GatherTimeoutError, match="GET answered 404"):
        hbm._exchange(1, 2, None, None, 0.5, generation=2)


def test_a_rank_that_never_meets_rank_0_in_horovodruns_store_is_told_within_the_timeout(stand_in_store):
    from distmem.errors import GatherTimeoutError

    t0 = time.monotonic()
    with pytest.raises(GatherTimeoutError, match=r"horovodrun's rendezvous server at 127\.0\.0\.1:\d+ within "
                                                 r"1\.0 s \(GET answered 404"):
        hbm._exchange(2, 4, None, None, 1.0)
    assert time.monotonic() - t0 < 3


def test_no_heartbeat_under_elastic_horovod(monkeypatch):
    # Elastic Horovod carries on without a lost rank: stopping the others would undo its recovery.
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert hbm.start(0, 4, "h") is None and hbm.current() is None
