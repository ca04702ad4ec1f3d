"""Every run and python block of README.md and docs/*.md, run as a user runs it (scripts/docs_regen.py:
bash for shell lines, the environment's python for snippets, from a working folder per markdown file
that views this tree, with the minimal setup the block's marker names): each command must exit 0 and
print what the block shows. The quoted outputs and figures are tests/unit/test_docs_true.py's; gpu
blocks are the GPU suite's (python scripts/docs_regen.py --blocks gpu).

These launch ranks, train for a few steps and estimate models: minutes in all. They describe the main
environment (TensorFlow 2.15 + Horovod + Open MPI), so only `make test-main` runs this folder."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _regen():
    spec = importlib.util.spec_from_file_location("docs_regen", os.path.join(ROOT, "scripts", "docs_regen.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["docs_regen"] = mod
    spec.loader.exec_module(mod)
    return mod


regen = _regen()
RUNNABLE = [b for b in regen.all_fences() if b.kind in ("run", "python")]


@pytest.fixture(scope="module")
def runner():
    r = regen.Runner(log=lambda s: print(s, file=sys.stderr, flush=True))
    yield r
    r.close()


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_a_documented_block_runs_as_shown(block, runner):
    result = runner.run(block)
    if result.skipped and not result.outcomes:
        pytest.skip("; ".join(result.skipped))
    assert not result.problems, f"{block.where} ({block.kind}) does not run as the docs show:\n" + \
        "\n".join(result.problems)
