"""ZeRO-1/2 and FSDP2 shard a torch model's state; TensorFlow replicates it (Horovod, tf.distribute).

``distmem fit`` on a Keras model listed FSDP2 and ZeRO layouts among its fits (a Keras user was told
to run ``fsdp2`` over 2), and ``distmem plan --strategy sharded --model <a Keras model>`` planned
"fsdp2 over 2" for it. For a TensorFlow model ``shardings="auto"`` is none, naming one is an error
with the remedy, and the sharded strategy refuses a Keras model, by its spec before estimating it
and by what the estimate found for a ``module:factory`` spec.
"""
import os
import subprocess
import sys

import pytest

from distmem.costs import LayerCost
from distmem.errors import ConfigError
from distmem.plan.fit import fit
from distmem.units import MiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def layers(n=6):
    return [LayerCost(f"l{i}", 400 * MiB, 100 * MiB, 4 * MiB, 25 * 2 ** 20, "Dense") for i in range(n)]


def _shards(res):
    return {c["layout"].get("shard") or "" for c in res.to_dict()["fits"]}


def test_a_tensorflow_fit_tries_no_sharding_and_a_torch_one_does():
    tf_fit = fit(layers=layers(), layers_batch_size=1, global_batch_size=16, gpus="4x16GiB", framework="tensorflow")
    assert _shards(tf_fit) == {""}, _shards(tf_fit)
    torch_fit = fit(layers=layers(), layers_batch_size=1, global_batch_size=16, gpus="4x16GiB", framework="torch")
    assert len(_shards(torch_fit)) > 1, _shards(torch_fit)


def test_a_sharding_named_for_a_tensorflow_model_is_refused_with_the_remedy():
    with pytest.raises(ConfigError, match="torch model's state.*Leave shardings out"):
        fit(layers=layers(), layers_batch_size=1, global_batch_size=16, gpus="4x16GiB", framework="tensorflow",
            shardings="zero1")
    res = fit(layers=layers(), layers_batch_size=1, global_batch_size=16, gpus="4x16GiB", framework="tensorflow",
              shardings="none")
    assert _shards(res) == {""}


def _cli(*args, extra_path=""):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, extra_path) if p), DISTMEM_QUIET="1",
               DISTMEM_MEASURE_CACHE="off", TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "distmem", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_sharded_strategy_refuses_a_keras_spec_before_estimating_it():
    got = _cli("plan", "--strategy", "sharded", "--model", "keras:MobileNetV2", "--input-shape", "32,32,3",
               "--batch-size", "4", "--gpus", "2x8GiB", "--ranks", "2")
    assert got.returncode == 1, (got.stdout, got.stderr)
    assert "is a Keras model" in got.stderr and "strategy='data'" in got.stderr, got.stderr
    assert "estimating" not in got.stderr


def test_the_sharded_strategy_and_fit_refuse_a_keras_factory(tmp_path):
    pytest.importorskip("tensorflow")
    (tmp_path / "mymodels.py").write_text(
        "import tensorflow as tf\n"
        "def build():\n"
        "    inp = tf.keras.Input((32,))\n"
        "    hidden = tf.keras.layers.Dense(64, activation='relu')(inp)\n"
        "    return tf.keras.Model(inp, tf.keras.layers.Dense(10)(hidden))\n")
    got = _cli("plan", "--strategy", "sharded", "--model", "mymodels:build", "--input-shape", "32",
               "--batch-size", "4", "--gpus", "2x8GiB", "--ranks", "2", extra_path=str(tmp_path))
    assert got.returncode == 1 and "is a Keras model" in got.stderr, (got.stdout, got.stderr)
    fitted = _cli("fit", "--model", "mymodels:build", "--input-shape", "32", "--global-batch-size", "16",
                  "--gpus", "2x8GiB", "--json", extra_path=str(tmp_path))
    assert fitted.returncode == 0, fitted.stderr
    import json

    fits = json.loads(fitted.stdout)["fits"]
    assert fits and all(not (f["layout"].get("shard") or "") for f in fits), [f["layout"] for f in fits]
