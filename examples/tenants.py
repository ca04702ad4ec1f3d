"""Serve two Keras models side by side in one process, each on its own slice of one GPU.

    python examples/tenants.py                                   # bert=6GiB,resnet=8GiB (seed 003)
    python examples/tenants.py --tenants bert=3GiB,resnet=auto --requests 20

distmem.init(strategy="tenants") splits the GPU into one logical device per model, each with its own
hard limit, before TensorFlow starts; ``plan.device(name)`` is the TensorFlow device string of a
model's slice ("/GPU:0", "/GPU:1"). Each model is built and served under ``tf.device`` of its
slice, so a traffic spike on one cannot take the other's memory. Without a GPU the same flow runs
over logical CPU devices ("/CPU:0", "/CPU:1"): the limits are recorded, not enforced, and the
report says so.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import distmem  # noqa: E402
from distmem.plan.strategies.tenants import tenant_table  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tenants", default="bert=6GiB,resnet=8GiB",
                   help="name=size pairs; this example serves a text model named 'bert' and an image model named "
                        "'resnet' (default bert=6GiB,resnet=8GiB)")
    p.add_argument("--requests", type=at_least(1), default=8, help="requests served per model")
    p.add_argument("--batch-size", type=at_least(1), default=16)
    p.add_argument("--report", default=None, help="also write the JSON report here")
    return parse_example(p)


def build_bert(tf):
    """A tiny text classifier standing in for BERT: token ids -> 2 classes."""
    return tf.keras.Sequential([
        tf.keras.layers.Input((64,), dtype="int32"),
        tf.keras.layers.Embedding(5000, 64),
        tf.keras.layers.GlobalAveragePooling1D(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(2),
    ], name="bert")


def build_resnet(tf):
    """A tiny image classifier standing in for ResNet: 32x32x3 -> 10 classes."""
    inp = tf.keras.Input((32, 32, 3))
    h = tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inp)
    r = tf.keras.layers.Conv2D(16, 3, padding="same")(h)
    h = tf.keras.layers.Activation("relu")(tf.keras.layers.Add()([h, r]))
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    return tf.keras.Model(inp, tf.keras.layers.Dense(10)(h), name="resnet")


def variable_device(v):
    """A variable's device string (Keras 3 keeps it on the backing tf.Variable, ``v.value``)."""
    return getattr(v, "device", None) or getattr(getattr(v, "value", None), "device", "") or ""


def main():
    args = parse_args()
    plan = distmem.init(strategy="tenants", tenants=args.tenants)  # before TensorFlow starts

    import numpy as np
    import tensorflow as tf

    builders = {"bert": build_bert, "resnet": build_resnet}
    inputs = {"bert": lambda n: np.random.randint(0, 5000, size=(n, 64)).astype("int32"),
              "resnet": lambda n: np.random.rand(n, 32, 32, 3).astype("float32")}
    names = [t["name"] for t in plan.extras["tenants"]]
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise SystemExit(f"this example serves tenants named {sorted(builders)}; got {unknown}")
    models = {}
    for name in names:
        with tf.device(plan.device(name)):
            models[name] = builders[name](tf)
            models[name](inputs[name](1), training=False)  # build: variables land on the slice
    placed = {}
    for name in names:
        devs = sorted({tf.DeviceSpec.from_string(variable_device(v)).to_string() for v in models[name].weights})
        placed[name] = devs
        echo(f"[tenants] {name}: {len(models[name].weights)} variables on {devs}, planned {plan.device(name)}")
    served = {n: 0 for n in names}
    for _ in range(args.requests):  # interleaved, as two services on one card would be
        for name in names:
            with tf.device(plan.device(name)):
                out = models[name](inputs[name](args.batch_size), training=False)
            served[name] += int(out.shape[0])
    echo("[tenants] served " + ", ".join(f"{n}: {c} samples" for n, c in served.items()))

    rep = distmem.report(path=args.report)
    usage = {}
    for t in plan.extras["tenants"]:
        dev = t["device"].lstrip("/")
        try:
            info = tf.config.experimental.get_memory_info(dev)
            usage[dev] = {"current_bytes": int(info["current"]), "peak_bytes": int(info["peak"])}
        except (ValueError, RuntimeError):
            usage[dev] = {}
    echo("tenants (this process):")
    echo(tenant_table(plan, usage))
    for w in plan.warnings:
        echo(f"WARNING: {w}")
    def same(actual, planned):
        a, p = tf.DeviceSpec.from_string(actual), tf.DeviceSpec.from_string(planned)
        return (a.device_type, a.device_index) == (p.device_type, p.device_index)

    bad = {n: d for n, d in placed.items() if not all(same(x, plan.device(n)) for x in d)}
    if bad:
        raise SystemExit(f"variables off their planned device: {bad}")
    return 0 if rep is not None else 1


if __name__ == "__main__":
    run_example(main)
