"""Runs on every rank under `mpirun -np 2` on a GPU machine (launched by tests/gpu/test_guard_gpu.py).

Rank FAIL_RANK gets a real per-process limit (torch.cuda.set_per_process_memory_fraction) from step
ARM_STEP on, calibrated between the peak memory of one micro-batch of the full per-rank batch and of
half of it, so the full micro-batch fails in the CUDA caching allocator itself and the half fits.
Nothing is injected. Every rank asserts: the job finishes, the first fallback names only FAIL_RANK and
carries the allocator's own message, every rank ends with the same micro-batch and fallbacks, the
global batch is unchanged and the final weights are bit-identical. Rank 0 prints GUARD_GPU_RESULT.
"""
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import distmem.guard as guard  # noqa: E402
from distmem.comm import get_comm  # noqa: E402

WIDTH = int(os.environ.get("GUARD_GPU_WIDTH", "2048"))
LOCAL = int(os.environ.get("GUARD_GPU_LOCAL_BATCH", "8192"))
STEPS, ARM_STEP, FAIL_RANK = 6, 2, 1


def fail(msg: str) -> None:
    sys.stderr.write(f"[rank {RANK}] GUARD GPU TEST FAILED: {msg}\n")
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


comm = get_comm()
RANK, SIZE = comm.rank, comm.size
if SIZE < 2 or comm.name != "mpi":
    fail(f"needs 2+ ranks over mpi4py, got {SIZE} over {comm.name}")
local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", RANK))
device = torch.device("cuda", local_rank % torch.cuda.device_count())
torch.cuda.set_device(device)

torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                            torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                            torch.nn.Linear(WIDTH, 10)).to(device)


def batch(step: int, n: int = LOCAL):
    g = torch.Generator(device=device).manual_seed(1000 * RANK + step)
    return (torch.randn(n, WIDTH, generator=g, device=device),
            torch.randint(0, 10, (n,), generator=g, device=device))


def peak(n: int):
    """Peak allocated and reserved bytes of a forward/backward over n samples (gradients kept)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    x, y = batch(999, n)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    del x, y
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


full_alloc, _ = peak(LOCAL)
_, half_reserved = peak(LOCAL // 2)
model.zero_grad(set_to_none=True)
state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # SGD momentum, made at step 0
limit = (full_alloc + half_reserved) // 2 + state_bytes
total = torch.cuda.get_device_properties(device).total_memory
if full_alloc < half_reserved * 1.1:
    fail(f"calibration: a full micro-batch peaks at {full_alloc} B, half of it reserves {half_reserved} B; no room "
         "for a limit between them (raise GUARD_GPU_LOCAL_BATCH)")

opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
samples = []


def loss_of(xb, yb):
    samples.append(len(xb))
    return F.cross_entropy(model(xb), yb)


step = guard.step(loss_of, params=list(model.parameters()), apply=lambda _: opt.step(), micro_batch_size=LOCAL,
                  global_batch_size=LOCAL * SIZE, comm=comm, timeout=120)
t0 = time.monotonic()
for i in range(STEPS):
    if i == ARM_STEP and RANK == FAIL_RANK:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
    step(*batch(i))
torch.cuda.synchronize(device)
seconds = time.monotonic() - t0

h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().double().cpu().numpy().tobytes())
digest = h.hexdigest()[:16]
view = [(f.step, tuple(f.ranks), f.old_micro_batch, f.new_micro_batch) for f in step.fallbacks]
rows = comm.allgather({"rank": RANK, "micro": step.micro_batch_size, "view": view, "checksum": digest,
                       "errors": {str(k): v for f in step.fallbacks for k, v in f.errors.items()},
                       "samples": samples, "recovery": [f.recovery_seconds for f in step.fallbacks]}, 120)

if not step.fallbacks:
    fail(f"no fallback happened: rank {FAIL_RANK}'s limit of {limit} B ({limit / total:.4f} of {total} B) did not "
         f"make a micro-batch of {LOCAL} fail (calibrated peaks: full {full_alloc} B allocated, half "
         f"{half_reserved} B reserved)")
first = step.fallbacks[0]
if first.ranks != [FAIL_RANK] or first.step != ARM_STEP:
    fail(f"first fallback {view[0]}: expected step {ARM_STEP} on rank(s) [{FAIL_RANK}] only")
msg = first.errors.get(FAIL_RANK, "")
if "OutOfMemoryError" not in msg or "out of memory" not in msg.lower():
    fail(f"the fallback's error is not the CUDA allocator's own: {msg!r}")
if len({json.dumps(r["view"]) for r in rows}) != 1 or len({r["micro"] for r in rows}) != 1:
    fail("ranks disagree: " + "; ".join(f"rank {r['rank']}: micro {r['micro']} fallbacks {r['view']}" for r in rows))
if len({r["checksum"] for r in rows}) != 1:
    fail("final weights differ: " + ", ".join(f"rank {r['rank']}: {r['checksum']}" for r in rows))
if step.micro_batch_size >= LOCAL or LOCAL % step.micro_batch_size:
    fail(f"final micro-batch {step.micro_batch_size} is not a smaller divisor of {LOCAL}")
# the global batch is unchanged: the last step still consumed LOCAL samples on each rank, in micro-batches
last = samples[-(LOCAL // step.micro_batch_size):]
if sum(last) != LOCAL or set(last) != {step.micro_batch_size} or first.global_batch != LOCAL * SIZE:
    fail(f"samples of the last step {last} do not add up to the per-rank batch {LOCAL}")
if RANK == 0:
    print("GUARD_GPU_RESULT " + json.dumps({
        "ranks": SIZE, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "limit_bytes": limit, "calibration": {"full_alloc": full_alloc, "half_reserved": half_reserved},
        "micro_before": LOCAL, "micro_after": step.micro_batch_size, "fallbacks": view, "oom_message": msg,
        "recovery_seconds": [r["recovery"] for r in rows], "seconds": round(seconds, 3), "checksum": digest}), flush=True)
comm.barrier(120)
