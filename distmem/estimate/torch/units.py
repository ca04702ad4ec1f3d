"""Which modules of a torch model are FSDP2 units (each given its own ``fully_shard``), the root
holding the rest, as users wrap them.

``units=`` says it the ways users do: class names (Hugging Face's ``transformer_layer_cls_to_wrap``,
``ModuleWrapPolicy``), module paths (``model.layers.0``), or a policy callable (``module -> bool`` or
``(name, module) -> bool``, as torch's ``lambda_auto_wrap_policy`` and torchtitan's per-block loop
decide). Without it: the model's repeated block, the class of the largest run (in parameters) of
identical child modules at any depth (a decoder's layers, a ViT's encoder blocks, a ResNet's bottlenecks), every
module of that class a unit; a model where nothing repeats (a VGG) has its top-level children as
units. A module inside a unit that is selected too is a unit of its own
(``fully_shard`` nests: the outer unit keeps what the inner one does not). What the result says is
plain data (:class:`FsdpUnits`) the planner prices; no framework is needed to read it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ...errors import ConfigError

__all__ = ["FsdpUnits", "fsdp_units", "repeated_block", "UnitsLike"]

UnitsLike = Union[None, str, Sequence[str], Callable[..., bool]]


@dataclass(frozen=True)
class FsdpUnits:
    """FSDP2 units of a model. ``paths``: each unit's module path, in registration order;
    ``kinds``: their class names; ``how``: what chose them (``"repeated block"``, ``"units="``);
    ``root``: the root's own children that hold parameters outside every unit (what the plan
    names); ``tensors``: every parameter once (tied ones at their first owner) as ``(name, bytes,
    dim 0, unit index or -1 for the root, requires_grad)``; ``order``: each unit's index in forward
    order where known (else registration order)."""

    paths: Tuple[str, ...]
    kinds: Tuple[str, ...]
    how: str
    root: Tuple[str, ...]
    tensors: Tuple[Tuple[str, int, int, int, bool], ...]

    def describe(self) -> str:
        """``8 x LlamaDecoderLayer; root: embed_tokens, norm, lm_head`` (what the plan says)."""
        counts: Dict[str, int] = {}
        for k in self.kinds:
            counts[k] = counts.get(k, 0) + 1
        units = ", ".join(f"{n} x {k}" for k, n in counts.items()) or "none (the whole model is the root)"
        return f"{units}; root: {', '.join(self.root) or 'nothing of its own'}"

    def unit_of(self, name: str) -> int:
        """The unit (index into ``paths``) holding module ``name`` (an estimator row's module path),
        or -1 for the root: the innermost unit whose path is ``name`` or a prefix of it."""
        best, depth = -1, -1
        for i, p in enumerate(self.paths):
            if (name == p or name.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
        return best


def _signature(m: Any) -> Tuple[Any, ...]:
    """What makes two sibling modules identical: their class and every parameter's name and shape."""
    return (type(m), tuple((n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters()))


def repeated_block(model: Any) -> Optional[type]:
    """The class of the largest run of consecutive identical children of any module in ``model``:
    the run holding the most parameters (ties: the longer, then the shallower one), so a decoder's
    layers win over the identical projections inside one layer; None where no module has two
    identical children in a row."""
    best: Optional[Tuple[int, int, int, type]] = None
    for name, parent in model.named_modules():
        depth = name.count(".") + (1 if name else 0)
        run: List[Any] = []
        children = [c for c in parent.children()]
        for child in children + [None]:
            if child is not None and run and _signature(child) == _signature(run[-1]):
                run.append(child)
                continue
            if len(run) >= 2 and any(True for _ in run[0].parameters()):
                size = sum(p.numel() for m in run for p in m.parameters())
                key = (size, len(run), -depth, type(run[0]))
                if best is None or key[:3] > best[:3]:
                    best = key
            run = [child] if child is not None else []
    return best[3] if best is not None else None


def _policy(units: Any) -> Tuple[Callable[[str, Any], bool], str]:
    if callable(units) and not isinstance(units, str):
        try:
            n = len([p for p in inspect.signature(units).parameters.values()
                     if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        except (TypeError, ValueError):
            n = 1
        if n >= 2:
            return (lambda name, m: bool(units(name, m))), "units= (a policy)"
        return (lambda name, m: bool(units(m))), "units= (a policy)"
    raise ConfigError(f"units={units!r}: give class names, module paths or a policy callable")


def _names(units: Any) -> List[str]:
    items = [u for u in str(units).split(",")] if isinstance(units, str) else list(units)
    out = [str(u).strip() for u in items if str(u).strip()]
    if not out:
        raise ConfigError(f"units={units!r}: give at least one class name or module path (e.g. LlamaDecoderLayer "
                          "or model.layers.0), or 'root' for no unit but the root")
    return out


def fsdp_units(model: Any, units: UnitsLike = None) -> FsdpUnits:
    """The FSDP2 units of ``model`` (see the module docstring). ``units``: None (the repeated block),
    ``"root"``/``"none"`` (no unit: the root holds everything), class names or module paths (a
    comma-separated string or a list), or a policy callable."""
    mods = list(model.named_modules())
    if units is None:
        block = repeated_block(model)
        if block is not None:
            chosen = [n for n, m in mods if n and type(m) is block]
            how = f"repeated block {block.__name__}"
        else:  # nothing repeats (a VGG): each top-level child with parameters, as before
            chosen = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
            how = "no repeated block: the top-level children"
    elif isinstance(units, str) and units.strip().lower() in ("root", "none"):
        chosen, how = [], "units=root"
    elif callable(units) and not isinstance(units, str):
        pick, how = _policy(units)
        chosen = [n for n, m in mods if n and pick(n, m)]
        if not chosen:
            raise ConfigError(f"units={getattr(units, '__name__', units)!r} chose no module of "
                              f"{type(model).__name__}; the policy is asked of every module (name, module)")
    else:
        chosen, how = [], "units="
        paths = {n for n, _ in mods}
        for want in _names(units):
            if want in paths and want:
                chosen.append(want)
                continue
            by_class = [n for n, m in mods if n and (type(m).__name__ == want or
                                                     f"{type(m).__module__}.{type(m).__qualname__}" == want)]
            if not by_class:
                classes = sorted({type(m).__name__ for _, m in mods})
                raise ConfigError(f"units: {want!r} is neither a module path nor a class of {type(model).__name__}; "
                                  f"its classes: {', '.join(classes[:12])}{' ...' if len(classes) > 12 else ''}; "
                                  "paths look like " + ", ".join(n for n, _ in mods[1:4]))
            chosen += by_class
        seen: set = set()
        chosen = [n for n, _ in mods if n in set(chosen) and not (n in seen or seen.add(n))]
    by_name = dict(mods)
    paths = tuple(chosen)
    probe = FsdpUnits(paths, tuple(type(by_name[p]).__name__ for p in paths), how, (), ())
    tensors: List[Tuple[str, int, int, int, bool]] = []
    owners: Dict[int, str] = {}
    for mname, m in mods:
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in owners:
                continue
            owners[id(p)] = mname
            full = f"{mname}.{pname}" if mname else pname
            tensors.append((full, int(p.numel() * p.element_size()), int(p.shape[0]) if p.dim() else 1,
                            probe.unit_of(mname), bool(p.requires_grad)))
    root: List[str] = []
    for cname, child in model.named_children():
        own = [t for t in tensors if probe.unit_of(t[0].rpartition(".")[0]) < 0 and
               (t[0].startswith(cname + ".") or t[0] == cname)]
        if not own:
            continue
        if any(p == cname or p.startswith(cname + ".") for p in paths):
            # a container of units: name its children that hold root parameters instead
            for gname, g in child.named_children():
                full = f"{cname}.{gname}"
                if any(t[0].startswith(full + ".") for t in own) and not any(p == full for p in paths):
                    root.append(full if gname.isdigit() or any(p.startswith(full + ".") for p in paths) else gname)
        else:
            root.append(cname)
    if any(t[3] < 0 and "." not in t[0] for t in tensors):
        root.append("(its own parameters)")
    return FsdpUnits(paths, probe.kinds, how, tuple(root), tuple(tensors))
