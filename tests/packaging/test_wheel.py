"""The wheel a user gets from ``pip wheel .``: built from a clean copy of the tree (the files git
knows, nothing built), installed into a fresh virtual environment that sees none of the development
environment (only the wheel's declared requirements are made importable there), and used from there: ``distmem-exec --cap`` preloads the wheel's own
``libdistmem_cap.so`` against the fake CUDA driver of tests/native and denies past the cap, and
``distmem doctor`` runs. Every subprocess has a timeout."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C_DIR = os.path.join(ROOT, "tests", "native", "c")
LIB_IN_WHEEL = "distmem/_native/libdistmem_cap.so"
MiB = 1024**2
GiB = 1024**3

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the native cap is Linux only")


def _run(cmd: List[str], *, timeout: float, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def _clean_env(**extra: str) -> Dict[str, str]:
    """The user's shell: no PYTHONPATH into the clone, no preload or cap settings of the test run."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTMEM_", "PYTHON")) and k not in ("LD_PRELOAD", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def copy_clean_tree(dest: str) -> None:
    """Copies the files git tracks or would track (untracked but not ignored), as a fresh clone has
    them: no build/, no distmem/_native/*.so, no egg-info."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, timeout=60)
    for rel in filter(None, listed.stdout.split("\0")):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):  # deleted in the working tree, not yet committed
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))
    assert not os.path.exists(os.path.join(dest, LIB_IN_WHEEL)), "the clean copy must not carry a built cap"


def declared_requirements(wheel: str) -> List[str]:
    """The distribution names the wheel requires without extras (Requires-Dist lines of METADATA)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    names = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            names.append(re.match(r"[A-Za-z0-9_.\-]+", line.split(":", 1)[1].strip()).group(0))
    return names


def provide(names: List[str], folder: str, site: str) -> None:
    """Makes exactly these distributions of this environment importable in the fresh venv (links in a
    folder named by a .pth file): what the wheel declares, and nothing else, is there."""
    os.makedirs(folder)
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"the wheel requires {name}, which this test environment lacks; install it here")
        tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = os.path.join(str(dist.locate_file("")), top)
            if top.endswith((".dist-info", ".egg-info")) or top == "__pycache__" or not os.path.exists(src):
                continue
            dest = os.path.join(folder, top)
            if not os.path.exists(dest):
                os.symlink(src, dest)
    with open(os.path.join(site, "_distmem_test_requirements.pth"), "w") as f:
        f.write(folder + "\n")


@dataclass
class Installed:
    wheel: str
    venv: str
    python: str
    bin: str
    site: str
    fake_dir: str
    capdrv: str
    work: str


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    src, wheels, venv, fake = (str(base / n) for n in ("src", "wheels", "venv", "fake"))
    copy_clean_tree(src)
    # --no-build-isolation: the build uses this environment's setuptools/wheel (no download); the
    # build step itself (cmake or cc) is what is under test.
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps", "--no-build-isolation",
          "-w", wheels, src], timeout=600, env=_clean_env(PATH=os.environ.get("PATH", "")))
    found = [f for f in os.listdir(wheels) if f.startswith("distmem-") and f.endswith(".whl")]
    assert len(found) == 1, f"expected one distmem wheel in {wheels}, found {os.listdir(wheels)}"
    wheel = os.path.join(wheels, found[0])

    # A fresh environment that sees nothing of this one (no system site-packages: the editable
    # install of the clone must not answer `import distmem`); pip of this environment installs into it.
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    python = os.path.join(venv, "bin", "python")
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install", "--no-deps",
          "--no-index", wheel], timeout=300, env=_clean_env())
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"], timeout=60,
                env=_clean_env()).stdout.strip()
    # No index here: the declared requirements come from this environment (exactly those), so an
    # import of anything undeclared fails as it would for a user.
    provide(declared_requirements(wheel), str(base / "requirements"), site)

    # The fake driver and the allocation driver program, as tests/native builds them.
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.fail("the wheel test needs a C compiler (cc or gcc) on PATH for the fake driver; install gcc")
    os.makedirs(fake)
    _run([cc, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o",
          os.path.join(fake, "libcuda.so.1"), os.path.join(C_DIR, "fake_cuda.c"), "-lpthread"], timeout=120)
    capdrv = os.path.join(fake, "capdrv")
    _run([cc, "-O2", "-o", capdrv, os.path.join(C_DIR, "capdrv.c"), "-ldl", "-lpthread"], timeout=120)
    work = str(base / "work")  # a working directory outside the clone
    os.makedirs(work)
    return Installed(wheel, venv, python, os.path.join(venv, "bin"), site, fake, capdrv, work)


