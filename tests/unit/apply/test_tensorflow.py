"""The TensorFlow adapter against real TensorFlow objects.

GPU calls: there is no GPU here (and no TensorFlow on the GPU machine), so a recording wrapper
stands in for ``tf.config``: it hands out real ``tf.config.PhysicalDevice`` objects for GPUs, takes
real ``tf.config.LogicalDeviceConfiguration`` objects, records every call with its arguments, and can
act as a runtime that has already initialised its devices. The tests pin the exact calls and the MiB
units. CPU calls go to the real ``tf.config`` in a child process (device setup is once per process):
the logical CPU split, an identical re-apply accepted, a different one refused with TooLateError.
Runs the same on TF 2.15 (Keras 2) and TF 2.21 (Keras 3).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

tf = pytest.importorskip("tensorflow")

from distmem.discover.gpus import fleet_inventory  # noqa: E402
from distmem.errors import TooLateError  # noqa: E402
from distmem.apply import tensorflow as tf_adapter  # noqa: E402
from distmem.plan import make_plan  # noqa: E402
from distmem.plan.types import Allocation, DeviceSlot, Plan  # noqa: E402
from distmem.discover.identity import Topology  # noqa: E402
from distmem.units import GiB, MiB  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class _Experimental:
    def __init__(self, rec):
        self._rec = rec

    def set_memory_growth(self, device, enable):
        self._rec.calls.append(("set_memory_growth", device.name, enable))
        if self._rec.initialised:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self._rec.growth[device.name] = enable

    def get_memory_growth(self, device):
        return self._rec.growth.get(device.name, False)


class RecordingConfig:
    """``tf.config`` for ``gpus`` GPUs that are not there: real TensorFlow types, every call recorded.

    ``initialised=True`` behaves like a runtime whose devices already started: every ``set_*`` raises
    RuntimeError as TensorFlow does, and ``get_*`` return the ``live`` configuration given.
    """

    def __init__(self, gpus=1, initialised=False, live_logical=None, live_visible=None, live_growth=None):
        self.calls = []
        self.initialised = initialised
        self.gpus = [tf.config.PhysicalDevice(name=f"/physical_device:GPU:{i}", device_type="GPU")
                     for i in range(gpus)]
        self.logical = dict(live_logical or {})
        self.visible = live_visible
        self.growth = dict(live_growth or {})
        self.LogicalDeviceConfiguration = tf.config.LogicalDeviceConfiguration
        self.experimental = _Experimental(self)

    def list_physical_devices(self, kind):
        self.calls.append(("list_physical_devices", kind))
        return list(self.gpus) if kind == "GPU" else tf.config.list_physical_devices(kind)

    def set_visible_devices(self, devices, kind):
        self.calls.append(("set_visible_devices", [d.name for d in devices], kind))
        if self.initialised:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = list(devices)

    def get_visible_devices(self, kind):
        return list(self.visible if self.visible is not None else self.gpus)

    def set_logical_device_configuration(self, device, configs):
        for c in configs:
            assert isinstance(c, tf.config.LogicalDeviceConfiguration), type(c)
        self.calls.append(("set_logical_device_configuration", device.name, [c.memory_limit for c in configs]))
        if self.initialised:
            raise RuntimeError("Virtual devices cannot be modified after being initialized")
        self.logical[device.name] = list(configs)

    def get_logical_device_configuration(self, device):
        return self.logical.get(device.name)

    def mutating_calls(self):
        return [c for c in self.calls if c[0] != "list_physical_devices"]


@pytest.fixture(autouse=True)
def _growth_env(monkeypatch):
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)


def one_rank():
    return Topology(rank=0, size=1, local_rank=0, local_size=1, host="n")


def test_tenants_split_one_gpu_into_limited_logical_devices_in_mib():
    plan = make_plan("tenants", one_rank(), fleet_inventory("1x16GiB"), tenants={"bert": "6GiB", "resnet": "8GiB"})
    rec = RecordingConfig(gpus=1)
    out = tf_adapter.apply(plan, tf_config=rec)
    assert rec.mutating_calls() == [
        ("set_visible_devices", ["/physical_device:GPU:0"], "GPU"),
        ("set_logical_device_configuration", "/physical_device:GPU:0", [6144, 8192]),
    ]
    limits = [c.memory_limit for c in rec.logical["/physical_device:GPU:0"]]
    assert all(type(x) is int for x in limits)
    # growth inside each limit is TensorFlow's environment switch, set before its GPUs start
    assert os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH") == "true"
    assert out["framework"] == "tensorflow" and out["gpus_seen"] == 1
    assert (plan.device("bert"), plan.device("resnet")) == ("/GPU:0", "/GPU:1")


def test_limit_is_rounded_down_to_whole_mib():
    slot = DeviceSlot(index=0, total_bytes=16 * GiB, planned_bytes=1536 * MiB + 123456, enforce=True, growth=True,
                      label="a")
    slot2 = DeviceSlot(index=0, total_bytes=16 * GiB, planned_bytes=2 * GiB - 1, enforce=True, growth=True, label="b")
    plan = Plan("tenants", 1, 0, [Allocation(0, 0, "n", "tenants", "limit", [slot, slot2])], "fleet", 0, 0)
    rec = RecordingConfig(gpus=1)
    tf_adapter.apply(plan, tf_config=rec)
    assert rec.mutating_calls()[-1] == ("set_logical_device_configuration", "/physical_device:GPU:0", [1536, 2047])


def test_alone_on_a_gpu_grows_and_is_pinned_by_local_rank():
    topo = Topology(rank=1, size=2, local_rank=1, local_size=2, host="n")
    plan = make_plan("data", topo, fleet_inventory("2x16GiB"))
    rec = RecordingConfig(gpus=2)
    tf_adapter.apply(plan, tf_config=rec)
    assert rec.mutating_calls() == [("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
                                    ("set_memory_growth", "/physical_device:GPU:1", True)]
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in os.environ


def test_shared_gpu_gets_the_equal_share_as_memory_limit():
    topo = Topology(rank=1, size=2, local_rank=1, local_size=2, host="n")
    plan = make_plan("data", topo, fleet_inventory("1x16GiB"))
    rec = RecordingConfig(gpus=1)
    tf_adapter.apply(plan, tf_config=rec)
    # (16 GiB - 256 MiB reserve - 2 x 768 MiB overhead) / 2, in MiB
    assert rec.mutating_calls() == [("set_visible_devices", ["/physical_device:GPU:0"], "GPU"),
                                    ("set_logical_device_configuration", "/physical_device:GPU:0",
                                     [(16384 - 256 - 2 * 768) // 2])]


def test_identical_reapply_on_an_initialised_runtime_is_accepted():
    plan = make_plan("tenants", one_rank(), fleet_inventory("1x16GiB"), tenants={"bert": "6GiB", "resnet": "8GiB"})
    first = RecordingConfig(gpus=1)
    tf_adapter.apply(plan, tf_config=first)
    live = RecordingConfig(gpus=1, initialised=True, live_logical=first.logical, live_visible=first.visible)
    out = tf_adapter.apply(plan, tf_config=live)
    assert any("already" in a for a in out["applied"]), out


def test_different_config_on_an_initialised_runtime_is_too_late():
    plan = make_plan("tenants", one_rank(), fleet_inventory("1x16GiB"), tenants={"bert": "6GiB", "resnet": "8GiB"})
    live = RecordingConfig(gpus=1, initialised=True,
                           live_logical={"/physical_device:GPU:0": [tf.config.LogicalDeviceConfiguration(4096)]},
                           live_visible=None)
    with pytest.raises(TooLateError) as err:
        tf_adapter.apply(plan, tf_config=live)
    msg = str(err.value)
    assert "[4096] MiB" in msg and "[6144, 8192] MiB" in msg and "distmem.init()" in msg
    # and growth turned off in a live runtime cannot be turned on
    data = make_plan("data", one_rank(), fleet_inventory("1x16GiB"))
    with pytest.raises(TooLateError, match="memory growth"):
        tf_adapter.apply(data, tf_config=RecordingConfig(gpus=1, initialised=True))


def test_plan_naming_a_gpu_tensorflow_does_not_see_is_an_error():
    topo = Topology(rank=1, size=2, local_rank=1, local_size=2, host="n")
    plan = make_plan("data", topo, fleet_inventory("2x16GiB"))
    with pytest.raises(Exception, match="TensorFlow sees only 1 GPU"):
        tf_adapter.apply(plan, tf_config=RecordingConfig(gpus=1))


CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    from distmem.discover.gpus import Inventory
    from distmem.errors import TooLateError
    from distmem.apply import tensorflow as tf_adapter
    from distmem.plan import make_plan
    from distmem.discover.identity import Topology
    import tensorflow as tf

    def tenants(n):
        return make_plan("tenants", Topology(), Inventory([], "none"),
                         tenants={f"t{i}": "1GiB" for i in range(n)})

    out = {}
    if sys.argv[1] == "too_early_op":
        tf.constant(1.0) + 1.0          # TensorFlow starts its devices here
    try:
        out["first"] = tf_adapter.apply(tenants(2))["applied"]
    except TooLateError as exc:
        out["first_error"] = str(exc)
    out["logical"] = [d.name for d in tf.config.list_logical_devices("CPU")]
    out["again"] = tf_adapter.apply(tenants(2))["applied"] if "first" in out else None
    try:
        tf_adapter.apply(tenants(3))
        out["different"] = "accepted"
    except TooLateError as exc:
        out["different"] = str(exc)
    print("RESULT " + json.dumps(out))
""")


