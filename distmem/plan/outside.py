"""Memory a training process holds on its GPU outside the framework's allocator. Pure.

What a memory limit (``torch.cuda.set_per_process_memory_fraction``, TensorFlow's
``memory_limit``) does not cover, yet the GPU must hold: the CUDA context (driver state, the
kernels of every loaded library), cuBLAS and cuDNN handles and their library code, and NCCL's
communicators (their proxy state, work FIFOs and, towards peers, the per-channel buffers sized
by ``NCCL_BUFFSIZE``). It is per process, so ``k`` ranks on one GPU hold it ``k`` times.

Every constant below comes from a measurement on an NVIDIA H200 with this repository's
``python bench/plan/fit.py outside`` (NVML's per-process used memory minus torch's reserved bytes,
each case in a fresh process), committed in ``bench/results/outside_allocator_h200.json``; the
one part that cannot be measured on one GPU — buffers towards peers — follows NCCL's
documentation and is flagged as assumed in the breakdown until the multi-GPU measurement
(issue 19) replaces it.

>>> outside_allocator_bytes("torch")                          # CUDA context + cuBLAS + cuDNN
>>> outside_allocator_bytes("torch", nccl_communicators=2)    # plus two NCCL communicators
>>> outside_allocator_breakdown("torch", nccl_communicators=1, nccl_peers=7)["parts"]
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from ..errors import ConfigError
from ..units import MiB, format_bytes, parse_bytes, plural

__all__ = ["OutsideModel", "H200_TORCH", "DEFAULT_NCCL_BUFFSIZE", "DEFAULT_NCCL_CHANNELS",
           "outside_allocator_bytes", "outside_allocator_breakdown", "nccl_env"]

#: NCCL's default ``NCCL_BUFFSIZE``: 4 MiB per channel per peer for the Simple protocol
#: (NCCL documentation, "Environment Variables": NCCL_BUFFSIZE, default 4194304).
DEFAULT_NCCL_BUFFSIZE = 4 * MiB

#: Channels NCCL opens between a pair of GPUs when nothing says otherwise. NCCL picks it from the
#: topology (2 on PCIe, up to 16-32 over NVLink on Hopper); 16 is what NCCL 2.18+ reports on
#: H100/H200 NVLink boxes (``NCCL_DEBUG=INFO``: "16 coll channels"). An assumption, not measured
#: here (one GPU has no peers): ``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS`` override it.
DEFAULT_NCCL_CHANNELS = 16

#: Buffers per channel and peer, one set per protocol on the receiving side. LL and LL128
#: buffers are fixed (LL: 256 KiB, LL128: about 4.6 MiB by NCCL's defaults); Simple is
#: NCCL_BUFFSIZE. From NCCL's source (src/include/comm.h, DEFAULT_LL_BUFFSIZE,
#: DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE); assumed until measured with peers (issue 19).
_LL_BUFFSIZE = 256 * 1024
_LL128_BUFFSIZE = 4718592


@dataclass(frozen=True)
class OutsideModel:
    """Measured bytes outside the allocator for one framework build on one GPU type.

    ``context_bytes``: a bare CUDA context (``torch.cuda.init()`` and one tiny tensor).
    ``cublas_bytes``: added by the first matmul (cuBLAS handle, its kernels loaded).
    ``cudnn_bytes``: added by the first convolution forward + backward (cuDNN handle, kernels).
    ``nccl_first_bytes``: added by the first NCCL communicator (one-rank process group, after one
    all-reduce, default NCCL_BUFFSIZE). ``nccl_next_bytes``: each further communicator
    (``new_group``). ``nccl_buffsize_slope``: bytes per byte of NCCL_BUFFSIZE per communicator,
    measured between the default and 2 MiB on one rank (no peers). ``granularity``: what the
    driver rounds per-process memory to. ``source``: where the figures come from.
    """

    name: str
    context_bytes: int
    cublas_bytes: int
    cudnn_bytes: int
    nccl_first_bytes: int
    nccl_next_bytes: int
    nccl_buffsize_slope: float = 0.0
    granularity: int = 2 * MiB
    source: str = ""
    measured: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


#: torch 2.11 + CUDA 13.0 + NCCL 2.28.9, driver 580.159, on an NVIDIA H200: measured by
#: ``python bench/plan/fit.py outside`` (bench/results/outside_allocator_h200.json; NVML per-process used
#: memory minus torch's reserved bytes, each case a fresh process, the larger of two repeats).
#: A bare context 610 MiB; +66 MiB after the first matmul; +18 MiB after a convolution forward and
#: backward (694 MiB in all, below the planners' 768 MiB default); +556 MiB for the first
#: one-rank NCCL communicator and +390 MiB for each further one, the same at NCCL_BUFFSIZE=2 MiB
#: as at the default 4 MiB (a one-rank communicator allocates no peer buffers).
H200_TORCH = OutsideModel(
    name="torch-2.11-cuda13.0-nccl2.28.9-h200",
    context_bytes=610 * MiB,
    cublas_bytes=66 * MiB,
    cudnn_bytes=18 * MiB,
    nccl_first_bytes=556 * MiB,
    nccl_next_bytes=390 * MiB,
    nccl_buffsize_slope=0.0,
    source="bench/results/outside_allocator_h200.json (H200, torch 2.11, CUDA 13.0, NCCL 2.28.9)",
    measured={"without_nccl_bytes": 694 * MiB, "with_1_communicator_bytes": 1250 * MiB,
              "with_3_communicators_bytes": 2030 * MiB, "nccl_buffsize_tested": [4194304, 2097152]},
)

_MODELS = {"torch": H200_TORCH}
_FRAMEWORKS = {"torch": "torch", "pytorch": "torch", "tensorflow": "tensorflow", "tf": "tensorflow",
               "keras": "tensorflow", "jax": "torch", "none": "torch"}


def nccl_env(env: Mapping[str, str]) -> Dict[str, Optional[int]]:
    """``NCCL_BUFFSIZE`` and the channel bounds from an environment mapping (bytes / counts);
    ``None`` where unset. A malformed value is a ConfigError naming it."""
    out: Dict[str, Optional[int]] = {}
    for key, name in (("NCCL_BUFFSIZE", "buffsize"), ("NCCL_MIN_NCHANNELS", "min_channels"),
                      ("NCCL_MAX_NCHANNELS", "max_channels")):
        raw = env.get(key)
        if raw in (None, ""):
            out[name] = None
            continue
        try:
            value = int(str(raw), 0)
        except ValueError:
            raise ConfigError(f"{key}={raw!r} is not a whole number; NCCL reads it as an integer (bytes for "
                              f"NCCL_BUFFSIZE, e.g. 4194304), so fix or unset it") from None
        if value < 1:
            raise ConfigError(f"{key}={raw!r} must be at least 1; unset it for NCCL's default")
        out[name] = value
    return out


def _channels(channels: Optional[int], min_channels: Optional[int], max_channels: Optional[int]) -> int:
    c = DEFAULT_NCCL_CHANNELS if channels is None else int(channels)
    if min_channels is not None:
        c = max(c, int(min_channels))
    if max_channels is not None:
        c = min(c, int(max_channels))
    return max(c, 1)


def outside_allocator_breakdown(framework: str = "torch", *, cuda: bool = True, cublas: bool = True,
                                cudnn: bool = True, nccl_communicators: int = 0,
                                nccl_buffsize: Any = None, nccl_peers: int = 0,
                                nccl_channels: Optional[int] = None, nccl_min_channels: Optional[int] = None,
                                nccl_max_channels: Optional[int] = None,
                                model: Optional[OutsideModel] = None) -> Dict[str, Any]:
    """Bytes one process holds on its GPU outside the allocator, part by part.

    ``cublas``/``cudnn``: the process runs matmuls / convolutions (a training step does; a
    model without convolutions may pass ``cudnn=False``). ``nccl_communicators``: NCCL
    communicators the process creates (a DDP or Horovod-NCCL job: one for the world group, one
    more per ``new_group``/sub-mesh such as a pipeline's data-parallel group).
    ``nccl_buffsize``: NCCL_BUFFSIZE (bytes or "2MiB"; default NCCL's 4 MiB). ``nccl_peers``:
    ranks each communicator exchanges buffers with (ring: 2, tree: up to 3; 0 on one rank).
    ``nccl_channels`` (or the ``NCCL_MIN/MAX_NCHANNELS`` bounds): channels per peer.

    Returns ``{"total_bytes", "parts": {name: bytes}, "assumed": [part names], "sources": {...},
    "warnings": [...]}``. The peer buffers are assumed from NCCL's documented buffer sizes
    (issue 19 measures them on two GPUs); a warning says so whenever NCCL is in use.
    """
    fw = _FRAMEWORKS.get(str(framework).lower())
    if fw is None:
        raise ConfigError(f"framework={framework!r}: the outside-allocator model knows "
                          f"{', '.join(sorted(_FRAMEWORKS))}; pass overhead= in bytes for another one")
    for name, value in (("nccl_communicators", nccl_communicators), ("nccl_peers", nccl_peers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name}={value!r}: give a whole number >= 0")
    m = model or _MODELS.get(fw, H200_TORCH)
    parts: Dict[str, int] = {}
    assumed: List[str] = []
    warnings: List[str] = []
    sources = {"measured": m.source}
    if not cuda:
        return {"total_bytes": 0, "parts": {}, "assumed": [], "sources": sources, "warnings": [], "model": m.name}
    parts["cuda_context"] = m.context_bytes
    if cublas:
        parts["cublas"] = m.cublas_bytes
    if cudnn:
        parts["cudnn"] = m.cudnn_bytes
    if fw == "tensorflow":
        # TensorFlow was not measured on the GPU machine (it has no TensorFlow): the same CUDA
        # libraries load, so torch's figures stand in; said in the warnings.
        warnings.append("memory outside the allocator for TensorFlow is taken from torch's H200 measurement "
                        "(same CUDA, cuBLAS and cuDNN libraries); measure it with overhead='measure' on your GPU")
    buffsize = DEFAULT_NCCL_BUFFSIZE if nccl_buffsize is None else parse_bytes(nccl_buffsize, what="nccl_buffsize")
    if nccl_communicators:
        if buffsize < 1:
            raise ConfigError(f"nccl_buffsize={nccl_buffsize!r}: NCCL needs a positive buffer size (default 4 MiB)")
        delta = int(round(m.nccl_buffsize_slope * (buffsize - DEFAULT_NCCL_BUFFSIZE)))
        parts["nccl_communicators"] = max(0, m.nccl_first_bytes + (nccl_communicators - 1) * m.nccl_next_bytes
                                          + nccl_communicators * delta)
        channels = _channels(nccl_channels, nccl_min_channels, nccl_max_channels)
        if nccl_peers:
            per = channels * nccl_peers * (buffsize + _LL_BUFFSIZE + _LL128_BUFFSIZE)
            parts["nccl_peer_buffers"] = nccl_communicators * per
            assumed.append("nccl_peer_buffers")
            sources["nccl_peer_buffers"] = (
                f"assumed: {nccl_communicators} communicator(s) x {nccl_peers} peer(s) x {channels} channel(s) x "
                f"(NCCL_BUFFSIZE {format_bytes(buffsize)} + LL {format_bytes(_LL_BUFFSIZE)} + LL128 "
                f"{format_bytes(_LL128_BUFFSIZE)}), NCCL's documented defaults")
        warnings.append(
            f"NCCL in use ({plural(nccl_communicators, 'communicator')}): one-rank communicators are measured on an H200 "
            f"({format_bytes(m.nccl_first_bytes)} the first, {format_bytes(m.nccl_next_bytes)} each further); "
            + (f"buffers towards {plural(nccl_peers, 'peer')} are assumed from NCCL's buffer sizes, " if nccl_peers else
               "buffers towards peers are not counted (pass nccl_peers=), ")
            + "not measured: they need two GPUs (issue 19). Leave margin or measure with overhead='measure'")
    total = sum(parts.values())
    total = int(math.ceil(total / m.granularity)) * m.granularity
    return {"total_bytes": total, "parts": parts, "assumed": assumed, "sources": sources, "warnings": warnings,
            "model": m.name}


def outside_allocator_bytes(framework: str = "torch", *, nccl_communicators: int = 0, nccl_buffsize: Any = None,
                            **options: Any) -> int:
    """Bytes one process holds outside the allocator (see :func:`outside_allocator_breakdown`),
    rounded up to the driver's 2 MiB granularity: what ``overhead="auto"`` plans for."""
    return int(outside_allocator_breakdown(framework, nccl_communicators=nccl_communicators,
                                           nccl_buffsize=nccl_buffsize, **options)["total_bytes"])
