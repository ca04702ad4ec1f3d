#!/usr/bin/env python3
"""Regenerate every command output quoted in README.md and docs/*.md, or check that they are current.

A quoted output is a fenced block with a marker comment on the line before it:

    <!-- distmem-docs: cmd="distmem plan --gpus 4x80GiB --ranks 8" head=3 prompt=1 -->
    ```bash
    $ distmem plan --gpus 4x80GiB --ranks 8
    plan: ...
    ```

Keys of the marker (``key="value"`` or ``key=value``):

* ``cmd`` - the command, as a user types it; ``distmem`` runs as ``python -m distmem`` of this tree,
  ``python`` as this interpreter, from the repository root, with ``DISTMEM_QUIET=1``;
* ``results`` - a file (under ``bench/results/``) that stores the full output: ``--write`` runs the
  command and rewrites the file and the block, the check compares the block with the file and (with
  ``--run`` or for markers without ``results``) the file with what the command prints now;
* ``head=N`` - quote the first N lines and a ``  ...`` line;
* ``prompt=1`` - the block starts with ``$ CMD`` (the command as written, ``comment`` appended);
* ``comment`` - a comment after the prompt line's command (``# dry run``);
* ``stderr=1`` - quote stderr after stdout (a command whose message is the point);
* ``needs`` - a module the command needs (``torchvision``): where it is missing the command is not re-run.

Timings (``10.59 s``) and this machine's paths are normalised before comparing, never in the docs.

Every other fenced block says what it is with a marker whose first word is its kind (no fenced
block goes without one; ``tests/unit/test_docs_true.py`` fails on one that does):

* ``run`` - shell lines a user types, each run as written by bash (a ``\\`` continues a line; a
  ``[--flag ...]`` group is optional: the line runs without the groups and with them); a ``$ CMD``
  line's following lines are the output it must print; every line must exit 0;
* ``python`` - a Python snippet run as written (``python`` of the environment);
* ``gpu`` - either of the above where it needs a GPU: run by the GPU suite
  (``python scripts/docs_regen.py --blocks gpu``), not on a CPU machine;
* ``illustrative`` - shown, not run, with ``reason="..."`` (a diagram, a sample of output, an
  install, a sketch with its parts elided: ``whole=examples/X.py`` names the program it sketches).

Options of ``run`` / ``python`` / ``gpu``: ``setup=NAME[,NAME]`` - the minimal setup the block
states or implies (files it names, a model it refers to, a preamble the snippet runs after; in
``scripts/docs_setups.py``, never written into what the user reads); ``under="LAUNCHER"`` - a
snippet every rank of this launch runs; ``timeout=S`` per command (default 300); ``needs="module"``
or ``needs="module@TEXT"`` - a module the block (or its lines containing TEXT) needs, where missing
they are skipped, said; ``skip="PREFIX"`` with ``why="..."`` - lines starting with PREFIX are not run.
Blocks of one file run in order in one working folder (a view of this tree: its top-level entries
linked, plus what the setups write), so a block may read what an earlier one wrote; ``cwd=tree`` runs
a block in this tree itself (``make``: the environment's view of a clone is keyed by its real path).

A figure inside a sentence names its results file and key in a comment right after it, invisible
once rendered: ``0.08<!-- distmem-figure: bench/results/estimate_speed_keras_tf215.json seconds_median --> s``;
the check compares the number with the file's value, ``--write`` puts the file's value in.

    python scripts/docs_regen.py            # check every marked block (cheap ones run; exit 1 if stale)
    python scripts/docs_regen.py --run      # also re-run the commands behind results files
    python scripts/docs_regen.py --write    # run everything and rewrite the blocks and results files
    python scripts/docs_regen.py --blocks run,python   # run every block of those kinds (gpu: the GPU suite)
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Block", "blocks", "fences", "figures", "render", "run_command", "normalise", "check", "main", "ROOT",
           "KINDS", "marker_problems", "commands", "Runner", "run_block"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- distmem-docs: (.*?) -->\s*$")
_KV = re.compile(r'([\w-]+)=("(?:[^"\\]|\\.)*"|\S+)')


@dataclass
class Block:
    path: str  # the markdown file, relative to ROOT
    line: int  # the marker's line (1-based)
    options: Dict[str, str]
    fence: str  # the opening fence line
    body: List[str]  # the lines between the fences
    start: int  # index of the first body line in the file's lines
    end: int  # index of the closing fence

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def kind(self) -> str:
        """``output`` (a ``cmd=`` quote), ``run``, ``python``, ``gpu``, ``illustrative``, or ``""``
        for a fenced block without a marker."""
        return self.options.get("_kind", "")

    @property
    def language(self) -> str:
        return self.fence[3:].strip()


def _options(text: str) -> Dict[str, str]:
    out = {}
    for key, value in _KV.findall(text):
        out[key] = value[1:-1].replace('\\"', '"') if value.startswith('"') else value
    first = text.split(None, 1)[0] if text.strip() else ""
    out["_kind"] = "output" if "cmd" in out else (first if "=" not in first else "")
    return out


def doc_files(root: str = ROOT) -> List[str]:
    return ["README.md"] + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))


def fences(path: str, root: str = ROOT) -> List[Block]:
    """Every fenced block of one markdown file, each with its marker's options (``kind`` ``""``
    where it has none; ``line`` is the marker's line, else the fence's)."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m and not (i + 1 < len(lines) and lines[i + 1].startswith("```")):
            raise SystemExit(f"{path}:{i + 1}: a distmem-docs marker must be followed by a fenced block")
        if lines[i].startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise SystemExit(f"{path}:{i + 1}: a fenced block is not closed")
            prev = MARKER.match(lines[i - 1]) if i else None
            options = _options(prev.group(1)) if prev else {"_kind": ""}
            out.append(Block(path, i if prev else i + 1, options, lines[i], lines[i + 1:end], i + 1, end))
            i = end + 1
            continue
        i += 1
    return out


def blocks(path: str, root: str = ROOT) -> List[Block]:
    """The blocks of one markdown file that quote a command's output (a marker with ``cmd=``)."""
    return [b for b in fences(path, root) if b.kind == "output"]


def run_command(cmd: str, stderr: bool = False, root: str = ROOT, timeout: float = 900.0) -> str:
    """What ``cmd`` prints, run as a user would from the repository root (``distmem`` = this tree's)."""
    words = shlex.split(cmd)
    env = dict(os.environ, PYTHONPATH=root, DISTMEM_QUIET="1", TF_CPP_MIN_LOG_LEVEL="3", COLUMNS="200")
    env.pop("DISTMEM_FLEET", None)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:1] == ["distmem"]:
        words = [sys.executable, "-m", "distmem"] + words[1:]
    elif words[:1] == ["python"]:
        words = [sys.executable] + words[1:]
    p = subprocess.run(words, cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    text = p.stdout + (p.stderr if stderr else "")
    return text.rstrip("\n")


def render(block: Block, output: str) -> List[str]:
    """The block's body for ``output``: the prompt line, then the (possibly cut) output."""
    lines = output.split("\n") if output else []
    head = block.options.get("head")
    if head is not None and len(lines) > int(head):
        lines = lines[:int(head)] + ["  ..."]
    if block.options.get("prompt") == "1":
        comment = block.options.get("comment")
        lines = [f"$ {block.options['cmd']}" + (f"      # {comment}" if comment else "")] + lines
    return lines


FIGURE = re.compile(r"(-?[0-9][0-9.,]*)<!-- distmem-figure: (\S+) (\S+) -->")


def _figure(root: str, path: str, key: str) -> str:
    import json

    with open(os.path.join(root, path), encoding="utf-8") as f:
        value: object = json.load(f)
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]  # type: ignore[index]
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def figures(root: str = ROOT) -> List[Tuple[str, str, str, str]]:
    """Every inline figure: (where, the number in the docs, the number in its results file, source)."""
    out = []
    for path in doc_files(root):
        with open(os.path.join(root, path), encoding="utf-8") as f:
            text = f.read()
        for m in FIGURE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{path}:{line}", m.group(1), _figure(root, m.group(2), m.group(3)),
                        f"{m.group(2)} {m.group(3)}"))
    return out


def _write_figures(root: str = ROOT) -> int:
    changed = 0
    for path in doc_files(root):
        full = os.path.join(root, path)
        with open(full, encoding="utf-8") as f:
            text = f.read()
        new = FIGURE.sub(lambda m: _figure(root, m.group(2), m.group(3)) + m.group(0)[len(m.group(1)):], text)
        if new != text:
            changed += 1
            with open(full, "w", encoding="utf-8") as f:
                f.write(new)
    return changed


_TIMING = re.compile(r"\b\d+(\.\d+)? s\b")


def normalise(lines: List[str]) -> List[str]:
    """Lines with timings and this machine's paths blanked, trailing blanks dropped."""
    out = []
    for line in lines:
        line = _TIMING.sub("N s", line)
        line = line.replace(ROOT, "<root>")
        out.append(line.rstrip())
    return out


def _results_path(block: Block, root: str = ROOT) -> Optional[str]:
    r = block.options.get("results")
    return os.path.join(root, r) if r else None


def current_output(block: Block, run: bool, root: str = ROOT) -> Tuple[str, str]:
    """(the output the block should quote, where it came from)."""
    res = _results_path(block, root)
    if res and not run:
        with open(res, encoding="utf-8") as f:
            return f.read().rstrip("\n"), os.path.relpath(res, root)
    return run_command(block.options["cmd"], block.options.get("stderr") == "1", root), "the command"


def check(run: bool = False, root: str = ROOT, only: Optional[str] = None) -> List[str]:
    """Every marked block that differs from what it should quote: one message each."""
    stale = [f"{where}: {got} differs from {source}: {want} (python scripts/docs_regen.py --write)"
             for where, got, want, source in figures(root) if got != want and not only]
    for path in doc_files(root):
        for b in blocks(path, root):
            if only and only not in b.options.get("cmd", ""):
                continue
            output, source = current_output(b, run, root)
            want, got = normalise(render(b, output)), normalise(b.body)
            if want != got:
                diff = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
                stale.append(f"{b.where}: the block quoting `{b.options['cmd']}` differs from {source} at its line "
                             f"{diff + 1}:\n  docs: {got[diff] if diff < len(got) else '<end>'}\n  now:  "
                             f"{want[diff] if diff < len(want) else '<end>'}\n  (python scripts/docs_regen.py --write)")
            res = _results_path(b, root)
            if res and run:
                with open(res, encoding="utf-8") as f:
                    stored = f.read().rstrip("\n")
                if normalise(stored.split("\n")) != normalise(output.split("\n")):
                    stale.append(f"{b.where}: {os.path.relpath(res, root)} differs from what `{b.options['cmd']}` "
                                 "prints now (python scripts/docs_regen.py --write)")
    return stale


def write(root: str = ROOT, only: Optional[str] = None) -> int:
    """Run every marked command, rewrite its results file and its blocks; the number of blocks changed."""
    changed = 0
    outputs: Dict[Tuple[str, str], str] = {}
    for path in doc_files(root):
        found = blocks(path, root)
        if not found:
            continue
        with open(os.path.join(root, path), encoding="utf-8") as f:
            lines = f.read().split("\n")
        for b in reversed(found):  # from the end: earlier indices stay valid
            if only and only not in b.options.get("cmd", ""):
                continue
            key = (b.options["cmd"], b.options.get("stderr", ""))
            if key not in outputs:
                outputs[key] = run_command(b.options["cmd"], b.options.get("stderr") == "1", root)
            output = outputs[key]
            res = _results_path(b, root)
            if res:
                os.makedirs(os.path.dirname(res), exist_ok=True)
                with open(res, "w", encoding="utf-8") as f:
                    f.write(output + "\n")
            body = render(b, output)
            if body != b.body:
                lines[b.start:b.end] = body
                changed += 1
        with open(os.path.join(root, path), "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
    return changed


# ------------------------------------------------------------------------------------ every block

KINDS = ("output", "run", "python", "gpu", "illustrative")
_OPTIONAL = re.compile(r"\s\[(-[^\[\]]*)\]")
_HELD = re.compile(r"^(?P<path>[\w./-]+\.py)(?:::(?P<name>\w+))?$")


def _setups(root: str = ROOT) -> Dict[str, Any]:
    import importlib.util

    path = os.path.join(root, "scripts", "docs_setups.py")
    if not os.path.exists(path):  # a tree of docs alone (the tests' own): this tree's setups
        path = os.path.join(ROOT, "scripts", "docs_setups.py")
    spec = importlib.util.spec_from_file_location("docs_setups", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_setups", mod)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.SETUPS


def all_fences(root: str = ROOT) -> List[Block]:
    return [b for path in doc_files(root) for b in fences(path, root)]


def marker_problems(block: Block, root: str = ROOT) -> List[str]:
    """What is wrong with a block's marker (empty: it is run, or says why not)."""
    k, o, w = block.kind, block.options, block.where
    if not k:
        return [f"{w}: a fenced block without a distmem-docs marker: mark it run, python or gpu (a test runs it) "
                "or illustrative reason=\"...\" (shown, not run: say why)"]
    if k not in KINDS:
        return [f"{w}: unknown kind {k!r} in its marker; use one of {', '.join(KINDS)}"]
    out = []
    if k in ("illustrative", "gpu") and len(o.get("reason", "").split()) < 4:
        out.append(f"{w}: {'an' if k[0] in 'aeiou' else 'a'} {k} block needs reason=\"...\" (why it is not run here, "
                   "in a few words)")
    if k == "illustrative" and "whole" in o and not os.path.exists(os.path.join(root, o["whole"])):
        out.append(f"{w}: whole={o['whole']} (the program it sketches) does not exist")
    for held in filter(None, o.get("held-by", "").split(",")):
        m = _HELD.match(held.strip())
        path = m and os.path.join(root, m.group("path"))
        if not m or not os.path.exists(path):
            out.append(f"{w}: held-by={held!r}: give tests/FILE.py::test_name of a test that holds what it shows")
        elif m.group("name") and not re.search(rf"^\s*def {m.group('name')}\b", open(path, encoding="utf-8").read(),
                                               re.M):
            out.append(f"{w}: held-by={held!r}: {m.group('path')} has no test {m.group('name')}")
    if "skip" in o and len(o.get("why", "").split()) < 3:
        out.append(f"{w}: skip={o['skip']!r} needs why=\"...\" (why those lines are not run)")
    if k in ("run", "python", "gpu"):
        known = _setups(root)
        out += [f"{w}: setup={s!r} is not in scripts/docs_setups.py ({', '.join(sorted(known))})"
                for s in filter(None, o.get("setup", "").split(",")) if s not in known]
        if o.get("cwd", "tree") != "tree" or (o.get("cwd") and o.get("setup")):
            out.append(f"{w}: cwd= takes only 'tree' (run in this tree itself), and then no setup= (nothing is "
                       "written into the tree)")
        if k == "run" and block.language not in ("", "bash", "sh", "console"):
            out.append(f"{w}: a run block holds shell lines; this one is ```{block.language}: mark it python")
    return out


