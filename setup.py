"""distmem: planned, enforced and observed GPU memory for distributed training.

Building a wheel (``pip wheel .``, ``pip install .``) also compiles the native hard cap
(``native/`` -> ``distmem/_native/libdistmem_cap.so``) through ``scripts/build_native.sh``, the same
CMake build or compiler line that ``make native`` uses, and ships it in the wheel, which is therefore
tagged for this platform (``py3-none-<platform>``: the library is plain C and loads into any Python).

    DISTMEM_NATIVE=0 pip wheel .     build without the cap (pure-Python wheel, no compiler needed)

An editable install (``pip install -e .``, used by scripts/env.sh) compiles nothing: it uses the
tree's ``distmem/_native/`` as it is, which ``make native`` (scripts/build_native.sh) fills.
"""
import os
import re
import subprocess
import sys

from setuptools import Distribution, find_namespace_packages, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 carries bdist_wheel; older ones take it from the wheel package
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - depends on the installed setuptools
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # neither: an sdist or editable build still works, with setuptools' own commands
        bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = "libdistmem_cap.so"


def _version() -> str:
    with open(os.path.join(HERE, "distmem", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _readme() -> str:
    path = os.path.join(HERE, "README.md")
    return open(path, encoding="utf-8").read() if os.path.exists(path) else ""


def _native_wanted() -> bool:
    value = os.environ.get("DISTMEM_NATIVE", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise SystemExit(f"DISTMEM_NATIVE={value!r} is not a switch: use DISTMEM_NATIVE=1 (build the native cap, "
                         "the default) or DISTMEM_NATIVE=0 (a wheel without it)")
    return value not in ("0", "false", "no", "off") and sys.platform.startswith("linux")


class BuildPyWithCap(build_py):
    """build_py, then the native cap compiled into the build tree's ``distmem/_native/``."""

    def run(self) -> None:
        super().run()
        if self.editable_mode or not _native_wanted():
            return
        dest = os.path.join(os.path.abspath(self.build_lib), "distmem", "_native")
        temp = os.path.join(os.path.abspath(self.get_finalized_command("build").build_temp), "native")
        script = os.path.join(HERE, "scripts", "build_native.sh")
        env = dict(os.environ, BUILD_DIR=temp, DEST_DIR=dest)
        # Bounded: a configure or compile that stalls must fail the build, not hang pip.
        try:
            proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"building the native cap ({script}) did not finish within 600 s; "
                             "set DISTMEM_NATIVE=0 to build distmem without it") from None
        if proc.returncode != 0:
            raise SystemExit(f"building the native cap failed (bash {script}, exit {proc.returncode}):\n"
                             f"{proc.stdout}{proc.stderr}\nInstall a C compiler (gcc) and optionally cmake >= 3.16, "
                             "or set DISTMEM_NATIVE=0 to build distmem without the cap")
        built = os.path.join(dest, LIBRARY)
        if not os.path.isfile(built):
            raise SystemExit(f"scripts/build_native.sh reported success but {built} does not exist:\n{proc.stderr}")
        self.announce(f"distmem: native cap built into {built}", level=2)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode and _native_wanted():
            outputs.append(os.path.join(self.build_lib, "distmem", "_native", LIBRARY))
        return outputs


class CapDistribution(Distribution):
    """Says it has binaries when it builds the cap, so the wheel is not pure and the library is
    installed to platlib (the wheel's root) with the package."""

    def has_ext_modules(self) -> bool:
        return _native_wanted()


CMDCLASS = {"build_py": BuildPyWithCap}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """A wheel for this platform when it carries the cap: ``py3-none-<platform>``, any Python 3."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            if _native_wanted():
                return "py3", "none", plat
            return python, abi, plat

    CMDCLASS["bdist_wheel"] = PlatformWheel


setup(
    name="distmem",
    version=_version(),
    description="Planned, enforced and observed GPU memory for Horovod and tf.distribute training",
    long_description=_readme(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # Every folder of distmem/ ships, even one that lacks an __init__.py (find_packages would drop it
    # silently and the wheel would fail on import); bytecode caches are not packages.
    packages=find_namespace_packages(include=["distmem", "distmem.*"], exclude=["*.__pycache__"]),
    package_data={"distmem": ["_native/*.so"]},
    distclass=CapDistribution,
    cmdclass=CMDCLASS,
    # numpy: distmem.plan.partition (imported by `import distmem`) computes with it.
    install_requires=["psutil>=5", "numpy>=1.21"],
    extras_require={
        "tensorflow": ["tensorflow>=2.12"],
        "horovod": ["horovod==0.28.1", "tensorflow>=2.12,<2.16"],
        "mpi": ["mpi4py>=3.1"],
        "torch": ["torch>=2.0"],
        "nvml": ["nvidia-ml-py>=12"],
        "report": ["rich>=12", "matplotlib>=3.5", "pyyaml>=6", "tensorboard>=2.12"],
        "test": ["pytest>=7", "pytest-timeout>=2", "pyyaml>=6"],
    },
    entry_points={"console_scripts": ["distmem=distmem.cli:main", "distmem-exec=distmem.cli.exec:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
