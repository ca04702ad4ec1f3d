"""One tf.distribute worker: gathers through MultiWorkerMirroredStrategy's collectives and prints
what it received as JSON lines the test reads. MODE=ok | skip (rank 1 never enters the gather)."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import distmem  # noqa: E402
import distmem.comm.tf_strategy  # noqa: E402

plan = distmem.init(strategy="data", verbose=False)  # before the strategy: the contract under test
import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
comm = distmem.use_strategy(strategy)
mode = os.environ.get("MODE", "ok")
timeout = float(os.environ.get("DISTMEM_TIMEOUT", "60"))


def say(key, value):
    print(f"RESULT {key} " + json.dumps(value), flush=True)


say("who", {"rank": comm.rank, "size": comm.size, "name": comm.name, "plan_rank": plan.rank,
            "plan_size": plan.world_size})
if mode == "skip" and comm.rank == 1:
    time.sleep(timeout + 3)  # never enters: rank 0 must give up within its timeout, not hang
    os._exit(0)
# Payloads of different lengths (one much longer) check the padding and the per-row lengths.
obj = {"rank": comm.rank, "text": "x" * (10 + 5000 * comm.rank), "nested": [comm.rank] * 3}
t0 = time.monotonic()
try:
    rows = comm.allgather(obj, timeout)
    say("allgather", [{"rank": r["rank"], "len": len(r["text"]), "nested": r["nested"]} for r in rows])
    say("sum", comm.allreduce([comm.rank + 1, 10], "sum", timeout))
    say("max", comm.allreduce([comm.rank + 1.5], "max", timeout))
    g, missing = comm.gather({"r": comm.rank}, 0, timeout)
    say("gather", {"rows": g, "missing": missing})
    rep = distmem.report(timeout=timeout)
    say("report", None if rep is None else {"ranks": [s.rank for s in rep.ranks], "missing": rep.missing,
                                            "transport": rep.aggregates.get("transport")})
except distmem.GatherTimeoutError as exc:
    say("timeout", {"seconds": time.monotonic() - t0, "missing": exc.missing, "message": str(exc)})
sys.stdout.flush()
os._exit(0)  # a collective abandoned after a timeout must not hold up interpreter exit