@dataclass
class Command:
    text: str  # the command as written (continuation lines joined)
    line: int  # its line in the markdown file
    expect: Optional[List[str]] = None  # the output a `$ CMD` line shows after it


def commands(block: Block) -> List[Command]:
    """A run block's commands: every logical line (``$ CMD`` lines where the block shows a prompt,
    with the lines after each as its output); an optional ``[--flag ...]`` group gives the line
    once without its groups and once with them."""
    body = block.body
    prompt = any(line.startswith("$ ") for line in body)
    out: List[Command] = []
    i = 0
    while i < len(body):
        line, at = body[i], block.start + i + 1
        i += 1
        if prompt and not line.startswith("$ "):
            if out and out[-1].expect is not None:
                out[-1].expect.append(line)
            continue
        text = line[2:] if prompt else line
        while text.rstrip().endswith("\\") and i < len(body):
            text = text.rstrip()[:-1] + " " + body[i].strip()
            i += 1
        if not text.strip() or text.strip().startswith("#"):
            continue
        variants = [text]
        if _OPTIONAL.search(text):
            variants = [_OPTIONAL.sub("", text), _OPTIONAL.sub(lambda m: " " + m.group(1), text)]
        out += [Command(v, at, [] if prompt else None) for v in variants]
    return out


@dataclass
class Outcome:
    command: str
    line: int
    rc: Optional[int]
    seconds: float
    output: str
    problem: Optional[str] = None


