"""torch estimates, by role: ``inputs`` builds the step's batch and loss on the meta device,
``dispatch`` counts every buffer the step makes, ``kernels`` stands in CUDA's kernels where they
differ from the meta device's, ``autocast`` applies CUDA autocast's casts, ``simulate`` runs the
step, ``trace`` replays its record, ``estimate`` turns it into the per-layer table."""
from __future__ import annotations

from .estimate import DEFAULT_TORCH_INPUT_SHAPE, estimate_torch
from .kernels import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES
from .simulate import LOSS_SCALE

__all__ = ["estimate_torch", "CUBLAS_WORKSPACE_BYTES", "CUBLAS_WORKSPACES", "DEFAULT_TORCH_INPUT_SHAPE",
           "LOSS_SCALE"]
