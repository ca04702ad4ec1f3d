"""Model parallel under a distmem plan: every rank owns several devices and its layers are cut
into one group per device; the ranks are data-parallel replicas of that split model.

    horovodrun -np 4 -H localhost:4 python examples/model_parallel.py              # 2 devices per rank
    horovodrun -np 2 -H localhost:2 python examples/model_parallel.py --devices 3

Per-layer costs are computed from the layer list before TensorFlow starts and handed to
``distmem.init(strategy="model")``: it cuts the layers so the largest group is as small as
possible, gives each device its group's limit, and returns the placement (layer -> "/GPU:k").
The model is built inside ``distmem.apply.placement.placement_scope(plan)``, so each layer's variables
(and its optimizer slots and forward ops) land on its device; the example checks that before
training. Without GPUs the same flow runs over logical CPU devices ("/CPU:k"), which
``distmem.init`` creates. Rank 0 prints distmem's report: planned beside measured.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import distmem  # noqa: E402
from distmem.costs import LayerCost  # noqa: E402
from distmem.units import plural  # noqa: E402

INPUT = 64
LAYERS = [("embed", 512), ("hidden1", 1024), ("hidden2", 1024), ("hidden3", 1024), ("hidden4", 512),
          ("hidden5", 512), ("logits", 10)]


#: Weight-sized temporaries Keras's Adam holds while it updates one variable (``m * alpha`` and
#: ``sqrt(v) + epsilon`` before the division; bench/estimate/keras_update_temporaries.py measures 2 on TF 2.15
#: and 2.21).
ADAM_UPDATE_TEMPORARIES = 2


def layer_costs(batch: int, optimizer_slots: int = 2, update_temporaries: int = ADAM_UPDATE_TEMPORARIES):
    """LayerCost per Dense layer at ``batch``: state = (weight + gradient + slots + the update's
    temporaries) x 4 B x params, activations = output and pre-activation (ReLU), 4 B per value.

    The update's temporaries are state, not one layer's backward step: ``hvd.DistributedOptimizer``
    hands the reduced gradients back together (one fused all-reduce), and TensorFlow's executor then
    runs every variable's update, in no fixed order and interleaved, so each variable's
    ``update_temporaries`` weight-sized tensors can be alive at once. Priced one layer at a time, the
    ranks peaked up to 2% above their demand under a loaded CPU (218.1 MiB against 213.6)."""
    out, width = [], INPUT
    for name, units in LAYERS:
        params = width * units + units
        kept = batch * units * (1 if name == "logits" else 2)
        out.append(LayerCost(name, (2 + optimizer_slots + update_temporaries) * 4 * params, 4 * kept, 4 * batch * units,
                             params, "Dense"))
        width = units
    return out


def build():
    import tensorflow as tf

    inp = tf.keras.Input((INPUT,), name="features")
    x = inp
    for name, units in LAYERS:
        x = tf.keras.layers.Dense(units, activation=None if name == "logits" else "relu", name=name)(x)
    return tf.keras.Model(inp, x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=at_least(1), default=2, help="devices per rank (GPUs, or logical CPUs without GPUs)")
    ap.add_argument("--batch-size", type=at_least(1), default=64)
    ap.add_argument("--steps", type=at_least(1), default=20)
    ap.add_argument("--report", default=os.environ.get("DISTMEM_REPORT", "runs/model_parallel/report.json"))
    args = parse_example(ap)
    plan = distmem.init(strategy="model", layers=layer_costs(args.batch_size), gpus_per_rank=args.devices,
                        batch_size=args.batch_size, input_bytes=4 * args.batch_size * INPUT,
                        wrapper="horovod")  # hvd.DistributedOptimizer below: its fusion buffer and reduced copies

    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd

    from distmem.apply import placement

    hvd.init()
    with placement.placement_scope(plan):
        model = build()
    placement.check_placement(model, plan)  # raises if any variable is off its planned device
    info = plan.extras["model"]
    if hvd.rank() == 0:
        from distmem.units import format_bytes

        for g in info["groups"]:
            echo(f"[rank 0] {g['device']}: layers {g['first_layer']}..{g['last_layer']} demand "
                  f"{format_bytes(g['demand_bytes'])}, planned {format_bytes(g['planned_bytes'])}")
        by_device = {}
        for layer, var, device in placement.variable_devices(model):
            by_device.setdefault(device.split("device:")[-1], []).append(var)
        for device, names in sorted(by_device.items()):
            echo(f"[rank 0] variables on {device}: {', '.join(names)}")
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(7 + hvd.rank())
    x = rng.random((args.batch_size * args.steps, INPUT), dtype=np.float32)
    y = (x[:, :10].argmax(axis=1)).astype("int64")
    model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=2 if hvd.rank() == 0 else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    placement.check_placement(model, plan)
    rep = distmem.report(path=args.report)
    if rep is not None:
        echo(f"[rank 0] report for {plural(len(rep.ranks), 'rank')} written to {args.report}")
    return 0


if __name__ == "__main__":
    run_example(main)
