"""distmem-exec fails closed (issue 26, findings 10 and 14): a cap that cannot load is an error,
never a command run uncapped with exit status 0; a cap value outside what the library can enforce
is refused with its bound; the error that reports another cap says where the cap came from.

The commands are real: capdrv allocates through the fake driver, so "ran uncapped" shows as two
600 MiB allocations granted under a 1 GiB cap.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from native_helpers import C_DIR, GiB, MiB, ROOT, _cc

from distmem.cli import exec as exec_cli

HERE = os.path.dirname(os.path.abspath(__file__))


def _env(built, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP") and k != "LD_PRELOAD"}
    env.update(PYTHONPATH=ROOT, DISTMEM_QUIET="1", LD_LIBRARY_PATH=built.fake_dir)
    env.update(extra)
    return env


def _exec(built, args, *, pythonpath=ROOT, timeout=60, **extra):
    env = _env(built, **extra)
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "distmem.cli.exec", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd="/")


def _allocs(proc):
    return [json.loads(ln)["rc"] for ln in proc.stdout.splitlines() if ln.startswith('{"op":"alloc"')]


def _refused(proc, *words):
    """distmem-exec said no (exit 2) before the command ran, naming why."""
    assert proc.returncode == 2 and not _allocs(proc), (
        f"exit {proc.returncode}, the command's allocations {_allocs(proc)} (ran uncapped?)\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    for w in words:
        assert w in proc.stderr, f"{w!r} not in:\n{proc.stderr}"


def _alloc_twice(built):
    return ["--", built.capdrv, "alloc", str(600 * MiB), "alloc", str(600 * MiB)]


# ---- finding 10: a cap that does not load ------------------------------------------------------------

def test_the_cap_that_loads_still_runs_the_command(built):
    proc = _exec(built, ["--cap", "1GiB", "--library", built.lib] + _alloc_twice(built))
    assert proc.returncode == 0 and _allocs(proc) == [0, 2], proc.stderr


@pytest.mark.parametrize("where", ["with space", "with:colon"])
def test_a_library_path_ld_so_would_split_is_refused(built, tmp_path, where):
    d = tmp_path / where
    d.mkdir()
    lib = d / "libdistmem_cap.so"
    shutil.copy2(built.lib, lib)
    proc = _exec(built, ["--cap", "1GiB", "--library", str(lib)] + _alloc_twice(built))
    _refused(proc, str(lib), "LD_PRELOAD")


def test_a_package_installed_under_a_path_with_a_space_is_refused(built, tmp_path):
    """The default library (distmem/_native/ beside the package), in a venv whose path has a space."""
    site = tmp_path / "my venv" / "site-packages"
    shutil.copytree(os.path.join(ROOT, "distmem"), site / "distmem",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (site / "distmem" / "_native").mkdir(exist_ok=True)
    shutil.copy2(built.lib, site / "distmem" / "_native" / "libdistmem_cap.so")
    proc = _exec(built, ["--cap", "1GiB"] + _alloc_twice(built), pythonpath=str(site))
    _refused(proc, "my venv", "space")


def test_a_missing_library_is_refused(built, tmp_path):
    proc = _exec(built, ["--cap", "1GiB", "--library", str(tmp_path / "missing.so")] + _alloc_twice(built))
    _refused(proc, str(tmp_path / "missing.so"))


def test_a_library_the_loader_cannot_load_is_refused(built, tmp_path):
    lib = tmp_path / "libdistmem_cap.so"
    lib.write_text("not a shared object\n")
    proc = _exec(built, ["--cap", "1GiB", "--library", str(lib)] + _alloc_twice(built))
    _refused(proc, str(lib))


def test_a_static_command_is_refused(built, tmp_path):
    prog = str(tmp_path / "static_prog")
    src = tmp_path / "static_prog.c"
    src.write_text('#include <stdio.h>\nint main(void) { puts("{\\"op\\":\\"alloc\\",\\"rc\\":0}"); return 0; }\n')
    made = subprocess.run([_cc(), "-static", "-O2", "-o", prog, str(src)], capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        pytest.skip(f"no static C library to build a static program with (libc.a): {made.stderr[-300:]}")
    proc = _exec(built, ["--cap", "1GiB", "--library", built.lib, "--", prog])
    _refused(proc, prog, "static")


def test_a_script_whose_interpreter_is_static_is_refused(built, tmp_path):
    prog = str(tmp_path / "static_sh")
    src = tmp_path / "static_sh.c"
    src.write_text("int main(void) { return 0; }\n")
    made = subprocess.run([_cc(), "-static", "-O2", "-o", prog, str(src)], capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        pytest.skip(f"no static C library to build a static program with (libc.a): {made.stderr[-300:]}")
    script = tmp_path / "job.sh"
    script.write_text(f"#!{prog}\n")
    script.chmod(0o755)
    proc = _exec(built, ["--cap", "1GiB", "--library", built.lib, "--", str(script)])
    _refused(proc, prog, "static")


def test_a_setuid_command_is_refused(users, built, tmp_path):
    """A set-user-ID program runs in secure mode, where ld.so ignores LD_PRELOAD paths."""
    owner = users.user("o")
    d = tmp_path / "suid"
    d.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(d, 0o755)
    prog = d / "capdrv"
    shutil.copy2(built.capdrv, prog)
    os.chown(prog, owner.uid, owner.gid)
    os.chmod(prog, 0o4755)
    proc = _exec(built, ["--cap", "1GiB", "--library", built.lib, "--", str(prog), "alloc", str(600 * MiB),
                         "alloc", str(600 * MiB)])
    _refused(proc, str(prog), "set-user-ID")


# ---- finding 14 (the cap's part): values the library cannot enforce --------------------------------

@pytest.mark.parametrize("value,bound", [
    ("1e308TiB", "9223372036854775807"), ("18446744073709551615", "9223372036854775807"),
    ("18446744073709551616", "9223372036854775807"), ("9223372036854775808", "9223372036854775807"),
    ("0", "1048576"), ("1000", "1048576"), ("nan", "size"), ("inf", "size"), ("1e400", "finite"),
])
def test_exec_refuses_a_cap_it_cannot_enforce(built, capsys, monkeypatch, value, bound):
    monkeypatch.setenv("DISTMEM_CAP_LIB", built.lib)
    rc = exec_cli.main(["--cap", value, "--dry-run", "--", "true"])
    err = capsys.readouterr().err
    assert rc == 2, f"--cap {value} was accepted"
    assert value in err and bound in err, err


def test_exec_refuses_a_gpu_budget_below_the_cap(built, capsys, monkeypatch):
    monkeypatch.setenv("DISTMEM_CAP_LIB", built.lib)
    rc = exec_cli.main(["--cap", "2GiB", "--gpu-budget", "1GiB", "--dry-run", "--", "true"])
    err = capsys.readouterr().err
    assert rc == 2 and "--gpu-budget" in err and "1GiB" in err and "2GiB" in err, err
    assert exec_cli.main(["--cap", "1GiB", "--gpu-budget", "1e308TiB", "--dry-run", "--", "true"]) == 2
    assert "9223372036854775807" in capsys.readouterr().err


def test_exec_accepts_the_largest_cap(built, capsys, monkeypatch):
    monkeypatch.setenv("DISTMEM_CAP_LIB", built.lib)
    assert exec_cli.main(["--cap", str(2**63 - 1), "--gpu-budget", str(2**63 - 1), "--dry-run", "--", "true"]) == 0
    assert f"DISTMEM_CAP_BYTES={2**63 - 1}" in capsys.readouterr().out


def test_the_library_refuses_what_python_refuses(built):
    """DISTMEM_CAP_BYTES set by hand: the sentinel and anything above 2^63 - 1 fail closed."""
    from native_helpers import run_capdrv
    for spec in ("18446744073709551615", "9223372036854775808", "16777216TiB"):
        r = run_capdrv(built, ["alloc", str(MiB), "status"], cap=spec)
        assert r.op("alloc")["rc"] == 2, f"DISTMEM_CAP_BYTES={spec} must deny, not lift the cap"
        assert "is invalid" in r.stderr and "9223372036854775807" in r.stderr, r.stderr


# ---- the error that reports another cap ---------------------------------------------------------------

def test_a_mismatch_names_the_cap_distmem_exec_set(built):
    proc = _exec(built, ["--cap", "1GiB", "--library", built.lib, "--", sys.executable,
                         os.path.join(HERE, "pyprog_cap.py"), "require", str(2 * GiB)])
    assert proc.returncode == 0, proc.stderr
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert "not set by distmem-exec" not in err, err
    assert "distmem-exec --cap 1GiB" in err, err


def test_a_mismatch_names_a_cap_set_by_hand(built):
    env = _env(built, LD_PRELOAD=built.lib, DISTMEM_CAP_BYTES="1GiB")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "pyprog_cap.py"), "require", str(2 * GiB)],
                          capture_output=True, text=True, timeout=60, env=env)
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert "DISTMEM_CAP_BYTES='1GiB'" in err and "not by distmem-exec" in err, err


# ---- what the checks let through, and the budget's options ----------------------------------------

def test_a_script_run_through_env_is_capped(built, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(f"#!/usr/bin/env sh\nexec '{built.capdrv}' alloc {600 * MiB} alloc {600 * MiB}\n")
    script.chmod(0o755)
    proc = _exec(built, ["--cap", "1GiB", "--library", built.lib, "--", str(script)])
    assert proc.returncode == 0 and _allocs(proc) == [0, 2], proc.stderr


def test_a_budget_folder_another_user_made_is_refused_before_the_command_runs(users, node, built):
    attacker = users.user("a")
    base = node.shm
    planted = os.path.join(base, f"distmem-cap-u{os.geteuid()}")
    made = subprocess.run(["mkdir", "-m", "777", planted], user=attacker.uid, group=attacker.gid,
                          extra_groups=[], capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    proc = _exec(built, ["--cap", "1GiB", "--gpu-budget", "2GiB", "--library", built.lib] + _alloc_twice(built),
                 DISTMEM_CAP_SHM_DIR=str(base))
    _refused(proc, planted, f"uid {attacker.uid}")


def test_the_group_option_names_a_group_this_user_is_in(built, capsys, monkeypatch):
    import grp
    monkeypatch.setenv("DISTMEM_CAP_LIB", built.lib)
    mine = grp.getgrgid(os.getegid()).gr_name
    assert exec_cli.main(["--cap", "1GiB", "--gpu-budget", "4GiB", "--gpu-budget-group", mine, "--dry-run",
                          "--", "true"]) == 0
    assert f"DISTMEM_CAP_SHM_GROUP={os.getegid()}" in capsys.readouterr().out
    assert exec_cli.main(["--cap", "1GiB", "--gpu-budget-group", mine, "--dry-run", "--", "true"]) == 2
    assert "needs the budget itself" in capsys.readouterr().err
    others = [g for g in grp.getgrall() if g.gr_gid != os.getegid() and g.gr_gid not in os.getgroups()]
    if others:
        assert exec_cli.main(["--cap", "1GiB", "--gpu-budget", "4GiB", "--gpu-budget-group", others[0].gr_name,
                              "--dry-run", "--", "true"]) == 2
        assert "not a member" in capsys.readouterr().err
