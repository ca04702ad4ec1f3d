"""The numbers a plan assumes when the user does not say, each with where it comes from. A leaf."""
from __future__ import annotations

__all__ = ["OVERHEAD_BYTES", "RESERVE", "HEADROOM", "TORCH_CACHE_HEADROOM", "TF_GPU_ALLOCATOR_HEADROOM",
           "headroom_for", "MIN_LIMIT_BYTES"]

_MiB = 1024**2

#: Memory a process holds on a GPU outside the framework allocator: CUDA context, cuBLAS/cuDNN
#: handles and workspaces. Measured on an H200 with CUDA 13: 612 MiB right after CUDA starts and
#: about 760 MiB once cuBLAS/cuDNN have run a training step; we plan for the latter, rounded up to
#: the next 64 MiB. The torch adapter can measure it on the machine instead (overhead="measure").
OVERHEAD_BYTES = 768 * _MiB

#: Kept free on every GPU for the driver and for fragmentation between processes' pools.
RESERVE = "256MiB"

#: Headroom added to a computed demand (pipeline stages, model groups) when none is given.
HEADROOM = "5%"

#: torch's caching allocator keeps freed blocks reserved; after one Adam step of eight torchvision
#: models at batch 32 on an H200, reserved ran 7% to 52% above the allocated peak. A footprint must
#: cover the worst of them, so the default headroom is the largest ratio measured.
TORCH_CACHE_HEADROOM = 0.52

#: TensorFlow's GPU BFC allocator coalesces free chunks and rounds to 256 B, so it wastes less than
#: torch's cache; 10% covers its bin-level internal fragmentation. Not measured on a GPU here (the
#: GPU machine has no TensorFlow): a planning margin, to be replaced by a measurement.
TF_GPU_ALLOCATOR_HEADROOM = 0.10

#: A planned limit below this is an error, never a silent zero (a framework given 0 bytes fails late).
MIN_LIMIT_BYTES = 1 * _MiB


def headroom_for(framework: str) -> float:
    """The allocator-cache headroom a limit derived from allocator peaks needs under ``framework``."""
    return TORCH_CACHE_HEADROOM if framework == "torch" else TF_GPU_ALLOCATOR_HEADROOM
