"""distmem.keras.MemoryReport inside a real model.fit (one process; tf.keras of whichever TensorFlow
the environment has: Keras 2 with TF 2.15, Keras 3 with TF 2.21), and ReportEvery's schedule.

The multi-rank runs of the callback are in tests/horovod/ranked/test_ranked_report_callback.py."""
import json
import os
import subprocess
import sys

import pytest

import distmem
from distmem.errors import ConfigError, DistmemError
from distmem.report.periodic import ReportEvery

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(autouse=True)
def _fresh():
    distmem.reset()
    yield
    distmem.reset()


def test_importing_distmem_keras_does_not_import_tensorflow():
    code = ("import sys, distmem, distmem.keras, distmem.report.periodic, distmem.report.sinks, distmem.report.summary\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\nprint('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_report_every_schedule_and_outputs(tmp_path):
    distmem.init(fleet="2x16GiB", framework="none", verbose=False)
    ev = ReportEvery(3, path=str(tmp_path / "t.json"), prometheus=str(tmp_path / "t.prom"), flush_seconds=0)
    got = [s for s in range(1, 11) if ev.step() is not None]
    assert got == [3, 6, 9]
    assert os.path.exists(tmp_path / "t.prom") and os.path.exists(tmp_path / "t.json")
    rep = ev.close()
    assert [p["step"] for p in rep.timeline] == [3, 6, 9, 10]
    assert ev.close().timeline == rep.timeline  # nothing new since: no second gather
    data = json.load(open(tmp_path / "t.json"))
    assert [p["step"] for p in data["timeline"]] == [3, 6, 9, 10] and data["ranks"][0]["rank"] == 0
    assert data["timeline"][0]["limit_bytes"] == [rep.ranks[0].limit_bytes]


def test_report_every_explicit_steps_gather_on_crossing_a_multiple():
    distmem.init(framework="none", verbose=False)
    ev = ReportEvery(100)
    hits = [s for s in (0, 50, 99, 150, 199, 230, 310, 399, 400) if ev.step(s) is not None]
    assert hits == [150, 230, 310, 400]


def test_report_every_keeps_points_bounded():
    distmem.init(framework="none", verbose=False)
    ev = ReportEvery(1, max_points=8)
    for _ in range(50):
        ev.step()
    steps = [p["step"] for p in ev.points]
    assert len(steps) <= 8 and steps[0] == 1 and steps[-1] == 50 and steps == sorted(steps)


def test_report_every_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="whole number"):
        ReportEvery(0)
    with pytest.raises(ConfigError, match="detail"):
        ReportEvery(5, detail="everything")


def test_report_every_summary_mode():
    distmem.init(framework="none", fleet="1x16GiB", verbose=False)
    ev = ReportEvery(2, detail="summary")
    for _ in range(4):
        ev.step()
    rep = ev.close()
    assert rep.detail == "summary" and rep.aggregates["ranks_reporting"] == 1
    assert [p["step"] for p in rep.timeline] == [2, 4] and "summary" in rep.timeline[0]


def _fit(tf, callback, epochs=2, steps=5, steps_per_execution=1):
    tf.keras.utils.set_random_seed(0)
    x = tf.random.uniform((40, 8))
    y = tf.random.uniform((40, 1))
    model = tf.keras.Sequential([tf.keras.layers.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(4)
    model.fit(data, epochs=epochs, steps_per_epoch=steps, callbacks=[callback], verbose=0)


@pytest.mark.parametrize("spe", [1, 2])
def test_memory_report_in_model_fit(tmp_path, spe):
    tf = pytest.importorskip("tensorflow")
    distmem.init(fleet="2x16GiB", framework="tensorflow", verbose=False)
    from distmem.keras import MemoryReport

    cb = MemoryReport(every_n_batches=3, path=str(tmp_path / "timeline.json"), plot=str(tmp_path / "m.png"),
                      log_dir=str(tmp_path / "tb"), prometheus=str(tmp_path / "m.prom"))
    assert isinstance(cb, tf.keras.callbacks.Callback)
    _fit(tf, cb, steps_per_execution=spe)
    steps = [p["step"] for p in cb.points]
    # 2 epochs x 5 batches = steps 1..10; with steps_per_execution=2 the hook sees steps 2, 4, 5, 7, 9, 10
    # and gathers when a multiple of 3 is reached or passed.
    assert steps == ([3, 6, 9, 10] if spe == 1 else [4, 7, 9, 10])
    data = json.load(open(tmp_path / "timeline.json"))
    assert [p["step"] for p in data["timeline"]] == steps
    assert data["ranks"][0]["framework"] == "tensorflow" and data["ranks"][0]["peak_bytes"] is not None
    assert all(p["peak_bytes"][0] is not None for p in data["timeline"])
    assert open(tmp_path / "m.png", "rb").read(4) == b"\x89PNG"
    import importlib.util

    assert os.path.isdir(tmp_path / "tb") == (importlib.util.find_spec("tensorboard") is not None)
    assert "distmem_rank_peak_bytes" in open(tmp_path / "m.prom").read()
    # A second fit continues the step count instead of restarting it.
    _fit(tf, cb, epochs=1, steps=3, steps_per_execution=spe)
    assert cb.points[-1]["step"] == 13 if spe == 1 else 14


def test_memory_report_without_init_says_what_to_do():
    tf = pytest.importorskip("tensorflow")
    from distmem.keras import MemoryReport

    with pytest.raises(DistmemError, match="call distmem.init"):
        _fit(tf, MemoryReport(every_n_batches=2), epochs=1, steps=2)


def test_memory_report_keras_flags():
    pytest.importorskip("tensorflow")
    from distmem.keras import MemoryReport

    assert MemoryReport._supports_tf_logs is True and MemoryReport.async_safe is False
    assert MemoryReport.__module__ == "distmem.keras"


def test_memory_report_costs_nothing_between_reports():
    """Issue 18: Keras times every batch hook; between two reports the callback only counts, it does
    not even call into the schedule (bench/report/keras_hook_cost.py measures the hook: ~0.1 us)."""
    tf = pytest.importorskip("tensorflow")
    distmem.init(fleet="2x16GiB", framework="tensorflow", verbose=False)
    from distmem.keras import MemoryReport

    cb = MemoryReport(every_n_batches=4)
    calls = []
    step = cb.every.step
    cb.every.step = lambda s=None: (calls.append(s), step(s))[1]
    _fit(tf, cb, epochs=2, steps=5)
    assert [p["step"] for p in cb.points] == [4, 8, 10]
    assert calls == [4, 8, 10], calls  # the two reports and the end of fit: none of the other 7 batches
