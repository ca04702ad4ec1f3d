"""The docs are true: every command output quoted in README.md and docs/*.md (a fenced block with a
``distmem-docs`` marker) is what the command prints now, and every inline figure with a
``distmem-figure`` marker is its results file's value (``scripts/docs_regen.py --write`` rewrites
them). Cheap commands run here; a command behind a results file is compared with that file, and the
file with a fresh run. Every other fenced block is run (tests/docs runs the run and python blocks,
the GPU suite the gpu ones) or says why it is not: checked here, with the runner's own rules."""
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


# ------------------------------------------------------------------ every fenced block: run, or says why

FENCES = regen.all_fences()


def test_every_fenced_block_is_run_or_says_why_not():
    """Every fenced block of README.md and docs/*.md carries a marker: run / python (the docs test in
    tests/docs runs it as written), gpu (the GPU suite runs it), output (a quoted command output,
    checked above) or illustrative with its reason; one without, or with a marker that names no
    reason, no known setup or no existing test, fails here."""
    problems = [p for b in FENCES for p in regen.marker_problems(b)]
    assert not problems, "\n".join(problems)
    kinds = {b.kind for b in FENCES}
    assert {"run", "python", "illustrative", "output"} <= kinds, kinds


def test_an_unmarked_or_unexplained_block_is_found(tmp_path):
    """The check can fail: a block without a marker, an illustrative one without a reason, a setup
    or a test that does not exist."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "```bash\ndistmem doctor\n```\n\n"
        "<!-- distmem-docs: illustrative -->\n```\nx\n```\n\n"
        "<!-- distmem-docs: python setup=no-such-setup -->\n```python\nprint(1)\n```\n\n"
        "<!-- distmem-docs: illustrative reason=\"a diagram of four ranks\" held-by=tests/none.py::test_x -->\n```\nx\n```\n"
        "<!-- distmem-docs: run -->\n```python\nprint(1)\n```\n")
    found = [p for b in regen.all_fences(str(tmp_path)) for p in regen.marker_problems(b, str(tmp_path))]
    assert len(found) == 5, found
    assert "without a distmem-docs marker" in found[0] and "reason" in found[1] and "no-such-setup" in found[2]
    assert "held-by" in found[3] and "mark it python" in found[4]


def test_a_run_block_is_read_as_a_user_types_it():
    """Continuations join, comments stay for bash, an optional [--flag] runs without and with it,
    a `$ CMD` line's following lines are its output."""
    b = regen.Block("x.md", 1, {"_kind": "run"}, "```bash", [
        "distmem plan --gpus 4x80GiB \\", "    --strategy pipeline [--recompute] [--headroom 10%]   # note",
        "# a comment", "", "distmem doctor"], 1, 6)
    texts = [c.text for c in regen.commands(b)]
    assert texts == ["distmem plan --gpus 4x80GiB  --strategy pipeline   # note",
                     "distmem plan --gpus 4x80GiB  --strategy pipeline --recompute --headroom 10%   # note",
                     "distmem doctor"], texts
    b = regen.Block("x.md", 1, {"_kind": "run"}, "```", ["$ echo 42", "42", "$ true"], 1, 4)
    assert [(c.text, c.expect) for c in regen.commands(b)] == [("echo 42", ["42"]), ("true", [])]


def test_a_block_that_fails_or_prints_otherwise_is_found(tmp_path):
    """The runner can fail: a command that exits non-zero, one that prints what its block does not
    show, a snippet that raises; the ones that hold pass, and a later block sees an earlier one's file."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "<!-- distmem-docs: run -->\n```\n$ python -c 'print(41 + 1)'\n41\n```\n\n"
        "<!-- distmem-docs: run -->\n```bash\nfalse\n```\n\n"
        "<!-- distmem-docs: python -->\n```python\nopen('made.txt', 'w').write('x')\nraise SystemExit(3)\n```\n\n"
        "<!-- distmem-docs: run -->\n```bash\ntest -s made.txt   # the snippet's file\n"
        "python -c 'print(6 * 7)'\n```\n")
    runner = regen.Runner(str(tmp_path))
    try:
        results = [runner.run(b) for b in regen.all_fences(str(tmp_path))]
    finally:
        runner.close()
    assert "prints what the block does not show" in results[0].problems[0] and "now:  42" in results[0].problems[0]
    assert "exited 1" in results[1].problems[0]
    assert "exited 3" in results[2].problems[0]
    assert results[3].problems == [] and len(results[3].outcomes) == 2
