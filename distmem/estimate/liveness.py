"""Replay a training step over a layer graph and find its memory peak. Pure.

A step is a list of :class:`Node` (one per layer application, in forward order) reading and
writing :class:`Tensor` s. The replay allocates each node's outputs and temporaries, frees a tensor
after its last forward reader unless a node keeps it for the backward pass, then walks the nodes
backwards: each allocates the gradients of its inputs and weights, frees the gradients of its
outputs and the tensors only it still kept. Every allocation and free goes through an allocator
model (``allocators``: requested bytes exactly, TensorFlow's BFC allocator or torch's CUDA
caching allocator, whose chunks can be larger than the request), and
the largest amount in use on the way is the peak the framework reports. What each node keeps is
the framework's business (see ``keras.rules``); this module only counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .allocators import ExactAllocator

__all__ = ["needs_gradient", "Tensor", "Node", "Graph", "Replay", "replay"]


@dataclass
class Tensor:
    """A buffer of ``per_sample * batch + fixed`` bytes; ``alias`` names the tensor whose buffer
    it shares (a reshape), so it costs nothing itself and keeps that buffer alive."""

    per_sample: int
    fixed: int = 0
    alias: Optional[int] = None

    def at(self, batch: int) -> int:
        return self.per_sample * batch + self.fixed


@dataclass
class Node:
    """One layer application.

    ``saved``: tensor ids (inputs, outputs or temporaries) its gradient reads, so they stay alive
    until this node's backward. ``temps``: buffers created inside the node; freed when it returns
    unless saved. ``backward_temps``: buffers its backward allocates besides the input gradients.
    ``grads``: bytes of each trainable weight's gradient. ``update_temps``: bytes of the optimizer
    temporaries while one of its weights is updated (one entry per buffer, all weights).
    ``early_update_temps``: bytes of update temporaries that do not depend on the gradient
    (momentum's ``m * momentum``, RMSprop's ``rho * velocity``): a dataflow executor computes them
    as soon as the step starts, so they are alive from the step's start until the update.
    ``held_read_copies``: bytes of weights that an update made at the step's start (decoupled weight
    decay) copies because the forward's read of them is still held for this node's backward: alive
    from the step's start until this node's backward has run and released the old buffer.
    """

    row: int
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    saved: Tuple[int, ...] = ()
    temps: Tuple[int, ...] = ()
    backward_temps: Tuple[int, ...] = ()
    grads: Tuple[int, ...] = ()
    update_temps: Tuple[int, ...] = ()
    trainable: bool = False
    early_update_temps: Tuple[int, ...] = ()
    held_read_copies: Tuple[int, ...] = ()


@dataclass
class Graph:
    """A training step: tensors, nodes in forward order, the step's data inputs (held by the caller
    for the whole step) and ``persistent`` (bytes of each weight and optimizer-state buffer,
    alive throughout, in the order they were created)."""

    tensors: List[Tensor] = field(default_factory=list)
    nodes: List[Node] = field(default_factory=list)
    inputs: Tuple[int, ...] = ()
    persistent: List[int] = field(default_factory=list)
    #: the :data:`PARTS` name of each ``persistent`` buffer (default ``"weights"``)
    persistent_parts: List[str] = field(default_factory=list)
    #: with gradients applied as they come (``grads_held=False``): a dataflow executor starts each
    #: weight update as soon as its gradient exists and goes on with the backward pass beside it, so
    #: an update (its gradient and temporaries) is still alive while the next layers' backward and
    #: updates run. It finishes once the backward has since allocated ``update_overlap`` times its
    #: own bytes (work as a clock: a large weight's element-wise update outlasts several small
    #: layers' backward); 0 = each update finishes before the backward goes on
    update_overlap: float = 0.0

    def add(self, per_sample: int, fixed: int = 0, alias: Optional[int] = None) -> int:
        self.tensors.append(Tensor(int(per_sample), int(fixed), alias))
        return len(self.tensors) - 1

    def root(self, t: int) -> int:
        while self.tensors[t].alias is not None:
            t = self.tensors[t].alias  # type: ignore[assignment]
        return t



@dataclass
class Replay:
    """What a replay found, in bytes at ``batch``.

    ``peak``: the largest amount in use. ``phase``/``node``: where it happened (``"forward"``,
    ``"backward"`` or ``"update"``; node index or -1). ``saved``: activations alive when the
    backward pass starts. ``saved_by_row``: those per table row (the earliest node keeping each).
    ``forward_peak``: the peak of a forward pass that keeps nothing (inference). ``parts``: the
    peak split into :data:`PARTS`, when the allocator tracked them.
    """

    batch: int
    peak: int
    phase: str
    node: int
    saved: int
    saved_by_row: Dict[int, int]
    forward_peak: int
    saved_at_peak: int = 0
    grads_at_peak: int = 0
    parts: Optional[Dict[str, int]] = None

    def as_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {
            "batch": self.batch, "peak": self.peak, "phase": self.phase, "node": self.node, "saved": self.saved,
            "forward_peak": self.forward_peak, "saved_at_peak": self.saved_at_peak,
            "grads_at_peak": self.grads_at_peak}
        if self.parts is not None:
            out["parts"] = dict(self.parts)
        return out


def _plan(g: Graph, train: bool):
    """What a replay needs that does not depend on the batch: which tensors need a gradient and
    which nodes a backward, how long each kept tensor lives, each tensor's last forward reader, the
    step's held inputs. Cached on the graph (keyed by its size, so a graph still being built is
    planned again); every estimate replays its graph several times."""
    key = (bool(train), len(g.nodes), len(g.tensors), tuple(g.inputs))
    cache = g.__dict__.setdefault("_plans", {})
    if key in cache:
        return cache[key]
    root = g.root
    nodes = g.nodes
    needs_grad = set()
    needs_backward = [False] * len(nodes)
    if train:
        for k, n in enumerate(nodes):
            if n.trainable or any(root(i) in needs_grad for i in n.inputs):
                needs_backward[k] = True
                needs_grad.update(root(o) for o in n.outputs)
    # a kept tensor lives until the backward of its earliest keeper (the backward walks nodes in reverse)
    kept_until: Dict[int, int] = {}
    for k, n in enumerate(nodes):
        if needs_backward[k]:
            for t in n.saved:
                r = root(t)
                kept_until[r] = min(kept_until.get(r, k), k)
    last_read: Dict[int, int] = {}
    for k, n in enumerate(nodes):
        for t in n.inputs:
            last_read[root(t)] = k
    held = {root(t) for t in g.inputs}
    freed_after: Dict[int, List[int]] = {}
    for t, k in kept_until.items():
        if t not in held:
            freed_after.setdefault(k, []).append(t)
    if len(cache) >= 4:
        cache.clear()
    cache[key] = (needs_grad, needs_backward, kept_until, last_read, held, freed_after)
    return cache[key]


def needs_gradient(g: Graph) -> set:
    """Tensor ids (roots) whose gradient a training step computes: outputs of trainable nodes and
    of every node downstream of one."""
    return _plan(g, True)[0]


def replay(graph: Graph, batch: int, *, grads_held: bool, train: bool = True,
           allocator: Optional[ExactAllocator] = None, steps: int = 1, saved_only: bool = False) -> Replay:
    """Replay ``steps`` training steps at ``batch`` and return the largest peak.

    ``grads_held``: weight gradients stay alive until one optimizer step after the backward pass
    (torch, loss-scaled Keras); otherwise each is applied and freed as soon as it exists (a Keras
    graph, whose per-variable updates depend only on their own gradient). ``train=False``
    replays a forward pass only. ``allocator``: how bytes are counted (default: exactly).
    ``saved_only``: return only what is kept for the backward pass (``saved``, ``saved_by_row``),
    which needs no allocation (peak fields are 0).
    """
    g = graph
    size = [0 if t.alias is not None else t.at(batch) for t in g.tensors]
    plan = _plan(g, train)
    kept_until, held = plan[2], plan[4]
    saved_by_row: Dict[int, int] = {}
    for t, k in kept_until.items():
        if t not in held:
            saved_by_row[g.nodes[k].row] = saved_by_row.get(g.nodes[k].row, 0) + size[t]
    saved_total = sum(saved_by_row.values())
    if saved_only:
        return Replay(batch, 0, "forward", -1, saved_total, saved_by_row, 0)
    step = _Step(g, size, plan, allocator if allocator is not None else ExactAllocator(), grads_held)
    for _ in range(max(1, steps)):
        step.early()
        step.forward()
        if not train:
            step.drop_forward()
            return Replay(batch, step.forward_peak, "forward", -1, 0, {}, step.forward_peak)
        step.backward()
        step.after_backward()
    peak, phase, where, saved_at, grads_at = step.best
    out = Replay(batch, int(peak), str(phase), int(where), saved_total, saved_by_row, step.forward_peak,
                 int(saved_at), int(grads_at))
    if step.a.track:
        out.parts = step.a.parts()
    return out


class _Step:
    """One replay's running state: the allocator, what is allocated, the peak so far and where."""

    def __init__(self, g: Graph, size: List[int], plan, a: ExactAllocator, grads_held: bool):
        self.g, self.size, self.a, self.grads_held = g, size, a, grads_held
        self.nodes = g.nodes
        (self.needs_grad, self.needs_backward, self.kept_until, self.last_read, self.held,
         self.freed_after) = plan
        pparts = g.persistent_parts
        for i, nbytes in enumerate(g.persistent):
            a.alloc(("w", i), nbytes, pparts[i] if i < len(pparts) else "weights")
        for t in self.held:
            a.alloc(t, size[t], "inputs")
        self.best = [a.in_use, "forward", -1, 0, 0]
        self.forward_peak = a.in_use
        self.kept_live = 0
        self.weight_grads = 0
        self.overlap = max(0.0, float(g.update_overlap))
        self.allocated: set = set()

    def mark(self, phase: str, k: int) -> None:
        if self.a.in_use > self.best[0]:
            self.best[:] = [self.a.in_use, phase, k, self.kept_live, self.weight_grads]

    def finish_update(self, k: int) -> None:
        a, n = self.a, self.nodes[k]
        for j in range(len(n.update_temps)):
            a.free(("ut", k, j))
        for j in range(len(n.early_update_temps)):
            a.free(("et", k, j))
        for j, nbytes in enumerate(n.grads):
            if ("wg", k, j) in a.sizes:
                self.weight_grads -= nbytes
            a.free(("wg", k, j))

    def early(self) -> None:
        """What a step's start allocates before any layer runs: update terms that need no
        gradient and the copies decoupled weight decay makes."""
        a = self.a
        self.allocated = set(self.held)
        self.kept_live = 0
        for k, n in enumerate(self.nodes):
            for j, nbytes in enumerate(n.early_update_temps):
                a.alloc(("et", k, j), nbytes)
            for j, nbytes in enumerate(n.held_read_copies):
                a.alloc(("rc", k, j), nbytes)

    def forward(self) -> None:
        a, size, root = self.a, self.size, self.g.root
        allocated, kept_until, held, last_read = self.allocated, self.kept_until, self.held, self.last_read
        for k, n in enumerate(self.nodes):
            fresh = list(dict.fromkeys(root(t) for t in (*n.outputs, *n.temps) if root(t) not in allocated))
            allocated.update(fresh)
            for t in fresh:
                a.alloc(t, size[t], "activations" if t in kept_until else "temporaries")
                if t in kept_until and t in a.sizes:  # counted by the allocator (not below its floor)
                    self.kept_live += size[t]
            self.mark("forward", k)
            self.forward_peak = max(self.forward_peak, a.in_use)
            for t in fresh:
                if t in kept_until or t in held or last_read.get(t, -1) > k:
                    continue
                a.free(t)
                allocated.discard(t)
            for t in dict.fromkeys(root(i) for i in n.inputs):
                if last_read.get(t) == k and t not in kept_until and t not in held and t in allocated:
                    a.free(t)
                    allocated.discard(t)

    def drop_forward(self) -> None:
        for t in list(self.allocated):
            if t not in self.held:
                self.a.free(t)

    def backward(self) -> None:
        """The backward pass in reverse node order; with gradients applied as they come, each
        weight update starts beside it (see :attr:`Graph.update_overlap`)."""
        self.grad_of: Dict[int, bool] = {}
        self.pending: List[Tuple[str, int, int]] = []
        # weight updates still running: (node, backward bytes allocated when it started, its bytes)
        self.in_flight: List[Tuple[int, int, int]] = []
        self.work = 0
        for k in range(len(self.nodes) - 1, -1, -1):
            if self.needs_backward[k]:
                self.backward_node(k)

    def backward_node(self, k: int) -> None:
        a, size, root, n = self.a, self.size, self.g.root, self.nodes[k]
        grad_of = self.grad_of
        extra = []
        for i in dict.fromkeys(root(t) for t in n.inputs):
            if i not in self.needs_grad:
                continue
            if i in grad_of:
                extra.append((("g+", i), size[i]))  # a second contribution, summed into the first
            else:
                grad_of[i] = True
                a.alloc(("g", i), size[i])
        for j, t in enumerate(n.backward_temps):
            extra.append((("bt", k, j), size[root(t)]))
        for key, nbytes in extra:
            a.alloc(key, nbytes)
        for j, nbytes in enumerate(n.grads):
            a.alloc(("wg", k, j), nbytes, "gradients")
            if ("wg", k, j) in a.sizes:
                self.weight_grads += nbytes
        self.mark("backward", k)
        if not self.grads_held:
            self.update_beside(k, n, extra)
        else:
            self.pending.extend(("wg", k, j) for j in range(len(n.grads)))
        for key, _ in extra:
            a.free(key)
        for j in range(len(n.held_read_copies)):
            a.free(("rc", k, j))
        for o in dict.fromkeys(root(t) for t in n.outputs):
            if grad_of.pop(o, False):
                a.free(("g", o))
        for t in self.freed_after.get(k, ()):
            if t in a.sizes:
                self.kept_live -= size[t]
            a.free(t)

    def update_beside(self, k: int, n: Node, extra) -> None:
        """Start node ``k``'s weight update and finish those the backward has outrun."""
        for j, nbytes in enumerate(n.update_temps):
            self.a.alloc(("ut", k, j), nbytes)
        self.mark("backward", k)
        cost = sum(n.grads) + sum(n.update_temps)
        self.work += sum(nb for _, nb in extra) + cost
        if cost:
            self.in_flight.append((k, self.work, cost))
        for item in [f for f in self.in_flight if self.work - f[1] >= self.overlap * f[2]]:
            self.in_flight.remove(item)
            self.finish_update(item[0])

    def after_backward(self) -> None:
        """Finish the updates still running, free the last gradients; with gradients held, the
        optimizer step over every node; then free the step's unkept tensors."""
        a, nodes = self.a, self.nodes
        while self.in_flight:
            self.finish_update(self.in_flight.pop(0)[0])
        for i in list(self.grad_of):
            a.free(("g", i))
        for k, n in enumerate(nodes):
            for j in range(len(n.held_read_copies)):
                a.free(("rc", k, j))
        if self.grads_held:
            for k, n in enumerate(nodes):
                # one node's update temporaries are alive together, as when its gradients are not held
                for j, nbytes in enumerate(n.update_temps):
                    a.alloc(("ut", k, j), nbytes)
                self.mark("update", k)
                for j in range(len(n.update_temps)):
                    a.free(("ut", k, j))
                for j in range(len(n.early_update_temps)):
                    a.free(("et", k, j))
            for key in self.pending:
                a.free(key)
            self.weight_grads = 0
        for t in self.allocated:
            if t not in self.held and t not in self.kept_until:
                a.free(t)
