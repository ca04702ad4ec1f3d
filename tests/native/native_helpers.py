"""Helpers of the native-cap tests: building (the library through its CMakeLists.txt, as CI does; a
fake CUDA driver named libcuda.so.1; the capdrv programs that reach the driver the way the CUDA
runtime, XLA and directly linked programs do) and running capdrv. The fixture lives in conftest.py;
this module has its own name so that test modules never import another folder's conftest."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c")
GiB = 1024**3
MiB = 1024**2


def _run(cmd: List[str], cwd: Optional[str] = None, timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with exit code {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


def _cc() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.fail("the native-cap tests need a C compiler (cc or gcc) on PATH; install gcc")
    return cc


def build_all(base) -> "Built":
    """Builds everything into the directory ``base`` (a pathlib.Path)."""
    build_dir = str(base / "cmake")
    if shutil.which("cmake"):
        _run(["cmake", "-S", os.path.join(ROOT, "native"), "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release"])
        _run(["cmake", "--build", build_dir, "--parallel"])
    elif os.environ.get("CI"):
        pytest.fail("CI builds the native cap with CMake, which is not on PATH; install cmake >= 3.16")
    else:  # e.g. the GPU machine: the build script's direct compiler call, same sources and flags
        proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_native.sh")], capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, BUILD_DIR=build_dir))
        assert proc.returncode == 0, f"scripts/build_native.sh failed:\n{proc.stdout}\n{proc.stderr}"
    lib = os.path.join(build_dir, "libdistmem_cap.so")
    assert os.path.isfile(lib), f"the build produced no {lib}"

    cc = _cc()
    fake_dir = str(base / "fake")
    os.makedirs(fake_dir)
    flags = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]
    _run([cc, "-shared", "-fPIC", *flags, "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o",
          os.path.join(fake_dir, "libcuda.so.1"), os.path.join(C_DIR, "fake_cuda.c"), "-lpthread"])
    capdrv = os.path.join(fake_dir, "capdrv")
    _run([cc, *flags, "-o", capdrv, os.path.join(C_DIR, "capdrv.c"), "-ldl", "-lpthread"])
    capattack = os.path.join(fake_dir, "capattack")
    _run([cc, *flags, "-o", capattack, os.path.join(C_DIR, "capattack.c"), "-lpthread"])
    capdrv_link = os.path.join(fake_dir, "capdrv_link")
    _run([cc, *flags, "-DCAPDRV_LINKED", "-o", capdrv_link, os.path.join(C_DIR, "capdrv.c"),
          "-L" + fake_dir, "-l:libcuda.so.1", "-Wl,-rpath," + fake_dir, "-ldl", "-lpthread"])
    # RTLD_NEXT check: libtop's layer() finds libbase's through dlsym(RTLD_NEXT, "layer").
    _run([cc, "-shared", "-fPIC", "-O2", "-o", os.path.join(fake_dir, "libbase.so"),
          os.path.join(C_DIR, "next_base.c")])
    _run([cc, "-shared", "-fPIC", "-O2", "-o", os.path.join(fake_dir, "libtop.so"),
          os.path.join(C_DIR, "next_top.c"), "-ldl"])
    next_prog = os.path.join(fake_dir, "next_prog")
    _run([cc, "-O2", "-o", next_prog, os.path.join(C_DIR, "next_prog.c"), "-L" + fake_dir, "-Wl,--no-as-needed",
          "-ltop", "-lbase", "-Wl,-rpath," + fake_dir, "-ldl"])
    return Built(lib, fake_dir, capdrv, capdrv_link, next_prog, build_dir, capattack)


@dataclass
class Built:
    lib: str           # libdistmem_cap.so from the CMake build
    fake_dir: str      # holds libcuda.so.1 (the fake driver)
    capdrv: str        # dlopen()s libcuda.so.1
    capdrv_link: str   # linked against libcuda.so.1
    next_prog: str     # checks RTLD_NEXT through the interposed dlsym
    build_dir: str
    capattack: str     # the other local user of the security tests (links nothing of the cap)


@dataclass
class DrvResult:
    rc: int
    ops: List[Dict]
    stderr: str
    stdout: str

    def op(self, name: str, index: int = 0) -> Dict:
        found = [o for o in self.ops if o.get("op") == name]
        assert len(found) > index, f"no {name!r} result #{index} in capdrv output:\n{self.stdout}\n{self.stderr}"
        return found[index]

    def all(self, name: str) -> List[Dict]:
        return [o for o in self.ops if o.get("op") == name]


def run_capdrv(built: Built, ops: List[str], *, cap: Optional[str] = None, api: str = "runtime",
               preload: bool = True, ptds: bool = False, env: Optional[Dict[str, str]] = None,
               timeout: float = 60) -> DrvResult:
    """Runs capdrv (capdrv_link for api='link') under the cap; fails with its output on a crash."""
    prog = built.capdrv_link if api == "link" else built.capdrv
    cmd = [prog, "--api", api] + (["--ptds"] if ptds else []) + ops
    full = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP")}
    full.pop("LD_PRELOAD", None)
    full["LD_LIBRARY_PATH"] = built.fake_dir
    if preload:
        full["LD_PRELOAD"] = built.lib
    if cap is not None:
        full["DISTMEM_CAP_BYTES"] = cap
    full.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)
    ops_out = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            ops_out.append(json.loads(line))
    assert proc.returncode == 0, (f"capdrv exited with {proc.returncode} (negative: killed by that signal)\n"
                                  f"command: {' '.join(cmd)}\nstdout:\n{proc.stdout[-4000:]}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    return DrvResult(proc.returncode, ops_out, proc.stderr, proc.stdout)
