"""One simulated training step on the meta device: forward (under autocast where asked), loss,
backward, optimizer step, every buffer counted through the allocator model; later steps replayed
from the first one's trace."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

from ...errors import ConfigError
from ..allocators import CudaCachingAllocator, ExactAllocator
from .autocast import AutocastMode
from .checkpointing import recomputed_under
from .dispatch import dispatch_mode, Tracker
from .inputs import as_batch, example_inputs, step_loss, import_torch
from .kernels import CUBLAS_WORKSPACES, CudaDropout, fused_sdpa
from .trace import peak_parts, replay_steps

__all__ = ["LOSS_SCALE", "foreach_as_torch_picks", "swapped", "Simulation", "inference_peak"]

#: The loss scale ``GradScaler`` multiplies the loss by under fp16 (its default ``init_scale``).
LOSS_SCALE = 65536.0

#: torch optimizers whose ``foreach=None`` runs the for-loop implementation on CUDA too: torch's
#: Adafactor (its foreach path holds a weight-sized temporary per tensor at once)
_FOR_LOOP_BY_DEFAULT = frozenset({"Adafactor"})


def foreach_as_torch_picks(opt: Any, cuda: bool) -> None:
    """Set each parameter group's unset ``foreach`` to what torch would run: the foreach kernels
    on CUDA (``_default_to_fused_or_foreach``), except for :data:`_FOR_LOOP_BY_DEFAULT`; the for-loop
    on CPU. An explicit ``foreach=True/False`` is kept."""
    default = cuda and type(opt).__name__ not in _FOR_LOOP_BY_DEFAULT
    for group in opt.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = default


@contextlib.contextmanager
def swapped(model: Any, state: Dict[str, Any]):
    """``model``'s parameters and buffers replaced by ``state`` (name -> tensor) for the block, as
    ``torch.func.functional_call`` does for one call (tied weights stay tied)."""
    try:
        from torch.nn.utils.stateless import _reparametrize_module as reparametrize
    except ImportError:  # pragma: no cover - torch without it: the parameters swapped by hand
        reparametrize = None
    if reparametrize is not None:
        with reparametrize(model, state, tie_weights=True):
            yield
        return
    from torch.nn.utils import stateless
    with stateless._reparametrize_module(model, state):  # pragma: no cover
        yield


class Simulation:
    """What every simulated step of one estimate shares: the module, its parameters and buffers,
    the optimizer factory, the precision, the allocator model's device and the switches."""

    def __init__(self, model: Any, *, example_input: Any, input_shape: Any, input_dtype: Any, loss: Any,
                 cuda: bool, prec: Any, factory: Any, workspace: int, replay_later: bool, memo: bool, cudnn: bool,
                 batch_dim: Any = 0, param_dtype: Any = None):
        self.model, self.example_input, self.input_shape, self.input_dtype = model, example_input, input_shape, \
            input_dtype
        #: where each input's batch is (see ``inputs``); FSDP2's param_dtype the parameters and
        #: floating inputs take in the step (None: as they are)
        self.batch_dim, self.param_dtype = batch_dim, param_dtype
        self.loss, self.cuda, self.prec, self.factory, self.workspace = loss, cuda, prec, factory, workspace
        self.replay_later, self.memo, self.cudnn = replay_later, memo, cudnn
        self.names = {id(m): n for n, m in model.named_modules()}
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())

    def run(self, batch: int, keep_table: bool, steps: int = 2, forward_only: bool = False,
            want_parts: bool = False) -> Dict[str, Any]:
        """``steps`` training steps at ``batch`` (or one forward pass): their peaks, the phase of
        the largest, and with ``keep_table`` what each module kept and output."""
        return _Run(self, batch, keep_table, steps, forward_only, want_parts).result()


