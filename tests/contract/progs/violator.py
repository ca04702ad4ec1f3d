"""A process of the contract's own test (tests/contract/test_contract.py): distmem doing its usual
work (``clean``), or with one deliberate breach of the contract added, as new code could add it:

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

if case == "read":
    from distmem.plan import from_report

    def bare(path):  # forgets every check
        with open(path) as f:
            return json.load(f)

    from_report.read_report_file = bare
if case in ("clean", "read"):
    from distmem.cli import main

    sys.exit(main(["plan", "--from", os.path.join(shared, "report.json"), "--gpus", "1x16GiB", "--ranks", "2"]))
if case == "bind":
    from distmem.comm import heartbeat_trust

    heartbeat_trust.listen_addresses = lambda *args, **kwargs: ["0.0.0.0"]
    distmem.init(fleet="2x16GiB", framework="none", verbose=False)
if case == "child":
    from distmem import children

    children.argv = lambda **kw: [sys.executable, "-c", kw["code"], *kw.get("args", ())]
    children.run(code="print('child')", capture_output=True, timeout=60)
if case == "import":
    sys.path.insert(0, "")
    import planted_module  # noqa: F401 - in the working folder
