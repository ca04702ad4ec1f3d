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

A figure inside a sentence names its results file and key in a comment right after it, invisible
once rendered: ``0.08<!-- distmem-figure: bench/results/estimate_speed_keras_tf215.json seconds_median --> s``;
the check compares the number with the file's value, ``--write`` puts the file's value in.

    python scripts/docs_regen.py            # check every marked block (cheap ones run; exit 1 if stale)
    python scripts/docs_regen.py --run      # also re-run the commands behind results files
    python scripts/docs_regen.py --write    # run everything and rewrite the blocks and results files
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

__all__ = ["Block", "blocks", "figures", "render", "run_command", "normalise", "check", "main", "ROOT"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- distmem-docs: (.*?) -->\s*$")
_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


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


def _options(text: str) -> Dict[str, str]:
    out = {}
    for key, value in _KV.findall(text):
        out[key] = value[1:-1].replace('\\"', '"') if value.startswith('"') else value
    return out


def doc_files(root: str = ROOT) -> List[str]:
    return ["README.md"] + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))


def blocks(path: str, root: str = ROOT) -> List[Block]:
    """The marked blocks of one markdown file."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise SystemExit(f"{path}:{i + 1}: a distmem-docs marker must be followed by a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise SystemExit(f"{path}:{i + 1}: the fenced block after the marker is not closed")
        out.append(Block(path, i + 1, _options(m.group(1)), lines[i + 1], lines[i + 2:end], i + 2, end))
    return out


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


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="run every command and rewrite the blocks and results files")
    p.add_argument("--run", action="store_true", help="check: also re-run the commands behind results files")
    p.add_argument("-k", default=None, help="only the blocks whose command contains this text")
    args = p.parse_args(argv)
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