class _Run:
    def __init__(self, sim: Simulation, batch: int, keep_table: bool, steps: int, forward_only: bool,
                 want_parts: bool):
        torch = import_torch()
        self.sim, self.batch, self.keep_table, self.steps = sim, batch, keep_table, steps
        self.forward_only, self.want_parts = forward_only, want_parts
        self.alloc = CudaCachingAllocator() if sim.cuda else ExactAllocator()
        self.tracker = tracker = Tracker(self.alloc)
        tracker.module_names = sim.names
        tracker.cudnn = sim.cuda and sim.cudnn
        self.mode = dispatch_mode(tracker, sim.memo)
        with self.mode:
            self.meta_params = {k: torch.empty_like(p, device="meta", dtype=sim.param_dtype if (
                sim.param_dtype is not None and p.is_floating_point()) else p.dtype).requires_grad_(p.requires_grad)
                                for k, p in sim.params.items()}
            self.meta_buffers = {k: torch.empty_like(b, device="meta") for k, b in sim.buffers.items()}
        self.trainable = [p for p in self.meta_params.values() if p.requires_grad]
        self.opt = sim.factory(self.trainable, {})
        foreach_as_torch_picks(self.opt, sim.cuda)
        self.args, self.kwargs = example_inputs(sim.model, sim.example_input, sim.input_shape, batch, sim.input_dtype,
                                                batch_dim=sim.batch_dim, cast=sim.param_dtype)
        for t in (*self.args, *self.kwargs.values()):
            tracker.register(t)  # the batch is on the device for the whole step
        self.weight_keys = {p.untyped_storage()._cdata for p in (*self.meta_params.values(),
                                                                 *self.meta_buffers.values())}
        self.grad_serials: set = set()
        self.before_trace: List[Tuple[int, str]] = []
        self.blas_after_first = False
        self.kept: Dict[int, int] = {}
        self.peaks: List[int] = []
        self.phases: List[str] = []
        self.trace: List[Tuple[int, int, str]] = []
        self.alive: set = set()
        cdt = torch.bfloat16 if "bfloat16" in sim.prec.name else torch.float16
        self.autocast = AutocastMode(cdt) if sim.prec.cast_weights else None

    def _hooks(self) -> list:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        torch, tracker = import_torch(), self.tracker

        def pre(mod, args):
            tracker.stack.append(id(mod))
            tracker.row_of(mod, own=any(True for _ in mod.children()))

        def post(mod, args, out):
            if tracker.stack and tracker.stack[-1] == id(mod):
                tracker.stack.pop()
            row = tracker.rows.get(id(mod))
            if row is not None and row not in tracker.out_bytes:
                from torch.utils._pytree import tree_flatten
                tracker.out_bytes[row] = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                             if torch.is_tensor(t))
        return [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]

    def _simulate(self) -> None:
        sim = self.sim
        hooks = self._hooks()
        # a module whose compile() was called runs eagerly here (the meta device has no compiled graph)
        compiled = sim.model.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            sim.model._compiled_call_impl = None
        try:
            dropout = CudaDropout().mode if sim.cuda else None
            with self.mode, fused_sdpa(sim.cuda, self.autocast), (dropout or contextlib.nullcontext()), \
                    recomputed_under([dropout, self.autocast]):
                for step in range(1 if sim.replay_later else self.steps):
                    if not self._step(step):
                        break
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"could not run {type(sim.model).__name__} on the meta device to size it "
                              f"({type(exc).__name__}: {exc}); check example_input/input_shape, or estimate a "
                              f"module whose forward does not read tensor values (no .item(), no data-dependent "
                              f"shapes)") from None
        finally:
            for h in hooks:
                h.remove()
            if compiled is not None:
                sim.model._compiled_call_impl = compiled

    def _forward(self, step: int):
        sim, tracker = self.sim, self.tracker
        # ``with autocast(): out = model(x); loss = crit(out, y)``, then backward outside it
        if self.autocast is not None:
            self.autocast.__enter__()
        try:
            out = sim.model(*self.args, **self.kwargs)
            value = step_loss(out, sim.loss, as_batch(self.args, self.kwargs))
        finally:
            if self.autocast is not None:
                self.autocast.__exit__(None, None, None)
                self.autocast.clear()
        if sim.prec.loss_scaling:
            value = value * LOSS_SCALE  # GradScaler.scale(loss)
        if self.keep_table and step == 0:
            for key, owner in list(tracker.owner.items()):
                row = tracker.rows.get(owner)
                if row is not None:
                    self.kept[row] = self.kept.get(row, 0) + tracker.size.get(key, 0)
        tracker.phase = "backward"
        return out, value

    def _step(self, step: int) -> bool:
        """One step; False once no other step is to follow (a forward pass alone)."""
        sim, alloc, tracker = self.sim, self.alloc, self.tracker
        alloc.reset_peak()
        tracker.peak_phase = "forward"
        tracker.phase = "forward"
        tracker.trace = [] if sim.replay_later and self.steps > 1 and not self.forward_only else None
        if step == 0:
            self.before_trace = [(n, "weights" if key in self.weight_keys else "inputs")
                                 for key, n in tracker.size.items()]
        state = dict(self.meta_params)
        state.update(self.meta_buffers)
        # the meta weights stand in for the module's own through the backward pass too: a
        # checkpointed block (torch.utils.checkpoint, Hugging Face's gradient checkpointing)
        # runs its forward again there
        with swapped(sim.model, state):
            out, value = self._forward(step)
            if self.forward_only:
                self.peaks.append(alloc.peak)
                self.phases.append(tracker.peak_phase)
                return False
            # the output and loss stay referenced through backward and the update, as in
            # ``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``
            value.backward()
        for p_ in self.trainable:
            if p_.grad is not None:
                serial = tracker.serial.get(p_.grad.untyped_storage()._cdata)
                if serial is not None:
                    self.grad_serials.add(serial)
        tracker.phase = "update"
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        del out, value
        if tracker.blas and sim.workspace and ("cublas", 0) not in alloc.sizes:
            # created on the first matmul and kept for the process: part of every later step
            for i in range(CUBLAS_WORKSPACES):
                alloc.alloc(("cublas", i), sim.workspace)
            self.blas_after_first = True
        self.peaks.append(alloc.peak)
        self.phases.append(tracker.peak_phase)
        if tracker.trace is not None:
            self.trace = list(tracker.trace)
            self.alive = set(tracker.serial.values())
            replay_steps(alloc, tracker, self.steps - 1, self.peaks, self.phases)
        return True

    def result(self) -> Dict[str, Any]:
        self._simulate()
        sim, peaks, tracker = self.sim, self.peaks, self.tracker
        step_peak = max(peaks)
        res = {"peak": step_peak, "phase": self.phases[peaks.index(step_peak)], "node": -1, "batch": self.batch,
               "steps": peaks}
        if self.want_parts and not self.forward_only and sim.replay_later and self.steps > 1:
            phases: Dict[str, Dict[str, int]] = {}
            res["parts"] = peak_parts(sim.cuda, self.before_trace, self.trace, self.alive, self.grad_serials,
                                       CUBLAS_WORKSPACES * [sim.workspace] if self.blas_after_first else [],
                                       self.steps, peaks.index(step_peak), step_peak, phases=phases)
            res["phase_parts"] = phases
        if self.keep_table:
            res["kept"] = self.kept
            res["rows"] = tracker.row_names
            res["out_bytes"] = dict(tracker.out_bytes)
            res["read_values"] = sorted(tracker.read_values)
        return res


