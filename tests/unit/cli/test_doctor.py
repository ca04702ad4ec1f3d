"""`distmem doctor`: what it reports and when it fails, with the reason and the remedy.

Environment and Horovod flags are passed in (env dicts, probe results), so each decision is
checked without a launcher; one test runs the real subprocess probe against the installed Horovod."""
import json
import sys

import pytest

from distmem import cli
from distmem.cli.doctor import diagnose, horovod_problems, probe_horovod

BOTH = {"installed": True, "module": "horovod.tensorflow", "flags": {"mpi_built": True, "gloo_built": True}}
NO_GLOO = {"installed": True, "module": "horovod.tensorflow", "flags": {"mpi_built": True, "gloo_built": False}}
NO_MPI = {"installed": True, "module": "horovod.tensorflow", "flags": {"mpi_built": False, "gloo_built": True}}
GLOO_ENV = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"}


def run(env=None, **kw):
    kw.setdefault("probe", lambda: BOTH)
    return diagnose(env=env or {}, **kw)


def test_healthy_single_process():
    d = run(fleet="2x16GiB")
    assert d.problems == [], d.problems
    assert d.facts["launcher"]["detected"] == "none" and "GPU 0" in d.facts["plan"]["summary"]
    assert d.facts["horovod"] == BOTH


def test_malformed_cuda_visible_devices_is_a_problem():
    d = run({"CUDA_VISIBLE_DEVICES": "0,gpu1"})
    (p,) = d.problems
    assert "CUDA_VISIBLE_DEVICES='0,gpu1'" in p and "'gpu1'" in p and "GPU indices" in p
    assert "listed twice" in run({"CUDA_VISIBLE_DEVICES": "1,1"}).problems[0]
    assert run({"CUDA_VISIBLE_DEVICES": "0,1,GPU-8c1f"}).problems == []


def test_more_ranks_than_a_gpu_can_hold():
    d = run(ranks=24, fleet="1x16GiB")
    (p,) = d.problems
    assert "24 ranks on 1 host" in p and "cannot hold 24 ranks" in p and "fewer ranks per GPU" in p
    assert run(ranks=8, fleet="1x16GiB").problems == []


def test_launcher_ranks_are_used_for_the_plan():
    d = run({**GLOO_ENV, "DISTMEM_FLEET": "1x80GiB"})
    assert d.facts["launcher"]["topology"]["size"] == 2 and "shared by 2" in d.facts["plan"]["summary"]


def test_horovod_without_the_launchers_controller():
    d = run(GLOO_ENV, probe=lambda: NO_GLOO)
    assert any("horovodrun --gloo" in p and "gloo_built() is False" in p and "HOROVOD_WITH_GLOO" in p
               for p in d.problems)
    assert run(GLOO_ENV, probe=lambda: NO_MPI).problems == []
    assert horovod_problems("horovodrun-mpi", NO_MPI) and not horovod_problems("horovodrun-mpi", NO_GLOO)
    # Checking ahead of a launch: no launcher variables yet, --launcher names the one to come.
    assert run({}, launcher="horovodrun-mpi", probe=lambda: NO_MPI).problems
    assert horovod_problems("mpirun", NO_MPI) == []  # plain mpirun + mpi4py does not need Horovod
    assert horovod_problems("horovodrun-gloo", {"installed": False}) == []


def test_inconsistent_launcher_variables():
    d = run({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "4"})
    assert any("inconsistent launcher variables" in p for p in d.problems)


def test_cli_exit_status_and_json(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "zero")
    assert cli.main(["doctor", "--no-horovod-probe", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and "CUDA_VISIBLE_DEVICES='zero'" in out["problems"][0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cli.main(["doctor", "--no-horovod-probe", "--fleet", "4x16GiB", "--ranks", "4"]) == 0
    text = capsys.readouterr().out
    assert "doctor: no problems found" in text and "launcher: none" in text and "packages:" in text


def test_doctor_imports_no_framework_in_process():
    before = {m for m in ("tensorflow", "torch", "horovod.tensorflow") if m in sys.modules}
    diagnose(env={}, probe=None)
    after = {m for m in ("tensorflow", "torch", "horovod.tensorflow") if m in sys.modules}
    assert after == before


def _installed(name):
    from importlib import metadata

    try:
        return bool(metadata.version(name))
    except metadata.PackageNotFoundError:
        return False


def test_probe_without_horovod_says_not_installed_even_beside_a_horovod_folder():
    # tests/horovod is on sys.path here: a namespace package of that name must not count as Horovod.
    if _installed("horovod"):
        pytest.skip("Horovod is installed in this environment")
    assert probe_horovod() == {"installed": False}


@pytest.mark.skipif(not _installed("horovod"), reason="Horovod not installed here")
def test_real_probe_reads_the_installed_build():
    hv = probe_horovod()
    assert hv["installed"] and hv["module"] in ("horovod.tensorflow", "horovod.torch"), hv
    assert set(hv["flags"]) >= {"mpi_built", "gloo_built", "nccl_built"}
    # The main environment builds Horovod with both controllers (requirements/horovod.txt).
    assert hv["flags"]["gloo_built"] is True and hv["flags"]["mpi_built"] is True
