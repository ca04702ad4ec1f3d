"""How ``distmem fit`` prices one layout: every stage's ranks held against their GPU's share. Pure.

For each :class:`~distmem.plan.fit.space.ParallelLayout` the :class:`Evaluator` holds every rank's demand
against its GPU:

* one stage (data parallel): the estimator's whole-step allocator peak at the micro-batch (plus
  the gradients accumulation keeps alive between micro-steps);
* a pipeline: the schedule-aware exact partition of the model's blocks
  (:mod:`distmem.plan.partition`: weights + gradients + optimizer state held once, activations x
  the micro-batches each stage holds in flight, the stage inputs), plus the backward's transient
  (two outputs of the stage's largest layer) and the buffers every rank keeps;

then ``planned = demand x (1 + headroom)`` in whole MiB (the allocator's cache and
fragmentation under a hard limit; where torch's expandable segments cannot be had, at least
``(demand + the largest single allocation) x (1 + headroom)``: a capped caching allocator can strand
a block that size, see :meth:`Evaluator.block_room`) must fit the rank's equal share of its GPU: total - driver
reserved - reserve - foreign - ranks on the GPU x memory outside the allocator
(:mod:`distmem.plan.outside`: CUDA context, cuBLAS/cuDNN, NCCL communicators).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ...costs import LayerCost
from ...discover.gpus import Gpu
from ...units import parse_bytes
from ..budget import Budget
from ..outside import outside_allocator_breakdown
from ..partition import accumulation_transient, lower_bound, partition_pipeline
from ..wrappers import added_bytes, sharding_wrapper, wrapper_demand
from .costs import Costs
from .space import ParallelLayout

__all__ = ["Evaluator", "Candidate", "StageFit", "nccl_communicators_of"]


def nccl_communicators_of(layout: ParallelLayout) -> int:
    """NCCL communicators a rank of ``layout`` creates: none alone, the world group for data
    parallel, world + pipeline group (+ the stage's data-parallel group) for a pipeline."""
    if layout.ranks == 1:
        return 0
    if layout.pipeline == 1:
        return 1
    return 2 if layout.data_parallel == 1 else 3


@dataclass
class StageFit:
    """One stage's ranks against their GPU (bytes). ``allocator_bytes``: the allocator peak the
    stage reaches; ``planned_bytes``: its limit (peak + headroom, whole MiB); ``share_bytes``: what
    its GPU offers each rank; ``breakdown``: the parts of the GPU memory a rank of it holds."""

    stage: int
    first_block: int
    stop_block: int
    in_flight: int
    allocator_bytes: int
    planned_bytes: int
    share_bytes: int
    gpu_total_bytes: int
    shared_by: int
    breakdown: Dict[str, int] = field(default_factory=dict)
    blocks: List[str] = field(default_factory=list)

    @property
    def margin_bytes(self) -> int:
        return self.share_bytes - self.planned_bytes

    @property
    def fits(self) -> bool:
        return self.planned_bytes <= self.share_bytes

    def to_dict(self) -> Dict[str, Any]:
        return {"stage": self.stage, "first_block": self.first_block, "stop_block": self.stop_block,
                "blocks": list(self.blocks), "in_flight": self.in_flight, "allocator_bytes": self.allocator_bytes,
                "planned_bytes": self.planned_bytes, "share_bytes": self.share_bytes,
                "gpu_total_bytes": self.gpu_total_bytes, "shared_by": self.shared_by,
                "margin_bytes": self.margin_bytes, "fits": self.fits, "breakdown": dict(self.breakdown)}


@dataclass
class Candidate:
    """A layout with its verdict. ``exact=False``: rejected by a lower bound, stages not computed."""

    layout: ParallelLayout
    fits: bool
    stages: List[StageFit] = field(default_factory=list)
    exact: bool = True
    outside: Dict[str, Any] = field(default_factory=dict)
    remedy: List[str] = field(default_factory=list)
    lower_bound_bytes: int = 0

    @property
    def binding(self) -> Optional[StageFit]:
        """The stage whose ranks are closest to (or furthest over) their GPU's share."""
        return min(self.stages, key=lambda s: s.margin_bytes) if self.stages else None

    @property
    def heaviest(self) -> Optional[StageFit]:
        return max(self.stages, key=lambda s: s.planned_bytes) if self.stages else None

    def allreduce_bytes(self, costs: Costs) -> int:
        """Gradient bytes one rank all-reduces per step (ring: ``2 (d - 1) / d`` x its stage's gradients)."""
        d = self.layout.data_parallel
        if d == 1:
            return 0
        split = costs.block_state_split()
        if self.stages and self.layout.pipeline > 1:
            grads = max(sum(b["gradients"] for b in split[s.first_block:s.stop_block]) for s in self.stages)
        else:
            grads = sum(b["gradients"] for b in split)
        return int(2 * (d - 1) / d * grads)

    def to_dict(self) -> Dict[str, Any]:
        b = self.binding
        return {"layout": self.layout.to_dict(), "fits": self.fits, "exact": self.exact,
                "step_units": round(self.layout.step_units(), 3),
                "binding_stage": b.stage if b else None,
                "margin_bytes": b.margin_bytes if b else None,
                "stages": [s.to_dict() for s in self.stages], "outside": self.outside,
                "remedy": list(self.remedy)}


class Evaluator:
    """Prices layouts; caches partitions, outside-allocator figures and shares."""

    def __init__(self, costs: Dict[str, Costs], gpus: List[Gpu], *, budget: Budget, overhead: Any, framework: str,
                 nccl: Any, nccl_buffsize: Any, wrapper: Any = None, expandable: bool = True) -> None:
        self.costs = costs
        self.gpus = gpus
        self.budget = budget
        self.headroom = budget.headroom
        self.framework = framework
        self.nccl = nccl
        self.nccl_buffsize = nccl_buffsize
        self.overhead = overhead
        #: a wrapper that shards nothing (Horovod, DDP): its buffers are added to every replicated rank
        self.wrapper = wrapper
        #: torch's allocator may use expandable segments (init() sets them where fit says so); without
        #: them every limit also leaves room for the largest single allocation
        self.expandable = expandable
        self._outside: Dict[int, Dict[str, Any]] = {}
        self._shares: Dict[Tuple[int, int, int], int] = {}
        self._parts: Dict[Tuple[Any, ...], Any] = {}
        self._blocks: Dict[Tuple[str, int], List[LayerCost]] = {}
        self._stage_gpus: Dict[Tuple[int, int, int], List[List[Gpu]]] = {}
        self._split: Dict[str, List[Dict[str, int]]] = {}
        self.evaluated = 0

    def outside(self, layout: ParallelLayout) -> Dict[str, Any]:
        comms = nccl_communicators_of(layout) if self.nccl in (None, "auto", True) else 0
        if comms not in self._outside:
            if self.overhead is not None:
                nbytes = parse_bytes(self.overhead, what="overhead")
                self._outside[comms] = {"total_bytes": nbytes, "parts": {"given": nbytes}, "assumed": [],
                                        "warnings": [], "sources": {"given": "overhead= argument"}}
            else:
                self._outside[comms] = outside_allocator_breakdown(
                    self.framework, nccl_communicators=comms, nccl_buffsize=self.nccl_buffsize,
                    nccl_peers=2 if comms else 0)
        return self._outside[comms]

    def share(self, gpu: Gpu, k: int, outside_bytes: int) -> int:
        key = (gpu.index, k, outside_bytes)
        if key not in self._shares:
            self._shares[key] = self.budget.share_or_zero(gpu, k, outside_bytes)
        return self._shares[key]

    def stage_gpus(self, layout: ParallelLayout, local_size: int) -> List[List[Gpu]]:
        """The GPUs each stage's ranks run on: rank ``r`` is stage ``r % p`` on its host's GPU
        ``(r % local_size) % gpus`` (launchers' block mapping, local rank ``i`` on GPU ``i % n``)."""
        p, n = layout.pipeline, len(self.gpus)
        key = (p, local_size, layout.ranks)
        if key not in self._stage_gpus:
            out: List[List[Gpu]] = [[] for _ in range(p)]
            # the mapping repeats after lcm(p, local_size) ranks
            period = min(layout.ranks, p * local_size // math.gcd(p, local_size))
            for r in range(period):
                gpu = self.gpus[(r % local_size) % n]
                if gpu not in out[r % p]:
                    out[r % p].append(gpu)
            self._stage_gpus[key] = out
        return self._stage_gpus[key]

    def split(self, precision: str) -> List[Dict[str, int]]:
        """Per block weights / gradients / optimizer bytes, computed once per precision."""
        if precision not in self._split:
            self._split[precision] = self.costs[precision].block_state_split()
        return self._split[precision]

    def blocks(self, precision: str, mb: int) -> List[LayerCost]:
        key = (precision, mb)
        if key not in self._blocks:
            self._blocks[key] = self.costs[precision].block_costs(mb)
        return self._blocks[key]

    def _added(self, grad_bytes: int) -> int:
        """What the job's replicating wrapper (Horovod's fusion buffer, DDP's buckets) adds to a rank."""
        return added_bytes(self.wrapper, grad_bytes) if self.wrapper is not None else 0

    def _planned(self, nbytes: int, block: int = 0) -> int:
        """The limit for an allocator peak of ``nbytes``: ``peak x (1 + headroom)`` in whole MiB, and
        at least ``(peak + block) x (1 + headroom)`` where ``block`` must be left room for."""
        limit = self.budget.limit_for(nbytes)
        return max(limit, self.budget.limit_for(nbytes + block)) if block else limit

    def block_room(self, c: Costs, layout: ParallelLayout) -> int:
        """The largest single allocation a limit must leave room for: 0 where the allocator can map
        blocks without splitting them (expandable segments) or does not strand them (TensorFlow's BFC
        coalesces); else torch's largest block at the layout's micro-batch (a capped caching
        allocator ran out of memory with a block that size stranded: vgg16 on the H200)."""
        if self.expandable or self.framework != "torch":
            return 0
        return int(c.largest_block(layout.micro_batch, layout.shard or ""))

    def lower_bound(self, layout: ParallelLayout) -> int:
        """A bound on the heaviest stage's allocator peak (bytes) that needs no partition."""
        c = self.costs[layout.precision]
        if layout.pipeline == 1:
            return 0
        m_eff = min(layout.accumulation, layout.pipeline) if layout.schedule == "1f1b" else layout.accumulation
        return lower_bound(self.blocks(layout.precision, layout.micro_batch), layout.pipeline, kind="pipeline",
                           schedule=layout.schedule, num_micro_batches=m_eff, recompute=layout.recompute,
                           input_bytes=c.input_bytes(layout.micro_batch)) + c.persistent_bytes

    def evaluate(self, layout: ParallelLayout, local_size: int, *, bound_only: bool = False) -> Candidate:
        c = self.costs[layout.precision]
        out = self.outside(layout)
        outside_bytes = int(out["total_bytes"])
        k = layout.ranks_per_gpu
        gpus = self.stage_gpus(layout, local_size)
        shares = [min(((self.share(g, k, outside_bytes), g) for g in gs), key=lambda x: x[0]) for gs in gpus]
        if bound_only and layout.pipeline > 1 and not layout.shard:
            lb = self.lower_bound(layout)
            best = max(s for s, _ in shares)
            if self._planned(lb) > best:
                return Candidate(layout, False, exact=False, outside=out, lower_bound_bytes=lb)
        self.evaluated += 1
        split = self.split(layout.precision)
        block = self.block_room(c, layout)
        stages: List[StageFit] = []
        if layout.pipeline == 1:
            if layout.shard:
                peak, parts = c.rank_peak(layout.micro_batch, layout.accumulation > 1,
                                          sharding_wrapper(layout.shard, layout.data_parallel))
            elif self.wrapper is not None and self.wrapper.kind == "ddp":
                # DDP's buckets depend on where the step peaks (the rebuild's second set is gone by the
                # update): the phase-aware rule, as for a sharded wrapper
                peak, parts = c.rank_peak(layout.micro_batch, layout.accumulation > 1,
                                          self.wrapper.with_world(layout.data_parallel))
            else:
                peak, parts = c.whole_peak(layout.micro_batch, layout.accumulation > 1)
                added = self._added(c.gradient_bytes)
                if added:
                    parts = dict(parts, **{"wrapper buffers": added})
                    peak += added
            share, gpu = shares[0]
            planned = self._planned(peak, block)
            bd = dict(parts)
            bd["allocator cache"] = planned - peak
            bd["outside allocator"] = outside_bytes
            stages.append(StageFit(0, 0, len(split), 1, peak, planned, share, gpu.total_bytes, k, bd,
                                   blocks=list(c.block_names)))
        else:
            m_eff = min(layout.accumulation, layout.pipeline) if layout.schedule == "1f1b" else layout.accumulation
            key = (layout.precision, layout.pipeline, layout.micro_batch, layout.schedule, m_eff, layout.recompute)
            part = self._parts.get(key)
            if part is None:
                part = partition_pipeline(self.blocks(layout.precision, layout.micro_batch), layout.pipeline,
                                          num_micro_batches=m_eff, schedule=layout.schedule or "1f1b",
                                          recompute=layout.recompute, input_bytes=c.input_bytes(layout.micro_batch))
                self._parts[key] = part
            for sd in part.stages:
                ss = split[sd.start:sd.stop]
                # the backward's gradients in flight, and (several micro-batches) the micro-batch's own
                # gradients before they are added: the rules init(strategy="pipeline") plans with
                trans = (c.transient_bytes(layout.micro_batch, sd.start, sd.stop)
                         + accumulation_transient([b["gradients"] for b in ss], layout.accumulation, self.framework))
                peak = sd.held_bytes + trans + c.persistent_bytes
                wrapped = 0
                if layout.shard:
                    # the stage's state sharded over its data-parallel replicas, plus the wrapper's buffers
                    st = c.model_state(sd.start, sd.stop)
                    wd = wrapper_demand(sharding_wrapper(layout.shard, layout.data_parallel), st)
                    wrapped = wd.backward_buffers - (st.state_bytes - wd.params - wd.grads - wd.optimizer)
                else:
                    wrapped = self._added(sum(b["gradients"] for b in ss))
                peak += wrapped
                planned = self._planned(peak, block)
                share, gpu = shares[sd.stage]
                bd = {"weights": sum(b["weights"] for b in ss), "gradients": sum(b["gradients"] for b in ss),
                      "optimizer": sum(b["optimizer"] for b in ss)}
                if sd.recompute:
                    bd["stage inputs"] = sd.in_flight * sd.boundary_bytes
                    bd["recomputed activations"] = sd.activation_bytes
                else:
                    bd["activations"] = sd.in_flight * sd.activation_bytes
                    bd["stage inputs"] = sd.in_flight * sd.boundary_bytes
                bd["transient"] = trans
                if wrapped:
                    bd["wrapper (sharded state, buffers)" if layout.shard else "wrapper buffers"] = wrapped
                bd["persistent buffers"] = c.persistent_bytes
                bd["allocator cache"] = planned - peak
                bd["outside allocator"] = outside_bytes
                stages.append(StageFit(sd.stage, sd.start, sd.stop, sd.in_flight, peak, planned, share,
                                       gpu.total_bytes, k, bd, blocks=c.block_names[sd.start:sd.stop]))
        fits = all(s.fits for s in stages)
        return Candidate(layout, fits, stages, exact=True, outside=out)