def test_the_wheel_ships_the_cap_and_is_tagged_for_the_platform(installed):
    with zipfile.ZipFile(installed.wheel) as zf:
        names = zf.namelist()
        wheel_meta = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        lib = zf.getinfo(LIB_IN_WHEEL) if LIB_IN_WHEEL in names else None
        assert lib is not None, (f"{os.path.basename(installed.wheel)} has no {LIB_IN_WHEEL}: a pip-installed "
                                 f"distmem has no native cap. Native files in it: "
                                 f"{[n for n in names if '_native' in n or n.endswith('.so')]}")
        assert zf.read(LIB_IN_WHEEL)[:4] == b"\x7fELF"
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert "Root-Is-Purelib: false" in wheel_meta, wheel_meta
    assert f"Tag: py3-none-{plat}" in wheel_meta, wheel_meta
    assert os.path.basename(installed.wheel).endswith(f"-py3-none-{plat}.whl")


def test_the_installed_package_finds_its_own_library(installed):
    out = _run([installed.python, "-c", "import json, distmem; from distmem.apply import native; "
                "print(json.dumps([distmem.__file__, native.library_path()]))"],
               timeout=120, cwd=installed.work, env=_clean_env()).stdout
    module, lib = json.loads(out.strip().splitlines()[-1])
    assert module.startswith(installed.site), f"distmem imported from {module}, not from the fresh venv"
    assert lib == os.path.join(installed.site, LIB_IN_WHEEL)


def test_distmem_exec_from_the_venv_caps_the_fake_driver(installed):
    exe = os.path.join(installed.bin, "distmem-exec")
    assert os.path.isfile(exe), f"the wheel installed no distmem-exec into {installed.bin}"
    env = _clean_env(LD_LIBRARY_PATH=installed.fake_dir, DISTMEM_QUIET="1")
    proc = _run([exe, "--cap", "1GiB", "--", installed.capdrv, "--api", "runtime", "alloc", str(600 * MiB),
                 "alloc", str(600 * MiB), "status"], timeout=120, cwd=installed.work, env=env)
    ops = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [o["rc"] for o in ops if o["op"] == "alloc"] == [0, 2], proc.stdout + proc.stderr
    status = next(o for o in ops if o["op"] == "status")
    assert status["loaded"] is True
    dev0 = status["devices"][0]
    assert dev0["cap"] == GiB and dev0["used"] == 600 * MiB and dev0["denials"] == 1
    assert "denied cuMemAlloc of 600.00 MiB" in proc.stderr, proc.stderr

    # The preloaded library is the wheel's, seen from Python inside the capped process.
    proc = _run([exe, "--cap", "1GiB", "--", installed.python, "-c",
                 "import json; from distmem.apply import native; print(json.dumps(native.status()))"],
                timeout=120, cwd=installed.work, env=env)
    st = json.loads(proc.stdout.strip().splitlines()[-1])
    assert st["active"] is True and st["cap_bytes"] == GiB, st
    assert st["library"] == os.path.join(installed.site, LIB_IN_WHEEL), st


def test_distmem_doctor_from_the_venv(installed):
    proc = _run([os.path.join(installed.bin, "distmem"), "doctor", "--json", "--no-horovod-probe",
                 "--fleet", "2x16GiB"], timeout=120, cwd=installed.work, env=_clean_env(), check=False)
    assert proc.returncode == 0, f"distmem doctor exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    start = proc.stdout.index("{")
    report = json.loads(proc.stdout[start:])
    assert report, proc.stdout
