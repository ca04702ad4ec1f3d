"""``distmem fit`` and ``strategy="auto"``: the layouts whose every rank fits its GPU, best first. Pure.

The search (:func:`solve_fit`) enumerates data-parallel degree x pipeline degree (1F1B, GPipe) x
micro-batch x gradient accumulation x precision x activation recomputation x ranks per GPU
(:class:`~distmem.plan.fit_space.Layout`), and for each holds every rank's demand against its
GPU:

* one stage (data parallel): the estimator's whole-step allocator peak at the micro-batch (plus
  the gradients accumulation keeps alive between micro-steps);
* a pipeline: the schedule-aware exact partition of the model's blocks
  (:mod:`distmem.plan.partition`: weights + gradients + optimizer state held once, activations x
  the micro-batches each stage holds in flight, the stage inputs), plus the backward's transient
  (two outputs of the stage's largest layer) and the buffers every rank keeps;

then ``planned = demand x (1 + headroom)`` in whole MiB (the allocator's cache and
fragmentation under a hard limit) must fit the rank's equal share of its GPU: total - driver
reserved - reserve - foreign - ranks on the GPU x memory outside the allocator
(:mod:`distmem.plan.outside`: CUDA context, cuBLAS/cuDNN, NCCL communicators).

Layouts are ranked by a throughput proxy, stated in :meth:`Layout.step_units`: the step's time per
GPU in sample-passes of the model, ``ranks_per_gpu x (m + p - 1) x (micro_batch + 2) / p``
(pipeline bubble and per-micro-step overhead in one figure), x 4/3 with recompute, / 2 in mixed
precision; ties go to fewer gradient bytes all-reduced per rank, then to the larger margin.
The search walks layouts best-first and stops once it has the requested fits and rejections,
so a large fleet costs little more than a small one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..costs import LayerCost
from ..discover.gpus import Gpu, Inventory, fleet_inventory
from ..errors import ConfigError, DoesNotFitError
from ..discover.identity import Topology
from ..units import MiB, SizeLike, format_bytes, parse_bytes, plural
from .types import DEFAULT_RESERVE, Plan
from .common import equal_share, resolve_options
from .fit_space import PROXY_TEXT, Costs, EstimateCosts, LayerListCosts, Layout, divisors
from .outside import outside_allocator_breakdown
from .partition import SCHEDULES, lower_bound, partition_pipeline

__all__ = ["fit", "fit_without_costs", "solve_fit", "plan_auto", "FitResult", "Candidate", "StageFit", "DEFAULT_FIT_HEADROOM",
           "PRECISION_CHOICES", "nccl_communicators_of"]

#: Allocator headroom over the allocator peak under a hard limit. A capped caching allocator frees
#: its cache and retries before it fails, so the limit must cover the peak plus fragmentation, not
#: the 7-52% cache it keeps when unconstrained. Measured on an H200 (bench/results/fit_h200.json):
#: the smallest limit each bench workload ran under without an OOM.
DEFAULT_FIT_HEADROOM = {"torch": 0.10, "tensorflow": 0.10}

#: Not in the limit: a margin sized by the model's largest block. A capped caching allocator can
#: strand blocks it split (vgg16 at micro-batch 64, 784 MiB activations, ran out of memory on the
#: H200 under limits 8% and 15% above its true peak, with 2.5 GiB reserved but unallocated:
#: bench/results/fit_h200_fragmentation.json); no margin short of ~40% covered it, so such models
#: need the allocator's expandable segments rather than a larger limit (docs/fit.md).

#: What ``precision="auto"`` tries; a single name (or alias) fixes it.
PRECISION_CHOICES = ("float32", "mixed_bfloat16")

_ALIASES = {"fp32": "float32", "32": "float32", "bf16": "mixed_bfloat16", "mixed_bf16": "mixed_bfloat16",
            "bfloat16": "mixed_bfloat16", "fp16": "mixed_float16", "float16": "mixed_float16",
            "mixed": "mixed_bfloat16", "amp": "mixed_float16", "mixed_fp16": "mixed_float16"}


def nccl_communicators_of(layout: Layout) -> int:
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

    layout: Layout
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


@dataclass
class FitResult:
    """What :func:`fit` found: layouts that fit (best first), the best rejected, and what to do."""

    model: str
    framework: str
    global_batch_size: int
    fleet: str
    hosts: int
    gpus_per_host: int
    fits: List[Candidate]
    rejected: List[Candidate]
    searched: int
    evaluated: int
    headroom: float
    block_names: List[str] = field(default_factory=list)
    suggestion: Optional[str] = None
    warnings: List[str] = field(default_factory=list)
    seconds: float = 0.0
    costs: Dict[str, Costs] = field(default_factory=dict, repr=False)

    @property
    def chosen(self) -> Optional[Candidate]:
        return self.fits[0] if self.fits else None

    def to_dict(self) -> Dict[str, Any]:
        def row(c: Candidate) -> Dict[str, Any]:
            d = c.to_dict()
            costs = self.costs.get(c.layout.precision)
            if costs is not None:
                d["allreduce_bytes"] = c.allreduce_bytes(costs)
            return d
        return {"model": self.model, "framework": self.framework, "global_batch_size": self.global_batch_size,
                "fleet": self.fleet, "hosts": self.hosts, "gpus_per_host": self.gpus_per_host,
                "headroom": self.headroom, "searched": self.searched, "evaluated": self.evaluated,
                "proxy": PROXY_TEXT, "chosen": row(self.chosen) if self.chosen else None,
                "fits": [row(c) for c in self.fits], "rejected": [row(c) for c in self.rejected],
                "suggestion": self.suggestion, "warnings": list(self.warnings), "blocks": list(self.block_names),
                "seconds": round(self.seconds, 3)}

    def table(self) -> str:
        """Plain-text table: the fits with their margin, then the best rejected with their binding rank."""
        from .fit_render import render_fit  # kept apart: text layout is not the solver's business

        return render_fit(self)




def _precisions(precision: Any) -> List[str]:
    if precision in (None, "auto"):
        return list(PRECISION_CHOICES)
    names = precision if isinstance(precision, (list, tuple)) else [precision]
    out = []
    for name in names:
        n = str(name).strip().lower()
        n = _ALIASES.get(n, n)
        if n not in ("float32", "mixed_float16", "mixed_bfloat16"):
            raise ConfigError(f"precision={name!r}: use auto (tries float32 and mixed_bfloat16), float32, "
                              "mixed_bfloat16 or mixed_float16 (fp32, bf16, fp16)")
        out.append(n)
    return out


def _int_choices(value: Any, what: str, default: Sequence[int]) -> List[int]:
    if value is None:
        return list(default)
    items = value if isinstance(value, (list, tuple, set)) else [value]
    out = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{what}={value!r}: give whole numbers >= 1")
        out.append(int(v))
    return sorted(set(out))


class _Evaluator:
    """Prices layouts; caches partitions, outside-allocator figures and shares."""

    def __init__(self, costs: Dict[str, Costs], gpus: List[Gpu], *, headroom: float, reserve: SizeLike,
                 overhead: Any, foreign: SizeLike, framework: str, nccl: Any, nccl_buffsize: Any) -> None:
        self.costs = costs
        self.gpus = gpus
        self.headroom = headroom
        self.framework = framework
        self.nccl = nccl
        self.nccl_buffsize = nccl_buffsize
        self.reserve, self.foreign, self.overhead = reserve, foreign, overhead
        self._outside: Dict[int, Dict[str, Any]] = {}
        self._shares: Dict[Tuple[int, int, int], int] = {}
        self._parts: Dict[Tuple[Any, ...], Any] = {}
        self._blocks: Dict[Tuple[str, int], List[LayerCost]] = {}
        self._stage_gpus: Dict[Tuple[int, int, int], List[List[Gpu]]] = {}
        self._split: Dict[str, List[Dict[str, int]]] = {}
        self.evaluated = 0

    def outside(self, layout: Layout) -> Dict[str, Any]:
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
            opts = resolve_options([gpu], reserve=self.reserve, overhead=outside_bytes, foreign=self.foreign)
            try:
                self._shares[key] = equal_share(gpu, k, opts)
            except DoesNotFitError:
                self._shares[key] = 0
        return self._shares[key]

    def stage_gpus(self, layout: Layout, local_size: int) -> List[List[Gpu]]:
        """The GPUs each stage's ranks run on: rank ``r`` is stage ``r % p`` on its node's GPU
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

    def _planned(self, nbytes: int) -> int:
        """The limit for an allocator peak of ``nbytes``: ``peak x (1 + headroom)`` in whole MiB."""
        return int(math.ceil(nbytes * (1.0 + self.headroom) / MiB)) * MiB

    def lower_bound(self, layout: Layout) -> int:
        """A bound on the heaviest stage's allocator peak (bytes) that needs no partition."""
        c = self.costs[layout.precision]
        if layout.pipeline == 1:
            return 0
        m_eff = min(layout.accumulation, layout.pipeline) if layout.schedule == "1f1b" else layout.accumulation
        return lower_bound(self.blocks(layout.precision, layout.micro_batch), layout.pipeline, kind="pipeline",
                           schedule=layout.schedule, num_micro_batches=m_eff, recompute=layout.recompute,
                           input_bytes=c.input_bytes(layout.micro_batch)) + c.persistent_bytes

    def evaluate(self, layout: Layout, local_size: int, *, bound_only: bool = False) -> Candidate:
        c = self.costs[layout.precision]
        out = self.outside(layout)
        outside_bytes = int(out["total_bytes"])
        k = layout.ranks_per_gpu
        gpus = self.stage_gpus(layout, local_size)
        shares = [min(((self.share(g, k, outside_bytes), g) for g in gs), key=lambda x: x[0]) for gs in gpus]
        if bound_only and layout.pipeline > 1:
            lb = self.lower_bound(layout)
            best = max(s for s, _ in shares)
            if self._planned(lb) > best:
                return Candidate(layout, False, exact=False, outside=out, lower_bound_bytes=lb)
        self.evaluated += 1
        split = self.split(layout.precision)
        stages: List[StageFit] = []
        if layout.pipeline == 1:
            peak, parts = c.whole_peak(layout.micro_batch, layout.accumulation > 1)
            share, gpu = shares[0]
            planned = self._planned(peak)
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
                trans = c.transient_bytes(layout.micro_batch, sd.start, sd.stop)
                peak = sd.total_bytes + trans + c.persistent_bytes
                planned = self._planned(peak)
                share, gpu = shares[sd.stage]
                ss = split[sd.start:sd.stop]
                bd = {"weights": sum(b["weights"] for b in ss), "gradients": sum(b["gradients"] for b in ss),
                      "optimizer": sum(b["optimizer"] for b in ss)}
                if sd.recompute:
                    bd["stage inputs"] = sd.in_flight * sd.boundary_bytes
                    bd["recomputed activations"] = sd.activation_bytes
                else:
                    bd["activations"] = sd.in_flight * sd.activation_bytes
                    bd["stage inputs"] = sd.in_flight * sd.boundary_bytes
                bd["transient"] = trans
                bd["persistent buffers"] = c.persistent_bytes
                bd["allocator cache"] = planned - peak
                bd["outside allocator"] = outside_bytes
                stages.append(StageFit(sd.stage, sd.start, sd.stop, sd.in_flight, peak, planned, share,
                                       gpu.total_bytes, k, bd, blocks=c.block_names[sd.start:sd.stop]))
        fits = all(s.fits for s in stages)
        return Candidate(layout, fits, stages, exact=True, outside=out)


