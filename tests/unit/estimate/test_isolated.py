"""A Keras model spec given to init()/plan_from_env() is estimated without starting TensorFlow in
the job's process: on a GPU node, a TensorFlow that started its GPUs to build the model would
refuse the limits init() then sets (TooLateError by distmem's own doing). Each case runs in a fresh
interpreter, because a started TensorFlow cannot be stopped."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytest.importorskip("tensorflow")


def _run(code, **env):
    full = {k: v for k, v in os.environ.items() if k != "DISTMEM_ESTIMATE_IN_PROCESS"}
    full.update(PYTHONPATH=ROOT, DISTMEM_QUIET="1", **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=full)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PLAN = ("import json, sys, distmem\n"
        "from distmem.estimate.isolated import tf_context_started\n"
        "plan = distmem.plan_from_env('pipeline', model='keras:MobileNetV2', input_shape=(64, 64, 3), num_stages=2,"
        " micro_batch_size=2, fleet='2x16GiB')\n"
        "print(json.dumps({'started': tf_context_started(), 'stages': len(plan.extras['pipeline']['stages']),"
        " 'limit': plan.allocations[0].limit_bytes}))\n")


def test_keras_spec_is_estimated_without_starting_tensorflow_here():
    got = _run(PLAN, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert got["started"] is False and got["stages"] == 2 and got["limit"] > 0


def test_the_same_plan_as_an_estimate_in_process(tmp_path):
    # the pipeline estimates the default way, measured: the second door reads the first one's
    # measurement back from the cache, so both plan the same bytes
    env = dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", DISTMEM_MEASURE_CACHE=str(tmp_path))
    child = _run(PLAN, **env)
    here = _run(PLAN, DISTMEM_ESTIMATE_IN_PROCESS="1", **env)
    assert here["started"] is True  # what the child process avoids
    assert child["limit"] == here["limit"] and child["stages"] == here["stages"]


def test_an_unknown_keras_model_is_the_same_config_error():
    code = ("import json, distmem\n"
            "try:\n"
            "    distmem.plan_from_env('pipeline', model='keras:NoSuchNet', num_stages=1, fleet='1x16GiB')\n"
            "except distmem.DistmemError as e:\n"
            "    print(json.dumps({'type': type(e).__name__, 'message': str(e)}))\n")
    got = _run(code)
    assert got["type"] == "ConfigError" and "NoSuchNet" in got["message"] and "known" in got["message"]


AUTO = ("import json, sys, distmem\n"
        "from distmem.estimate.isolated import tf_context_started\n"
        "plan = distmem.plan_from_env('auto', model='keras:MobileNetV2', input_shape=(64, 64, 3), global_batch_size=8,"
        " precision='float32', fleet='2x16GiB')\n"
        "print(json.dumps({'started': tf_context_started(), 'limit': plan.allocations[0].limit_bytes,"
        " 'layout': plan.extras['fit']['layout']}))\n")


def test_strategy_auto_fits_a_keras_spec_without_starting_tensorflow_here(tmp_path):
    # fit estimates the default way, measured: the second door reads the first one's measurement
    # back from the cache, so both plan the same bytes
    env = dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", DISTMEM_MEASURE_CACHE=str(tmp_path))
    child = _run(AUTO, **env)
    here = _run(AUTO, DISTMEM_ESTIMATE_IN_PROCESS="1", **env)
    assert child["started"] is False and here["started"] is True
    assert child["limit"] == here["limit"] and child["layout"] == here["layout"]


@pytest.mark.parametrize("method,hidden", [("auto", False), ("measure", False), ("model", True)])
def test_a_measuring_child_sees_the_gpus_this_process_would_use(monkeypatch, method, hidden):
    # The child that estimates a spec starts the measuring child: hiding the GPUs from the first
    # would measure a GPU job's steps on the CPU (and key the measurement apart from this process's).
    from distmem.estimate import isolated
    from distmem.plan import layers

    seen = {}
    monkeypatch.setattr(isolated, "needs_child", lambda spec: True)
    monkeypatch.setattr(isolated, "call", lambda target, kwargs, **kw: seen.update(kw) or ([], None))
    layers.estimate_layers("keras:MobileNetV2", batch_size=2, method=method)
    assert seen.get("hide_gpus", True) is hidden
