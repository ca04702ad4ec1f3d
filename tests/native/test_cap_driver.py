"""libdistmem_cap.so against the fake driver: the interposition roads, the accounting, the denial,
the cuMemGetInfo rewrite, the async / VMM / managed / pitch entry points, threads, configuration.

Every capped run has an uncapped twin or a fake-side check (fakeStats: what the "device" saw), so
these tests fail if the cap stops capping, not only if it crashes."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from native_helpers import GiB, MiB, run_capdrv

APIS = ["runtime", "runtime11", "xla", "link"]

EXPORTED = {
    "dlsym", "cuGetProcAddress", "cuGetProcAddress_v2", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2",
    "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemFreeAsync",
    "cuMemFreeAsync_ptsz", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", "cuMemCreate",
    "cuMemRelease", "distmem_cap_get_stats", "distmem_cap_get_info", "distmem_cap_get_shared", "distmem_cap_spec",
    "distmem_cap_shared_error",
    "distmem_cap_config_error",
}


def test_library_exports_exactly_its_interface(built):
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is needed to list the library's exports; install binutils")
    out = subprocess.run([nm, "-D", "--defined-only", built.lib], capture_output=True, text=True, timeout=30).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert names == EXPORTED, f"unexpected: {sorted(names - EXPORTED)}; missing: {sorted(EXPORTED - names)}"
    deps = subprocess.run(["ldd", built.lib], capture_output=True, text=True, timeout=30).stdout
    assert "libcuda" not in deps, f"the cap must not link against the driver:\n{deps}"


def test_without_the_cap_the_fake_driver_grants_more(built):
    r = run_capdrv(built, ["alloc", str(600 * MiB), "alloc", str(600 * MiB), "info", "status"], preload=False)
    assert [o["rc"] for o in r.all("alloc")] == [0, 0]
    assert r.op("info")["total"] == 8 * GiB
    assert r.op("status")["loaded"] is False


@pytest.mark.parametrize("api", APIS)
def test_cap_denies_past_the_cap_on_every_road(built, api):
    r = run_capdrv(built, ["info", "alloc", str(512 * MiB), "alloc", str(600 * MiB), "info", "free",
                           "alloc", str(600 * MiB), "status", "fake", "counter", "alloc"], cap="1GiB", api=api)
    assert [o["rc"] for o in r.all("alloc")] == [0, 2, 0], r.stdout
    before, after = r.all("info")
    assert (before["total"], before["free"]) == (GiB, GiB)
    assert (after["total"], after["free"]) == (GiB, GiB - 512 * MiB)
    dev0 = r.op("status")["devices"][0]
    assert dev0["cap"] == GiB and dev0["used"] == 600 * MiB and dev0["denials"] == 1
    assert dev0["last_denied"] == 600 * MiB and dev0["live"] == 1 and dev0["total"] == 2
    fake = r.op("fake")
    assert fake["used"] == 600 * MiB and fake["peak"] <= GiB
    # The denied request never reached the driver: two real allocations, not three.
    assert r.op("counter")["value"] == 2


@pytest.mark.parametrize("api", ["runtime", "xla"])
def test_first_denial_logs_one_line_naming_cap_and_request(built, api):
    r = run_capdrv(built, ["alloc", str(900 * MiB), "alloc", str(300 * MiB), "alloc", str(400 * MiB)],
                   cap="1GiB", api=api)
    assert [o["rc"] for o in r.all("alloc")] == [0, 2, 2]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("distmem-cap:")]
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert "denied cuMemAlloc of 300.00 MiB (314572800 bytes) on GPU 0" in line
    assert "900.00 MiB of its 1.00 GiB cap in use" in line and "124.00 MiB left" in line
    assert "DISTMEM_CAP_BYTES" in line


def test_verbose_logs_load_and_every_denial(built):
    r = run_capdrv(built, ["alloc", str(2 * GiB), "alloc", str(3 * GiB)], cap="1GiB",
                   env={"DISTMEM_CAP_VERBOSE": "1"})
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("distmem-cap:")]
    assert len(lines) == 3, r.stderr
    assert "active in pid" in lines[0] and "1.00 GiB" in lines[0]


def test_info_untouched_without_a_cap(built):
    r = run_capdrv(built, ["alloc", str(GiB), "info", "status"])
    assert r.op("info")["total"] == 8 * GiB and r.op("info")["free"] == 7 * GiB
    dev0 = r.op("status")["devices"][0]
    assert dev0["cap"] == 2**64 - 1 and dev0["used"] == GiB  # counted, not capped


def test_info_reports_the_smaller_of_device_and_cap(built):
    # A cap above the device: the device's own figures.
    r = run_capdrv(built, ["info"], cap="4GiB", env={"FAKE_CUDA_TOTAL": str(GiB)})
    assert (r.op("info")["total"], r.op("info")["free"]) == (GiB, GiB)
    # Memory the cap did not see (an unwrapped legacy allocation standing in for another tenant)
    # leaves the device with less free than the cap would allow: the device's free figure wins.
    r = run_capdrv(built, ["legacy", str(400 * MiB), "info"], cap="900MiB", env={"FAKE_CUDA_TOTAL": str(GiB)})
    assert r.op("legacy")["rc"] == 0
    assert (r.op("info")["total"], r.op("info")["free"]) == (900 * MiB, GiB - 400 * MiB)


@pytest.mark.parametrize("api", ["runtime", "xla"])
@pytest.mark.parametrize("ptds", [False, True], ids=["legacy-stream", "per-thread-stream"])
def test_async_and_pool_paths(built, api, ptds):
    r = run_capdrv(built, ["async", str(600 * MiB), "pool", str(600 * MiB), "freeasync", "pool", str(600 * MiB),
                           "async", str(600 * MiB), "freeasync", "freeasync", "status", "fake",
                           "counter", "async_ptsz", "counter", "pool_ptsz", "counter", "free_async_ptsz",
                           "counter", "async", "counter", "pool", "counter", "free_async"],
                   cap="1GiB", api=api, ptds=ptds)
    rcs = [(o["op"], o["rc"]) for o in r.ops if o["op"] in ("async", "pool", "freeasync")]
    assert rcs == [("async", 0), ("pool", 2), ("freeasync", 0), ("pool", 0), ("async", 2), ("freeasync", 0),
                   ("freeasync", -1)], r.stdout
    dev0 = r.op("status")["devices"][0]
    assert dev0["used"] == 0 and dev0["denials"] == 2 and dev0["peak"] == 600 * MiB
    assert r.op("fake")["used"] == 0 and r.op("fake")["peak"] <= GiB
    counters = {o["name"]: o["value"] for o in r.all("counter")}
    # The wrapper forwards to the variant the caller asked for: _ptsz only with the per-thread flag.
    hit, miss = (("async_ptsz", "pool_ptsz", "free_async_ptsz"), ("async", "pool", "free_async"))
    if not ptds:
        hit, miss = miss, hit
    assert all(counters[name] >= 1 for name in hit), counters
    assert all(counters[name] == 0 for name in miss), counters


@pytest.mark.parametrize("api", ["runtime", "xla", "link"])
def test_vmm_create_release(built, api):
    r = run_capdrv(built, ["create", str(600 * MiB), "create", str(600 * MiB), "release", "create", str(600 * MiB),
                           "hostcreate", str(4 * GiB), "status", "fake", "release", "release", "status", "fake"],
                   cap="1GiB", api=api)
    creates = [(o["op"], o["rc"]) for o in r.ops if o["op"] in ("create", "hostcreate", "release")]
    # Host allocations are not device memory: neither counted nor refused.
    assert creates == [("create", 0), ("create", 2), ("release", 0), ("create", 0), ("hostcreate", 0),
                       ("release", 0), ("release", 0)], r.stdout
    s1, s2 = r.all("status")
    assert s1["devices"][0]["used"] == 600 * MiB and s1["devices"][0]["live"] == 1
    assert s2["devices"][0]["used"] == 0 and s2["devices"][0]["live"] == 0
    assert r.all("fake")[0]["peak"] <= GiB


def test_vmm_charges_the_device_named_in_the_allocation_properties(built):
    r = run_capdrv(built, ["create", str(512 * MiB), "1", "create", str(200 * MiB), "1", "create", str(512 * MiB),
                           "0", "status"], cap="0:1GiB,1:256MiB")
    assert [o["rc"] for o in r.all("create")] == [2, 0, 0]
    d0, d1 = r.op("status")["devices"]
    assert (d0["used"], d1["used"]) == (512 * MiB, 200 * MiB)
    assert (d0["cap"], d1["cap"]) == (GiB, 256 * MiB)


@pytest.mark.parametrize("api", ["runtime", "xla", "link"])
def test_managed(built, api):
    r = run_capdrv(built, ["managed", str(700 * MiB), "managed", str(700 * MiB), "status"], cap="1GiB", api=api)
    assert [o["rc"] for o in r.all("managed")] == [0, 2]


def test_pitch_charges_the_padded_size(built):
    # The fake pads rows to 512 bytes: 1000 x 1000 takes 1024 x 1000 = 1,024,000 bytes.
    r = run_capdrv(built, ["pitch", "1000", "1000", "status", "free", "pitch", "1000", "1048", "status", "fake"],
                   cap=str(1048576))
    first, second = r.all("pitch")
    assert first["rc"] == 0 and first["pitch"] == 1024
    assert r.all("status")[0]["devices"][0]["used"] == 1024 * 1000
    # 1000 x 1048 = 1,048,000 fits the 1 MiB cap, but the padded 1,073,152 does not: the driver's
    # allocation is given back and the call refused.
    assert second["rc"] == 2
    assert r.all("status")[1]["devices"][0]["used"] == 0
    assert r.op("fake")["used"] == 0 and r.op("fake")["live"] == 0


def test_threads_never_push_the_device_past_the_cap(built):
    cap = 8 * MiB
    # Each thread keeps 4 allocations of 1-3 MiB live: alone it may need 9 MiB, all 16 need ~128 MiB.
    r = run_capdrv(built, ["threads", "16", "4000", str(MiB), "4", "status", "fake"], cap=str(cap), timeout=120)
    t = r.op("threads")
    assert t["other"] == 0, r.stdout
    assert t["ok"] + t["denied"] == 16 * 4000
    assert t["denied"] > 0 and t["ok"] > 0, "16 threads of 1-3 MiB under an 8 MiB cap must contend"
    dev0 = r.op("status")["devices"][0]
    assert dev0["used"] == 0 and dev0["live"] == 0 and dev0["denials"] == t["denied"]
    assert dev0["peak"] <= cap
    fake = r.op("fake")
    assert fake["used"] == 0 and fake["live"] == 0
    assert fake["peak"] <= cap, f"the device saw {fake['peak']} bytes at once under a {cap}-byte cap"


def test_threads_without_the_cap_go_past_it(built):
    # The twin of the test above: the same load, uncapped, exceeds 8 MiB, so the capped run's peak
    # is the cap's doing.
    r = run_capdrv(built, ["threads", "16", "4000", str(MiB), "4", "fake"], timeout=120)
    assert r.op("threads")["denied"] == 0
    assert r.op("fake")["peak"] > 8 * MiB, r.stdout


def test_threads_with_room_see_no_denial(built):
    r = run_capdrv(built, ["threads", "8", "2000", str(MiB), "2", "status"], cap=str(8 * 2 * 3 * MiB), timeout=120)
    assert r.op("threads")["denied"] == 0 and r.op("threads")["other"] == 0
    assert r.op("status")["devices"][0]["used"] == 0


def test_per_device_caps_follow_the_current_device(built):
    r = run_capdrv(built, ["dev", "1", "alloc", str(300 * MiB), "info", "dev", "0", "alloc", str(300 * MiB), "info",
                           "status"], cap="0:1GiB,1:256MiB")
    assert [o["rc"] for o in r.all("alloc")] == [2, 0]
    assert r.all("info")[0]["total"] == 256 * MiB and r.all("info")[1]["total"] == GiB
    d0, d1 = r.op("status")["devices"]
    assert d0["used"] == 300 * MiB and d1["denials"] == 1


def test_star_sets_the_default_and_unlisted_devices_are_uncapped(built):
    r = run_capdrv(built, ["status"], cap="1:1GiB,*:2GiB")
    d0, d1 = r.op("status")["devices"]
    assert (d0["cap"], d1["cap"]) == (2 * GiB, GiB)
    r = run_capdrv(built, ["dev", "1", "alloc", str(3 * GiB), "status"], cap="0:1GiB")
    assert r.op("alloc")["rc"] == 0
    assert r.op("status")["devices"][1]["cap"] == 2**64 - 1


@pytest.mark.parametrize("spec,expected", [
    ("1073741824", GiB), ("1GiB", GiB), ("1.5GiB", 3 * GiB // 2), ("10 GB", 10 * 10**9), ("512mib", 512 * MiB),
    ("2048KiB", 2 * MiB), (" 0:1GiB ", GiB), ("0", 0),
])
def test_sizes_are_read_like_distmem_units(built, spec, expected):
    r = run_capdrv(built, ["status"], cap=spec)
    assert r.op("status")["devices"][0]["cap"] == expected


@pytest.mark.parametrize("spec", ["10QB", "abc", "1GiB,,", "99:1GiB", "-1", "0:", "1GiB 2GiB"])
def test_a_malformed_cap_fails_closed_and_says_why(built, spec):
    r = run_capdrv(built, ["alloc", "1048576", "status"], cap=spec)
    assert r.op("alloc")["rc"] == 2, f"{spec!r} must deny, not pass"
    assert re.search(r"DISTMEM_CAP_BYTES=.* is invalid", r.stderr), r.stderr
    assert "will be denied" in r.stderr


def test_a_free_the_driver_refuses_changes_nothing(built):
    r = run_capdrv(built, ["alloc", str(MiB), "badfree", "status"], cap="1GiB")
    assert r.op("badfree")["rc"] == 1  # the fake's CUDA_ERROR_INVALID_VALUE, passed through
    assert r.op("status")["devices"][0]["used"] == MiB


def test_an_address_reused_after_an_unseen_free_is_not_charged_twice(built):
    # reset = the context destroyed: the driver forgets every allocation, the cap sees no free.
    r = run_capdrv(built, ["alloc", str(600 * MiB), "reset", "alloc", str(600 * MiB), "status"], cap="2GiB")
    assert [o["rc"] for o in r.all("alloc")] == [0, 0]
    dev0 = r.op("status")["devices"][0]
    assert dev0["used"] == 600 * MiB and dev0["live"] == 1


def test_legacy_32bit_entry_points_are_left_alone(built):
    r = run_capdrv(built, ["gpa_status", "cuMemAlloc", "2000", "gpa_status", "cuMemAlloc", "3020",
                           "gpa_status", "cuGetProcAddress", "11030", "gpa_status", "cuGetProcAddress", "12000",
                           "gpa_status", "cuCtxGetDevice", "2000", "gpa_status", "cuNoSuchThing", "12000"],
                   cap="1GiB")
    where = {(o["name"], i): o for i, o in enumerate(r.all("gpa_status"))}
    rows = r.all("gpa_status")
    assert rows[0]["from"].endswith("libcuda.so.1")      # v1 cuMemAlloc (32-bit): not wrapped
    assert rows[1]["from"].endswith("libdistmem_cap.so")  # cuMemAlloc_v2: wrapped
    assert rows[2]["from"].endswith("libdistmem_cap.so") and rows[3]["from"].endswith("libdistmem_cap.so")
    assert rows[4]["from"].endswith("libcuda.so.1")      # not an allocation function
    assert rows[5]["rc"] == 500 and rows[5]["status"] == 1, where  # driver's answer passed through


def test_dlsym_keeps_rtld_next_relative_to_the_caller(built):
    import os
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    base = subprocess.run([built.next_prog], capture_output=True, text=True, timeout=30, env=env)
    capped = subprocess.run([built.next_prog], capture_output=True, text=True, timeout=30,
                            env=dict(env, LD_PRELOAD=built.lib, DISTMEM_CAP_BYTES="1GiB"))
    assert base.returncode == 0 and capped.returncode == 0, (base.stderr, capped.stderr)
    assert base.stdout == capped.stdout, f"without the cap: {base.stdout}\nwith it: {capped.stdout}"
    assert '"layer":11' in capped.stdout and '"missing_null":true' in capped.stdout
    assert '"dlerror_set":true' in capped.stdout and '"printf_found":true' in capped.stdout


def test_c_dlsym_fallback_works_even_unoptimised(built, tmp_path):
    """The C dlsym (every architecture but x86-64) in a Debug build: RTLD_NEXT and the cap still hold."""
    import os
    from native_helpers import ROOT, _run
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake to build the C-fallback variant")
    build = str(tmp_path / "cfallback")
    _run(["cmake", "-S", os.path.join(ROOT, "native"), "-B", build, "-DCMAKE_BUILD_TYPE=Debug",
          "-DDISTMEM_CAP_FORCE_C_DLSYM=ON"])
    _run(["cmake", "--build", build])
    lib = os.path.join(build, "libdistmem_cap.so")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([built.next_prog], capture_output=True, text=True, timeout=30,
                         env=dict(env, LD_PRELOAD=lib)).stdout
    assert '"layer":11' in out, out
    from dataclasses import replace
    r = run_capdrv(replace(built, lib=lib), ["alloc", str(600 * MiB), "alloc", str(600 * MiB)], cap="1GiB", api="xla")
    assert [o["rc"] for o in r.all("alloc")] == [0, 2]


def _find_cudart():
    import glob
    import os
    import site
    import sys
    if os.environ.get("DISTMEM_TEST_CUDART"):
        return os.environ["DISTMEM_TEST_CUDART"]
    roots = list(sys.path) + site.getsitepackages() + [site.getusersitepackages()]
    for root in roots:
        for pattern in ("nvidia/cuda_runtime/lib/libcudart.so.*", "nvidia/cu*/lib/libcudart.so.*"):
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return found[-1]
    return None


def test_the_real_cuda_runtime_takes_the_wrappers(built):
    """The NVIDIA CUDA runtime binary (pip: nvidia-cuda-runtime-cu12, or DISTMEM_TEST_CUDART=path)
    over the fake driver: it cannot initialise there, but its driver lookups must already come back
    as the cap's wrappers: one dlsym for cuGetProcAddress, then cuGetProcAddress itself and the 11
    allocation entry points through it."""
    import json
    import os
    import sys
    from native_helpers import ROOT
    cudart = _find_cudart()
    if not cudart:
        pytest.skip("no libcudart here (pip install nvidia-cuda-runtime-cu12, or set DISTMEM_TEST_CUDART)")
    code = ("import ctypes, json; rt = ctypes.CDLL(%r); n = ctypes.c_int(); rc = rt.cudaGetDeviceCount(ctypes.byref(n));"
            " from distmem.apply import native; print(json.dumps({'rc': rc, 'status': native.status()}))" % cudart)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP")}
    env.update(LD_PRELOAD=built.lib, DISTMEM_CAP_BYTES="1GiB", LD_LIBRARY_PATH=built.fake_dir, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout.strip().splitlines()[-1])["status"]
    assert st["active"]
    assert st["lookups"]["dlsym"] >= 1 and st["lookups"]["cuGetProcAddress"] >= 13, st["lookups"]
