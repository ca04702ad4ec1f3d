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
activation, all-gathered) is stated to the plan as ``exchange_bytes``: the all-gather's output of one
vector per rank and two send buffers, this tick's and the previous one (see ``exchange``)
(``--exchange-in-plan off`` leaves it out, to see what it adds).
Everything a stage holds is a TensorFlow tensor (data, the exchange's buffers, received activations),
so the CPU allocator's peak counts what the plan counts; ``--width-scale`` scales every layer's width.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, positive_number, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import distmem  # noqa: E402
from distmem.costs import LayerCost  # noqa: E402
from distmem.units import plural  # noqa: E402

# The model as a layer list: (name, kind, width). Names are what the plan's partition refers to.
LAYERS = [("conv1", "conv", 32), ("conv2", "conv", 32), ("pool1", "pool", 0), ("conv3", "conv", 64),
          ("conv4", "conv", 64), ("pool2", "pool", 0), ("conv5", "conv", 128), ("gap", "gap", 0),
          ("fc1", "dense", 256), ("fc2", "dense", 128), ("logits", "dense", 10)]
INPUT = (32, 32, 3)


def scaled(scale: float = 1.0):
    """LAYERS with every hidden width times ``scale`` (at least 1); the logits keep their 10 classes."""
    return [(name, kind, width if name == "logits" or not width else max(1, round(width * scale)))
            for name, kind, width in LAYERS]


def output_shapes(layers=LAYERS):
    """Each layer's output shape for one sample (no batch axis), as ``build_stage`` makes it."""
    shape, out = INPUT, []
    for name, kind, width in layers:
        if kind == "conv":
            shape = shape[:2] + (width,)
        elif kind == "pool":
            shape = (shape[0] // 2, shape[1] // 2, shape[2])
        elif kind == "gap":
            shape = shape[-1:]
        else:
            shape = (width,)
        out.append(shape)
    return out


def layer_costs(micro_batch: int, optimizer_slots: int = 2, layers=LAYERS):
    """LayerCost per layer for ONE micro-batch: state = (1 weight + 1 gradient + slots) x 4 B x params;
    activations = what backward keeps, 4 B per value: the layer's output, once. What TensorFlow's
    gradients read (TF 2.15): ReLU its output (not its pre-activation), Conv2D and MatMul their input
    (the previous layer's output) and kernel, MaxPool its input and output, BiasAdd nothing, a global
    average (Mean) only its input's shape. So a conv or dense layer with a fused ReLU keeps its output
    and nothing else, and every layer this example can build (ReLU on all but the logits, whose softmax
    gradient keeps a tensor of their size) keeps exactly its output; its input is the previous layer's
    output, or the stage's boundary input, counted there."""
    out, channels = [], INPUT[-1]
    for (name, kind, width), shape in zip(layers, output_shapes(layers)):
        params = {"conv": 3 * 3 * channels * width + width, "dense": channels * width + width}.get(kind, 0)
        channels, values = shape[-1], micro_batch * int(np.prod(shape))
        out.append(LayerCost(name, (2 + optimizer_slots) * 4 * params, 4 * values, 4 * values, params, kind))
    return out


def build_stage(names, input_shape, layers=LAYERS):
    import tensorflow as tf

    inp = tf.keras.Input(input_shape[1:])
    x = inp
    for name, kind, width in layers:
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
    ap.add_argument("--width-scale", type=positive_number, default=1.0,
                    help="every hidden layer's width times this (default 1: the widths in LAYERS)")
    ap.add_argument("--allocator-region", choices=["planned", "grow"], default="planned",
                    help="without a GPU: give TensorFlow's CPU allocator the planned bytes as one region "
                         "first, as the plan's limit does on a GPU (planned, default), or let it grow "
                         "region by region (grow: TensorFlow's CPU default; its whole-chunk counting "
                         "then adds to the peak)")
    args = parse_example(ap)
    mb, m = args.micro_batch_size, args.micro_batches
    layers = scaled(args.width_scale)
    costs = layer_costs(mb, layers=layers)
    # Every tick each rank all-gathers one vector padded to the largest activation any cut can send
    # (known before the partition): TensorFlow holds the gathered output (one vector per rank), this
    # tick's send buffer and the previous tick's, which the exchange keeps until this one is gathered
    # (see exchange() below). That is this example's exchange, stated to the plan.
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
                        exchange_bytes=(2 + ranks) * 4 * width if args.exchange_in_plan == "on" else 0)

    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    info = plan.extras["pipeline"]
    p, rank = info["num_stages"], hvd.rank()
    if info["replicas"] != 1:
        raise SystemExit(f"this example runs one pipeline: launch exactly {p} ranks (got {hvd.size()})")
    stage = plan.mine.stage
    names = info["partition"]["parts"][stage]["layers"]
    if args.allocator_region == "planned" and not tf.config.list_physical_devices("GPU"):
        # Under the plan's limit a GPU's allocator (TensorFlow's BFC, no memory growth) is one region
        # from the start. The CPU one grows region by region (2 MiB, doubling) and counts a chunk it
        # does not split (one under twice the request) whole: a 10 MiB tensor in a fresh 16 MiB region
        # counts 16 MiB. One region of the planned bytes first, so that the CPU peak counts what the
        # job holds as a GPU would; the reservation is not the job's, and the peak restarts after it.
        tf.zeros([plan.mine.breakdown["planned_bytes"] // 4])
        tf.config.experimental.reset_memory_stats("CPU:0")
    # Shapes at every stage boundary (from the layer list: a throwaway build would leave its weights).
    after = dict(zip([name for name, _, _ in layers], output_shapes(layers)))
    shapes = [(mb,) + INPUT] + [(mb,) + after[part["layers"][-1]] for part in info["partition"]["parts"]]
    model = build_stage(names, shapes[stage], layers)
    opt = tf.keras.optimizers.Adam(1e-3)
    if rank == 0:
        from distmem.units import format_bytes

        for a in plan.allocations:
            echo(f"[rank 0] plan: rank {a.rank} stage {a.stage}: demand {format_bytes(a.demand_bytes)}, planned "
                  f"{format_bytes(a.limit_bytes or a.breakdown['planned_bytes'])} ({a.mode}); {a.notes[0]}")
        echo("[rank 0] stages: " + "; ".join(f"{s}: {', '.join(x['layers'])}"
                                              for s, x in enumerate(info["partition"]["parts"])))
    # Made in TensorFlow, and only where used: a tensor made from a NumPy array shares the array's memory
    # when it happens to be 64-byte aligned and is copied into TensorFlow's allocator when not.
    images = [tf.random.stateless_uniform((mb,) + INPUT, seed=(1234, k)) for k in range(m)] if stage == 0 else []
    labels = ([tf.random.stateless_uniform((mb,), seed=(4321, k), maxval=10, dtype=tf.int32) for k in range(m)]
              if stage == p - 1 else [])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    sent = [None]  # the previous tick's send buffer

    def exchange(vector, tick, source=None, shape=None):
        """All-gather one vector per rank padded to ``width``; return rank ``source``'s, as ``shape``.
        Its buffers are TensorFlow's (stated as exchange_bytes). Horovod's background thread lets go
        of an all-gather's input and output only after the caller has the result, so a rank with
        nothing to compute (the pipeline's bubble) would make its next send buffer while the last one
        may or may not be held still; keeping the previous send buffer until this tick's all-gather
        is done makes the exchange hold the same (2 + ranks) vectors whatever that thread's timing.
        The piece kept is copied out of the output (a whole row of it would be a view of all of it)."""
        flat = tf.zeros([0]) if vector is None else tf.reshape(vector, [-1])
        padded = tf.concat([flat, tf.zeros([width - flat.shape[0]])], 0)[None]  # a new buffer, even at full width
        got = hvd.allgather(padded, name=f"tick{tick}")
        sent[0] = padded
        if source is None:
            return None
        n = int(np.prod(shape))
        piece = tf.raw_ops.DeepCopy(x=got[source]) if n == width else got[source, :n]
        return tf.reshape(piece, shape)

    # The steps below keep nothing in local names: what a stage holds is in tapes/inputs/outputs/grads_in
    # and acc (the gradients, held once like the weights), as the plan counts it.
    acc = [tf.zeros_like(v) for v in model.trainable_variables]

    def forward(k, tapes, inputs, outputs, losses):
        x = images[k] if stage == 0 else inputs[k]
        with tf.GradientTape(persistent=False) as tape:
            tape.watch(x)
            y = model(x, training=True)
            if stage == p - 1:
                y = loss_fn(labels[k], y) / m
                losses.append(float(y))
        tapes[k], inputs[k], outputs[k] = tape, x, y
        return None if stage == p - 1 else y

    def backward(k, tapes, inputs, outputs, grads_in):
        upstream = None if stage == p - 1 else grads_in.pop(k)
        dx, *dw = tapes.pop(k).gradient(outputs.pop(k), [inputs.pop(k)] + model.trainable_variables,
                                        output_gradients=upstream)
        acc[:] = [a + g for a, g in zip(acc, dw)]
        return None if stage == 0 else dx

    for step in range(args.steps):
        tapes, inputs, outputs, grads_in, losses = {}, {}, {}, {}, []
        # Forward: at tick t stage s runs micro-batch t - s; every stage keeps all m micro-batches.
        for t in range(m + p - 1):
            k, kk = t - stage, t - (stage - 1)  # kk: the micro-batch the previous stage sends this tick
            got = exchange(forward(k, tapes, inputs, outputs, losses) if 0 <= k < m else None, f"{step}f{t}",
                           *((rank - 1, shapes[stage]) if stage > 0 and 0 <= kk < m else ()))
            if got is not None:
                inputs[kk] = got
            del got
        # Backward in reverse: at tick t stage s runs micro-batch's backward when the gradient arrives.
        for t in range(m + p - 1):
            k, k_next = t - (p - 1 - stage), t - (p - 1 - (stage + 1))
            got = exchange(backward(k, tapes, inputs, outputs, grads_in) if 0 <= k < m else None, f"{step}b{t}",
                           *((rank + 1, shapes[stage + 1]) if stage < p - 1 and 0 <= k_next < m else ()))
            if got is not None:
                grads_in[k_next] = got
            del got
        opt.apply_gradients(zip(acc, model.trainable_variables))
        acc[:] = [tf.zeros_like(v) for v in model.trainable_variables]
        if stage == p - 1:
            echo(f"[rank {rank}] step {step}: loss {sum(losses):.4f}")
    rep = distmem.report(path=args.report)
    if rep is not None:
        echo(f"[rank 0] report for {plural(len(rep.ranks), 'rank')} written to {args.report}")
    return 0


if __name__ == "__main__":
    run_example(main)
