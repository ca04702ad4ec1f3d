"""Pipeline parallel under a distmem plan: a small CNN cut into stages, one stage per rank, GPipe.

    horovodrun -np 4 -H localhost:4 python examples/pipeline.py
    horovodrun -np 4 -H localhost:4 python examples/pipeline.py --micro-batches 8 --recompute

Per-layer costs are computed from the layer list before TensorFlow starts (parameters and output
shapes, fp32 with Adam), handed to ``distmem.init(strategy="pipeline")``, which cuts the layers
into stages exactly for the GPipe schedule and gives every rank its stage's limit. Each rank then
builds only its stage and runs a real GPipe step: micro-batch activations travel forward and
their gradients backward between neighbouring stages (through ``hvd.allgather``, which every rank
joins at each tick), every stage keeps all its micro-batches' activations until the backward, and
applies its own Adam update. Rank 0 prints distmem's report: each rank's stage, planned limit
and measured peak. Without GPUs the plan is computed (mode "cpu") and the peaks are TensorFlow's
CPU allocator figures. The example's own exchange (each tick, one vector per rank padded to the largest
activation, all-gathered) is stated to the plan as ``exchange_bytes``: the all-gather's input and its
output of one vector per rank (``--exchange-in-plan off`` leaves it out, to see what it adds).
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

# The model as a layer list: (name, kind, width). Names are what the plan's partition refers to.
LAYERS = [("conv1", "conv", 32), ("conv2", "conv", 32), ("pool1", "pool", 0), ("conv3", "conv", 64),
          ("conv4", "conv", 64), ("pool2", "pool", 0), ("conv5", "conv", 128), ("gap", "gap", 0),
          ("fc1", "dense", 256), ("fc2", "dense", 128), ("logits", "dense", 10)]
INPUT = (32, 32, 3)


def layer_costs(micro_batch: int, optimizer_slots: int = 2):
    """LayerCost per layer for ONE micro-batch: state = (1 weight + 1 gradient + slots) x 4 B x params;
    activations = what backward keeps, 4 B per value: the output, and for a layer with a fused ReLU
    also its pre-activation."""
    h, w, c = INPUT
    out = []
    for name, kind, width in LAYERS:
        if kind == "conv":
            params, c = 3 * 3 * c * width + width, width
        elif kind == "pool":
            params, h, w = 0, h // 2, w // 2
        elif kind == "gap":
            params, h, w = 0, 1, 1
        else:
            params, c = c * width + width, width
        values = micro_batch * h * w * c
        kept = 2 * values if kind in ("conv", "dense") and name != "logits" else values
        out.append(LayerCost(name, (2 + optimizer_slots) * 4 * params, 4 * kept, 4 * values, params, kind))
    return out


def build_stage(names, input_shape):
    import tensorflow as tf

    inp = tf.keras.Input(input_shape[1:])
    x = inp
    for name, kind, width in LAYERS:
        if name not in names:
            continue
        if kind == "conv":
            x = tf.keras.layers.Conv2D(width, 3, padding="same", activation="relu", name=name)(x)
        elif kind == "pool":
            x = tf.keras.layers.MaxPooling2D(name=name)(x)
        elif kind == "gap":
            x = tf.keras.layers.GlobalAveragePooling2D(name=name)(x)
        else:
            x = tf.keras.layers.Dense(width, activation=None if name == "logits" else "relu", name=name)(x)
    return tf.keras.Model(inp, x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch-size", type=at_least(1), default=16)
    ap.add_argument("--micro-batches", type=at_least(1), default=4)
    ap.add_argument("--steps", type=at_least(1), default=5)
    ap.add_argument("--recompute", action="store_true", help="plan with activation recomputation (the "
                    "example itself keeps activations; the plan shows the smaller demand)")
    ap.add_argument("--report", default=os.environ.get("DISTMEM_REPORT", "runs/pipeline/report.json"))
    ap.add_argument("--exchange-in-plan", choices=["on", "off"], default="on",
                    help="state this example's all-gather buffers to the plan (exchange_bytes=; default on)")
    args = parse_example(ap)
    mb, m = args.micro_batch_size, args.micro_batches
    costs = layer_costs(mb)
    # Every tick each rank all-gathers one vector padded to the largest activation any cut can send
    # (known before the partition): TensorFlow holds its input and the gathered output, one vector per
    # rank, at once. That is this example's exchange, stated to the plan.
    width = max([mb * INPUT[0] * INPUT[1] * INPUT[2]] + [c.output_bytes // 4 for c in costs])
    size_var = next((v for v in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE") if os.environ.get(v)), None)
    try:
        ranks = int(os.environ[size_var]) if size_var else 1
    except ValueError:
        raise SystemExit(f"pipeline.py: {size_var}={os.environ[size_var]!r} is not a whole number of ranks; launch "
                         "with horovodrun -np N (it sets it)") from None
    plan = distmem.init(strategy="pipeline", layers=costs, schedule="gpipe", num_micro_batches=m,
                        micro_batch_size=mb, input_bytes=4 * mb * INPUT[0] * INPUT[1] * INPUT[2],
                        recompute=args.recompute,
                        exchange_bytes=(1 + ranks) * 4 * width if args.exchange_in_plan == "on" else 0)

    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    info = plan.extras["pipeline"]
    p, rank = info["num_stages"], hvd.rank()
    if info["replicas"] != 1:
        raise SystemExit(f"this example runs one pipeline: launch exactly {p} ranks (got {hvd.size()})")
    stage = plan.mine.stage
    names = info["partition"]["parts"][stage]["layers"]
    # Shapes at every stage boundary, from a throwaway build of the whole layer list.
    shapes = [(mb,) + INPUT]
    for part in info["partition"]["parts"]:
        shapes.append((mb,) + tuple(build_stage(part["layers"], shapes[-1]).output_shape[1:]))
    model = build_stage(names, shapes[stage])
    opt = tf.keras.optimizers.Adam(1e-3)
    if rank == 0:
        from distmem.units import format_bytes

        for a in plan.allocations:
            echo(f"[rank 0] plan: rank {a.rank} stage {a.stage}: demand {format_bytes(a.demand_bytes)}, planned "
                  f"{format_bytes(a.limit_bytes or a.breakdown['planned_bytes'])} ({a.mode}); {a.notes[0]}")
        echo("[rank 0] stages: " + "; ".join(f"{s}: {', '.join(x['layers'])}"
                                              for s, x in enumerate(info["partition"]["parts"])))
    rng = np.random.default_rng(1234)
    data = [(rng.random((mb,) + INPUT, dtype=np.float32), rng.integers(0, 10, mb)) for _ in range(m)]
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def exchange(vector, tick):
        padded = np.zeros((1, width), np.float32)
        if vector is not None:
            flat = np.asarray(vector, np.float32).reshape(-1)
            padded[0, :flat.size] = flat
        return hvd.allgather(tf.constant(padded), name=f"tick{tick}").numpy()

    for step in range(args.steps):
        tapes, inputs, outputs, losses = {}, {}, {}, []
        # Forward: at tick t stage s runs micro-batch t - s; every stage keeps all m micro-batches.
        for t in range(m + p - 1):
            k, send = t - stage, None
            if 0 <= k < m:
                x = tf.constant(data[k][0]) if stage == 0 else inputs[k]
                with tf.GradientTape(persistent=False) as tape:
                    tape.watch(x)
                    y = model(x, training=True)
                    if stage == p - 1:
                        y = loss_fn(data[k][1], y) / m
                        losses.append(float(y))
                tapes[k], inputs[k], outputs[k] = tape, x, y
                send = None if stage == p - 1 else y.numpy()
            got = exchange(send, f"{step}f{t}")
            if stage > 0 and 0 <= t - (stage - 1) < m:
                kk = t - (stage - 1)
                inputs[kk] = tf.constant(got[rank - 1, :int(np.prod(shapes[stage]))].reshape(shapes[stage]))
        # Backward in reverse: at tick t stage s runs micro-batch's backward when the gradient arrives.
        grads_in, acc = {}, [tf.zeros_like(v) for v in model.trainable_variables]
        for t in range(m + p - 1):
            k, send = t - (p - 1 - stage), None
            if 0 <= k < m:
                upstream = None if stage == p - 1 else grads_in.pop(k)
                dx, *dw = tapes.pop(k).gradient(outputs[k], [inputs[k]] + model.trainable_variables,
                                                output_gradients=upstream)
                acc = [a + g for a, g in zip(acc, dw)]
                send = None if stage == 0 else dx.numpy()
                del inputs[k], outputs[k]
            got = exchange(send, f"{step}b{t}")
            k_next = t - (p - 1 - (stage + 1))
            if stage < p - 1 and 0 <= k_next < m:
                grads_in[k_next] = tf.constant(got[rank + 1, :int(np.prod(shapes[stage + 1]))]
                                               .reshape(shapes[stage + 1]))
        opt.apply_gradients(zip(acc, model.trainable_variables))
        if stage == p - 1:
            echo(f"[rank {rank}] step {step}: loss {sum(losses):.4f}")
    rep = distmem.report(path=args.report)
    if rep is not None:
        echo(f"[rank 0] report for {plural(len(rep.ranks), 'rank')} written to {args.report}")
    return 0


if __name__ == "__main__":
    run_example(main)
