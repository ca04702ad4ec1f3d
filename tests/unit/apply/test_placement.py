"""Placement on real TensorFlow: a model-parallel plan over logical CPU devices puts every variable of
every layer on its planned device. Runs TensorFlow in a child process so that the logical device
split happens before TensorFlow's runtime starts, whatever other tests did in this process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tensorflow")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = textwrap.dedent("""
    import json, sys
    from distmem.costs import LayerCost
    from distmem.discover.gpus import Inventory
    from distmem.plan import make_plan
    from distmem.discover.identity import Topology
    from distmem.apply import placement

    spec = json.loads(sys.argv[1])
    costs = [LayerCost(**c) for c in spec["costs"]]
    plan = make_plan("model", Topology(), Inventory([], "none"), layers=costs, gpus_per_rank=spec["devices"])
    print("LOGICAL", json.dumps(placement.logical_cpu_devices(plan.extras["cpu_logical_devices"])))
    import numpy as np
    import tensorflow as tf

    def build():
        inp = tf.keras.Input((8,), name="x")
        h = inp
        for c in spec["costs"]:
            if c["name"].startswith("bn"):
                h = tf.keras.layers.BatchNormalization(name=c["name"])(h)
            else:
                h = tf.keras.layers.Dense(spec["width"], name=c["name"])(h)
        return tf.keras.Model(inp, h)

    mode = spec["mode"]
    if mode == "build_placed":
        model = placement.build_placed(build, plan)
    elif mode == "wrong_names":
        try:
            with placement.placement_scope({"nope": "/CPU:1"}):
                build()
        except Exception as exc:
            print("ERROR", type(exc).__name__, str(exc))
        sys.exit(0)
    else:  # unplaced: the check must catch it
        model = build()
        print("BAD", json.dumps(placement.verify_placement(model, plan)))
        sys.exit(0)
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((16, 8), "float32"), np.ones((16, spec["width"]), "float32"), epochs=1, verbose=0)
    graph = tf.function(lambda x: model(x)).get_concrete_function(tf.TensorSpec((4, 8), tf.float32)).graph
    ops = {op.name: op.device for op in graph.get_operations() if op.type == "MatMul"}
    print("RESULT", json.dumps({"placement": plan.extras["model"]["placement"],
                                "variables": placement.variable_devices(model),
                                "bad": placement.verify_placement(model, plan), "ops": ops}))
""")


def _run(mode, devices=3):
    costs = [dict(name=f"dense{k}", state_bytes=(k % 3 + 1) * 1000, activation_bytes=500, output_bytes=64)
             for k in range(5)] + [dict(name="bn0", state_bytes=800, activation_bytes=300, output_bytes=64),
                                   dict(name="dense_out", state_bytes=2000, activation_bytes=100, output_bytes=8)]
    spec = {"costs": costs, "devices": devices, "width": 16, "mode": mode}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2",
               CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines() if " " in line}


def test_every_variable_lands_on_its_planned_logical_cpu():
    got = _run("build_placed")
    assert json.loads(got["LOGICAL"]) == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    result = json.loads(got["RESULT"])
    placement = result["placement"]
    assert set(placement.values()) == {"/CPU:0", "/CPU:1", "/CPU:2"}  # the plan really uses all three
    assert result["bad"] == []
    assert len(result["variables"]) >= 2 * 6 + 4  # kernels, biases, batch-norm's four
    for layer, var, device in result["variables"]:
        index = placement[layer].split(":")[1]
        assert device.endswith(f"device:CPU:{index}"), (layer, var, device, placement[layer])
    # forward computation follows the variables, also after the scope (here: a new trace)
    for op, device in result["ops"].items():
        layer = op.split("/")[-2]
        if layer not in placement:  # Keras 3 names a traced layer call "dense0_1"
            layer = layer.rsplit("_", 1)[0]
        assert device.endswith(placement[layer][1:]), (op, device)


def test_unplaced_model_is_reported():
    got = _run("unplaced")
    bad = json.loads(got["BAD"])
    assert bad and all("planned /CPU:" in b for b in bad)


def test_names_that_never_appear_raise():
    got = _run("wrong_names")
    assert got["ERROR"].startswith("ConfigError") and "nope" in got["ERROR"] and "same layer names" in got["ERROR"]
