"""A model whose spec or object says its framework is planned as that framework's.

``distmem plan --strategy pipeline --model torchvision:resnet18`` on a node with TensorFlow installed
took the framework from what was installed, not from the model, and priced the torch model's stages
with TensorFlow's rules (the last stage's transient 53.2 MiB where torch's is 18.2 MiB). Without
``--framework`` the plan is now the one ``--framework torch`` gives; a ``module:factory`` spec (known
only once built) still takes the installed one.
"""
import os
import subprocess
import sys

import pytest

from distmem.plan.request import _model_framework

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _plan(*extra):
    env = dict(os.environ, PYTHONPATH=ROOT, DISTMEM_QUIET="1", DISTMEM_MEASURE_CACHE="off", TF_CPP_MIN_LOG_LEVEL="3")
    got = subprocess.run([sys.executable, "-m", "distmem", "plan", "--gpus", "2x16GiB", "--ranks", "2", "--strategy",
                          "pipeline", "--num-stages", "2", "--model", "torchvision:resnet18", "--input-shape",
                          "3,64,64", "--micro-batch-size", "8", "--estimate", "model", "--json", *extra],
                         env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_a_torchvision_spec_is_planned_as_torch_whatever_is_installed():
    pytest.importorskip("torchvision")
    named = _plan()
    assert named == _plan("--framework", "torch")
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return  # nothing else installed to be taken instead
    assert named != _plan("--framework", "tensorflow"), "the two frameworks plan this model alike: no check here"


def test_what_a_model_says_of_its_framework():
    assert _model_framework("torchvision:resnet18") == "torch"
    assert _model_framework("hf:gpt2") == "torch"
    assert _model_framework("keras:MobileNetV2") == "tensorflow"
    assert _model_framework("saved/model.keras") == "tensorflow"
    assert _model_framework("mypkg.models:build") is None
    assert _model_framework(None) is None
    assert _model_framework(object()) is None
