"""Launch the guard's Horovod suites under `horovodrun -np 4` with Gloo and with MPI, one framework per
launch (horovod.tensorflow and horovod.torch each keep their own Horovod state), each with a hard timeout."""
import os

import pytest

from helpers import ROOT, horovodrun

pytest.importorskip("horovod")
pytestmark = pytest.mark.horovod

RANKED = os.path.join(ROOT, "tests", "horovod_guard", "ranked")


@pytest.mark.parametrize("mode", ["gloo", "mpi"])
@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_guard_under_horovodrun(framework, mode):
    hvd = pytest.importorskip({"torch": "horovod.torch", "tf": "horovod.tensorflow"}[framework])
    if not hasattr(hvd, "init"):  # the package imports, but its extension was not built (HOROVOD_WITHOUT_PYTORCH=1)
        pytest.skip(f"Horovod was built without {framework} support in this environment")
    args = ["-m", "pytest", os.path.join(RANKED, f"test_ranked_guard_hvd_{framework}.py"), "-q", "-p",
            "no:cacheprovider", "-o", "addopts=", "--rootdir", RANKED]
    res = horovodrun(4, args, mode=mode, timeout=480, env={"DISTMEM_HVD_MODE": mode, "DISTMEM_TIMEOUT": "60"})
    res.check()
    assert res.out.count(" passed") >= 4 and "failed" not in res.out, res.out[-4000:]