def _child(scenario):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", CHILD, scenario], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


def test_real_logical_cpu_split_reapply_and_too_late():
    out = _child("in_time")
    assert out["logical"] == ["/device:CPU:0", "/device:CPU:1"]
    assert out["first"] == ["/physical_device:CPU:0: 2 logical CPU devices"]
    # TensorFlow itself accepts an identical configuration once started; either wording is fine
    assert out["again"] and "2 logical CPU devices" in out["again"][0]
    assert "TensorFlow already initialised its devices" in out["different"]
    assert "split the CPU into 3 logical devices" in out["different"]
    assert "live configuration 2 logical CPU devices, planned 3 logical CPU devices for tenants t0 (/CPU:0, " \
           "1.0 GiB recorded)" in out["different"]


def test_real_split_after_the_first_op_is_too_late():
    out = _child("too_early_op")
    assert out["logical"] == ["/device:CPU:0"]
    assert "first_error" in out, out
    assert "call distmem.init() right after the imports" in out["first_error"]
    # issue 18: real figures, not "live configuration None MiB, planned [None, None] MiB"
    assert "None" not in out["first_error"], out["first_error"]
    assert "live configuration 1 logical CPU device, planned 2 logical CPU devices for tenants t0 (/CPU:0, 1.0 GiB " \
           "recorded), t1 (/CPU:1, 1.0 GiB recorded)" in out["first_error"]


def test_init_turns_on_tf_cpu_allocator_statistics_in_a_fresh_process():
    """distmem.init(framework="tensorflow") sets TF_CPU_ALLOCATOR_USE_BFC before TensorFlow starts,
    so the CPU allocator keeps statistics (run without the variable, in its own interpreter)."""
    import subprocess
    import sys

    code = ("import os, distmem; distmem.init(framework='tensorflow', verbose=False); "
            "import tensorflow as tf; x = tf.zeros((1024, 1024)); "
            "print(os.environ.get('TF_CPU_ALLOCATOR_USE_BFC'), distmem.snapshot().peak_bytes)")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["DISTMEM_QUIET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    flag, peak = out.stdout.split()[-2:]
    assert flag == "true" and peak != "None" and int(peak) >= 4 * 2 ** 20, out.stdout
