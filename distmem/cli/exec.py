"""``distmem-exec [options] -- COMMAND...``: run COMMAND under distmem's native hard cap (the
LD_PRELOAD library of :mod:`distmem.apply.native`), with this rank's cap computed from the plan."""
from __future__ import annotations

import argparse
import grp
import os
import shlex
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence

from .. import settings
from ..apply.native import (ENV_CAP, ENV_DEVICE, ENV_GPU_BUDGET, ENV_GROUP, ENV_LIB, ENV_ORIGIN, ENV_PLAN,
                            LIBRARY_NAME, CapLike, NativeCapError, caps_from_plan, launch_env, parse_cap)
from ..apply.native_launch import check_budget_folder, check_command, confirm_loads
from ..console import say
from ..discover import layout
from ..errors import ConfigError, DistmemError
from ..plan import get, names
from ..plan.request import REQUEST_ARGUMENTS
from .request_args import add_request_arguments, flag_of, strategy_options

__all__ = ["main", "plan_for_exec", "exec_options"]


#: ``-o`` keys that are the request's own arguments (``init()``'s keywords beside the strategy's options).
_REQUEST_KEYS = tuple(k for k in REQUEST_ARGUMENTS if k != "strategy")
#: Where an init() keyword's flag is not --KEY.
_FLAGS = {"from_report": "--from", "fleet": "--fleet"}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # noqa: D401 - argparse's hook: a ConfigError, not an exit
        raise _Refused(message)


def exec_options(strategy: str, items: Sequence[str]) -> Dict[str, Any]:
    """``-o KEY=VALUE`` items as ``init()``'s keyword arguments for ``strategy``, read by the parser of
    ``distmem plan``'s flags (:func:`~distmem.cli.request_args.add_request_arguments`, then each strategy
    option's own reader, :func:`~distmem.cli.request_args.strategy_options`): ``-o stages=9GiB,7GiB`` is
    ``--stages 9GiB,7GiB``, ``-o num_stages=4`` is ``--num-stages 4``, ``-o from_report=R`` is ``--from R``;
    a switch (``--recompute``) takes true or false. ConfigError naming the item and the remedy else."""
    chosen = get(strategy)
    mine = {f.name: f for f in chosen.fields()}
    every = {f.name: f for n in names() for f in _fields(n)}
    argv, request = ["--strategy", strategy], []
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"-o {item!r} is not KEY=VALUE; e.g. -o reserve=1GiB or -o num_stages=4")
        f = mine.get(key) or every.get(key)
        if key in _REQUEST_KEYS and key not in mine:
            request.append(key)
            f = None
        elif f is None:
            known = [n for n, g in mine.items() if g.metadata.get("cli", True)]
            raise ConfigError(f"-o {item}: {key} is not an option of --strategy {strategy} (its options: "
                              f"{', '.join(known) or 'none'}) nor an argument of init() ({', '.join(_REQUEST_KEYS)})")
        elif not f.metadata.get("cli", True):
            raise ConfigError(f"-o {item}: {key} is given in Python only (init({key}=...)), not on a command line")
        flag = _FLAGS.get(key, flag_of(key))
        if f is not None and f.metadata.get("flag"):
            if value.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"-o {item}: {key} is a switch ({flag}); give {key}=true or {key}=false")
            argv += [flag] if value.lower() in _TRUE else []
        else:
            argv.append(f"{flag}={value}")
    parser = _Parser(prog="distmem-exec -o", add_help=False)
    add_request_arguments(parser, argv, job=False)
    try:
        args = parser.parse_args(argv)
    except _Refused as exc:
        raise ConfigError(f"-o: {exc} (-o KEY=VALUE reads VALUE as distmem plan reads --KEY)") from None
    given = {k: getattr(args, "gpus" if k == "fleet" else k) for k in request}
    return {**given, **strategy_options(chosen, args)}


def _fields(name: str) -> List[Any]:
    try:
        return get(name).fields()
    except ConfigError:  # a strategy this build cannot load takes no options here
        return []


def plan_for_exec(options: Dict[str, Any]) -> Any:
    """The job's plan from the launcher environment, as ``init()`` will make it in the command
    (:func:`distmem.api.plan_for_exec`: this process starts no transport and meets the other
    wrappers of its host apart from the commands)."""
    from ..api import plan_for_exec as planned

    return planned("distmem-exec", **options)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distmem-exec",
        description="Run a command under distmem's native hard cap: compute this rank's cap from the plan "
                    "(or take --cap) and exec the command with LD_PRELOAD and DISTMEM_CAP_BYTES set.",
        epilog="examples:  horovodrun -np 4 distmem-exec -- python train.py\n"
               "           distmem-exec --strategy data -o reserve=1GiB -- python train.py\n"
               "           distmem-exec --cap 10GiB -- python serve.py",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap", help="cap every device the command uses at this size (bytes, 10GiB, 512MB); "
                                 "skips the plan")
    p.add_argument("--strategy", default="data", help="plan strategy, as in distmem.init (default: data)")
    p.add_argument("--fleet", help="declared GPUs for a machine without them, e.g. 4x16GiB")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a planner option, as keyword arguments of distmem.init (repeatable); VALUE is read as "
                        "distmem plan reads the flag of that name: -o num_stages=4, -o stages=9GiB,7GiB, "
                        "-o reserve=1GiB, -o recompute=true")
    p.add_argument("--gpu-budget", help="also hold all of this user's capped processes on each GPU together below "
                                        f"this size (sets {ENV_GPU_BUDGET}; a table in /dev/shm only you can use)")
    p.add_argument("--gpu-budget-group", metavar="GROUP",
                   help="share the GPU-wide budget with every member of GROUP (name or id) instead of keeping it "
                        f"per user (sets {ENV_GROUP}); every member can then read and change the table")
    p.add_argument("--library", help=f"path of {LIBRARY_NAME} (default: ${ENV_LIB} or the installed copy)")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command, run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    return p


