"""Model specs through the real `distmem estimate` entry point: an --input-shape that contradicts a
Keras model's own fixed input is an error naming both (a factory and a saved .keras file), a saved
model file is a spec, and a missing torchvision is named alone."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _distmem(args, cwd, pre=""):
    code = pre + "import sys\nfrom distmem.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(cwd)]), DISTMEM_QUIET="1", TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


@pytest.fixture()
def fixed(tmp_path):
    pytest.importorskip("tensorflow")
    (tmp_path / "fixed_input.py").write_text(textwrap.dedent("""
        def build():
            import tensorflow as tf
            inp = tf.keras.Input((64, 64, 3))
            x = tf.keras.layers.Conv2D(8, 3)(inp)
            x = tf.keras.layers.GlobalAveragePooling2D()(x)
            return tf.keras.Model(inp, tf.keras.layers.Dense(10)(x))

        if __name__ == "__main__":
            build().save("fixed.keras")
    """))
    return tmp_path


def test_input_shape_contradicting_a_factory_model_is_an_error(fixed):
    bad = _distmem(["estimate", "--model", "fixed_input:build", "--input-shape", "3,64,64"], fixed)
    assert bad.returncode != 0
    assert "--input-shape 3,64,64 contradicts the model's own input (64,64,3" in bad.stderr, bad.stderr
    assert "give --input-shape 64,64,3" in bad.stderr and "Traceback" not in bad.stderr
    good = _distmem(["estimate", "--model", "fixed_input:build", "--input-shape", "64,64,3", "--json"], fixed)
    assert good.returncode == 0, good.stderr


def test_a_saved_keras_file_is_a_spec_and_is_checked_too(fixed):
    subprocess.run([sys.executable, "fixed_input.py"], cwd=fixed, check=True, timeout=300,
                   env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    ok = _distmem(["estimate", "--model", "fixed.keras", "--batch-size", "2", "--json"], fixed)
    assert ok.returncode == 0, ok.stderr
    assert '"framework": "keras"' in ok.stdout
    bad = _distmem(["estimate", "--model", "fixed.keras", "--input-shape", "32,32,3"], fixed)
    assert bad.returncode != 0 and "model file 'fixed.keras'" in bad.stderr and "(64,64,3" in bad.stderr
    gone = _distmem(["estimate", "--model", "nothere.keras"], fixed)
    assert gone.returncode != 0 and "does not exist" in gone.stderr


def test_missing_torchvision_is_named_alone(tmp_path):
    pytest.importorskip("torch")
    res = _distmem(["estimate", "--model", "torchvision:resnet18"], tmp_path,
                   pre="import sys\nsys.modules['torchvision'] = None  # as if not installed\n")
    assert res.returncode != 0
    assert "needs torchvision," in res.stderr and "torch and torchvision" not in res.stderr, res.stderr
