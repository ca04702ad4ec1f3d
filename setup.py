"""distmem: planned, enforced and observed GPU memory for distributed training."""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    with open(os.path.join(HERE, "distmem", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _readme() -> str:
    path = os.path.join(HERE, "README.md")
    return open(path, encoding="utf-8").read() if os.path.exists(path) else ""


setup(
    name="distmem",
    version=_version(),
    description="Planned, enforced and observed GPU memory for Horovod and tf.distribute training",
    long_description=_readme(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["distmem", "distmem.*"]),
    package_data={"distmem": ["_native/*.so"]},
    install_requires=["psutil>=5"],
    extras_require={
        "tensorflow": ["tensorflow>=2.12"],
        "horovod": ["horovod==0.28.1", "tensorflow>=2.12,<2.16"],
        "mpi": ["mpi4py>=3.1"],
        "torch": ["torch>=2.0"],
        "nvml": ["nvidia-ml-py>=12"],
        "report": ["rich>=12", "matplotlib>=3.5", "pyyaml>=6", "tensorboard>=2.12"],
        "test": ["pytest>=7", "pytest-timeout>=2", "pyyaml>=6"],
    },
    entry_points={"console_scripts": ["distmem=distmem.cli:main", "distmem-exec=distmem.native:exec_main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
