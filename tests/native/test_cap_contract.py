"""The native cap's side of the "nobody else's job" contract, where Python's audit hook cannot see:
its GPU-wide table in a folder another user can write (a 1777 ``DISTMEM_CAP_SHM_DIR``, as
``/dev/shm``), traced with ``strace``. Inside that folder nothing is done by path - only relative
to a folder's descriptor - every such open refuses links, every create is exclusive, and nothing is
bound (tests/contract/contract.py, ``strace_violations``). The checker is shown to fail on the calls
it must refuse."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "contract"))
import contract  # noqa: E402

from native_helpers import MiB  # noqa: E402


def test_the_caps_table_in_a_shared_folder_is_never_touched_by_name(built, tmp_path):
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    log = tmp_path / "trace.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP") and k != "LD_PRELOAD"}
    env.update(LD_LIBRARY_PATH=built.fake_dir, LD_PRELOAD=built.lib, DISTMEM_CAP_BYTES="1GiB",
               DISTMEM_CAP_GPU_BYTES="1GiB", DISTMEM_CAP_SHM_DIR=str(shm), FAKE_CUDA_UUID="gpu-contract")
    proc = subprocess.run([strace, "-f", "-qq", "-e", "trace=" + ",".join(contract.TRACED), "-o", str(log),
                           built.capdrv, "alloc", str(600 * MiB), "shared"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = log.read_text()
    assert str(shm) in text and "O_NOFOLLOW" in text, text[-3000:]  # the table was made there, and traced
    assert contract.strace_violations(text, str(shm)) == [], text[-4000:]


def test_the_checker_refuses_what_it_must():
    shm = "/dev/shm"
    bad = ['1 openat(AT_FDCWD, "/dev/shm/distmem-cap-u0/table", O_RDWR) = 4',
           '1 openat(5, "table", O_RDWR|O_CLOEXEC) = 6',
           '1 openat(5, ".tmp-1", O_RDWR|O_CREAT|O_NOFOLLOW|O_CLOEXEC, 0600) = 6',
           '1 unlink("/dev/shm/distmem-cap-u0/table") = 0',
           '1 bind(3, {sa_family=AF_INET, sin_port=htons(0), sin_addr=inet_addr("0.0.0.0")}, 16) = 0']
    good = ['1 openat(AT_FDCWD, "/dev/shm", O_RDONLY|O_DIRECTORY|O_CLOEXEC) = 3',
            '1 openat(3, "distmem-cap-u0", O_RDONLY|O_DIRECTORY|O_NOFOLLOW|O_CLOEXEC) = 4',
            '1 openat(4, ".tmp-1", O_RDWR|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC, 0600) = 5',
            '1 renameat2(4, ".tmp-1", 4, "table", RENAME_NOREPLACE) = 0',
            '1 openat(AT_FDCWD, "/lib/x86_64-linux-gnu/libc.so.6", O_RDONLY|O_CLOEXEC) = 3']
    assert len(contract.strace_violations("\n".join(bad), shm)) == len(bad)
    assert contract.strace_violations("\n".join(good), shm) == []
