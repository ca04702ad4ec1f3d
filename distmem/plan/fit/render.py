"""Plain-text table of a :class:`~distmem.plan.fit.solve.FitResult`: fits with their margin, the best
rejected layouts with their binding rank, its breakdown and what would make it fit. Pure."""
from __future__ import annotations

from typing import Any, List

from ...console import text_table
from ...units import format_bytes, plural

__all__ = ["render_fit"]


def _prec(name: str) -> str:
    from ...estimate.precision import PRECISIONS

    return PRECISIONS[name].short if name in PRECISIONS else name


def _cells(c: Any) -> List[str]:
    lay = c.layout
    return [str(lay.data_parallel), str(lay.pipeline), lay.schedule or "-", str(lay.micro_batch),
            str(lay.accumulation), _prec(lay.precision), "yes" if lay.recompute else "no", str(lay.ranks_per_gpu),
            f"{lay.step_units():.1f}", f"{lay.bubble:.0%}", lay.shard or "-"]


_HEAD = ["#", "dp", "pp", "sched", "micro", "accum", "prec", "recomp", "r/GPU", "proxy", "bubble", "shard"]
_RIGHT = [True, True, True, False, True, True, False, False, True, True, True, False]


def _parts(stage: Any) -> str:
    keep = [(k, v) for k, v in stage.breakdown.items() if v]
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in keep)


def render_fit(res: Any) -> str:
    """The result as the ``distmem fit`` table (bytes in binary units)."""
    gpus = res.gpus_per_host * res.hosts
    lines = [f"distmem fit: {res.model} ({res.framework}), global batch {res.global_batch_size} on {res.hosts} "
             f"{plural(res.hosts, 'host', bare=True)} x {res.fleet} = {plural(gpus, 'GPU')}; {res.searched} layouts "
             f"searched, {res.evaluated} priced "
             f"in {res.seconds:.2f} s",
             f"ranked by {_proxy_line()}; limit = allocator peak x {1 + res.headroom:.4g} (whole MiB)", ""]
    idle = getattr(res, "idle_gpus", 0)
    if res.fits:
        lines.append("fits (best first):" if not idle else
                     f"fits (best first; none runs a rank on every GPU: the best leaves {plural(idle, 'GPU')} idle, "
                     "see below):")
        rows = []
        for i, c in enumerate(res.fits, 1):
            h = c.heaviest
            b = c.binding
            rows.append([str(i)] + _cells(c) + [f"stage {h.stage}" if c.layout.pipeline > 1 else "any",
                                                format_bytes(h.planned_bytes), format_bytes(b.share_bytes),
                                                format_bytes(b.margin_bytes),
                                                f"{b.margin_bytes / max(b.share_bytes, 1):.0%}"])
        lines += ["  " + x for x in text_table(_HEAD + ["heaviest", "limit", "GPU share", "margin", "margin%"], rows,
                                            _RIGHT + [False, True, True, True, True])]
        ch = res.fits[0]
        lines.append("")
        lines.append(f"chosen: {ch.layout.describe()}" + (f" ({plural(ch.layout.ranks, 'rank')}; "
                                                           f"{plural(idle, 'GPU')} idle)" if idle else ""))
        for s in ch.stages:
            blocks = f"blocks {s.first_block}..{s.stop_block - 1}" if ch.layout.pipeline > 1 else "whole model"
            lines.append(f"  stage {s.stage} ({blocks}, {s.in_flight} micro-batch(es) in flight): "
                         f"limit {format_bytes(s.planned_bytes)} of {format_bytes(s.share_bytes)}: {_parts(s)}")
    else:
        lines.append("no layout fits.")
    if res.rejected:
        lines += ["", "best rejected (binding rank, its breakdown, what would make it fit):"]
        rows = []
        for i, c in enumerate(res.rejected, 1):
            b = c.binding
            rows.append([str(i)] + _cells(c) + [f"stage {b.stage}" if b else "-",
                                                format_bytes(b.planned_bytes) if b else "-",
                                                format_bytes(b.share_bytes) if b else "-"])
        lines += ["  " + x for x in text_table(_HEAD + ["binding", "needs", "GPU share"], rows,
                                            _RIGHT + [False, True, True])]
        for i, c in enumerate(res.rejected, 1):
            b = c.binding
            if b is not None:
                lines.append(f"  {i}. stage {b.stage} on a {format_bytes(b.gpu_total_bytes)} GPU: {_parts(b)}")
            lines.append(f"     would fit with: {'; '.join(c.remedy)}")
    if res.suggestion:
        lines += ["", res.suggestion]
    for w in res.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _proxy_line() -> str:
    from .space import PROXY_TEXT

    return PROXY_TEXT
