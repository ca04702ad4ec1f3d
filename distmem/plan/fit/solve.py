"""``distmem fit``'s search: the layouts whose every rank fits its GPU, best first, and the best rejected. Pure.

:func:`solve_fit` enumerates data-parallel degree x pipeline degree (1F1B, GPipe) x micro-batch x
gradient accumulation x precision x activation recomputation x ranks per GPU
(:mod:`distmem.plan.fit.space`) and prices each layout (:mod:`distmem.plan.fit.evaluate`).

Layouts are ranked by a throughput proxy, stated in :meth:`ParallelLayout.step_units`: the step's time per
GPU in sample-passes of the model, ``ranks_per_gpu x (m + p - 1) x (micro_batch + 2) / p``
(pipeline bubble and per-micro-step overhead in one figure), x 4/3 with recompute, / 2 in mixed
precision; ties go to fewer gradient bytes all-reduced per rank, then to the larger margin.
The search walks layouts best-first and stops once it has the requested fits and rejections,
so a large fleet costs little more than a small one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...console import progress
from ...discover.gpus import Gpu
from ...errors import ConfigError
from ...units import MiB, SizeLike, format_bytes, plural
from ... import defaults
from ..budget import Budget, parse_headroom, resolve_budget
from ..partition import SCHEDULES
from .costs import Costs
from .evaluate import Candidate, Evaluator
from .space import PROXY_TEXT, ParallelLayout, enumerate_layouts

__all__ = ["solve_fit", "FitResult", "PRECISION_CHOICES", "precision_choices", "shard_choices"]

#: The headroom over the allocator peak is :data:`distmem.defaults.LIMIT_HEADROOM` (measured on an
#: H200: bench/results/fit_h200.json), the one every door uses.
#: Not in the limit: a margin sized by the model's largest block. A capped caching allocator can
#: strand free memory in the blocks it split by more than any such margin: vgg16 at micro-batch 64
#: (784 MiB activations) ran out of memory on the H200 under limits 8% and 15% above its true peak,
#: with 2.5 GiB reserved but unallocated (bench/results/fit_h200_fragmentation.json), and 9 chosen
#: layouts of the scale bench whose largest allocation was below their headroom ran out below their
#: limits (bench/results/fit_scale_h200.jsonl, issue 39). Expandable segments give a segment's
#: free pages back when the limit is reached; every hard torch limit of a fit assumes them
#: (:func:`_allocator_advice`), or leaves the largest block room where they cannot be had.

#: What ``precision="auto"`` tries; a single name (or alias) fixes it.
PRECISION_CHOICES = ("float32", "mixed_bfloat16")


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
    #: torch under a hard limit: the chosen limits hold with the allocator's expandable segments,
    #: which the job should run with (``init()`` sets them; see the warning)
    expandable_segments: bool = False
    #: the warning that says so (also in :attr:`warnings`); a door that sets them says it its own way
    allocator_note: Optional[str] = None
    #: GPUs of the fleet the best fit leaves idle: no layout with a rank on every GPU fits, one of
    #: fewer ranks does (:attr:`suggestion` says why)
    idle_gpus: int = 0
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
                "suggestion": self.suggestion, "warnings": list(self.warnings),
                "expandable_segments": self.expandable_segments, "idle_gpus": self.idle_gpus,
                "blocks": list(self.block_names),
                "seconds": round(self.seconds, 3)}

    def table(self) -> str:
        """Plain-text table: the fits with their margin, then the best rejected with their binding rank."""
        from .render import render_fit  # kept apart: text layout is not the solver's business

        return render_fit(self)




def precision_choices(precision: Any) -> List[str]:
    if precision in (None, "auto"):
        return list(PRECISION_CHOICES)
    names = precision if isinstance(precision, (list, tuple)) else [precision]
    from ...estimate.precision import resolve_precision  # the one table of names and aliases

    out = []
    for name in names:
        try:
            out.append(resolve_precision(name).name)
        except ConfigError as exc:
            raise ConfigError(f"precision={name!r}: use auto (tries float32 and mixed_bfloat16) or a name: "
                              f"{exc}") from None
    return out


#: Ties in step time go to the layout that moves fewer bytes: replicated state, then ZeRO-1, ZeRO-2,
#: FSDP2 keeping units gathered, FSDP2 resharding after the forward.
SHARD_RANK = {"": 0, "zero1": 1, "zero2": 2, "fsdp2_keep": 3, "fsdp2": 4}


def shard_choices(value: Any, framework: str = "torch") -> List[str]:
    """The shardings ``shardings=`` names, in :data:`SHARD_RANK` order. They are torch's
    (``ZeroRedundancyOptimizer`` / DeepSpeed ZeRO-1/2, FSDP2's ``fully_shard``): for a TensorFlow
    model ``"auto"`` is none, and naming one is an error with the remedy."""
    from ..wrappers import SHARDINGS

    if value in ("none", "off", False):
        return []
    torch = str(framework).lower() not in ("tensorflow", "keras", "tf")
    if value in ("auto", None):
        return list(SHARDINGS) if torch else []
    items = [x.strip() for x in value.split(",")] if isinstance(value, str) else list(value)
    for x in items:
        if x not in SHARDINGS:
            raise ConfigError(f"shardings={value!r}: {x!r} is not one of {', '.join(SHARDINGS)} (or auto, none)")
    if items and not torch:
        raise ConfigError(f"shardings={value!r}: ZeRO-1/2 and FSDP2 shard a torch model's state; a TensorFlow model "
                          "replicates it on every data-parallel rank (Horovod, tf.distribute). Leave shardings out "
                          "(or 'none') for this model")
    return [x for x in SHARDINGS if x in items]


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


#: At most this many of an estimate's own warnings in a fit's (the rest counted).
ESTIMATE_WARNINGS_SHOWN = 5


def _estimate_warnings(costs: Dict[str, Costs], first: List[Candidate]) -> List[str]:
    """The estimate's own warnings (a value its step read that the model guessed, a measurement
    that fell back to the model, a carry refused), of the precision of the first layout answered
    (else of every precision), each once, prefixed ``estimate (<precision>):``: the doors that print
    a fit (``distmem fit``) silence the estimator's Python warnings and show these instead."""
    precs = [first[0].layout.precision] if first and first[0].layout.precision in costs else list(costs)
    out: List[str] = []
    for prec in precs:
        est = getattr(costs[prec], "est", None)
        seen = [str(w) for w in (getattr(est, "warnings", None) or [])]
        for w in seen[:ESTIMATE_WARNINGS_SHOWN]:
            out.append(f"estimate ({prec}): {w}")
        if len(seen) > ESTIMATE_WARNINGS_SHOWN:
            out.append(f"estimate ({prec}): and {len(seen) - ESTIMATE_WARNINGS_SHOWN} more warnings "
                       f"(distmem estimate on the model lists them all)")
    return out


