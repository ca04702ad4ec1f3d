"""The optional GPU-wide budget (DISTMEM_CAP_GPU_BYTES): several capped processes on one (fake) GPU
share it through a table in the user's own folder under DISTMEM_CAP_SHM_DIR; dead and zombie
processes give their share back; the last one out removes the table; a budget that cannot be
enforced denies (fails closed). Other users are tests/native/test_cap_security.py's business."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import time

from native_helpers import GiB, MiB, run_capdrv

TABLE_BYTES = 128 + 512 * 16


def _tables(shm):
    d = os.path.join(str(shm), f"distmem-cap-u{os.geteuid()}")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _env(built, shm, budget="1GiB", uuid="gpu-a", cap="1GiB"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP") and k != "LD_PRELOAD"}
    env.update(LD_LIBRARY_PATH=built.fake_dir, LD_PRELOAD=built.lib, DISTMEM_CAP_BYTES=cap,
               DISTMEM_CAP_SHM_DIR=str(shm), FAKE_CUDA_UUID=uuid)
    if budget is not None:
        env["DISTMEM_CAP_GPU_BYTES"] = budget
    return env


def _start(built, env, ops):
    return subprocess.Popen([built.capdrv, *ops], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    ops = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, ops, err


def _allocs(ops):
    return [o["rc"] for o in ops if o["op"] == "alloc"]


def test_two_processes_share_one_budget(built, tmp_path):
    a_ready, b_done = tmp_path / "a", tmp_path / "b"
    env = _env(built, tmp_path)
    a = _start(built, env, ["alloc", str(600 * MiB), "touch", str(a_ready), "waitfile", str(b_done), "shared"])
    try:
        b = _start(built, env, ["waitfile", str(a_ready), "alloc", str(600 * MiB), "alloc", str(300 * MiB), "shared",
                                "touch", str(b_done)])
        rc_b, ops_b, err_b = _finish(b)
    finally:
        rc_a, ops_a, err_a = _finish(a)
    assert rc_a == 0 and rc_b == 0, (err_a, err_b)
    assert _allocs(ops_a) == [0]
    # Each process is within its own 1 GiB cap; together they would hold 1.2 GiB of a 1 GiB budget.
    assert _allocs(ops_b) == [2, 0], ops_b
    shared = [o for o in ops_b if o["op"] == "shared"][0]
    assert shared == {"op": "shared", "budget": GiB, "used": 900 * MiB, "processes": 2, "active": 1}
    assert "GPU-wide budget (DISTMEM_CAP_GPU_BYTES)" in err_b and "600.00 MiB of its 1.00 GiB" in err_b
    assert _tables(tmp_path) == [], "the last process out removes the table"


def test_without_a_budget_processes_do_not_interact(built, tmp_path):
    a_ready, b_done = tmp_path / "a", tmp_path / "b"
    env = _env(built, tmp_path, budget=None)
    a = _start(built, env, ["alloc", str(600 * MiB), "touch", str(a_ready), "waitfile", str(b_done)])
    try:
        b = _start(built, env, ["waitfile", str(a_ready), "alloc", str(600 * MiB), "shared", "touch", str(b_done)])
        rc_b, ops_b, err_b = _finish(b)
    finally:
        _finish(a)
    assert _allocs(ops_b) == [0], err_b
    assert [o for o in ops_b if o["op"] == "shared"][0]["budget"] == 2**64 - 1
    assert not list(tmp_path.glob("distmem-cap-*")), "no budget, no shared table"


def test_other_gpus_have_their_own_table(built, tmp_path):
    a_ready, b_ready, done = tmp_path / "a", tmp_path / "b", tmp_path / "done"
    a = _start(built, _env(built, tmp_path, uuid="gpu-a"),
               ["alloc", str(600 * MiB), "touch", str(a_ready), "waitfile", str(done)])
    try:
        b = _start(built, _env(built, tmp_path, uuid="gpu-b"),
                   ["waitfile", str(a_ready), "alloc", str(600 * MiB), "touch", str(b_ready), "waitfile", str(done)])
        deadline = time.time() + 30
        while not b_ready.exists() and time.time() < deadline and b.poll() is None:
            time.sleep(0.02)
        held = _tables(tmp_path)
        done.touch()
        _, ops_b, err_b = _finish(b)
    finally:
        done.touch()
        _finish(a)
    assert _allocs(ops_b) == [0], err_b
    assert len(held) == 2 and all(n.startswith("distmem-cap-v2-") for n in held), held


def test_the_table_is_private_complete_and_removed_by_the_last_process(built, tmp_path):
    ready, done = tmp_path / "ready", tmp_path / "done"
    a = _start(built, _env(built, tmp_path), ["alloc", str(100 * MiB), "touch", str(ready), "waitfile", str(done)])
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline and a.poll() is None:
            time.sleep(0.02)
        folder = tmp_path / f"distmem-cap-u{os.geteuid()}"
        d, (name,) = os.lstat(folder), _tables(tmp_path)
        t = os.lstat(folder / name)
    finally:
        done.touch()
        rc, _, err = _finish(a)
    assert rc == 0, err
    assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.geteuid()
    assert stat.S_ISREG(t.st_mode) and stat.S_IMODE(t.st_mode) == 0o600 and t.st_size == TABLE_BYTES
    assert _tables(tmp_path) == [], "the last process out removed the table"


def test_a_killed_process_leaves_the_table_to_the_next(built, tmp_path):
    env = _env(built, tmp_path)
    killed = subprocess.run([built.capdrv, "alloc", str(600 * MiB), "die"], env=env, capture_output=True, timeout=60)
    assert killed.returncode == -9
    assert len(_tables(tmp_path)) == 1, "no exit handler ran: the table stays, its slot's lock went with the process"
    r = run_capdrv(built, ["alloc", str(900 * MiB), "shared"], cap="1GiB",
                   env={"DISTMEM_CAP_GPU_BYTES": "1GiB", "DISTMEM_CAP_SHM_DIR": str(tmp_path), "FAKE_CUDA_UUID": "gpu-a"})
    assert r.op("alloc")["rc"] == 0 and r.op("shared")["processes"] == 1, r.stderr
    assert _tables(tmp_path) == []


def test_processes_racing_get_exactly_what_fits(built, tmp_path):
    """Sixteen processes create the table and reserve at once: 10 x 100 MiB fit in 1 GiB, and exactly
    10 get it (no over-grant, and no spurious denial from the lock-free reservation)."""
    go, done = tmp_path / "go", tmp_path / "done"
    env = _env(built, tmp_path)
    procs = [_start(built, env, ["waitfile", str(go), "alloc", str(100 * MiB), "touch", str(tmp_path / f"r{i}"),
                                 "waitfile", str(done)]) for i in range(16)]
    try:
        go.touch()
        deadline = time.time() + 60
        while len(list(tmp_path.glob("r*"))) < 16 and time.time() < deadline:
            time.sleep(0.02)
    finally:
        done.touch()
        results = [_finish(p) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
    granted = sum(_allocs(ops).count(0) for _, ops, _ in results)
    assert granted == 10, f"{granted} of 16 x 100 MiB granted under a 1 GiB budget"


def test_slots_of_dead_processes_are_reused(built, tmp_path):
    """More processes than the table has slots die holding memory: the next ones take their slots."""
    ready, done = tmp_path / "ready", tmp_path / "done"
    env = _env(built, tmp_path, budget="100GiB", cap="100GiB")
    holder = _start(built, env, ["alloc", str(MiB), "touch", str(ready), "waitfile", str(done)])
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.02)
        loop = f"for i in $(seq 530); do '{built.capdrv}' alloc {MiB} die 2>/dev/null; done; '{built.capdrv}' alloc {MiB} shared"
        out = subprocess.run(["/bin/sh", "-c", loop], env=env, capture_output=True, text=True, timeout=300)
    finally:
        done.touch()
        _finish(holder)
    last = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")][-2:]
    assert last[0] == {"op": "alloc", "bytes": MiB, "rc": 0}, out.stderr[-2000:]
    assert last[1]["processes"] == 2 and "slots" not in out.stderr, (last, out.stderr[-2000:])


def test_a_killed_process_gives_its_share_back(built, tmp_path):
    env = _env(built, tmp_path)
    victim = subprocess.run([built.capdrv, "alloc", str(600 * MiB), "die"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert victim.returncode == -9, victim
    r = run_capdrv(built, ["alloc", str(600 * MiB), "shared"], cap="1GiB",
                   env={"DISTMEM_CAP_GPU_BYTES": "1GiB", "DISTMEM_CAP_SHM_DIR": str(tmp_path), "FAKE_CUDA_UUID": "gpu-a"})
    assert r.op("alloc")["rc"] == 0, r.stderr
    assert r.op("shared")["used"] == 600 * MiB and r.op("shared")["processes"] == 1


def test_a_zombie_holds_nothing(built, tmp_path):
    env = _env(built, tmp_path)
    done = tmp_path / "done"
    z = subprocess.Popen([built.capdrv, "alloc", str(600 * MiB), "touch", str(done)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while not done.exists() and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # exited, not reaped: a zombie keeps its pid and /proc entry
        r = run_capdrv(built, ["alloc", str(600 * MiB)], cap="1GiB",
                       env={"DISTMEM_CAP_GPU_BYTES": "1GiB", "DISTMEM_CAP_SHM_DIR": str(tmp_path),
                            "FAKE_CUDA_UUID": "gpu-a"})
        assert r.op("alloc")["rc"] == 0, r.stderr
    finally:
        z.wait(timeout=30)


def test_a_malformed_budget_fails_closed(built, tmp_path):
    """A budget asked for and unreadable is not "no budget": every allocation is denied, saying why."""
    for spec in ("most of it", "18446744073709551615"):
        r = run_capdrv(built, ["alloc", str(MiB), "alloc", str(MiB)], cap="1GiB",
                       env={"DISTMEM_CAP_GPU_BYTES": spec, "DISTMEM_CAP_SHM_DIR": str(tmp_path)})
        assert _allocs(r.ops) == [2, 2], (spec, r.stderr)
        assert f"DISTMEM_CAP_GPU_BYTES={spec} is invalid" in r.stderr and "cannot be enforced" in r.stderr


def test_an_unusable_table_directory_fails_closed_and_says_so_once(built, tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    r = run_capdrv(built, ["alloc", str(100 * MiB), "alloc", str(100 * MiB), "alloc", str(900 * MiB)], cap="1GiB",
                   env={"DISTMEM_CAP_GPU_BYTES": "1GiB", "DISTMEM_CAP_SHM_DIR": str(missing)})
    assert _allocs(r.ops) == [2, 2, 2]
    lines = [ln for ln in r.stderr.splitlines() if "cannot be enforced" in ln]
    assert len(lines) == 1 and str(missing) in lines[0], r.stderr


def test_a_base_folder_anyone_can_rename_in_is_refused(built, tmp_path):
    base = tmp_path / "open"
    base.mkdir()
    os.chmod(base, 0o777)  # world-writable without the sticky bit: others could swap the user's folder
    r = run_capdrv(built, ["alloc", str(MiB)], cap="1GiB",
                   env={"DISTMEM_CAP_GPU_BYTES": "1GiB", "DISTMEM_CAP_SHM_DIR": str(base)})
    assert _allocs(r.ops) == [2] and "not sticky" in r.stderr, r.stderr


def test_status_shows_the_budget(built, tmp_path):
    import sys
    from native_helpers import ROOT
    code = ("import ctypes, json; from distmem.apply import native; c = ctypes.CDLL('libcuda.so.1'); p = ctypes.c_ulonglong();"
            f" c.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t({256 * MiB})); print(json.dumps(native.status()))")
    env = _env(built, tmp_path)
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout.strip().splitlines()[-1])
    assert st["gpu_budget"] == {"budget_bytes": GiB, "used_bytes": 256 * MiB, "processes": 1, "joined": True,
                                "error": None}


def test_status_says_why_a_budget_cannot_be_enforced(built, tmp_path):
    import sys
    from native_helpers import ROOT
    (tmp_path / f"distmem-cap-u{os.geteuid()}").mkdir(mode=0o755)
    os.chmod(tmp_path / f"distmem-cap-u{os.geteuid()}", 0o755)
    code = ("import ctypes, json; from distmem.apply import native; c = ctypes.CDLL('libcuda.so.1'); p = ctypes.c_ulonglong();"
            f" rc = c.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t({MiB})); print(json.dumps([rc, native.status()]))")
    env = _env(built, tmp_path)
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    rc, st = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 2 and st["gpu_budget"]["joined"] is False
    assert "has mode 0755" in st["gpu_budget"]["error"], st["gpu_budget"]


def _gpu_peak(path):
    import struct
    with open(path, "rb") as f:
        data = f.read(128)
    return struct.unpack("<16Q", data)[8]


def _hammer(built, tmp_path, budget):
    """4 processes x 8 threads, each keeping up to 8 allocations of 4-12 MiB live (up to 768 MiB a
    process), on one fake GPU that counts across processes; returns its peak and the threads' tallies."""
    gpu = tmp_path / "gpu"
    gpu.write_bytes(b"\0" * 128)
    go = tmp_path / "go"
    env = _env(built, tmp_path, budget=budget, cap="1GiB")
    env["FAKE_CUDA_SHARED"] = str(gpu)
    procs = [_start(built, env, ["waitfile", str(go), "threads", "8", "4000", str(4 * MiB), "8"]) for _ in range(4)]
    time.sleep(0.2)
    go.touch()
    results = [_finish(p, timeout=120) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err[-2000:] for _, _, err in results]
    threads = [o for _, ops, _ in results for o in ops if o["op"] == "threads"]
    return _gpu_peak(gpu), threads


def test_racing_processes_never_hold_more_than_the_budget(built, tmp_path):
    peak, threads = _hammer(built, tmp_path, "64MiB")
    assert all(t["other"] == 0 for t in threads), threads
    assert sum(t["denied"] for t in threads) > 0 and sum(t["ok"] for t in threads) > 0, threads
    assert peak <= 64 * MiB, f"the GPU held {peak / MiB:.0f} MiB at once under a 64 MiB GPU-wide budget"
    assert _tables(tmp_path) == []
    r = run_capdrv(built, ["alloc", str(64 * MiB), "shared"], cap="64MiB",
                   env={"DISTMEM_CAP_GPU_BYTES": "64MiB", "DISTMEM_CAP_SHM_DIR": str(tmp_path), "FAKE_CUDA_UUID": "gpu-a"})
    assert r.op("alloc")["rc"] == 0, "bytes were lost in the races: the whole budget is free again"


def test_racing_processes_without_a_budget_go_past_it(built, tmp_path):
    """The twin: the same load without a budget holds more than 64 MiB at once, so the test above
    measures the budget, not a light load."""
    peak, _ = _hammer(built, tmp_path, None)
    assert peak > 64 * MiB, peak
