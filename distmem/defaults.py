"""The numbers a plan assumes when the user does not say, each with where it comes from. A leaf."""
from __future__ import annotations

__all__ = ["OVERHEAD_BYTES", "RESERVE", "LIMIT_HEADROOM", "TORCH_EXPANDABLE_HEADROOM", "TORCH_CACHE_HEADROOM",
           "TF_GPU_ALLOCATOR_HEADROOM", "headroom", "MIN_LIMIT_BYTES", "MAX_LIMIT_BYTES", "FROM_REPORT_MARGIN", "ESTIMATE_MARGIN",
           "FRAGMENTATION_MIN_BYTES", "FOREIGN_MIN_BYTES", "IMBALANCE_RATIO", "FRAGMENTATION_TIE", "GROWTH_MIN_STEPS",
           "GROWTH_MIN_BYTES", "OUTSIDE_MIN_BYTES", "DEVICE_FULL_BYTES"]

_MiB = 1024**2

#: Memory a process holds on a GPU outside the framework allocator: CUDA context, cuBLAS/cuDNN
#: handles and workspaces. Measured on an H200 with CUDA 13: 612 MiB right after CUDA starts and
#: about 760 MiB once cuBLAS/cuDNN have run a training step; we plan for the latter, rounded up to
#: the next 64 MiB. The torch adapter can measure it on the machine instead (overhead="measure").
OVERHEAD_BYTES = 768 * _MiB

#: Kept free on every GPU for the driver and for fragmentation between processes' pools.
RESERVE = "256MiB"

#: Headroom a hard limit derived from an allocator peak needs (pipeline stages, model groups, the
#: layouts ``fit`` and ``strategy="auto"`` choose). A capped allocator frees its cache and retries
#: before it fails, so the limit covers the peak plus fragmentation, not the cache an unconstrained
#: one keeps. Measured on an H200 for torch (bench/results/fit_h200.json: the smallest limit each
#: workload ran under without an OOM); TensorFlow's BFC allocator coalesces and rounds to 256 B,
#: so the same figure is kept for it (not measured on a GPU: the GPU machine has no TensorFlow).
LIMIT_HEADROOM = 0.10

#: Headroom a torch hard limit needs over the estimate's bounded (high) figure where the job runs with
#: the allocator's expandable segments (the layouts ``fit`` and ``strategy="auto"`` choose; ``init()``
#: sets them before CUDA starts). The bounded figure covers the estimate's error (its path's ``under``
#: margin, distmem.estimate.table); the headroom covers what the allocator reserves above the bytes
#: allocated when the cap is reached (a segment's pages, the small pool's 2 MiB blocks) beyond what the
#: bound leaves. Measured on the H200 (bench/results/fit_headroom_h200_fine2_summary.json): 108 ranks
#: of the fit at scale, each run under 1.00-1.04 x its true peak in steps of half a point, each priced
#: by the figure fit gives it now; over the bounded figure the fit half (45 ranks) needed at most
#: 0.71%, so 1.5%, half a point over and rounded up to the half point; every one of the 62 held-out
#: ranks that trained needed at most -0.02%. Run at scale under it (bench/results/
#: fit_scale_h200_headroom15_summary.json): every held-out case (119) and 78 of the fit half's 92,
#: none of 197 chosen layouts out of memory. Without expandable segments :data:`LIMIT_HEADROOM`
#: holds, with room for the largest allocation.
TORCH_EXPANDABLE_HEADROOM = 0.015

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


#: The largest limit, reserve or budget anything may carry: 2**63 - 1 bytes (what a signed 64-bit
#: counter holds; no GPU comes near it).
MAX_LIMIT_BYTES = 2**63 - 1


def headroom(framework: str, enforced: bool = True, expandable: bool = False) -> float:
    """The headroom (a ratio of the demand) a limit derived from an allocator peak gets when none is
    given: :data:`LIMIT_HEADROOM` under a hard limit (:data:`TORCH_EXPANDABLE_HEADROOM` for torch
    when the job runs with expandable segments: ``expandable``); a budget that is not enforced
    (memory growth) must also hold the cache an unconstrained allocator keeps
    (:data:`TORCH_CACHE_HEADROOM` for torch, :data:`TF_GPU_ALLOCATOR_HEADROOM` otherwise). The one
    place every door reads it."""
    if enforced:
        return TORCH_EXPANDABLE_HEADROOM if expandable and framework == "torch" else LIMIT_HEADROOM
    return TORCH_CACHE_HEADROOM if framework == "torch" else TF_GPU_ALLOCATOR_HEADROOM


#: The margin a limit planned from a run's observed peak gets (``distmem plan --from``,
#: ``init(from_report=...)``): the peak plus 10%, the same figure as :data:`LIMIT_HEADROOM` (the
#: smallest limit each H200 workload ran under was its peak plus fragmentation, below 10%).
FROM_REPORT_MARGIN = 0.10

#: A change the post-mortem prices with distmem's estimate (a model of the step, not this job's own
#: measured steps: a smaller micro-batch after a rank ran out in its first step) must fit its limit
#: with this much more room than :data:`FROM_REPORT_MARGIN`: the estimate is of the step's allocated
#: peak, while a hard limit caps the reserved pool, whose blocks of mixed sizes ran further above it. On
#: the H200 an MLP's accumulation step priced at 1.1 GiB with the batch held whole ran out of its 1.25 GiB
#: limit (bench/results/postmortem_scenarios_h200.json, global_batch).
ESTIMATE_MARGIN = 0.10

#: An out-of-memory error is put down to fragmentation only when the allocator held at least this
#: much free in its pool (reserved - allocated) besides the request not fitting its largest free
#: block: a few MiB of slack is every allocator's normal rounding, not a cause.
FRAGMENTATION_MIN_BYTES = 64 * _MiB

#: Another process's memory on a rank's GPU is named as a cause only above this many bytes the plan
#: did not reserve (a monitoring agent's context is a few MiB).
FOREIGN_MIN_BYTES = 64 * _MiB

#: A rank whose step needed this many times the median of its peers' (the other ranks of its
#: pipeline stage) is out of balance with them: uneven data, a longer sequence, another stage's
#: layers. Below it the ranks differ by what steps normally differ by.
IMBALANCE_RATIO = 1.5

#: A largest free block within this fraction of the request is a tie with it (the allocator's
#: rounding and block splitting), not fragmentation.
FRAGMENTATION_TIE = 0.05

#: Memory is said to grow from step to step only over at least this many steps' starts, by at least
#: this many bytes in all: a step's allocator caches and lazily built state settle within a step or two.
GROWTH_MIN_STEPS = 4
GROWTH_MIN_BYTES = 64 * _MiB

#: A process's memory outside its allocator (NVML's bytes for it - its allocator's pool) beyond the
#: plan's per-process overhead is named as a cause only above this many bytes in all: the overhead's
#: own spread (cuBLAS/cuDNN handles, lazily loaded kernels) stays below it.
OUTSIDE_MIN_BYTES = 256 * _MiB

#: A GPU is full, by NVML, when its total less what the driver keeps less every process's bytes
#: leaves under this much: a rank that ended on its own CUDA failure then (NCCL's "unhandled cuda
#: error", whose detail "Failed to CUDA calloc async 608 bytes" a record may not keep) ran out of
#: memory outside its allocator. On the H200 two ranks that did left 18 MiB of 140.4 GiB
#: (tests/fixtures/postmortem/h200/outside_allocator-*).
DEVICE_FULL_BYTES = 64 * _MiB
