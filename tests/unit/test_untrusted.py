"""distmem.untrusted within one process (the cross-user cases are tests/security): reads that never
follow a link, never block on a FIFO, stay bounded and take only this user's files from a folder
others can write; writes through the descriptor that detect a swapped temporary file; private
folders; text that never drives a terminal."""
from __future__ import annotations

import os
import stat
import threading

import pytest

from distmem import untrusted
from distmem.errors import ConfigError

NOBODY = 65534


@pytest.fixture
def shared(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    return folder


def test_a_read_refuses_links_fifos_and_large_files(shared):
    target = shared / "real.json"
    target.write_text('{"a": 1}')
    (shared / "link.json").symlink_to(target)
    os.mkfifo(shared / "fifo.json")
    (shared / "big.json").write_bytes(b" " * 2048)
    assert untrusted.read_json(str(target), max_bytes=100) == {"a": 1}
    with pytest.raises(untrusted.Unsafe, match="symbolic link"):
        untrusted.read_bytes(str(shared / "link.json"), max_bytes=100)
    with pytest.raises(untrusted.Unsafe, match="not a regular file"):  # and it returned: O_NONBLOCK
        untrusted.read_bytes(str(shared / "fifo.json"), max_bytes=100)
    with pytest.raises(untrusted.Unsafe, match="2048 bytes, more than the 1024"):
        untrusted.read_bytes(str(shared / "big.json"), max_bytes=1024)
    with pytest.raises(ConfigError, match="not JSON"):
        (shared / "deep.json").write_text("[" * 100_000)
        untrusted.read_json(str(shared / "deep.json"), max_bytes=1 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_file_is_taken_only_from_a_folder_nobody_else_writes(shared, tmp_path):
    planted = shared / "report.json"
    planted.write_text("{}")
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(untrusted.Unsafe, match=r"belongs to uid 65534.*folder another user can write"):
        untrusted.read_bytes(str(planted), max_bytes=100)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "report.json").write_text("{}")
    os.chown(theirs / "report.json", NOBODY, NOBODY)
    assert untrusted.read_bytes(str(theirs / "report.json"), max_bytes=100) == b"{}"  # only root and we write there
    other = shared / "oom"
    other.mkdir()
    os.chown(other, NOBODY, NOBODY)
    with pytest.raises(untrusted.Unsafe, match="nothing in it is taken as this user's"):
        with untrusted.folder(str(other)):
            pass


def test_a_write_goes_through_its_descriptor_and_a_swapped_file_is_refused(shared, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("SECRET\n")
    os.chmod(secret, 0o600)
    path = shared / "job.prom"
    with pytest.raises(untrusted.Unsafe, match="replaced before it took its name"):
        with untrusted.atomic_file(str(path), ".prom") as f:
            tmp = [n for n in os.listdir(shared) if n.endswith(".prom.tmp")][0]
            os.unlink(shared / tmp)
            os.symlink(secret, shared / tmp)  # what another user does in a folder without the sticky bit
            f.write(b"metrics\n")
    assert secret.read_text() == "SECRET\n" and stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert not path.exists()  # the swapped link was not moved to the final name either
    leftover = [n for n in os.listdir(shared) if n.startswith(".distmem-")]
    assert [os.path.islink(shared / n) for n in leftover] == [True]  # only the other user's link: never ours to remove
    os.unlink(shared / leftover[0])
    untrusted.write_atomic(str(path), "metrics\n", ".prom", mode=0o644)
    assert path.read_text() == "metrics\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [n for n in os.listdir(shared) if n.startswith(".distmem-")] == []


def test_a_private_folder_is_made_0700_and_another_users_is_refused(tmp_path):
    with untrusted.private_folder(str(tmp_path / "a" / "b")) as f:
        assert stat.S_IMODE(os.fstat(f.fd).st_mode) == 0o700
        f.write("x.json", b"{}")
        assert f.create_once("key", b"one") and not f.create_once("key", b"two")
        assert f.read("key", max_bytes=10) == b"one"
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(untrusted.Unsafe, match="symbolic link"):
        with untrusted.private_folder(str(tmp_path / "link")):
            pass


def test_racing_creators_agree_on_one_value(tmp_path):
    got = []

    def make(i):
        with untrusted.private_folder(str(tmp_path / "keys")) as f:
            f.create_once("key", f"value-{i}".encode())
            got.append(f.read("key", max_bytes=100))

    threads = [threading.Thread(target=make, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1


def test_text_never_drives_a_terminal():
    assert untrusted.printable("ok \x1b]0;title\x07 \u202e") == "ok \\x1b]0;title\\x07 \\u202e"
    assert untrusted.printable("a" * 500, 10) == "a" * 10
