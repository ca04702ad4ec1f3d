"""``hf:`` model specs: a transformers model built from a local config with random weights on the
meta device, and a clear error (no download) for a name that cannot be resolved locally.

Skipped where ``transformers`` is not importable (the main environment has none; the GPU image has)."""
import argparse
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed in this environment")

from distmem.errors import ConfigError  # noqa: E402
from distmem.estimate import cli, estimate  # noqa: E402
from distmem.estimate.loader import load_model  # noqa: E402


@pytest.fixture
def tiny_gpt2(tmp_path):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    cfg.save_pretrained(tmp_path)
    return tmp_path


def test_local_config_builds_on_meta_with_token_inputs(tiny_gpt2):
    model = load_model(f"hf:{tiny_gpt2}", (64,))
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert next(model.parameters()).device.type == "meta"  # nothing allocated, nothing initialised
    ids = model.example_input(3)["input_ids"]
    assert tuple(ids.shape) == (3, 64) and ids.dtype == torch.long
    est = estimate(f"hf:{tiny_gpt2}", batch_size=4, optimizer="adamw", input_shape=(64,), device="cpu")
    params = sum(p.numel() for p in model.parameters())
    assert est.params == params and est.optimizer_bytes == 2 * 4 * params
    # logits of 4 x 64 tokens over 512 words, kept for the loss: a floor the peak must clear
    assert est.peak_bytes > est.state_bytes + 4 * 64 * 512 * 4


def test_config_json_file_and_model_type(tiny_gpt2):
    assert type(load_model(f"hf:{tiny_gpt2 / 'config.json'}")).__name__ == "GPT2LMHeadModel"
    t5 = load_model("hf:t5", (32,))  # a model type's default config: no file needed
    assert "decoder_input_ids" in t5.example_input(2)


def test_unresolvable_name_says_no_download(capsys):
    with pytest.raises(ConfigError, match="cannot be resolved without a download"):
        load_model("hf:nobody/no-such-model-xyz")
    from distmem.cli import main

    assert main(["estimate", "--model", "hf:nobody/no-such-model-xyz"]) == 1
    assert "huggingface-cli download" in capsys.readouterr().err


def test_cli_json(tiny_gpt2, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    code = cli.run(parser.parse_args(["--model", f"hf:{tiny_gpt2}", "--input-shape", "32", "--batch-size", "2",
                                      "--precision", "bf16", "--json"]))
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["framework"] == "torch" and out["precision"] == "mixed_bfloat16"