def _remedies(cand: Candidate, fits: List[Candidate], headroom: float, budget: Budget) -> List[str]:
    b = cand.binding
    if b is None:
        return [f"its lightest possible partition already needs {format_bytes(cand.lower_bound_bytes)} per rank"]
    over = b.planned_bytes - b.share_bytes
    lay = cand.layout
    k = lay.ranks_per_gpu
    need = k * (b.planned_bytes + int(cand.outside.get("total_bytes", 0))) + budget.reserve_bytes + budget.foreign_bytes
    need_total = int(need / max(1e-9, 1.0 - budget.reserve_fraction - budget.foreign_fraction))
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
    if not lay.shard:
        sharded = [f for f in fits if f.layout.shard and f.layout.pipeline == lay.pipeline
                   and f.layout.micro_batch >= lay.micro_batch]
        if sharded:
            out.append(f"{sharded[0].layout.shard} sharding over the {sharded[0].layout.data_parallel} replicas fits")
    deeper = [f for f in fits if f.layout.pipeline > lay.pipeline and f.layout.precision == lay.precision]
    if deeper:
        f = min(deeper, key=lambda f: f.layout.pipeline)
        out.append(f"a pipeline of {f.layout.pipeline} stages fits")
    return out


def _smallest_fleet(ev: Evaluator, costs: Dict[str, Costs], B: int, gpus_per_host: int, hosts: int,
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
        lay = ParallelLayout(1, p, 1, B, prec, p > 1, 1, "1f1b" if p > 1 else None)
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
        one = (f"one pipeline of {plural(p, 'stage')}, micro-batch 1 x {B}, 1F1B, {'recompute, ' if p > 1 else ''}"
               f"{prec}, heaviest stage {format_bytes(b.planned_bytes)} of {format_bytes(b.share_bytes)}")
        if p <= have:
            # it fits this fleet: only the search's own limits (the options given) left it out
            return (f"nothing the search was allowed to try fits; {one}, fits {p} of these {plural(have, 'GPU')} "
                    f"(leaving {have - p} idle); widen what the search tries (--micro-batches, --pipelines, "
                    "--precision, --ranks-per-gpu, --ranks-per-host)")
        hosts_needed = -(-p // gpus_per_host)
        return (f"nothing fits {plural(have, 'GPU')} of {format_bytes(gpu.total_bytes)}; the smallest fleet that fits "
                f"is {plural(p, 'such GPU', 'such GPUs')} ({plural(hosts_needed, 'host')} of "
                f"{plural(gpus_per_host, 'GPU')}): {one}; it trains slowly (bubble "
                f"{lay_bubble(p, B):.0%}); more GPUs let data parallelism add throughput")
    p, b = last
    big = max(range(n), key=lambda i: costs[prec].block_costs(1)[i].state_bytes)
    blk = costs[prec].block_costs(1)[big]
    return (f"no pipeline fits a GPU of {format_bytes(gpu.total_bytes)}: even {p} stages (one block each, "
            f"micro-batch 1, recompute) need {format_bytes(b.planned_bytes)} on stage {b.stage} against "
            f"{format_bytes(b.share_bytes)}; block {blk.name!r} alone holds {format_bytes(blk.state_bytes)} of "
            f"weights, gradients and optimizer state; use GPUs of at least "
            f"{format_bytes(b.planned_bytes + int(ev.outside(ParallelLayout(1, p, 1, B, prec, True, 1, '1f1b'))['total_bytes']) + 1024 * MiB)}, "
            f"a lighter optimizer, or shard the block (tensor parallelism, not modelled here)")


def lay_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1) if p > 1 else 0.0


def solve_fit(costs: Dict[str, Costs], *, global_batch_size: int, gpus: Sequence[Gpu], hosts: int = 1,
              model_name: str = "model", framework: str = "torch", fleet: str = "", headroom: Optional[float] = None,
              reserve: SizeLike = defaults.RESERVE, overhead: Any = None, foreign: SizeLike = 0,
              schedules: Sequence[str] = SCHEDULES, recompute: Any = "auto", ranks_per_gpu: Any = (1, 2),
              pipelines: Any = None, micro_batches: Any = None, nccl: Any = "auto", nccl_buffsize: Any = None,
              top: int = 10, rejected: int = 5, fixed_local_size: Optional[int] = None,
              idle_gpus: bool = False, max_evaluations: int = 50000, memory: Optional[str] = None,
              shardings: Any = "auto", wrapper: Any = None, expandable_segments: Any = True) -> FitResult:
    """The layouts of ``global_batch_size`` samples per step on ``hosts`` hosts of ``gpus`` that fit
    every rank, best first (see the module docstring), and the best rejected ones.

    ``costs``: precision name -> :class:`~distmem.plan.fit.costs.Costs`. ``headroom``: the
    allocator's margin over its peak (default :data:`distmem.defaults.LIMIT_HEADROOM`). ``overhead``: bytes
    outside the allocator per process (default: :mod:`distmem.plan.outside`'s model for the
    layout's NCCL communicators). ``recompute``: ``"auto"`` tries both (pipelines only),
    True/False fixes it. ``pipelines`` / ``micro_batches`` / ``ranks_per_gpu``: restrict the
    search. ``fixed_local_size``: ranks per host already launched (``strategy="auto"``).
    ``idle_gpus``: also try layouts that leave GPUs idle (default: every GPU runs a rank).
    ``memory``: how the limits are applied (``"growth"``: the default headroom also holds the cache).
    ``shardings``: sharded data parallel to try beside replicated state (``"auto"``: every one of
    :data:`distmem.plan.wrappers.SHARDINGS`; ``"none"`` or ``()``: none; or a list); a sharded
    layout ranks after the replicated one of the same step time (it moves more bytes: FSDP2
    gathers the parameters again in the backward). ``wrapper``: a
    :class:`~distmem.plan.wrappers.Wrapper` that replicates the state (Horovod, DDP), whose buffers
    every replicated rank also holds. ``expandable_segments`` (torch): True where the job may run
    with the allocator's expandable segments (the hard limits then assume them and ``init()`` sets
    them: :attr:`FitResult.expandable_segments`); False where it cannot (the user turned them off,
    CUDA started before ``init()`` on a torch that cannot change them): every limit then also leaves
    room for the largest single allocation.
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
    if expandable_segments not in (True, False, "auto", None):
        raise ConfigError(f"expandable_segments={expandable_segments!r}: use True (the job may run with torch's "
                          "expandable segments), False (it cannot: limits leave room for the largest block) or 'auto'")
    expandable = expandable_segments is not False
    # the one default every door uses: under memory growth the limit also holds the cache; torch's hard
    # limits with expandable segments (init() sets them for the layout chosen) need less
    h = (defaults.headroom(fw, enforced=memory != "growth", expandable=expandable) if headroom is None
         else parse_headroom(headroom))
    budget = resolve_budget(reserve=reserve, foreign=foreign, headroom=h)
    if recompute in ("auto", None):
        rc_choices: List[bool] = [False, True]
    elif isinstance(recompute, bool):
        rc_choices = [recompute]
    else:
        raise ConfigError(f"recompute={recompute!r}: use 'auto', True or False")
    k_choices = _int_choices(ranks_per_gpu, "ranks_per_gpu", (1, 2))
    p_choices = None if pipelines is None else _int_choices(pipelines, "pipelines", ())
    mb_choices = None if micro_batches is None else _int_choices(micro_batches, "micro_batches", ())
    shard_names = shard_choices(shardings, framework)  # a model that is not TensorFlow's, layer lists too
    precisions = [p for p in costs]
    first = next(iter(costs.values()))
    nblocks = len(first.block_names)
    g = len(gpus)
    if fixed_local_size is not None and fixed_local_size > g and fixed_local_size % g:
        raise ConfigError(f"{fixed_local_size} ranks per host over {g} GPU(s) do not share the GPUs evenly; "
                          f"launch a multiple of {g} ranks per host (or at most {g})")
    layouts, degrees = enumerate_layouts(nblocks, global_batch_size, g, hosts, precisions=precisions,
                                  schedules=list(schedules), recompute=rc_choices, ranks_per_gpu=k_choices,
                                  pipelines=p_choices, micro_batches=mb_choices, fixed_local_size=fixed_local_size,
                                  idle_gpus=idle_gpus, shardings=shard_names)
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
    ev = Evaluator(costs, gpus, budget=budget, overhead=overhead, framework=fw, nccl=nccl,
                   nccl_buffsize=nccl_buffsize, wrapper=wrapper, expandable=expandable)

    grad_bytes = {p: costs[p].gradient_bytes for p in costs}

    def key(item: Tuple[ParallelLayout, int]) -> Tuple[Any, ...]:
        lay = item[0]
        grads = grad_bytes[lay.precision]
        ar = 0 if lay.data_parallel == 1 else 2 * (lay.data_parallel - 1) / lay.data_parallel * grads / lay.pipeline
        return (round(lay.step_units(), 9), SHARD_RANK.get(lay.shard, 0), ar, lay.ranks_per_gpu, lay.recompute,
                lay.schedule != "1f1b", lay.pipeline, lay.precision)

    layouts.sort(key=key)
    progress(f"searching {len(layouts)} layouts of {model_name} over {plural(g * hosts, 'GPU')}")
    fits, rej = _walk(layouts, ev, top, rejected, max_evaluations)
    searched = len(layouts)
    idle = 0
    if not fits and not idle_gpus and fixed_local_size is None and g > 1:
        # Every GPU busy fits nowhere, yet fewer ranks may: each rank also holds memory outside the
        # allocator (its context, NCCL's buffers), which a job of fewer ranks does not. What fits
        # the fleet given is an answer, with the GPUs it leaves idle said; not "a smaller fleet".
        fewer, _ = enumerate_layouts(nblocks, global_batch_size, g, hosts, precisions=precisions,
                                     schedules=list(schedules), recompute=rc_choices, ranks_per_gpu=[1],
                                     pipelines=p_choices, micro_batches=mb_choices, idle_gpus=True,
                                     shardings=shard_names)
        fewer = sorted([(lay, L) for lay, L in fewer if L < g], key=key)
        progress(f"no layout with a rank on every GPU fits: searching {len(fewer)} that leave GPUs idle")
        fits, _ = _walk(fewer, ev, top, 0, max_evaluations)
        searched += len(fewer)
        idle = g * hosts - fits[0].layout.ranks if fits else 0
    for cand in rej:
        cand.remedy = _remedies(cand, fits, h, budget)
    warnings: List[str] = []
    for cand in (fits or rej)[:1]:
        for w in cand.outside.get("warnings", []):
            if w not in warnings:
                warnings.append(w)
    for w in _estimate_warnings(costs, (fits or rej)[:1]):
        if w not in warnings:
            warnings.append(w)
    advice = _allocator_advice(fits[0], costs, fw) if fits and expandable and memory != "growth" else None
    if advice:
        warnings.append(advice["warning"])
    suggestion = None
    if not fits:
        suggestion = _smallest_fleet(ev, costs, global_batch_size, g, hosts, precisions)
    elif idle:
        used = fits[0].layout.ranks
        suggestion = (f"no layout with a rank on every one of the {plural(g * hosts, 'GPU')} fits (best rejected above); "
                      f"the layouts that fit run fewer ranks: the best runs {plural(used, 'rank')} and leaves "
                      f"{plural(idle, 'GPU')} idle. Every rank also holds memory outside the allocator (its context, "
                      f"NCCL's buffers towards its peers: {format_bytes(_outside(rej))} on the best rejected), which "
                      f"a job of fewer ranks does not; larger GPUs let every GPU train")
    res = FitResult(model=model_name, framework=fw, global_batch_size=global_batch_size,
                    fleet=fleet or f"{g}x{format_bytes(gpus[0].total_bytes)}", hosts=hosts, gpus_per_host=g,
                    fits=fits, rejected=rej, searched=searched, evaluated=ev.evaluated, headroom=h,
                    block_names=list(first.block_names), suggestion=suggestion, warnings=warnings, costs=costs)
    res.seconds = time.perf_counter() - t0
    res.expandable_segments = bool(advice)
    res.allocator_note = advice["warning"] if advice else None
    res.idle_gpus = idle
    return res


def _outside(rejected: List[Candidate]) -> int:
    return int(rejected[0].outside.get("total_bytes", 0)) if rejected else 0


def _walk(layouts: Sequence[Tuple[ParallelLayout, int]], ev: Evaluator, top: int, rejected: int,
          max_evaluations: int) -> Tuple[List[Candidate], List[Candidate]]:
    """Price ``layouts`` (sorted best first) until ``top`` fit and ``rejected`` did not: (fits, rejected)."""
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
                fk = (lay.data_parallel, lay.ranks_per_gpu, lay.precision, lay.accumulation > 1, lay.shard)
                if fk in dp_fit_at and lay.micro_batch <= dp_fit_at[fk]:
                    continue
        cand = ev.evaluate(lay, L, bound_only=len(rej) >= rejected)
        if cand.fits:
            if len(fits) < top:
                fits.append(cand)
            if lay.pipeline == 1:
                fk = (lay.data_parallel, lay.ranks_per_gpu, lay.precision, lay.accumulation > 1, lay.shard)
                dp_fit_at[fk] = max(dp_fit_at.get(fk, 0), lay.micro_batch)
        elif len(rej) < rejected:
            if not cand.exact:
                cand = ev.evaluate(lay, L)
            rej.append(cand)
    return fits, rej


def _allocator_advice(cand: Candidate, costs: Dict[str, Costs], framework: str) -> Optional[Dict[str, Any]]:
    """torch's caching allocator under a hard limit strands free memory in the blocks it split
    (fragmentation) and can run out below the limit by more than a headroom sized from the largest
    allocation covers: vgg16's 784 MiB activations ran out under limits up to 15% above the true
    peak (bench/results/fit_h200_fragmentation.json), and on the scale bench 9 chosen layouts ran
    out below their limits, each with its largest allocation below the headroom (the rule before
    asked for expandable segments only above it: bench/results/fit_scale_h200.jsonl, issue 39).
    Expandable segments give a segment's free pages back when the limit is reached, so every
    chosen torch layout under a hard limit runs with them. Returns the advice (None: not torch)."""
    b = cand.heaviest
    if framework != "torch" or b is None or cand.layout.precision not in costs:
        return None
    block = costs[cand.layout.precision].largest_block(cand.layout.micro_batch, cand.layout.shard or "")
    room = b.planned_bytes - b.allocator_bytes
    return {"largest_block": block, "headroom_bytes": room,
            "warning": ("torch's caching allocator under a hard limit strands free memory in the blocks it splits "
                        "and can run out below its limit by more than the headroom covers (on the H200, chosen "
                        "layouts whose largest allocation was below their headroom did); the limits here hold with "
                        "expandable segments: run the job with them (init() sets PYTORCH_ALLOC_CONF="
                        "expandable_segments:True before CUDA starts; DISTMEM_TORCH_EXPANDABLE_SEGMENTS=1 asks for "
                        "them by hand). Without them (DISTMEM_TORCH_EXPANDABLE_SEGMENTS=0, or fit(..., "
                        "expandable_segments=False)) each limit also leaves room for the largest allocation, "
                        f"{format_bytes(block)} here" + ("" if block else " (unknown for these costs)"))}
