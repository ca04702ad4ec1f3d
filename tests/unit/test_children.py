"""distmem.children: the one way distmem starts a Python child (issue 26, finding 11; the
cross-user case is tests/security/test_security_files.py)."""
import json
import os
import subprocess
import sys

from distmem import children

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOW = "import json, sys, distmem; print(json.dumps({'path': sys.path, 'distmem': distmem.__file__}))"


def show(tmp_path, pythonpath, **kw):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    res = children.run(code=SHOW, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120, **kw)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_no_working_folder_and_no_relative_entry_on_the_childs_path(tmp_path):
    (tmp_path / "distmem").mkdir()
    (tmp_path / "distmem" / "__init__.py").write_text("raise SystemExit('the working folder was imported')")
    for pythonpath in (".", ":" + ROOT, ROOT + "::.", "relative/dir:" + ROOT):
        got = show(tmp_path, pythonpath)
        assert got["path"][0] == children.package_root(), got
        assert all(p and os.path.isabs(p) for p in got["path"]), got
        assert str(tmp_path) not in got["path"], got
        assert os.path.realpath(got["distmem"]).startswith(os.path.join(children.package_root(), "distmem"))


def test_the_users_absolute_entries_are_kept_and_extra_folders_come_last(tmp_path):
    mine = tmp_path / "lib"
    mine.mkdir()
    got = show(tmp_path, str(mine), extra_paths=[str(tmp_path / "models")])
    assert str(mine) in got["path"] and got["path"][-1] == str(tmp_path / "models")
    assert got["path"].index(str(mine)) < got["path"].index(str(tmp_path / "models"))


def test_a_module_runs_as_main_with_its_arguments(tmp_path):
    res = children.run(module="json.tool", args=["--compact"], input='{"a": [1, 2]}', capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert res.returncode == 0 and res.stdout.strip() == '{"a":[1,2]}', res.stderr


def test_the_environment_keeps_only_absolute_pythonpath_entries():
    env = children.environment({"PYTHONPATH": "::.:/abs/one:rel:/abs/two:"})
    assert env["PYTHONPATH"].split(os.pathsep) == [children.package_root(), "/abs/one", "/abs/two"]


def test_import_folders_finds_a_user_module_without_importing_it(tmp_path):
    pkg = tmp_path / "mymodels_for_children"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported')")
    sys.path.insert(0, str(tmp_path))
    try:
        assert children.import_folders("mymodels_for_children.nets") == [str(tmp_path)]
        assert "mymodels_for_children" not in sys.modules
        assert children.import_folders("no_such_module_here", "", "1bad") == []
        assert children.import_folders("sys") == []  # built in: on every path already
    finally:
        sys.path.remove(str(tmp_path))


def test_every_python_child_of_distmem_goes_through_children():
    """No other subprocess start of ``sys.executable`` in the package: the rule has one door."""
    hits = []
    for folder, _, files in os.walk(os.path.join(ROOT, "distmem")):
        for name in files:
            if name.endswith(".py") and name != "children.py":
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                for call in ("subprocess.run([sys.executable", "subprocess.Popen([sys.executable",
                             "[python or sys.executable", '"-c", code', '"-m", __name__'):
                    if call in text:
                        hits.append(f"{os.path.relpath(os.path.join(folder, name), ROOT)}: {call}")
    assert hits == []
