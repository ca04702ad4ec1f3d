"""Activation checkpointing in the simulated step: a checkpointed block runs its forward again in the
backward pass, and that second forward must see what the first saw.

The simulation stands in CUDA's behaviour with torch function modes (autocast's casts, the fused
dropout's one-byte mask). Those modes belong to the thread's Python state, which autograd does not
carry into the backward pass, so a block recomputed there would run without them — in float32
where autocast ran bfloat16, with a float mask where CUDA keeps a byte — and ``torch.utils.checkpoint``
rejects the recomputation ("Recomputed values ... have different metadata"). :func:`recomputed_under`
wraps the function every checkpoint recomputes (reentrant: ``CheckpointFunction``; non-reentrant
and selective: the ``_checkpoint_without_reentrant_generator``, which Hugging Face's
``gradient_checkpointing_enable()`` and torchtitan's per-op policy use too) so that it enters the
simulation's modes that are not already active. What the recomputation allocates, and what a
selective policy keeps instead (its cached outputs stay alive), is then counted as torch runs it.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

__all__ = ["recomputed_under", "with_modes"]


def with_modes(fn: Callable, modes: Sequence[Any]) -> Callable:
    """``fn`` run under each of ``modes`` (torch function modes) not already active."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        from torch.overrides import _get_current_function_mode_stack
        active = [id(m) for m in _get_current_function_mode_stack()]
        with contextlib.ExitStack() as stack:
            for m in modes:
                if m is not None and id(m) not in active:
                    stack.enter_context(m)
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def recomputed_under(modes: Sequence[Any]):
    """While active, every ``torch.utils.checkpoint`` recomputation runs under ``modes``."""
    import torch.utils.checkpoint as ckpt
    modes = [m for m in modes if m is not None]
    if not modes:
        yield
        return
    # the non-reentrant recomputation's generator: ``_checkpoint_without_reentrant_generator(fn, ...)``
    # (torch 2.1-2.12), ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, ...)`` after
    names = [n for n in ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")
             if callable(getattr(ckpt, n, None))]
    originals = {n: getattr(ckpt, n) for n in names}
    fwd = ckpt.CheckpointFunction.forward

    def wrap(gen):
        def generator(fn, *args, **kwargs):
            return gen(with_modes(fn, modes), *args, **kwargs)
        return generator

    def forward(ctx, run_function, preserve_rng_state, *args):
        return fwd(ctx, with_modes(run_function, modes), preserve_rng_state, *args)
    for n, gen in originals.items():
        setattr(ckpt, n, wrap(gen))
    ckpt.CheckpointFunction.forward = staticmethod(forward)
    try:
        yield
    finally:
        for n, gen in originals.items():
            setattr(ckpt, n, gen)
        ckpt.CheckpointFunction.forward = staticmethod(fwd)
