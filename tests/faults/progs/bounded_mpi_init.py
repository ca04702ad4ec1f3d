"""A bounded MPI_Init, for the hang bench/comm/faults.py finds under mpirun: a rank lost before MPI_Init
(distmem initialises MPI lazily, inside the first report()) leaves every other rank blocked in
MPI_Init's fence, with no timeout, and mpi4py holds the GIL there, so a thread cannot bound it.
Calling MPI_Init_thread through ctypes (which releases the GIL) in a daemon thread can be bounded;
mpi4py then attaches with rc.initialize = False.

    mpirun -np 2 -x KILL1=1 --mca orte_abort_on_non_zero_status 0 python bounded_mpi_init.py
      rank 0: MPI_Init not done after 5.00 s        (exit 3: where distmem would raise)
    mpirun -np 2 -x KILL1=0 python bounded_mpi_init.py
      rank 0/1: ctypes init ok provided=3 ... allgather=[0, 1]

Not used by the bench or the tests; a tested sketch of a remedy for distmem's MPI transport.
"""
import ctypes
import ctypes.util
import os
import signal
import threading
import time

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
if rank == 1 and os.environ.get("KILL1") == "1":
    os.kill(os.getpid(), signal.SIGKILL)
lib = ctypes.CDLL(ctypes.util.find_library("mpi") or "libmpi.so.40", mode=ctypes.RTLD_GLOBAL)
provided = ctypes.c_int(-1)
t0 = time.time()
MPI_THREAD_MULTIPLE = 3  # Open MPI's value; mpi4py's MPI.THREAD_MULTIPLE once imported
thread = threading.Thread(target=lambda: lib.MPI_Init_thread(None, None, MPI_THREAD_MULTIPLE, ctypes.byref(provided)),
                          daemon=True)
thread.start()
thread.join(float(os.environ.get("DISTMEM_TIMEOUT", "5")))
if thread.is_alive():
    print(f"rank {rank}: MPI_Init not done after {time.time() - t0:.2f} s", flush=True)
    os._exit(3)
import mpi4py  # noqa: E402

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

print(f"rank {rank}: ctypes init ok provided={provided.value} initialized={MPI.Is_initialized()} "
      f"allgather={MPI.COMM_WORLD.allgather(rank)}", flush=True)