def _enumerate(num_blocks: int, B: int, gpus_per_host: int, hosts: int, *, precisions: List[str],
               schedules: Sequence[str], recompute: Sequence[bool], ranks_per_gpu: Sequence[int],
               pipelines: Optional[Sequence[int]], micro_batches: Optional[Sequence[int]],
               fixed_local_size: Optional[int] = None,
               idle_gpus: bool = False) -> Tuple[List[Tuple[Layout, int]], List[int]]:
    """All layouts with their ranks per host; and every data-parallel degree considered."""
    out: List[Tuple[Layout, int]] = []
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
                for prec in precisions:
                    if p == 1:
                        out.append((Layout(d, 1, mb, m, prec, False, k, None), L))
                        continue
                    for sched in schedules:
                        for rc in recompute:
                            out.append((Layout(d, p, mb, m, prec, rc, k, sched), L))
    return out, sorted(set(degrees))


def _remedies(cand: Candidate, fits: List[Candidate], headroom: float, reserve_bytes: int,
              foreign_bytes: int) -> List[str]:
    b = cand.binding
    if b is None:
        return [f"its lightest possible partition already needs {format_bytes(cand.lower_bound_bytes)} per rank"]
    over = b.planned_bytes - b.share_bytes
    lay = cand.layout
    k = lay.ranks_per_gpu
    need_total = k * (b.planned_bytes + int(cand.outside.get("total_bytes", 0))) + reserve_bytes + foreign_bytes
    out = [f"{format_bytes(over)} short on stage {b.stage}'s GPU: a GPU of {format_bytes(need_total)} or more "
           f"would hold it"]
    same = [f for f in fits if f.layout.data_parallel == lay.data_parallel and f.layout.pipeline == lay.pipeline
            and f.layout.precision == lay.precision and f.layout.ranks_per_gpu == k]
    smaller = [f for f in same if f.layout.micro_batch < lay.micro_batch]
    if smaller:
        f = max(smaller, key=lambda f: f.layout.micro_batch)
        out.append(f"micro-batch {f.layout.micro_batch} x {f.layout.accumulation} fits")
    if lay.pipeline > 1 and lay.schedule == "gpipe":
        out.append("schedule 1f1b holds fewer micro-batches in flight")
    if lay.pipeline > 1 and not lay.recompute and any(f.layout.recompute for f in same):
        out.append("recompute fits")
    if lay.precision == "float32" and any(f.layout.precision != "float32" for f in fits
                                          if f.layout.pipeline == lay.pipeline):
        out.append("mixed precision fits")
    deeper = [f for f in fits if f.layout.pipeline > lay.pipeline and f.layout.precision == lay.precision]
    if deeper:
        f = min(deeper, key=lambda f: f.layout.pipeline)
        out.append(f"a pipeline of {f.layout.pipeline} stages fits")
    return out


