"""``distmem estimate`` (distmem/estimate/cli.py) and the model loader: forms, output, errors."""
import json
import sys
import textwrap

import pytest

from distmem.errors import ConfigError
from distmem.estimate import cli
from distmem.estimate.loader import load_model, parse_shape


def run(argv, capsys):
    from distmem.cli import main  # the real door: `distmem estimate`, under the command line's one rule

    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_parse_shape():
    assert parse_shape("96,96,3") == (96, 96, 3)
    assert parse_shape("3x224x224") == (3, 224, 224)
    assert parse_shape(None) is None
    with pytest.raises(ConfigError, match="expected whole numbers separated by commas"):
        parse_shape("96,a")
    with pytest.raises(ConfigError, match="every dimension must be a positive integer"):
        parse_shape("0,3")


def test_bad_specs_say_what_works(capsys):
    with pytest.raises(ConfigError, match="use keras:NAME"):
        load_model("resnet")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'"):
        load_model("no_such_module_xyz:build")
    code, out, err = run(["--model", "nothing"], capsys)
    assert code == 1 and "distmem estimate: error: model spec 'nothing'" in err and out == ""


def test_user_factory_keras_table_and_json(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorflow")
    (tmp_path / "my_models_est.py").write_text(textwrap.dedent("""
        import tensorflow as tf
        def build(input_shape=(8,)):
            inp = tf.keras.Input(input_shape)
            h = tf.keras.layers.Dense(16, activation="relu", name="hidden")(inp)
            return tf.keras.Model(inp, tf.keras.layers.Dense(2, name="head")(h))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = run(["--model", "my_models_est:build", "--input-shape", "8", "--batch-size", "4",
                        "--optimizer", "adam", "--per-layer"], capsys)
    assert code == 0
    assert "training peak (allocator)" in out and "hidden" in out and "head" in out
    code, out, _ = run(["--model", "my_models_est:build", "--batch-size", "4", "--json", "--per-layer",
                        "--mixed-precision"], capsys)
    data = json.loads(out)
    assert data["precision"] == "mixed_float16" and data["params"] == 8 * 16 + 16 + 16 * 2 + 2
    assert [r["name"] for r in data["per_layer"]] == ["hidden", "head"]
    assert data["peak_bytes"] > 0 and data["footprint_bytes"]["torch"] > data["peak_bytes"]
    sys.modules.pop("my_models_est", None)


def test_unknown_keras_application(capsys):
    pytest.importorskip("tensorflow")
    code, _, err = run(["--model", "keras:NotAModel"], capsys)
    assert code == 1 and "is not a keras.applications model" in err and "known, e.g." in err
    code, _, err = run(["--model", "keras:MobileNetV3"], capsys)
    line = err.strip().splitlines()[-1]  # the error; a stage line may come before it
    assert code == 1 and "did you mean MobileNetV2" in line and len(line) < 400  # the nearest, not the whole list


def test_user_factory_torch(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    (tmp_path / "my_torch_est.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = run(["--model", "my_torch_est:build", "--input-shape", "4", "--batch-size", "3", "--json"],
                       capsys)
    assert code == 0
    data = json.loads(out)
    assert data["framework"] == "torch" and data["params"] == 4 * 8 + 8 + 8 * 2 + 2
    code, _, err = run(["--model", "my_torch_est:build", "--batch-size", "3"], capsys)
    assert code == 1 and "input_shape" in err  # a torch module needs to be told its input
    sys.modules.pop("my_torch_est", None)


def test_hf_spec_without_transformers_names_the_install(monkeypatch):
    """Where transformers is missing, hf: says what to install (the main environment has none)."""
    import builtins
    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(ConfigError, match=r"hf:gpt2 needs torch and transformers; install them"):
        load_model("hf:gpt2")
