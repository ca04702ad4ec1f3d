"""Is the estimator's model of TensorFlow's BFC allocator right? Replay TensorFlow's own allocations.

For one zoo case (``bench/estimate/estimate_zoo.py``), a fresh process runs the profiler from before the model
is built through three training steps, so every allocation and free of the process is in the trace
with its address and requested bytes. The recorded sequence is then replayed, in TensorFlow's own
order, through distmem's BFC model (``distmem.estimate.allocators.BFCAllocator``), and three peaks
are printed as one JSON line: what TensorFlow's allocator held in chunks (the figure the accuracy
benchmark measures), what the model holds for the same sequence, and the bytes requested at the
busiest moment (no allocator). If the model's peak matches TensorFlow's, the allocator model is
right and any fragmentation the estimate misses comes from the order TensorFlow's executor
allocates in, not from the allocator's rules.

distmem-bench: internal - it checks the estimator's own BFC allocator model against TensorFlow's
recorded allocations (a diagnosis of the estimate's parts); no product figure comes from it, the
estimate's accuracy is estimate_zoo's and estimate_heldout's through distmem.estimate.

    python bench/estimate/bfc_replay.py ResNet50V2 64 16 sgd float32 [--out FILE.jsonl]   # appends a line
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

CHILD = r'''
import os, sys
sys.path.insert(0, sys.argv[1])  # the tree's root
from bench.estimate import estimate_zoo as z, estimate_zoo_keras as zk
tf, _ = zk.keras_ns()
case = {"model": sys.argv[3], "size": int(sys.argv[4]), "batch": int(sys.argv[5]), "optimizer": sys.argv[6],
        "precision": sys.argv[7]}
tf.profiler.experimental.start(sys.argv[2])  # before the model exists: every allocation is traced
tf, model, x, y = zk.keras_compiled(case)
for _ in range(3):
    model.train_on_batch(x, y)
tf.profiler.experimental.stop()
print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
'''


def events(logdir: str):
    """(time, is_alloc, address, requested bytes, TensorFlow's bytes in use after it), in order."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    out = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.stat_metadata.items()}
        kinds = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for e in line.events:
                kind = kinds.get(e.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                st = {names.get(s.metadata_id): (s.int64_value or s.uint64_value) for s in e.stats}
                out.append((line.timestamp_ns * 1000 + e.offset_ps, kind == "MemoryAllocation", st.get("addr"),
                            int(st.get("requested_bytes") or 0), int(st.get("bytes_allocated") or 0)))
    out.sort(key=lambda r: r[0])
    return out


def replay(evs):
    from distmem.estimate.allocators import BFCAllocator
    a = BFCAllocator(0)
    live, requested, peaks = {}, 0, {"tf": 0, "model": 0, "requested": 0}
    for _, is_alloc, addr, nbytes, tf_in_use in evs:
        if is_alloc:
            a.alloc(addr, nbytes)
            live[addr] = nbytes
            requested += nbytes
        else:
            a.free(addr)
            requested -= live.pop(addr, 0)
        peaks["tf"] = max(peaks["tf"], tf_in_use)
        peaks["model"] = max(peaks["model"], a.in_use)
        peaks["requested"] = max(peaks["requested"], requested)
    return peaks


def main(argv=None) -> int:
    from bench.estimate import estimate_zoo as z
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    z.add_case_arguments(p)
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    p.add_argument("--timeout", type=int, default=900)
    args = p.parse_args(argv)
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryDirectory() as logdir:
        out = subprocess.run([sys.executable, "-c", CHILD, runner.ROOT, logdir, args.model, str(args.size),
                              str(args.batch), args.optimizer, args.precision], env=env, capture_output=True, text=True,
                             timeout=args.timeout)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        measured = int(out.stdout.strip().splitlines()[-1])
        evs = events(logdir)
    peaks = replay(evs)
    import tensorflow as tf
    line = {"bench": "bfc_replay", "case": z.case_id(z.case_of(args)),
            "tensorflow": tf.__version__, "events": len(evs),
            "tf_chunk_peak": peaks["tf"], "model_chunk_peak_same_order": peaks["model"],
            "requested_peak": peaks["requested"], "get_memory_info_peak": measured,
            "model_over_tf": round(peaks["model"] / peaks["tf"], 4) if peaks["tf"] else None,
            "tf_chunks_over_requested": round(peaks["tf"] / peaks["requested"], 4) if peaks["requested"] else None}
    runner.emit(line, args.out)  # a .jsonl --out gets the line appended
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