def _smallest_fleet(ev: _Evaluator, costs: Dict[str, Costs], B: int, gpus_per_host: int, hosts: int,
                    precisions: List[str]) -> str:
    """Where nothing fits: the shortest single pipeline (micro-batch 1, 1F1B, recompute) that fits
    this GPU type, as a fleet, or the block too large for any pipeline."""
    prec = precisions[-1] if len(precisions) > 1 else precisions[0]
    c = costs[prec]
    n = len(c.block_names)
    gpu = max(ev.gpus, key=lambda g: g.total_bytes)
    found = None
    last = None
    for p in range(1, n + 1):
        lay = Layout(1, p, 1, B, prec, p > 1, 1, "1f1b" if p > 1 else None)
        cand = ev.evaluate(lay, max(p, 1))
        b = cand.binding
        last = (p, b)
        if cand.fits:
            found = (p, cand)
            break
    have = gpus_per_host * hosts
    if found is not None:
        p, cand = found
        b = cand.heaviest
        hosts_needed = -(-p // gpus_per_host)
        return (f"nothing fits {plural(have, 'GPU')} of {format_bytes(gpu.total_bytes)}; the smallest fleet that fits "
                f"is {plural(p, 'such GPU', 'such GPUs')} ({plural(hosts_needed, 'host')} of {gpus_per_host}): one "
                f"pipeline of {plural(p, 'stage')}, "
                f"micro-batch 1 x {B}, 1F1B, {'recompute, ' if p > 1 else ''}{prec}, heaviest stage "
                f"{format_bytes(b.planned_bytes)} of {format_bytes(b.share_bytes)}; it trains slowly (bubble "
                f"{lay_bubble(p, B):.0%}); more GPUs let data parallelism add throughput")
    p, b = last
    big = max(range(n), key=lambda i: costs[prec].block_costs(1)[i].state_bytes)
    blk = costs[prec].block_costs(1)[big]
    return (f"no pipeline fits a GPU of {format_bytes(gpu.total_bytes)}: even {p} stages (one block each, "
            f"micro-batch 1, recompute) need {format_bytes(b.planned_bytes)} on stage {b.stage} against "
            f"{format_bytes(b.share_bytes)}; block {blk.name!r} alone holds {format_bytes(blk.state_bytes)} of "
            f"weights, gradients and optimizer state; use GPUs of at least "
            f"{format_bytes(b.planned_bytes + int(ev.outside(Layout(1, p, 1, B, prec, True, 1, '1f1b'))['total_bytes']) + 1024 * MiB)}, "
            f"a lighter optimizer, or shard the block (tensor parallelism, not modelled here)")


def lay_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1) if p > 1 else 0.0


