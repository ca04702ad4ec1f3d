"""What ``distmem fit`` searches: parallel layouts, their enumeration and the throughput proxy that ranks them. Pure.

A :class:`ParallelLayout` is one way to run a training job on a fleet: ``data_parallel`` replicas of a
``pipeline`` of stages, each replica taking ``micro_batch`` samples ``accumulation`` times per
step (gradient accumulation when ``pipeline == 1``, the pipeline's micro-batches otherwise), so
``global batch = data_parallel x accumulation x micro_batch``; in a ``precision``, with or
without activation ``recompute``, with ``ranks_per_gpu`` processes sharing each GPU.

The costs that price a layout are in :mod:`distmem.plan.fit.costs`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple


__all__ = ["PROXY_TEXT", "ParallelLayout", "divisors", "enumerate_layouts", "MICRO_STEP_OVERHEAD_SAMPLES",
           "MIXED_PRECISION_SPEEDUP", "RECOMPUTE_COST"]

#: Throughput proxy: a micro-step costs as much as this many extra samples (kernel launches,
#: per-step Python, optimizer hooks), so eight micro-steps of 4 cost more than one of 32.
MICRO_STEP_OVERHEAD_SAMPLES = 2.0

#: Throughput proxy: mixed precision (fp16/bf16 math on tensor cores) runs a step this much faster
#: than float32. An assumption for ranking only; the memory side is the estimator's.
MIXED_PRECISION_SPEEDUP = 2.0

#: Throughput proxy: recomputation runs every forward twice: (1 fwd + 2 bwd + 1 fwd) / (1 fwd + 2 bwd).
RECOMPUTE_COST = 4.0 / 3.0


def divisors(n: int) -> List[int]:
    """Positive divisors of ``n`` in increasing order."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return small + large[::-1]


@dataclass(frozen=True, order=True)
class ParallelLayout:
    """One way to run the job (data x pipeline x micro-batch x ...), not the observed placement of ranks
    (:class:`distmem.discover.layout.Layout`); ``global batch = data_parallel x accumulation x micro_batch``."""

    data_parallel: int
    pipeline: int
    micro_batch: int
    accumulation: int
    precision: str
    recompute: bool
    ranks_per_gpu: int
    schedule: Optional[str] = None  # "1f1b" | "gpipe" when pipeline > 1
    #: sharded data parallel over the ``data_parallel`` replicas (:data:`distmem.plan.wrappers.SHARDINGS`:
    #: zero1, zero2, fsdp2, fsdp2_keep); "" replicates the state (DDP, Horovod)
    shard: str = ""

    @property
    def ranks(self) -> int:
        return self.data_parallel * self.pipeline

    @property
    def global_batch(self) -> int:
        return self.data_parallel * self.accumulation * self.micro_batch

    @property
    def bubble(self) -> float:
        """Pipeline bubble fraction ``(p - 1) / (m + p - 1)`` (0 without a pipeline)."""
        p, m = self.pipeline, self.accumulation
        return (p - 1) / (m + p - 1) if p > 1 else 0.0

    def step_units(self) -> float:
        """The throughput proxy: one step's time per GPU in sample-passes of the whole model.

        ``ranks_per_gpu x (m + p - 1) x (micro_batch + MICRO_STEP_OVERHEAD_SAMPLES) / p``, times
        :data:`RECOMPUTE_COST` with recompute and divided by :data:`MIXED_PRECISION_SPEEDUP` in mixed
        precision: a pipeline of ``p`` stages runs ``m + p - 1`` slots of ``1/p`` of the model, and
        ranks sharing a GPU take turns on it."""
        p, m = self.pipeline, self.accumulation
        units = self.ranks_per_gpu * (m + p - 1) * (self.micro_batch + MICRO_STEP_OVERHEAD_SAMPLES) / p
        if self.recompute:
            units *= RECOMPUTE_COST
        if self.precision != "float32":
            units /= MIXED_PRECISION_SPEEDUP
        return units

    def describe(self) -> str:
        pipe = f"pp{self.pipeline} {self.schedule}" if self.pipeline > 1 else "no pipeline"
        extra = (", recompute" if self.recompute else "") + (f", {self.ranks_per_gpu} ranks/GPU"
                                                              if self.ranks_per_gpu > 1 else "")
        if self.shard:
            extra += f", {self.shard} over {self.data_parallel}"
        return (f"dp{self.data_parallel} x {pipe}, micro-batch {self.micro_batch} x {self.accumulation}, "
                f"{self.precision}{extra}")

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(ranks=self.ranks, bubble=round(self.bubble, 4))
        return d


PROXY_TEXT = ("step time per GPU in sample-passes of the model (lower is faster): ranks/GPU x (m + p - 1) x "
              "(micro-batch + 2) / p, x 4/3 with recompute, / 2 in mixed precision; m = micro-batches "
              "(accumulation) per step, p = pipeline stages")


def enumerate_layouts(num_blocks: int, B: int, gpus_per_host: int, hosts: int, *, precisions: List[str],
               schedules: Sequence[str], recompute: Sequence[bool], ranks_per_gpu: Sequence[int],
               pipelines: Optional[Sequence[int]], micro_batches: Optional[Sequence[int]],
               fixed_local_size: Optional[int] = None, idle_gpus: bool = False,
               shardings: Sequence[str] = ()) -> Tuple[List[Tuple[ParallelLayout, int]], List[int]]:
    """All layouts with their ranks per host; and every data-parallel degree considered. Each
    layout of more than one replica also comes sharded in each of ``shardings``."""
    out: List[Tuple[ParallelLayout, int]] = []
    degrees: List[int] = []
    if fixed_local_size is not None:
        L = fixed_local_size
        k = L // gpus_per_host if L > gpus_per_host else 1
        shapes = [(L, k)]
    else:
        # every GPU busy; idle_gpus adds layouts on fewer GPUs per host (divisors of the count)
        shapes = [(L, 1) for L in (divisors(gpus_per_host) if idle_gpus else [gpus_per_host])]
        shapes += [(k * gpus_per_host, k) for k in ranks_per_gpu if k > 1]
    for L, k in shapes:
        R = L * hosts
        for p in divisors(R):
            if p > num_blocks or (pipelines is not None and p not in pipelines):
                continue
            d = R // p
            degrees.append(d)
            if B % d:
                continue
            per_replica = B // d
            for m in divisors(per_replica):
                mb = per_replica // m
                if micro_batches is not None and mb not in micro_batches:
                    continue
                shards = [""] + (list(shardings) if d > 1 else [])
                for prec in precisions:
                    for sh in shards:
                        if p == 1:
                            out.append((ParallelLayout(d, 1, mb, m, prec, False, k, None, sh), L))
                            continue
                        for sched in schedules:
                            for rc in recompute:
                                out.append((ParallelLayout(d, p, mb, m, prec, rc, k, sched, sh), L))
    return out, sorted(set(degrees))
