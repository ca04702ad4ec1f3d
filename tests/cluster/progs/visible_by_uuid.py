"""Run the rest of the command line with CUDA_VISIBLE_DEVICES naming this rank's own GPU by UUID.

The GPU is number ``local rank`` of this host's declared fleet, named by its UUID (``--chars N``: only
the first N characters, a unique prefix, as CUDA accepts). How a site hands out GPUs by UUID.
"""
from __future__ import annotations

import os
import socket
import sys
import uuid

__all__ = []


def main() -> None:
    args = sys.argv[1:]
    chars = None
    if args[:1] == ["--chars"]:
        chars, args = int(args[1]), args[2:]
    env = os.environ
    local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK") or env.get("SLURM_LOCALID") or env.get("LOCAL_RANK") or 0)
    full = "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"distmem-fleet://{socket.gethostname()}/{local}"))
    env["CUDA_VISIBLE_DEVICES"] = full[:chars] if chars else full
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
