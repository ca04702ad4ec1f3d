"""The optional GPU-wide budget (DISTMEM_CAP_GPU_BYTES): several capped processes on one (fake) GPU
share it through a table in DISTMEM_CAP_SHM_DIR; dead and zombie processes give their share back."""
from __future__ import annotations

import json
import os
import subprocess
import time

from native_helpers import GiB, MiB, run_capdrv


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
    assert len(list(tmp_path.glob("distmem-cap-*"))) == 1


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
    a_ready, b_done = tmp_path / "a", tmp_path / "b"
    a = _start(built, _env(built, tmp_path, uuid="gpu-a"),
               ["alloc", str(600 * MiB), "touch", str(a_ready), "waitfile", str(b_done)])
    try:
        b = _start(built, _env(built, tmp_path, uuid="gpu-b"),
                   ["waitfile", str(a_ready), "alloc", str(600 * MiB), "touch", str(b_done)])
        _, ops_b, err_b = _finish(b)
    finally:
        _finish(a)
    assert _allocs(ops_b) == [0], err_b
    assert len(list(tmp_path.glob("distmem-cap-*"))) == 2


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


def test_a_malformed_budget_leaves_the_own_cap_in_force(built, tmp_path):
    r = run_capdrv(built, ["alloc", str(600 * MiB), "alloc", str(600 * MiB), "shared"], cap="1GiB",
                   env={"DISTMEM_CAP_GPU_BYTES": "most of it", "DISTMEM_CAP_SHM_DIR": str(tmp_path)})
    assert _allocs(r.ops) == [0, 2]
    assert "DISTMEM_CAP_GPU_BYTES=most of it is invalid" in r.stderr
    assert r.op("shared")["budget"] == 2**64 - 1


def test_an_unusable_table_directory_is_reported_once(built, tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    r = run_capdrv(built, ["alloc", str(100 * MiB), "alloc", str(100 * MiB), "alloc", str(900 * MiB)], cap="1GiB",
                   env={"DISTMEM_CAP_GPU_BYTES": "1GiB", "DISTMEM_CAP_SHM_DIR": str(missing)})
    assert _allocs(r.ops) == [0, 0, 2]  # the process's own cap still holds
    lines = [ln for ln in r.stderr.splitlines() if "GPU-wide budget off" in ln]
    assert len(lines) == 1 and str(missing) in lines[0], r.stderr


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
    assert st["gpu_budget"] == {"budget_bytes": GiB, "used_bytes": 256 * MiB, "processes": 1, "joined": True}
