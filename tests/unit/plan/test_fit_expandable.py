"""Fragmentation is the fit's problem: where a chosen layout's limit holds only with torch's expandable
segments, every door that plans the job says so and ``init()`` sets them before CUDA starts (merged
with the user's allocator settings); where they cannot be had (the user turned them off, CUDA started
before ``init()`` on a torch that cannot change them), the fit leaves each limit room for the largest
single allocation instead."""
import os

import pytest

torch = pytest.importorskip("torch")

import distmem  # noqa: E402
from distmem.apply import torch as tadapter  # noqa: E402
from distmem.cli.k8s import manifests  # noqa: E402
from distmem.units import MiB  # noqa: E402
from fake_torch_cuda import FakeCudaBase  # noqa: E402

WIDE = 16384
#: one micro-batch of 1,024 makes a 64 MiB activation: more than 10% of the step's peak
JOB = dict(global_batch_size=4096, input_shape=(512,), precision="float32", pipelines=[1], shardings="none",
           estimate="model")


def wide_model():
    """A model users write, whose largest single allocation is one wide layer's output."""
    return torch.nn.Sequential(torch.nn.Linear(512, WIDE), torch.nn.ReLU(), torch.nn.Linear(WIDE, 10))


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    # set, so that monkeypatch restores what init() writes; empty reads as unset
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "DISTMEM_TORCH_EXPANDABLE_SEGMENTS"):
        monkeypatch.setenv(var, "")
    for k in [k for k in os.environ if k.startswith(("OMPI_", "PMI", "HOROVOD_", "SLURM_"))] + ["DISTMEM_FLEET"]:
        monkeypatch.delenv(k, raising=False)
    distmem.reset()
    tadapter.set_backend(None)
    yield
    tadapter.set_backend(None)
    distmem.reset()


def largest_output(layout):
    return layout.micro_batch * WIDE * 4


def test_fit_asks_for_expandable_segments_or_leaves_the_block_room():
    model = wide_model()
    free = distmem.fit(model, gpus="4x4GiB", **JOB)
    assert free.expandable_segments, free.warnings
    h = free.chosen.heaviest
    assert h.planned_bytes - h.allocator_bytes < largest_output(free.chosen.layout)  # why it asks
    fixed = distmem.fit(model, gpus="4x4GiB", expandable_segments=False, **JOB)
    assert not fixed.expandable_segments
    assert not any("expandable" in w for w in fixed.warnings)
    h2 = fixed.chosen.heaviest
    block = largest_output(fixed.chosen.layout)
    assert h2.planned_bytes - h2.allocator_bytes >= block, "the limit leaves the largest block room"
    assert h2.planned_bytes >= int((h2.allocator_bytes + block) * 1.10) - MiB
    with pytest.raises(distmem.ConfigError, match="expandable_segments='sometimes'"):
        distmem.fit(model, gpus="4x4GiB", expandable_segments="sometimes", **JOB)


def test_every_planning_door_says_the_job_needs_them():
    plan = distmem.plan_from_env(strategy="auto", framework="torch", fleet="4x4GiB", model=wide_model(), **JOB)
    assert plan.extras["fit"]["expandable_segments"] is True
    assert any("init() sets torch's expandable segments" in w for w in plan.warnings)
    job = manifests(plan)[-1]
    env = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "value": "1"} in env
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert "DISTMEM_TORCH_EXPANDABLE_SEGMENTS" in launcher  # the launch line carries it to every rank
    assert os.environ["PYTORCH_ALLOC_CONF"] == "", "planning alone sets nothing"


