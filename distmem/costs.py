"""Per-layer memory cost: the one shape the estimator produces and the partitioners consume. Pure."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Sequence

__all__ = ["LayerCost", "total_state", "total_activations", "EARLIER_BACKWARD", "GRADIENT_BEING_MADE"]

#: How an estimate's ``phase_breakdown`` names the backward moments it records beside the
#: backward's peak (numbered from 1, fewest gradients made first): moments with fewer gradients
#: made, where a rank keeping only a share of each gradient (ZeRO-2, FSDP2) may peak instead.
EARLIER_BACKWARD = "backward, fewer gradients made "
#: In those moments' splits, the newest gradient (the one made last, its accumulation not yet
#: done: a rank keeping a share of each gradient still holds it whole); ``gradients`` the rest.
GRADIENT_BEING_MADE = "gradient being made"


@dataclass(frozen=True)
class LayerCost:
    """Memory one layer needs during training.

    ``state_bytes``: weights + gradients + optimizer slots (+ fp32 master weights under mixed
    precision); held once, whatever the number of micro-batches in flight.
    ``activation_bytes``: activations this layer keeps for the backward pass for ONE (micro-)batch;
    multiplied by the micro-batches a pipeline stage keeps in flight.
    ``output_bytes``: bytes of the layer's output for one (micro-)batch: what crosses a device or
    stage boundary if the model is cut after this layer.
    ``backward_bytes``: what the layer's backward allocates for one (micro-)batch besides the
    gradients of its output and of its input (a kernel's workspace, a recomputed output); 0 where
    the backward makes only those.
    """

    name: str
    state_bytes: int
    activation_bytes: int
    output_bytes: int = 0
    params: int = 0
    kind: str = ""
    backward_bytes: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def total_state(layers: Sequence[LayerCost]) -> int:
    return sum(layer.state_bytes for layer in layers)


def total_activations(layers: Sequence[LayerCost]) -> int:
    return sum(layer.activation_bytes for layer in layers)
