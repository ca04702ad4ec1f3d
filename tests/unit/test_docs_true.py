"""The docs are true: every command output quoted in README.md and docs/*.md (a fenced block with a
``distmem-docs`` marker) is what the command prints now, and every inline figure with a
``distmem-figure`` marker is its results file's value (``scripts/docs_regen.py --write`` rewrites
them). Cheap commands run here; a command behind a results file is compared with that file, and the
file with a fresh run."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _regen():
    spec = importlib.util.spec_from_file_location("docs_regen", os.path.join(ROOT, "scripts", "docs_regen.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["docs_regen"] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


regen = _regen()
BLOCKS = [b for path in regen.doc_files() for b in regen.blocks(path)]


def test_the_docs_quote_commands_and_figures():
    assert len(BLOCKS) >= 3 and len(regen.figures()) >= 5
    assert any("results" in b.options for b in BLOCKS) and any("results" not in b.options for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.path}:{b.line}" for b in BLOCKS])
def test_a_quoted_output_is_what_the_command_prints(block):
    output, source = regen.current_output(block, run="results" not in block.options)
    want, got = regen.normalise(regen.render(block, output)), regen.normalise(block.body)
    assert got == want, f"{block.where} quotes `{block.options['cmd']}` as it no longer reads ({source}); " \
                        "run python scripts/docs_regen.py --write"


_RESULTS = {b.options["results"]: b for b in BLOCKS if "results" in b.options}


@pytest.mark.parametrize("results", sorted(_RESULTS), ids=sorted(_RESULTS))
def test_a_results_file_is_what_the_command_prints_now(results):
    block = _RESULTS[results]
    needs = block.options.get("needs")  # a module the command needs (a torch model's fit), where absent: skip
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"`{block.options['cmd']}` needs {needs}, which this environment does not have")
    with open(os.path.join(ROOT, results), encoding="utf-8") as f:
        stored = f.read().rstrip("\n")
    now = regen.run_command(block.options["cmd"], block.options.get("stderr") == "1")
    assert regen.normalise(stored.split("\n")) == regen.normalise(now.split("\n")), \
        f"{results} is not what `{block.options['cmd']}` prints now; run python scripts/docs_regen.py --write"


def test_every_inline_figure_is_its_results_files():
    wrong = [f"{where}: {got} (file: {want}, {source})" for where, got, want, source in regen.figures() if got != want]
    assert not wrong, wrong


def test_a_stale_block_is_found(tmp_path):
    """The check can fail: a quoted output that differs from the command's is reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text('<!-- distmem-docs: cmd="python -c print(41+1)" -->\n```\n41\n```\n')
    stale = regen.check(root=str(tmp_path))
    assert len(stale) == 1 and "README.md:1" in stale[0] and "41" in stale[0]
    (tmp_path / "README.md").write_text('<!-- distmem-docs: cmd="python -c print(41+1)" -->\n```\n42\n```\n')
    assert regen.check(root=str(tmp_path)) == []
