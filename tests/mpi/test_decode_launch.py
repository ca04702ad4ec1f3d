"""A row that fails to decode costs that row, never the gather (issue 26, finding 12).

Three real ranks per transport; rank 1 sends an object no other rank can unpickle. Rank 0's gather
keeps rows 0 and 2 and reports rank 1 as missing, every rank returns well within the timeout (before
the fix, rank 0's gather raised under MPI and ranks 1 and 2 waited 20 s for their ack; under Horovod,
torch.distributed and tf.distribute every row was lost), and an all-gather raises on the ranks that
cannot decode, naming rank 1, while rank 1 - which can decode the others - gets every row."""
import os
import socket

import pytest

from helpers import ROOT, env_bin, horovodrun, mpirun, python, result_rows, run

PROG = os.path.join(os.path.dirname(__file__), "progs", "undecodable_row.py")
TIMEOUT = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(transport: str):
    env = {"TRANSPORT": transport, "DECODE_TIMEOUT": str(TIMEOUT), "DISTMEM_QUIET": "1"}
    if transport == "mpi":
        pytest.importorskip("mpi4py")
        return mpirun(3, [PROG], timeout=180, env=env)
    if transport == "torch":
        pytest.importorskip("torch")
        env["MASTER_PORT"] = str(_free_port())
        return mpirun(3, [PROG], timeout=180, env=env)
    if transport == "horovod":
        if not os.path.exists(os.path.join(env_bin(), "horovodrun")):
            pytest.skip("horovodrun not in this environment (the main environment has it)")
        return horovodrun(3, [PROG], mode="gloo", timeout=240, env=env)
    pytest.importorskip("tensorflow")
    return run([python(), os.path.join(ROOT, "launch", "tf_config.py"), "-n", "3", "--timeout", "200", PROG], 240,
               env)


@pytest.mark.parametrize("transport", ["mpi", "horovod", "torch", "tf"])
def test_an_undecodable_row_is_a_missing_rank_and_nobody_waits(transport):
    res = launch(transport).check()
    rows = {}
    for got in result_rows(res.out):
        rows[got["rank"]] = got
    assert sorted(rows) == [0, 1, 2], res.out[-4000:]
    assert rows[0]["rows"] == [0, None, 2] and rows[0]["missing"] == [1], rows[0]
    assert rows[1]["rows"] is None and rows[2]["rows"] is None
    for r in rows.values():
        assert r["gather_seconds"] < TIMEOUT / 2 and r["allgather_seconds"] < TIMEOUT / 2, r
    assert rows[0]["allgather"] == {"missing": [1]} and rows[2]["allgather"] == {"missing": [1]}
    assert rows[1]["allgather"] == [0, 1, 2]
    assert "cannot be decoded here" in res.out