@dataclass
class BlockResult:
    block: Block
    outcomes: List[Outcome] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)

    @property
    def problems(self) -> List[str]:
        return [f"{self.block.path}:{o.line}: `{o.command}` {o.problem}\n{_tail(o.output)}"
                for o in self.outcomes if o.problem]


def _tail(text: str, n: int = 25) -> str:
    lines = text.rstrip().split("\n")
    return "\n".join("    | " + line[:300] for line in lines[-n:])


def _kill(proc: "subprocess.Popen[str]") -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _reap(tag: str) -> None:
    """Kill what a command left running: every process whose environment carries its tag (a
    launcher's ranks sit in sessions of their own, out of the command's process group's reach)."""
    import signal

    needle = f"DISTMEM_DOCS_RUN={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


class Runner:
    """Runs blocks as a user would: bash for shell lines, the environment's python for snippets,
    from one working folder per markdown file (a view of this tree plus what the setups write)."""

    def __init__(self, root: str = ROOT, env_bin: Optional[str] = None, log: Any = None) -> None:
        self.root = root
        self.env_bin = env_bin or os.environ.get("DISTMEM_ENV_BIN") or os.path.dirname(sys.executable)
        self.base = tempfile.mkdtemp(prefix="distmem-docs-")
        self.folders: Dict[str, str] = {}
        self.done: Dict[str, BlockResult] = {}
        self.prepared: Dict[Tuple[str, str], None] = {}
        self.ran: Dict[Tuple[str, str], Tuple[Optional[int], str, str, float]] = {}  # a command shown twice runs once
        self.log = log

    def quoted(self) -> Dict[str, str]:
        """Commands whose output a block quotes from a results file (checked by a fresh run in
        tests/unit/test_docs_true.py): command -> where."""
        if not hasattr(self, "_quoted"):
            self._quoted = {b.options["cmd"]: b.where for b in all_fences(self.root)
                            if b.kind == "output" and "results" in b.options}
        return self._quoted

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)

    def folder(self, path: str) -> str:
        if path not in self.folders:
            work = os.path.join(self.base, re.sub(r"\W", "_", path))
            os.makedirs(work)
            for name in os.listdir(self.root):
                if name not in (".git", "runs") and not name.startswith("."):
                    os.symlink(os.path.join(self.root, name), os.path.join(work, name))
            self.folders[path] = work
        return self.folders[path]

    def env(self, work: str, setups: List[Any]) -> Dict[str, str]:
        env = dict(os.environ)
        env.pop("DISTMEM_FLEET", None)
        env["PATH"] = self.env_bin + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = self.root
        env["DISTMEM_ENV_BIN"] = self.env_bin
        env["PYTHONUNBUFFERED"] = "1"
        # a machine with fewer cores than the ranks a block launches (CI: 2); root in containers
        env.update(OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        for s in setups:
            for key, value in s.env.items():
                value = value.format(root=self.root, work=work)
                env[key] = value + os.pathsep + env[key] if key == "PYTHONPATH" else value
        return env

    def _prepare(self, work: str, setups: List[Any], env: Dict[str, str]) -> None:
        for s in setups:
            if (work, s.name) in self.prepared:
                continue
            for rel, content in s.files.items():
                target = os.path.join(work, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "w", encoding="utf-8") as f:
                    f.write(content.format(root=self.root, work=work) if s.format_files else content)
            for rel, program in s.made.items():
                target = os.path.join(work, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                p = subprocess.run(["python", "-c", program, target], cwd=work, env=env, capture_output=True,
                                   text=True, timeout=600, stdin=subprocess.DEVNULL)
                if p.returncode != 0:
                    raise RuntimeError(f"setup {s.name}: making {rel} failed:\n{p.stderr[-3000:]}")
            self.prepared[(work, s.name)] = None

    def shell(self, text: str, work: str, env: Dict[str, str], timeout: float) -> Tuple[Optional[int], str, str,
                                                                                            float]:
        t0 = time.monotonic()
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        env = dict(env, DISTMEM_DOCS_RUN=tag)
        proc = subprocess.Popen(["bash", "-c", "set -o pipefail\n" + text], cwd=work, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            rc = None
        finally:
            _kill(proc)  # what the command left behind in its session
            _reap(tag)  # and outside it (a launcher's ranks)
        return rc, out, err, time.monotonic() - t0

    def run(self, block: Block) -> BlockResult:
        """Run ``block`` (the earlier runnable blocks of its file first, once each)."""
        if block.where in self.done:
            return self.done[block.where]
        for earlier in fences(block.path, self.root):
            if earlier.start >= block.start:
                break
            if earlier.kind in ("run", "python") and earlier.where not in self.done:
                self.run(earlier)
        result = self._run(block)
        self.done[block.where] = result
        return result

    def _run(self, block: Block) -> BlockResult:
        o = block.options
        known = _setups(self.root)
        setups = [known[s] for s in filter(None, o.get("setup", "").split(","))]
        # cwd=tree: in this tree itself, as a user runs `make` in the clone (the environment's view of a
        # clone is keyed by its real path, which a working folder of links is not)
        work = self.root if o.get("cwd") == "tree" else self.folder(block.path)
        env = self.env(work, setups)
        result = BlockResult(block)
        self._prepare(work, setups, env)
        timeout = float(o.get("timeout", 300))
        needs = [n.split("@", 1) for n in filter(None, o.get("needs", "").split(","))]
        python = block.kind == "python" or (block.kind == "gpu" and block.language == "python")
        if python:
            import importlib.util

            missing = [n[0] for n in needs if importlib.util.find_spec(n[0]) is None]
            if missing:
                result.skipped.append(f"the snippet needs {', '.join(missing)}, which this environment lacks")
                return result
            script = os.path.join(work, f".docs_{re.sub(r'[^A-Za-z0-9]', '_', block.where)}.py")
            with open(script, "w", encoding="utf-8") as f:
                f.write("".join(s.preamble + "\n" for s in setups if s.preamble) + "\n".join(block.body) + "\n")
            cmds = [Command((o["under"] + " " if o.get("under") else "") + f"python {os.path.basename(script)}",
                            block.start + 1)]
        else:
            cmds = commands(block)
        for c in cmds:
            if o.get("skip") and c.text.lstrip().startswith(o["skip"]):
                result.skipped.append(f"`{c.text}`: {o.get('why')}")
                continue
            lacking = [m for m, *only in needs if (not only or only[0] in c.text) and not _have(m)]
            if lacking and not python:
                result.skipped.append(f"`{c.text}` needs {', '.join(lacking)}, which this environment lacks")
                continue
            key = (re.sub(r"\s+#.*$", "", c.text).strip(), o.get("setup", ""))
            if not python and key[0] in self.quoted():
                # the same command behind a quoted output's results file: tests/unit/test_docs_true.py runs it
                # and compares what it prints, so it is not launched twice
                result.skipped.append(f"`{c.text}`: run and compared by the quoted output of "
                                      f"{self.quoted()[key[0]]} (test_docs_true)")
                continue
            if python or key not in self.ran:
                if self.log:
                    self.log(f"[docs] {block.path}:{c.line}: {c.text}")
                self.ran[key] = self.shell(c.text, work, env, timeout)
            rc, out, err, seconds = self.ran[key]
            text = out + err
            problem = None
            if rc is None:
                problem = f"did not finish within {timeout:.0f} s"
            elif rc != 0:
                problem = f"exited {rc}"
            elif c.expect is not None:
                want = normalise([line for line in c.expect])
                got = normalise((out + (err if o.get("stderr") == "1" else "")).rstrip("\n").split("\n"))
                while want and not want[-1]:
                    want.pop()
                if want != got:
                    diff = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
                    problem = (f"prints what the block does not show, at its line {diff + 1}:\n  docs: "
                               f"{want[diff] if diff < len(want) else '<end>'}\n  now:  "
                               f"{got[diff] if diff < len(got) else '<end>'}")
            result.outcomes.append(Outcome(c.text, c.line, rc, round(seconds, 1), text, problem))
        return result


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_block(block: Block, runner: Optional[Runner] = None) -> BlockResult:
    """Run one block (a run, python or gpu one) as a user would; the GPU suite calls this."""
    own = runner is None
    runner = runner or Runner()
    try:
        return runner.run(block)
    finally:
        if own:
            runner.close()


def run_kinds(kinds: List[str], root: str = ROOT, only: Optional[str] = None) -> int:
    """``--blocks KINDS``: run every block of those kinds; one line per block; 1 if any failed."""
    runner = Runner(root, log=lambda s: print(s, file=sys.stderr, flush=True))
    failed = 0
    try:
        for b in all_fences(root):
            if b.kind not in kinds or (only and only != b.where and only not in "\n".join(b.body)):
                continue
            r = runner.run(b)
            took = sum(o.seconds for o in r.outcomes)
            state = "FAILED" if r.problems else ("skipped" if r.skipped and not r.outcomes else "ok")
            print(f"{b.where} [{b.kind}] {state} ({len(r.outcomes)} command(s), {took:.0f} s)"
                  + "".join(f"\n  skipped {s}" for s in r.skipped) + "".join(f"\n  {p}" for p in r.problems),
                  flush=True)
            failed += bool(r.problems)
    finally:
        runner.close()
    print(f"docs_regen: {failed} block(s) failed" if failed else "docs_regen: every block ran as shown")
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="run every command and rewrite the blocks and results files")
    p.add_argument("--run", action="store_true", help="check: also re-run the commands behind results files")
    p.add_argument("-k", default=None, help="only the blocks whose command contains this text")
    p.add_argument("--blocks", default=None, metavar="KINDS",
                   help="run every block of these kinds (run,python; gpu on a GPU machine) and report each")
    args = p.parse_args(argv)
    if args.blocks:
        kinds = args.blocks.split(",")
        bad = [k for k in kinds if k not in ("run", "python", "gpu")]
        if bad:
            p.error(f"--blocks {args.blocks}: {', '.join(bad)} cannot be run; give run, python and/or gpu")
        return run_kinds(kinds, only=args.k)
    if args.write:
        n = write(only=args.k)
        f = _write_figures() if not args.k else 0
        print(f"docs_regen: {n} block(s) rewritten, figures changed in {f} file(s)")
        return 0
    stale = check(run=args.run, only=args.k)
    for s in stale:
        print(s)
    print(f"docs_regen: {len(stale)} stale block(s)" if stale else "docs_regen: every marked block is current")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