def solve_fit(costs: Dict[str, Costs], *, global_batch_size: int, gpus: Sequence[Gpu], hosts: int = 1,
              model_name: str = "model", framework: str = "torch", fleet: str = "", headroom: Optional[float] = None,
              reserve: SizeLike = DEFAULT_RESERVE, overhead: Any = None, foreign: SizeLike = 0,
              schedules: Sequence[str] = SCHEDULES, recompute: Any = "auto", ranks_per_gpu: Any = (1, 2),
              pipelines: Any = None, micro_batches: Any = None, nccl: Any = "auto", nccl_buffsize: Any = None,
              top: int = 10, rejected: int = 5, fixed_local_size: Optional[int] = None,
              idle_gpus: bool = False, max_evaluations: int = 50000) -> FitResult:
    """The layouts of ``global_batch_size`` samples per step on ``hosts`` hosts of ``gpus`` that fit
    every rank, best first (see the module docstring), and the best rejected ones.

    ``costs``: precision name -> :class:`~distmem.plan.fit_space.Costs`. ``headroom``: the
    allocator's margin over its peak (default :data:`DEFAULT_FIT_HEADROOM`). ``overhead``: bytes
    outside the allocator per process (default: :mod:`distmem.plan.outside`'s model for the
    layout's NCCL communicators). ``recompute``: ``"auto"`` tries both (pipelines only),
    True/False fixes it. ``pipelines`` / ``micro_batches`` / ``ranks_per_gpu``: restrict the
    search. ``fixed_local_size``: ranks per host already launched (``strategy="auto"``).
    ``idle_gpus``: also try layouts that leave GPUs idle (default: every GPU runs a rank).
    """
    import time

    t0 = time.perf_counter()
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size!r}: give the samples per optimizer step, "
                          "a whole number >= 1")
    if not isinstance(hosts, int) or hosts < 1:
        raise ConfigError(f"hosts={hosts!r}: give a whole number of hosts >= 1")
    gpus = list(gpus)
    if not gpus:
        raise ConfigError("fit needs the GPUs of one host: pass gpus='8x80GiB' (or an inventory); on a machine "
                          "without GPUs, declare the fleet you will train on")
    if not costs:
        raise ConfigError("fit needs the model's costs for at least one precision")
    for s in schedules:
        if s not in SCHEDULES:
            raise ConfigError(f"schedule {s!r} is not one of {', '.join(SCHEDULES)}")
    fw = "torch" if str(framework).lower() in ("torch", "pytorch") else "tensorflow"
    h = DEFAULT_FIT_HEADROOM[fw] if headroom is None else float(headroom)
    if not 0 <= h < 10:
        raise ConfigError(f"headroom={headroom!r}: give a ratio such as 0.10 (10% over the allocator peak)")
    if recompute in ("auto", None):
        rc_choices: List[bool] = [False, True]
    elif isinstance(recompute, bool):
        rc_choices = [recompute]
    else:
        raise ConfigError(f"recompute={recompute!r}: use 'auto', True or False")
    k_choices = _int_choices(ranks_per_gpu, "ranks_per_gpu", (1, 2))
    p_choices = None if pipelines is None else _int_choices(pipelines, "pipelines", ())
    mb_choices = None if micro_batches is None else _int_choices(micro_batches, "micro_batches", ())
    precisions = [p for p in costs]
    first = next(iter(costs.values()))
    nblocks = len(first.block_names)
    g = len(gpus)
    if fixed_local_size is not None and fixed_local_size > g and fixed_local_size % g:
        raise ConfigError(f"{fixed_local_size} ranks per host over {g} GPU(s) do not share the GPUs evenly; "
                          f"launch a multiple of {g} ranks per host (or at most {g})")
    layouts, degrees = _enumerate(nblocks, global_batch_size, g, hosts, precisions=precisions,
                                  schedules=list(schedules), recompute=rc_choices, ranks_per_gpu=k_choices,
                                  pipelines=p_choices, micro_batches=mb_choices, fixed_local_size=fixed_local_size,
                                  idle_gpus=idle_gpus)
    if not layouts:
        ok = sorted({d for d in degrees if d})
        mult = sorted({global_batch_size // d * d for d in ok} | {-(-global_batch_size // d) * d for d in ok})
        near = [x for x in mult if x > 0][:6]
        detail = f" and micro-batches {sorted(mb_choices)}" if mb_choices else ""
        raise ConfigError(
            f"global batch {global_batch_size} cannot be split over {g * hosts} GPU(s) ({hosts} host(s) of {g}): "
            f"every layout has a data-parallel degree in {ok}{detail} and none divides {global_batch_size} into "
            f"whole micro-batches; use a global batch that one of them divides (nearby: "
            f"{', '.join(map(str, near))}), or other --hosts / ranks per host")
    ev = _Evaluator(costs, gpus, headroom=h, reserve=reserve, overhead=overhead, foreign=foreign, framework=fw,
                    nccl=nccl, nccl_buffsize=nccl_buffsize)

    grad_bytes = {p: costs[p].gradient_bytes for p in costs}

    def key(item: Tuple[Layout, int]) -> Tuple[Any, ...]:
        lay = item[0]
        grads = grad_bytes[lay.precision]
        ar = 0 if lay.data_parallel == 1 else 2 * (lay.data_parallel - 1) / lay.data_parallel * grads / lay.pipeline
        return (round(lay.step_units(), 9), ar, lay.ranks_per_gpu, lay.recompute, lay.schedule != "1f1b",
                lay.pipeline, lay.precision)

    layouts.sort(key=key)
    fits: List[Candidate] = []
    rej: List[Candidate] = []
    # Data parallel demand grows with the micro-batch: once (d, k, precision, accumulating) fits at
    # micro-batch b, any smaller one fits too; that spares a simulation per layout past the top.
    dp_fit_at: Dict[Tuple[Any, ...], int] = {}
    for lay, L in layouts:
        if len(fits) >= top and len(rej) >= rejected:
            break
        if ev.evaluated >= max_evaluations:
            break
        if len(fits) >= top:
            # only rejections are still wanted: skip what is known to fit without pricing it
            if lay.pipeline == 1:
                fk = (lay.data_parallel, lay.ranks_per_gpu, lay.precision, lay.accumulation > 1)
                if fk in dp_fit_at and lay.micro_batch <= dp_fit_at[fk]:
                    continue
        cand = ev.evaluate(lay, L, bound_only=len(rej) >= rejected)
        if cand.fits:
            if len(fits) < top:
                fits.append(cand)
            if lay.pipeline == 1:
                fk = (lay.data_parallel, lay.ranks_per_gpu, lay.precision, lay.accumulation > 1)
                dp_fit_at[fk] = max(dp_fit_at.get(fk, 0), lay.micro_batch)
        elif len(rej) < rejected:
            if not cand.exact:
                cand = ev.evaluate(lay, L)
            rej.append(cand)
    opts = resolve_options(gpus, reserve=reserve, foreign=foreign)
    for cand in rej:
        cand.remedy = _remedies(cand, fits, h, opts["reserve_bytes"], opts["foreign_bytes"])
    warnings: List[str] = []
    for cand in (fits or rej)[:1]:
        for w in cand.outside.get("warnings", []):
            if w not in warnings:
                warnings.append(w)
    suggestion = None
    if not fits:
        suggestion = _smallest_fleet(ev, costs, global_batch_size, g, hosts, precisions)
    res = FitResult(model=model_name, framework=fw, global_batch_size=global_batch_size,
                    fleet=fleet or f"{g}x{format_bytes(gpus[0].total_bytes)}", hosts=hosts, gpus_per_host=g,
                    fits=fits, rejected=rej, searched=len(layouts), evaluated=ev.evaluated, headroom=h,
                    block_names=list(first.block_names), suggestion=suggestion, warnings=warnings, costs=costs)
    res.seconds = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------------------------
# Facade: from a model (or layer list) and a fleet to a FitResult.

def _gpus_of(gpus: Any) -> Tuple[List[Gpu], str]:
    if isinstance(gpus, Inventory):
        return list(gpus.gpus), gpus.source
    if isinstance(gpus, str):
        inv = fleet_inventory(gpus)
        return list(inv.gpus), gpus
    if isinstance(gpus, (list, tuple)) and gpus and all(isinstance(g, Gpu) for g in gpus):
        return list(gpus), "gpus"
    raise ConfigError(f"gpus={gpus!r}: give a fleet such as '8x80GiB' (per host) or an Inventory")


def costs_from_model(model: Any, precisions: Sequence[str], *, optimizer: Any = "adam", input_shape: Any = None,
                     batch_size: int = 8, device: Optional[str] = None, **estimate_options: Any) -> Dict[str, Costs]:
    """One :class:`EstimateCosts` per precision through ``distmem.estimate`` (imported here, not at
    module level, so the solver stays free of frameworks)."""
    import importlib

    est_mod = importlib.import_module("distmem.estimate")
    out: Dict[str, Costs] = {}
    loaded = est_mod.load_model(model, est_mod.parse_shape(input_shape)) if isinstance(model, str) else model
    for prec in precisions:
        opts = dict(estimate_options)
        if device is not None:
            opts["device"] = device
        est = est_mod.estimate(loaded, batch_size=batch_size, optimizer=optimizer, input_shape=input_shape,
                               precision=prec, **opts)
        out[prec] = EstimateCosts(est)
    return out


def fit(model: Any = None, *, global_batch_size: int, gpus: Any, hosts: int = 1,
        framework: Optional[str] = None, precision: Any = "auto", optimizer: Any = "adam",
        input_shape: Any = None, layers: Optional[Sequence[Any]] = None, layers_batch_size: Optional[int] = None,
        costs: Optional[Dict[str, Costs]] = None, estimate_batch_size: Optional[int] = None,
        device: Optional[str] = None, name: Optional[str] = None, **options: Any) -> FitResult:
    """Which layouts of ``model`` at ``global_batch_size`` fit every rank of ``hosts`` hosts of
    ``gpus`` (``"8x80GiB"`` per host, an Inventory, or a list of Gpu), best first.

    The model is a torch module, a Keras model or a spec (``"torchvision:resnet50"``,
    ``"keras:ResNet50"``, ``"pkg.mod:factory"``), estimated once per precision
    (``precision="auto"`` tries float32 and mixed_bfloat16); or ``layers=`` a LayerCost list (or
    dicts) for ONE sample batch of ``layers_batch_size``. Other options go to :func:`solve_fit`
    (``headroom``, ``reserve``, ``overhead``, ``foreign``, ``schedules``, ``recompute``,
    ``ranks_per_gpu``, ``pipelines``, ``micro_batches``, ``nccl``, ``nccl_buffsize``, ``top``,
    ``rejected``)."""
    gl, source = _gpus_of(gpus)
    precisions = _precisions(precision)
    if costs is None:
        if (model is None) == (layers is None):
            raise ConfigError("fit needs exactly one of model= (a torch/Keras model or a spec such as "
                              "'torchvision:resnet50') or layers=[LayerCost, ...] with layers_batch_size=")
        if layers is not None:
            from .partition import layers_from_dicts

            if len(precisions) != 1:
                precisions = [precisions[0]]
            rows = layers_from_dicts(list(layers))
            costs = {precisions[0]: LayerListCosts(rows, int(layers_batch_size or 1), precision=precisions[0],
                                                   framework=framework or "torch")}
        else:
            b = estimate_batch_size or max(1, min(8, global_batch_size))
            costs = costs_from_model(model, precisions, optimizer=optimizer, input_shape=input_shape,
                                     batch_size=b, device=device)
    fw = framework or next(iter(costs.values())).framework
    label = name or (model if isinstance(model, str) else type(model).__name__ if model is not None else "layers")
    return solve_fit(costs, global_batch_size=global_batch_size, gpus=gl, hosts=hosts, model_name=str(label),
                     framework=fw, fleet=source if not isinstance(gpus, str) else gpus, **options)


def fit_without_costs(model: Any = None, **kwargs: Any) -> FitResult:
    """:func:`fit`, its result without the per-precision costs (they hold the estimator's replay
    functions): what a child process hands back to ``strategy="auto"``."""
    result = fit(model, **kwargs)
    result.costs = {}
    return result


# ---------------------------------------------------------------------------------------------
# strategy="auto": the chosen layout as a Plan on the job's observed layout.

def plan_auto(topo: Topology, inv: Inventory, *, model: Any = None, global_batch_size: int,
              layers: Optional[Sequence[Any]] = None, layers_batch_size: Optional[int] = None,
              framework: Optional[str] = None, precision: Any = "auto", optimizer: Any = "adam",
              input_shape: Any = None, memory: str = "auto", reserve: SizeLike = DEFAULT_RESERVE,
              overhead: Any = None, foreign: SizeLike = 0, headroom: Optional[float] = None,
              costs: Optional[Dict[str, Costs]] = None, **options: Any) -> Plan:
    """Plan the best layout that fits for the job as launched (``topo.size`` ranks,
    ``topo.local_size`` per node, this node's GPUs), identically on every rank.

    The plan is a pipeline plan of the chosen layout's stages (one stage for data parallel) with
    each stage's limit its planned bytes, ``strategy="auto"``; ``plan.extras["fit"]`` carries
    ``micro_batch``, ``accumulation``, ``schedule``, ``recompute``, ``precision``, the stage map
    (``stages``: blocks per stage, ``rank_stage``: how ranks map to stages) and
    ``guard_start_batch`` (the OOM guard's starting micro-batch). Raises DoesNotFitError, with the
    best rejected layout and what would fit, when none does."""
    from .pipeline import plan_pipeline

    observed = options.pop("layout", None)  # the job's observed layout: the chosen stages are placed on it
    if not inv.gpus:
        raise ConfigError("strategy='auto' holds layouts against GPUs, and this node shows none; declare the fleet "
                          "(DISTMEM_FLEET=8x80GiB) for a dry run, or use strategy='data' on CPU")
    fit_args = dict(global_batch_size=global_batch_size, gpus=inv, hosts=topo.num_nodes, framework=framework,
                    precision=precision, optimizer=optimizer, input_shape=input_shape, layers=layers,
                    layers_batch_size=layers_batch_size, costs=costs, headroom=headroom, reserve=reserve,
                    overhead=overhead, foreign=foreign, fixed_local_size=topo.local_size, top=1,
                    rejected=options.pop("rejected", 1), **options)
    from ..estimate import isolated

    if costs is None and layers is None and isolated.needs_child(model):
        # Building a Keras model here would start TensorFlow's GPUs before init() applies the plan.
        result = isolated.call("distmem.plan.fit:fit_without_costs", dict(fit_args, model=model))
    else:
        result = fit(model, **fit_args)
    chosen = result.chosen
    if chosen is None:
        best = result.rejected[0] if result.rejected else None
        why = ""
        if best is not None and best.binding is not None:
            b = best.binding
            why = (f"; the best layout, {best.layout.describe()}, needs {format_bytes(b.planned_bytes)} on stage "
                   f"{b.stage} against {format_bytes(b.share_bytes)} ({'; '.join(best.remedy)})")
        raise DoesNotFitError(f"no layout of {topo.size} rank(s) ({topo.local_size} per node, {len(inv.gpus)} GPU(s) "
                              f"per node) fits {result.model} at global batch {global_batch_size}{why}; "
                              f"{result.suggestion or 'run distmem fit for the layouts that do'}")
    lay = chosen.layout
    demands = [s.allocator_bytes for s in chosen.stages]
    plan = plan_pipeline(topo, inv, stages=demands, num_stages=lay.pipeline, num_micro_batches=lay.accumulation,
                         schedule=lay.schedule or "1f1b", recompute=lay.recompute, headroom=result.headroom,
                         memory=memory, reserve=reserve, overhead=int(chosen.outside["total_bytes"]), foreign=foreign,
                         layout=observed)
    plan.strategy = "auto"
    for a in plan.allocations:
        a.strategy = "auto"
        if lay.pipeline == 1:
            a.stage = None
    stage_map = [{"stage": s.stage, "first_block": s.first_block, "stop_block": s.stop_block, "blocks": s.blocks,
                  "in_flight": s.in_flight, "planned_bytes": s.planned_bytes} for s in chosen.stages]
    plan.extras["fit"] = {
        "layout": lay.to_dict(), "micro_batch": lay.micro_batch, "accumulation": lay.accumulation,
        "data_parallel": lay.data_parallel, "pipeline": lay.pipeline, "schedule": lay.schedule,
        "recompute": lay.recompute, "precision": lay.precision, "ranks_per_gpu": lay.ranks_per_gpu,
        "stages": stage_map, "rank_stage": "stage = rank % pipeline, replica = rank // pipeline",
        "guard_start_batch": lay.micro_batch, "step_units": round(lay.step_units(), 3),
        "outside": chosen.outside, "headroom": result.headroom, "model": result.model,
        "global_batch_size": global_batch_size,
    }
    plan.options.update(strategy_requested="auto", global_batch_size=global_batch_size)
    for w in result.warnings:
        if w not in plan.warnings:
            plan.warnings.append(w)
    return plan
