"""The PyTorch adapter: the real CPU build's paths, and the GPU logic against a fake ``torch.cuda``
that records every call (which calls, in which order, on which device, with which fraction)."""
import json
import os
import random

import pytest

torch = pytest.importorskip("torch")

import distmem  # noqa: E402
from distmem.discover.gpus import Inventory, fleet_inventory  # noqa: E402
from distmem.errors import ConfigError, DistmemError, TooLateError  # noqa: E402
from distmem.apply import adapter, detect_framework  # noqa: E402
from distmem.apply import torch as tadapter  # noqa: E402
from distmem.apply import torch_probe as probe  # noqa: E402
from distmem.plan import make_plan  # noqa: E402
from distmem.plan.types import DeviceSlot  # noqa: E402
from distmem.discover.identity import Topology  # noqa: E402
from distmem.units import GiB, MiB  # noqa: E402
from fake_torch_cuda import FakeCudaBase  # noqa: E402

# What CUDA reports on an H200 (139.8 GiB) beside NVML's 143771 MiB total.
H200_CUDA_TOTAL = 143155 * MiB


class FakeCuda(FakeCudaBase):
    """Stands in for ``torch.cuda``. Mirrors CUDA 12+: set_device, mem_get_info and setting a fraction
    create a context on the device they touch; nothing else does."""

    version = "2.11.0+cu130"

    def __init__(self, n=2, total=H200_CUDA_TOTAL, initialised=False, contexts=(), reserved=None, uuids=None):
        super().__init__(n, initialised, contexts)
        self.n, self.total = n, total
        self.calls = []
        self.fractions = {}
        self.reserved = dict(reserved or {})
        self.uuids = uuids or {i: f"0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(n)}
        self.settings = []

    def _touch(self, i):
        assert 0 <= i < self.n, f"touched device {i} of {self.n}"
        self.initialised = True
        self.ctx.add(i)

    def set_device(self, i):
        self.calls.append(("set_device", i))
        self._touch(i)
        self.current = i

    def mem_get_info(self, i):
        self.calls.append(("mem_get_info", i))
        self._touch(i)
        return self.total - self.reserved.get(i, 0), self.total

    def set_memory_fraction(self, f, i):
        self.calls.append(("set_memory_fraction", i, f))
        assert isinstance(f, float) and 0 <= f <= 1
        self._touch(i)
        self.fractions[i] = f

    def memory_stats(self, i):
        r = self.reserved.get(i, 0)
        return {"allocated_bytes.all.current": r // 2, "allocated_bytes.all.peak": r,
                "reserved_bytes.all.current": r, "reserved_bytes.all.peak": r, "num_ooms": 0}

    def reset_peak(self, i):
        self.calls.append(("reset_peak", i))

    def device_uuid(self, i):
        return self.uuids[i]

    def set_allocator_settings(self, conf):
        self.settings.append(conf)
        return True


class Untouchable:
    """A backend that fails the test if anything is called on it."""

    def __getattr__(self, name):
        raise AssertionError(f"backend.{name} was called for a rank without GPUs")


def data_plan(rank, size, fleet="2x143771MiB", **options):
    topo = Topology(rank=rank, size=size, local_rank=rank, local_size=size, host="n", source="test")
    return make_plan("data", topo, fleet_inventory(fleet), **options)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in ("CUDA_DEVICE_ORDER", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
              "DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "DISTMEM_FLEET"):
        monkeypatch.delenv(k, raising=False)
    tadapter._applied.clear()
    distmem.reset()
    yield
    tadapter.set_backend(None)
    tadapter._applied.clear()
    distmem.reset()


# ------------------------------------------------------------------------------ real torch, CPU build

def test_framework_names_resolve_to_this_adapter():
    assert detect_framework("torch") == detect_framework("pytorch") == "torch"
    assert adapter("torch").module is tadapter and adapter("torch").name == "torch"
    for name in tadapter.__all__:
        assert hasattr(tadapter, name), name


def test_cpu_build_applies_nothing_and_says_why():
    assert not torch.cuda.is_available()
    plan = data_plan(1, 2)
    plan.source = "nvml"  # as if NVML had found GPUs that this torch cannot use
    out = tadapter.apply(plan)
    assert out["gpus_seen"] == 0 and out["devices"] == {}
    assert any("nothing applied" in a and "sees no CUDA device" in a for a in out["applied"])
    assert any("GPU 1 limits are not applied" in w for w in plan.warnings), plan.warnings
    assert not torch.cuda.is_initialized()


def test_cpu_build_dry_run_plan_adds_no_warning():
    plan = data_plan(0, 2)
    tadapter.apply(plan)
    assert plan.warnings == []


def test_cpu_rank_touches_no_backend():
    plan = make_plan("data", Topology(0, 2, 0, 2, "n", "test"), Inventory([], "none"))
    assert plan.mine.devices == []
    assert tadapter.apply(plan, backend=Untouchable()) == {"framework": "torch", "applied": [], "gpus_seen": 0,
                                                           "devices": {}}
    assert "CUDA_DEVICE_ORDER" not in os.environ


def test_cpu_build_stats_are_none_and_never_start_cuda():
    plan = data_plan(0, 2)
    st = tadapter.stats(plan)
    assert st == {"framework": "torch", "current_bytes": None, "peak_bytes": None, "reserved_bytes": None,
                  "devices": []}
    tadapter.reset_peak(plan)
    assert not torch.cuda.is_initialized()
    assert tadapter.device(plan) == torch.device("cpu")


def test_init_with_torch_on_cpu_is_a_dry_run_and_snapshot_works():
    plan = distmem.init(framework="torch", fleet="2x16GiB", verbose=False)
    assert plan.mine.devices and plan.source.startswith("fleet")
    snap = distmem.snapshot()
    assert snap.framework == "torch" and snap.current_bytes is None and snap.rss_bytes
    assert tadapter.device() == torch.device("cpu")


def test_device_without_plan_names_the_fix():
    with pytest.raises(DistmemError, match=r"distmem.init\(framework='torch'\)"):
        tadapter.device()


def test_measure_on_cpu_fails_with_the_remedy():
    with pytest.raises(DistmemError, match=r"overhead='768MiB'"):
        probe.measure_context(0, timeout=120)


# ------------------------------------------------------------------------------ GPU logic, fake CUDA

def test_shared_gpu_pins_then_limits_only_the_planned_device():
    plan = data_plan(3, 4)  # 4 ranks, 2 GPUs: rank 3 shares GPU 1 with rank 1
    fake = FakeCuda()
    out = tadapter.apply(plan, backend=fake)
    slot = plan.mine.devices[0]
    assert slot.index == 1 and slot.enforce and slot.shared_by == 2
    assert fake.calls[0] == ("set_device", 1), "pinning must come before any call that starts a context"
    assert [c[0] for c in fake.calls] == ["set_device", "mem_get_info", "set_memory_fraction"]
    assert fake.ctx == {1}, "no context on GPU 0"
    f = fake.fractions[1]
    limit = int(f * fake.total)
    assert slot.planned_bytes - 1 <= limit <= slot.planned_bytes
    assert out["devices"][1]["limit_bytes"] == limit and out["devices"][1]["fraction"] == f
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert any("hard limit" in a for a in out["applied"])


def test_alone_on_a_gpu_is_pinned_and_grows():
    plan = data_plan(1, 2)
    fake = FakeCuda()
    out = tadapter.apply(plan, backend=fake)
    assert fake.calls == [("set_device", 1)]
    assert fake.fractions == {}
    assert any("grows on demand" in a for a in out["applied"])


def test_memory_limit_alone_sets_a_fraction():
    plan = data_plan(0, 2, memory="limit")
    fake = FakeCuda()
    tadapter.apply(plan, backend=fake)
    assert 0 in fake.fractions and fake.ctx == {0}


def test_explicit_limit_converts_to_the_fraction_of_cuda_total():
    plan = data_plan(0, 4, limit="40GiB")
    fake = FakeCuda()
    tadapter.apply(plan, backend=fake)
    assert int(fake.fractions[0] * fake.total) in (40 * GiB, 40 * GiB - 1)


def test_cuda_started_on_another_device_is_too_late():
    plan = data_plan(1, 2)
    fake = FakeCuda(initialised=True, contexts={0})
    with pytest.raises(TooLateError) as err:
        tadapter.apply(plan, backend=fake)
    msg = str(err.value)
    assert "cuda:0" in msg and "planned cuda:1" in msg and "distmem.init(framework='torch')" in msg
    assert "CUDA_VISIBLE_DEVICES" in msg
    assert fake.calls == [], "nothing may be changed once it is too late"


def test_cuda_started_on_the_planned_device_is_accepted():
    plan = data_plan(3, 4)
    fake = FakeCuda(initialised=True, contexts={1}, reserved={1: 100 * MiB})
    out = tadapter.apply(plan, backend=fake)
    assert any("already started" in a for a in out["applied"])
    assert 1 in fake.fractions


def test_cuda_initialised_without_a_context_is_not_too_late():
    plan = data_plan(1, 2)
    fake = FakeCuda(initialised=True, contexts=())  # torch.cuda.init() ran, no context yet
    tadapter.apply(plan, backend=fake)
    assert fake.ctx == {1}


def test_allocator_already_above_the_limit_is_too_late():
    plan = data_plan(3, 4)
    fake = FakeCuda(initialised=True, contexts={1}, reserved={1: 100 * GiB})
    with pytest.raises(TooLateError, match=r"already holds 100.0 GiB"):
        tadapter.apply(plan, backend=fake)


def test_planned_device_beyond_what_torch_sees():
    plan = data_plan(1, 2)
    with pytest.raises(ConfigError, match=r"GPU 1, but torch sees only 1 CUDA device"):
        tadapter.apply(plan, backend=FakeCuda(n=1))


def test_overcommit_against_cuda_total_is_warned_with_the_reserve_to_pass():
    # NVML says 143771 MiB; CUDA reports 616 MiB less. Two ranks x (share + 768 MiB) do not fit.
    plan = data_plan(0, 4)
    tadapter.apply(plan, backend=FakeCuda(total=H200_CUDA_TOTAL))
    w = [x for x in plan.warnings if "CUDA reports a total" in x]
    assert w and "pass reserve= at least" in w[0], plan.warnings
    plan2 = data_plan(0, 4, reserve="1GiB")
    tadapter.apply(plan2, backend=FakeCuda(total=H200_CUDA_TOTAL))
    assert not [x for x in plan2.warnings if "CUDA reports a total" in x], plan2.warnings


def test_several_slices_on_one_gpu_share_one_limit():
    plan = data_plan(0, 2, memory="limit")
    s = plan.mine.devices[0]
    half = s.planned_bytes // 2
    plan.mine.devices[:] = [DeviceSlot(0, s.total_bytes, half, True, True, label="a"),
                            DeviceSlot(0, s.total_bytes, half, True, True, label="b")]
    fake = FakeCuda()
    out = tadapter.apply(plan, backend=fake)
    assert int(fake.fractions[0] * fake.total) in (2 * half, 2 * half - 1)
    assert any("share this one limit" in a for a in out["applied"])


def test_to_fraction_never_exceeds_the_plan():
    rng = random.Random(7)
    for _ in range(20000):
        total = rng.randrange(1 * GiB, 200 * GiB)
        planned = rng.randrange(1, total)
        f = tadapter.to_fraction(planned, total)
        assert 0 < f <= 1
        assert planned - 1 <= int(f * total) <= planned, (planned, total, f)
    assert tadapter.to_fraction(10, 5) == 1.0
    with pytest.raises(ConfigError):
        tadapter.to_fraction(1, 0)


def test_uuid_mismatch_names_cuda_device_order(monkeypatch):
    plan = data_plan(1, 2)
    plan.source = "nvml"
    plan.mine.devices[0].nvml_index = 1
    monkeypatch.setattr(tadapter, "_nvml_uuid", lambda i: "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd")
    with pytest.raises(ConfigError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        tadapter.apply(plan, backend=FakeCuda())
    monkeypatch.setattr(tadapter, "_nvml_uuid", lambda i: "GPU-00000001-AAAA-bbbb-cccc-dddddddddddd")
    out = tadapter.apply(plan, backend=FakeCuda())
    assert out["devices"][1]["uuid"].startswith("GPU-00000001")


def test_expandable_segments_set_before_cuda_starts(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    fake = FakeCuda()
    tadapter.apply(data_plan(3, 4), backend=fake, expandable_segments=True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ, "the user's variable is the one to extend"
    assert fake.settings == ["expandable_segments:True"]


def test_expandable_segments_variable_follows_torch_version(monkeypatch):
    monkeypatch.setenv("DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "1")
    tadapter.apply(data_plan(3, 4), backend=FakeCuda())
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    old = FakeCuda()
    old.version = "2.4.1"
    tadapter.apply(data_plan(3, 4), backend=old, expandable_segments=False)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_expandable_segments_env_must_be_readable(monkeypatch):
    monkeypatch.setenv("DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "maybe")
    with pytest.raises(ConfigError, match="DISTMEM_TORCH_EXPANDABLE_SEGMENTS='maybe'"):
        tadapter.apply(data_plan(3, 4), backend=FakeCuda())


def test_expandable_segments_too_late_without_a_runtime_setter():
    fake = FakeCuda(initialised=True, contexts={1})
    fake.set_allocator_settings = lambda conf: (_ for _ in ()).throw(RuntimeError("unsupported"))
    with pytest.raises(TooLateError, match="expandable_segments:True"):
        tadapter.apply(data_plan(3, 4), backend=fake, expandable_segments=True)


def test_stats_sum_the_planned_devices_and_show_the_limit():
    plan = data_plan(3, 4)
    fake = FakeCuda(reserved={1: 3 * GiB})
    tadapter.apply(plan, backend=fake)
    st = tadapter.stats(plan, backend=fake)
    assert st["current_bytes"] == int(1.5 * GiB) and st["peak_bytes"] == 3 * GiB and st["reserved_bytes"] == 3 * GiB
    (row,) = st["devices"]
    assert row["device"] == "cuda:1" and row["limit_bytes"] <= plan.mine.limit_bytes
    tadapter.reset_peak(plan, backend=fake)
    assert ("reset_peak", 1) in fake.calls


def test_stats_do_not_start_cuda():
    fake = FakeCuda()
    assert tadapter.stats(data_plan(0, 2), backend=fake)["current_bytes"] is None
    tadapter.reset_peak(data_plan(0, 2), backend=fake)
    assert fake.calls == [] and not fake.initialised


def test_init_applies_through_the_backend_and_reports(monkeypatch):
    """api.init -> adapter('torch').apply with an NVML-like inventory: the wiring the GPU run relies on."""
    from distmem import api

    inv = fleet_inventory("2x143771MiB")
    inv.source = "nvml"
    from distmem.discover import gpus

    monkeypatch.setattr(gpus, "inventory", lambda **kw: inv)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    fake = FakeCuda(reserved={1: GiB})
    tadapter.set_backend(fake)
    plan = distmem.init(framework="torch", reserve="1GiB", verbose=False)
    assert plan.mine.rank == 3 and fake.calls[0] == ("set_device", 1) and 1 in fake.fractions
    from distmem import comm

    comm.set_comm(comm.SingleComm())
    snap = distmem.snapshot()
    assert snap.reserved_bytes == GiB and snap.framework == "torch"
    assert snap.extra["framework_devices"][0]["limit_bytes"] <= plan.mine.limit_bytes


def test_measure_overhead_rounds_up_to_64_mib(monkeypatch):
    for raw, want in ((612 * MiB, 640 * MiB), (760 * MiB, 768 * MiB), (768 * MiB, 768 * MiB),
                      (768 * MiB + 1, 832 * MiB), (1, 64 * MiB)):
        monkeypatch.setattr(probe, "measure_context", lambda d, timeout=120.0, r=raw: {"overhead_bytes": r})
        got = probe.measure_context_overhead(0)
        assert got == want and 0 <= got - raw < probe.OVERHEAD_ROUNDING
    assert probe.OVERHEAD_ROUNDING < tadapter.OVERHEAD_TOLERANCE


def test_measure_overhead_agrees_across_ranks(monkeypatch):
    from distmem import comm

    class MaxComm(comm.SingleComm):
        def allreduce(self, values, op="sum", timeout=60):
            assert op == "max"
            return [max(values[0], 896.0 * MiB)]

    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setattr(probe, "measure_context", lambda d, timeout=120.0: {"overhead_bytes": 700 * MiB})
    comm.set_comm(MaxComm())
    assert probe.measure_context_overhead(0) == 896 * MiB
    assert probe.measure_context_overhead(0, agree=False) == 704 * MiB


def test_measure_parses_the_child_line(monkeypatch):
    import subprocess

    line = probe.MEASURE_TAG + json.dumps({"overhead_bytes": 5, "device": 0})

    class Done:
        returncode, stdout, stderr = 0, "noise\n" + line + "\n", ""

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done())
    assert probe.measure_context(0)["overhead_bytes"] == 5


def test_too_late_changes_no_allocator_setting(monkeypatch):
    fake = FakeCuda(initialised=True, contexts={0})
    with pytest.raises(TooLateError):
        tadapter.apply(data_plan(1, 2), backend=fake, expandable_segments=True)
    assert fake.settings == [] and "PYTORCH_ALLOC_CONF" not in os.environ and fake.calls == []


class CappedCuda(FakeCuda):
    """torch.cuda under distmem's native cap: cuMemGetInfo reports min(device, cap) as the total,
    the device's properties keep the real one."""

    def __init__(self, cap, **kw):
        super().__init__(**kw)
        self.cap = cap

    def mem_get_info(self, i):
        free, total = super().mem_get_info(i)
        return min(free, self.cap), min(total, self.cap)

    def device_total(self, i):
        return self.total


def _cap_in_force(monkeypatch, cap):
    from distmem.apply import native

    monkeypatch.setattr(native, "status", lambda device=None: {"active": True, "cap_bytes": cap, "device": device})


def test_sharing_check_under_the_native_cap_uses_the_device_total(monkeypatch):
    # issue 35: on the H200 under `mpirun -np 2 distmem-exec`, every rank warned that 2 x (69 GiB +
    # overhead) does not fit "a total of 69.0 GiB": the cap's rewritten total, not the device's.
    plan = data_plan(0, 2, fleet="1x143771MiB", reserve="1GiB")  # fits the device (the test above)
    planned = plan.mine.devices[0].planned_bytes
    _cap_in_force(monkeypatch, planned)
    out = tadapter.apply(plan, backend=CappedCuda(planned, n=1))
    assert not [w for w in plan.warnings if "CUDA reports a total" in w], plan.warnings
    dev = out["devices"][0]
    assert dev["limit_bytes"] <= planned and dev["total_bytes"] == planned
    assert dev["device_total_bytes"] == H200_CUDA_TOTAL
    # the same check still speaks where the device itself is short: 2 ranks planned on NVML's total
    tight = data_plan(0, 2, fleet="1x143771MiB", reserve="1MiB")
    tight_share = tight.mine.devices[0].planned_bytes
    _cap_in_force(monkeypatch, tight_share)
    tadapter.apply(tight, backend=CappedCuda(tight_share, n=1, total=H200_CUDA_TOTAL - 2 * GiB))
    assert [w for w in tight.warnings if "CUDA reports a total of 137.8 GiB" in w], tight.warnings


def test_a_plan_above_the_native_cap_names_the_cap(monkeypatch):
    plan = data_plan(0, 2, fleet="1x143771MiB")
    cap = 10 * GiB
    _cap_in_force(monkeypatch, cap)
    tadapter.apply(plan, backend=CappedCuda(cap, n=1))
    w = [x for x in plan.warnings if "exceeds" in x]
    assert w and "native cap of 10.0 GiB" in w[0] and "DISTMEM_CAP_BYTES" in w[0], plan.warnings
