"""Between two real users: what distmem's children import, and who can read what it writes
(issue 26, findings 11 and 13; issue 36, finding 1).

The attacker owns a folder everyone may write (like /tmp or a group scratch folder) and leaves a
``distmem/``, ``torch/`` and ``horovod/`` there; the victim works in that folder. Before the
isolated children (aa55a88) the estimator's child, the CUDA-context probe and doctor's Horovod
probe each ran the attacker's package as the victim; and a report written under the victim's
umask 077 was forced to 0644, readable by the attacker.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile

import pytest

from crossuser import ENV_BIN, ROOT

PLANTED = '''import os
open(os.path.join({folder!r}, "ran-" + __name__.replace(".", "-") + "-as-uid-%d" % os.getuid()), "w").close()
'''

VICTIM = r"""
import json
from distmem.estimate import isolated
from distmem.apply import torch_probe
from distmem.cli import doctor
out = {}
try:
    out["estimate"] = isolated.call("json:dumps", {"obj": [1, 2]})
except Exception as exc:
    out["estimate"] = "%s: %s" % (type(exc).__name__, exc)
try:
    torch_probe.measure_context(timeout=300)
except Exception as exc:
    out["probe"] = type(exc).__name__
out["horovod"] = doctor.probe_horovod(timeout=300)
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture
def shared(users):
    """A folder of the attacker's that everyone may write (mode 1777, like /tmp)."""
    folder = tempfile.mkdtemp(prefix="dms-shared-", dir="/tmp")
    os.chown(folder, users.attacker.uid, users.attacker.gid)
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def plant(users, folder: str) -> None:
    """As the attacker: packages named like the ones distmem's children import."""
    for package in ("distmem", "distmem/estimate", "torch", "horovod", "horovod/tensorflow", "horovod/torch"):
        path = os.path.join(folder, package, "__init__.py")
        res = users.shell(users.attacker, f"mkdir -p {shlex.quote(os.path.dirname(path))} && "
                                          f"cat > {shlex.quote(path)} <<'EOF'\n{PLANTED.format(folder=folder)}EOF")
        assert res.returncode == 0, res.stderr
    path = os.path.join(folder, "distmem", "estimate", "isolated.py")
    res = users.shell(users.attacker, f"cat > {shlex.quote(path)} <<'EOF'\n{PLANTED.format(folder=folder)}EOF")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("pythonpath", ["absolute", "relative"])
def test_children_never_import_from_the_working_folder(users, shared, pythonpath):
    """Finding 11: the victim, working in the attacker's folder, runs the three children distmem
    starts; none may import the attacker's packages. ``relative`` is how the project runs from its
    tree (``PYTHONPATH=.`` entries): a relative entry must not reach the children either."""
    pytest.importorskip("torch")
    plant(users, shared)
    script = os.path.join(users.victim.home, "victim.py")
    with open(script, "w") as f:
        f.write(VICTIM)
    os.chown(script, users.victim.uid, users.victim.gid)
    path = ROOT if pythonpath == "absolute" else ROOT + os.pathsep + "."
    # The victim's own process imports distmem from the tree (first on its path), as a user's would.
    res = users.python(users.victim, script, env={"PYTHONPATH": path}, cwd=shared, timeout=900)
    ran = sorted(n for n in os.listdir(shared) if n.startswith("ran-"))
    assert not ran, f"the attacker's code ran as the victim: {ran}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, res.stderr[-3000:]
    assert '"estimate": "[1, 2]"' in line  # the estimator's child still works, from distmem's own folder


@pytest.mark.parametrize("name", ["report.json", "report.png"])
def test_outputs_follow_the_umask(users, shared, name):
    """Finding 13: under umask 077 the report JSON and plot were forced to 0644 (the attacker could
    read them); they get what the umask gives (0600), and the usual 022 still gives 0644."""
    pytest.importorskip("matplotlib")
    code = ("import sys, distmem\n"
            "from distmem.report.sinks import plot, write_json\n"
            "distmem.init(fleet='1x16GiB', framework='none', verbose=False)\n"
            "rep = distmem.report(print_table=False)\n"
            "path = sys.argv[1]\n"
            "write_json(rep, path) if path.endswith('.json') else plot(rep, path)\n")
    for umask, mode in ((0o077, 0o600), (0o022, 0o644)):
        path = os.path.join(shared, f"{umask:03o}-{name}")
        res = users.python(users.victim, code, path, umask=umask, cwd=users.victim.home)
        assert res.returncode == 0, res.stderr[-3000:]
        assert os.stat(path).st_mode & 0o777 == mode, (oct(umask), oct(os.stat(path).st_mode))
        peek = users.shell(users.attacker, f"cat {shlex.quote(path)} > /dev/null")
        assert (peek.returncode == 0) == bool(mode & 0o004), (oct(umask), peek)


ATTACKER_MODEL = '''import os
open(os.path.join({folder!r}, "ran-dms-model-as-uid-%d" % os.getuid()), "w").close()
import torch
def build(input_shape=None):
    return torch.nn.Linear(4, 1000)  # 5000 parameters: the estimate would be of this model
'''
VICTIM_MODEL = '''import torch
def build(input_shape=None):
    return torch.nn.Linear(4, 2)  # 10 parameters
'''


@pytest.mark.parametrize("how", ["script", "python -m"])
def test_a_model_factory_is_never_imported_from_the_working_folder(users, shared, how):
    """Issue 36, finding 1: ``distmem estimate --model dms_model:build`` run from a shared folder, the
    victim's own module on its PYTHONPATH. Before, the working folder went first on sys.path: the
    attacker's ``dms_model.py`` there ran as the victim and the estimate was of its model."""
    pytest.importorskip("torch")
    res = users.shell(users.attacker, f"cat > {shlex.quote(os.path.join(shared, 'dms_model.py'))} <<'EOF'\n"
                                      f"{ATTACKER_MODEL.format(folder=shared)}EOF")
    assert res.returncode == 0, res.stderr
    models = os.path.join(users.victim.home, "models")
    users.shell(users.victim, f"mkdir -p {models} && cat > {models}/dms_model.py <<'EOF'\n{VICTIM_MODEL}EOF")
    tool = [os.path.join(ENV_BIN, "distmem")] if how == "script" else ["-m", "distmem"]
    res = users.run(users.victim, [sys.executable, *tool, "estimate", "--model", "dms_model:build", "--input-shape",
                                   "4", "--batch-size", "2", "--json"],
                    env={"PYTHONPATH": ROOT + os.pathsep + models}, cwd=shared, timeout=600)
    ran = sorted(n for n in os.listdir(shared) if n.startswith("ran-"))
    assert not ran, f"the attacker's module ran as the victim: {ran}\n{res.stderr[-3000:]}"
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["params"] == 10, res.stdout[-2000:]