def test_init_sets_them_before_cuda_starts_merged_with_the_users(monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    plan = distmem.init(strategy="auto", framework="torch", fleet="4x4GiB", model=wide_model(), **JOB)
    assert plan.extras["fit"]["expandable_segments"] is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"
    assert os.environ["PYTORCH_ALLOC_CONF"] == ""
    err = capsys.readouterr().err
    assert "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64,expandable_segments:True (the chosen layout's largest " \
           "allocation is larger than its limit's headroom" in err


def test_the_users_no_is_kept_and_planned_for(monkeypatch):
    limits = {}
    for word, var, value in (("free", None, None), ("distmem", "DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "0"),
                             ("torch", "PYTORCH_ALLOC_CONF", "expandable_segments:False")):
        for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            monkeypatch.setenv(v, "")  # what the previous init() set, gone
        if var:
            monkeypatch.setenv(var, value)
        distmem.reset()
        plan = distmem.init(strategy="auto", framework="torch", fleet="4x4GiB", model=wide_model(), verbose=False,
                            **JOB)
        limits[word] = plan.extras["fit"]["stages"][0]["planned_bytes"]
        if var:
            assert plan.extras["fit"]["expandable_segments"] is False
            assert os.environ["PYTORCH_ALLOC_CONF"] in ("", "expandable_segments:False")
            monkeypatch.setenv(var, "")
        else:
            assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    f = plan.extras["fit"]
    block = f["micro_batch"] * WIDE * 4
    assert limits["distmem"] == limits["torch"] >= limits["free"]
    # the same micro-batch now leaves the block room (a larger limit), or a smaller one was chosen
    assert limits["distmem"] > limits["free"] or block < 64 * MiB


class StartedCuda(FakeCudaBase):
    """CUDA already started on device 0; no run-time allocator settings (an older torch)."""

    version = "2.0.1"
    set_allocator_settings = None

    def __init__(self):
        super().__init__(1, True, {0})

    def available(self):
        return False


def test_cuda_started_on_a_torch_that_cannot_change_them_plans_the_block_room(capsys):
    tadapter.set_backend(StartedCuda())
    plan = distmem.init(strategy="auto", framework="torch", fleet="4x4GiB", model=wide_model(), **JOB)
    assert plan.extras["fit"]["expandable_segments"] is False
    assert any("CUDA started before init()" in w and "room for the largest single allocation" in w
               for w in plan.warnings)
    assert os.environ["PYTORCH_ALLOC_CONF"] == "" and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ""
    f = plan.extras["fit"]
    s = f["stages"][0]
    assert s["planned_bytes"] >= f["micro_batch"] * WIDE * 4


class LiveCuda(FakeCudaBase):
    version = "2.11.0+cu130"

    def __init__(self, initialised=False, setter=True):
        super().__init__(2, initialised, {0} if initialised else ())
        self.settings = []
        self.calls = []
        if not setter:
            self.set_allocator_settings = lambda conf: (_ for _ in ()).throw(RuntimeError("unsupported"))

    def set_device(self, i):
        self.initialised, self.current = True, i
        self.ctx.add(i)

    def mem_get_info(self, i):
        return 100 * 1024 * MiB, 100 * 1024 * MiB

    def set_memory_fraction(self, f, i):
        self.calls.append(f)

    def memory_stats(self, i):
        return {}

    def device_uuid(self, i):
        return None

    def set_allocator_settings(self, conf):
        self.settings.append(conf)
        return True


def _needing_plan():
    plan = distmem.plan_from_env(strategy="auto", framework="torch", fleet="4x4GiB", model=wide_model(), **JOB)
    plan.source = "declared"
    return plan


def test_apply_sets_them_for_a_plan_that_needs_them_and_at_run_time():
    fake = LiveCuda()
    out = tadapter.apply(_needing_plan(), backend=fake)
    assert fake.settings == ["expandable_segments:True"]
    assert any(a.startswith("PYTORCH_ALLOC_CONF=expandable_segments:True (and at run time) (the chosen layout")
               for a in out["applied"])


def test_apply_says_it_when_cuda_started_and_they_cannot_be_set():
    plan = _needing_plan()
    fake = LiveCuda(initialised=True, setter=False)
    tadapter.apply(plan, backend=fake)  # not an error: the plan's own warning names the way out
    assert any("assume torch's expandable segments" in w and "DISTMEM_TORCH_EXPANDABLE_SEGMENTS=0" in w
               for w in plan.warnings)