def _say(msg: str, *, note: bool = False) -> None:
    """A line on stderr; notes (not errors) are silenced by DISTMEM_QUIET=1."""
    say(f"distmem-exec: {msg}", always=not note)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``distmem-exec [options] -- COMMAND...``: exec COMMAND under this rank's native cap.

    Returns (only when nothing is exec'd) the exit status: 0 for --dry-run, 2 for a usage or plan
    error, 127 when COMMAND cannot be run.
    """
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        _parser().print_usage(sys.stderr)
        _say("no command given; e.g. distmem-exec -- python train.py")
        return 2
    try:
        devices: Optional[List[int]] = None
        # Every input first, before the plan or the library: one line naming the option and its value.
        if args.cap is not None:
            parse_cap(args.cap, what="--cap")
        if args.gpu_budget is not None:
            budget_bytes = parse_cap(args.gpu_budget, what="--gpu-budget")
            if args.cap is not None and budget_bytes < parse_cap(args.cap, what="--cap"):
                raise ConfigError(f"--gpu-budget {args.gpu_budget} is below --cap {args.cap}: the budget holds every "
                                  "capped process on a GPU together, so it must be at least one cap; raise it or "
                                  "lower --cap")
        if args.library is not None and not os.path.isfile(args.library):
            raise ConfigError(f"--library {args.library!r}: no such file; build it with scripts/build_native.sh or "
                              f"leave --library out to use the installed {LIBRARY_NAME}")
        if os.sep not in command[0] and shutil.which(command[0]) is None:
            # 127, as env, timeout and the shell answer a command that is not found
            _say(f"cannot run {command[0]!r}: not found on PATH ({os.environ.get('PATH', '')}); give its full path")
            return 127
        if args.gpu_budget_group:
            _group_id(args.gpu_budget_group)
        if args.cap is not None:
            cap: CapLike = args.cap
            where = f"--cap {args.cap}"
        else:
            options: Dict[str, Any] = {"strategy": args.strategy, **exec_options(args.strategy, args.option)}
            if args.fleet:
                options["fleet"] = args.fleet
            plan = plan_for_exec(options)
            caps = caps_from_plan(plan)
            if not caps:
                _say(f"rank {plan.mine.rank} has no GPU in the plan (devices from {plan.source}); "
                     "running the command without a cap", note=True)
                if args.dry_run:
                    print(shlex.join(command))
                    return 0
                return _exec(command, dict(os.environ))
            devices = sorted(caps)
            values = set(caps.values())
            # One device, or equal caps: a single size caps every device the process touches, so an
            # accidental context on another GPU cannot escape.
            cap = values.pop() if len(values) == 1 else caps
            where = f"plan strategy={plan.strategy}, rank {plan.mine.rank}, GPU {','.join(map(str, devices))}"
        budget = args.gpu_budget
        env = launch_env(cap, library=args.library, devices=devices, gpu_budget=budget,
                         gpu_group=_group_id(args.gpu_budget_group) if args.gpu_budget_group else None)
        if args.cap is None:
            env[ENV_PLAN] = plan.fingerprint()
        env[ENV_ORIGIN] = f"{env[ENV_CAP]} distmem-exec " + (f"--cap {args.cap}" if args.cap is not None else
                                                             f"from plan {env[ENV_PLAN]} ({where})")
        if not args.dry_run:
            lib = env["LD_PRELOAD"].split()[0]
            check_command(command, env, lib)
            check_budget_folder(env)
            confirm_loads(env, lib)
    except DistmemError as exc:
        _say(str(exc))
        return 2
    if args.dry_run:
        print(f"LD_PRELOAD={shlex.quote(env['LD_PRELOAD'])} {ENV_CAP}={env[ENV_CAP]}"
              + (f" {ENV_DEVICE}={env[ENV_DEVICE]}" if ENV_DEVICE in env else "")
              + (f" {ENV_GPU_BUDGET}={env[ENV_GPU_BUDGET]}" if budget is not None else "")
              + (f" {ENV_GROUP}={env[ENV_GROUP]}" if ENV_GROUP in env else "")
              + " " + shlex.join(command))
        return 0
    if settings.flag("DISTMEM_CAP_VERBOSE"):
        _say(f"cap {env[ENV_CAP]} ({where}) for: {shlex.join(command)}", note=True)
    return _exec(command, env)


def _group_id(group: str) -> int:
    """GROUP (a name or a number) as a group id this process belongs to; ConfigError otherwise."""
    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--gpu-budget-group {group}: no such group") from None
    if gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(f"--gpu-budget-group {group}: this user (uid {os.geteuid()}) is not a member of group {gid}, "
                          "so it could not use that group's table; add the user to the group or pick another")
    return gid


def _exec(command: List[str], env: Dict[str, str]) -> int:
    layout.leave()  # no exit handler runs at exec: the command's pid must not keep this process's records
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        _say(f"cannot run {command[0]!r}: {exc.strerror or exc} (PATH={env.get('PATH', '')})")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