def inference_peak(model, params, buffers, args, kwargs, cuda, prec, cudnn: bool, memo: bool,
                   param_dtype: Any = None) -> int:
    """Allocator peak of one forward pass under ``no_grad`` (eval mode), weights included."""
    torch = import_torch()
    alloc = CudaCachingAllocator() if cuda else ExactAllocator()
    tracker = Tracker(alloc)
    tracker.cudnn = cuda and cudnn
    mode = dispatch_mode(tracker, memo)
    cdt = torch.bfloat16 if "bfloat16" in prec.name else torch.float16
    autocast = AutocastMode(cdt) if prec.cast_weights else None
    with mode:
        state = {k: torch.empty_like(p, device="meta", dtype=param_dtype if (
            param_dtype is not None and p.is_floating_point()) else p.dtype) for k, p in params.items()}
        state.update({k: torch.empty_like(b, device="meta") for k, b in buffers.items()})
        for t in (*args, *kwargs.values()):
            tracker.register(t)
        with torch.no_grad(), fused_sdpa(cuda, autocast):
            was = model.training
            model.eval()
            try:
                if autocast is not None:
                    with autocast:
                        out = torch.func.functional_call(model, state, args, kwargs)
                else:
                    out = torch.func.functional_call(model, state, args, kwargs)
            finally:
                model.train(was)
        del out
    return alloc.peak
