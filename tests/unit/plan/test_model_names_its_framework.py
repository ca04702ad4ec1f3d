"""A model whose spec or object says its framework is planned as that framework's.

``distmem plan --strategy pipeline --model torchvision:resnet18`` on a node with TensorFlow installed
took the framework from what was installed, not from the model, and priced the torch model's stages
with TensorFlow's rules (the last stage's transient 53.2 MiB where torch's is 18.2 MiB). Without
``--framework`` the plan is now the one ``--framework torch`` gives; a ``module:factory`` spec (known
only once built) still takes the installed one. A ``--framework`` (or ``framework=``) the model
contradicts is refused, at the plan request and in ``fit``, naming both.
"""
import os
import subprocess
import sys

import pytest

from distmem.plan.request import _model_framework

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run(*extra):
    env = dict(os.environ, PYTHONPATH=ROOT, DISTMEM_QUIET="1", DISTMEM_MEASURE_CACHE="off", TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "distmem", "plan", "--gpus", "2x16GiB", "--ranks", "2", "--strategy",
                           "pipeline", "--num-stages", "2", "--model", "torchvision:resnet18", "--input-shape",
                           "3,64,64", "--micro-batch-size", "8", "--estimate", "model", "--json", *extra],
                          env=env, capture_output=True, text=True, timeout=600)


def _plan(*extra):
    got = _run(*extra)
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_a_torchvision_spec_is_planned_as_torch_whatever_is_installed():
    pytest.importorskip("torchvision")
    named = _plan()
    assert named == _plan("--framework", "torch")


def test_a_framework_the_model_contradicts_is_refused_with_both_named():
    """``--framework tensorflow`` with a torchvision spec was planned with TensorFlow's rules
    without a word; it is refused, naming both and the remedy, before anything is built."""
    got = _run("--framework", "tensorflow")
    assert got.returncode != 0 and not got.stdout.strip(), (got.returncode, got.stdout[-300:])
    said = got.stderr
    assert "framework='tensorflow'" in said and "torchvision:resnet18" in said and "torch model" in said, said
    assert "framework='torch'" in said and "leave the framework out" in said, said


def test_fit_refuses_a_framework_the_model_contradicts():
    torch = pytest.importorskip("torch")
    from distmem.errors import ConfigError
    from distmem.plan.fit import fit

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    with pytest.raises(ConfigError, match=r"framework='tf' was given, but the model 'Sequential' is a torch model"):
        fit(model, global_batch_size=16, gpus="2x16GiB", input_shape=(64,), framework="tf", estimate="model")
    got = fit(model, global_batch_size=16, gpus="2x16GiB", input_shape=(64,), framework="torch", estimate="model")
    assert got.framework == "torch"


def test_what_a_model_says_of_its_framework():
    assert _model_framework("torchvision:resnet18") == "torch"
    assert _model_framework("hf:gpt2") == "torch"
    assert _model_framework("keras:MobileNetV2") == "tensorflow"
    assert _model_framework("saved/model.keras") == "tensorflow"
    assert _model_framework("mypkg.models:build") is None
    assert _model_framework(None) is None
    assert _model_framework(object()) is None
