"""A process of the contract's own test (tests/contract/test_contract.py): distmem doing its usual
work (``clean``), or with one deliberate breach of the contract added to distmem's code (compiled
under the name of the distmem module it changes, as a change to that file would be):

* ``read``: the next plan's report read with a bare ``open()`` (no link, FIFO or owner check);
* ``bind``: the heartbeat's hub listening on every interface (run under ``mpirun -np 2``);
* ``child``: distmem's isolated child started as a plain ``python -c`` (the working folder first);
* ``import``: a module imported from the working folder through the entry ``python -c`` adds.
"""
import json
import os
import sys

case, shared = sys.argv[1], sys.argv[2]
import distmem  # noqa: E402,F401

#: New code in distmem, as a change could add it: compiled under the file name of the module it
#: replaces a function of, so that the hook sees distmem's code doing it.
BARE_READ = """
def read_report_file(path):  # forgets every check
    with open(path) as f:
        return json.load(f)
"""
if case == "read":
    from distmem.plan import from_report

    exec(compile(BARE_READ, from_report.__file__, "exec"), from_report.__dict__)
if case in ("clean", "read"):
    from distmem.cli import main

    sys.exit(main(["plan", "--from", os.path.join(shared, "report.json"), "--gpus", "1x16GiB", "--ranks", "2"]))
if case == "bind":
    from distmem.comm import heartbeat_trust

    exec(compile("def listen_addresses(*args, **kwargs):\n    return ['0.0.0.0']\n", heartbeat_trust.__file__,
                 "exec"), heartbeat_trust.__dict__)
    distmem.init(fleet="2x16GiB", framework="none", verbose=False)
if case == "child":
    from distmem import children

    exec(compile("def argv(**kw):\n    return [sys.executable, '-c', kw['code'], *kw.get('args', ())]\n",
                 children.__file__, "exec"), children.__dict__)
    children.run(code="print('child')", capture_output=True, timeout=60)
if case == "import":
    sys.path.insert(0, "")
    import planted_module  # noqa: F401 - in the working folder
