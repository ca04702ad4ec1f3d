"""Pipeline parallel under a distmem plan: a small CNN cut into stages, one stage per rank, GPipe.

    horovodrun -np 4 -H localhost:4 python examples/pipeline.py
    horovodrun -np 4 -H localhost:4 python examples/pipeline.py --micro-batches 8 --recompute

Per-layer costs are computed from the layer list before TensorFlow starts (parameters and output
shapes, fp32 with Adam), handed to ``distmem.init(strategy="pipeline")``, which cuts the layers
into stages exactly for the GPipe schedule and gives every rank its stage's limit. Each rank then
builds only its stage and runs a real GPipe step: micro-batch activations travel forward and
their gradients backward between neighbouring stages, every stage keeps all its micro-batches'
activations until the backward, and applies its own Adam update. Rank 0 prints distmem's report:
each rank's stage, planned limit and measured peak. Without GPUs the plan is computed (mode "cpu") and the peaks are TensorFlow's
CPU allocator figures, under the same limit (``--allocator-region``). The stages talk through one
``hvd.alltoall`` per tick, each rank sending only to its neighbour: what travels is a stage input or
the gradient of a stage output, both counted by the plan (the stage inputs, and the backward's
gradients in flight: the gradient received for the stage's output, and at the layer the backward
has reached its output's and its input's gradients), so nothing is stated on top.
Everything a stage holds is a TensorFlow tensor (data, received activations and gradients),
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
    output, or the stage's boundary input, counted there.
    backward_bytes = what a layer's backward allocates besides its output's and its input's gradients
    (the plan adds those, and the weight gradient is the state's): nothing for conv and dense; on
    TensorFlow's CPU kernels (oneDNN) MaxPoolGrad recomputes the forward, an output-sized tensor and a
    workspace twice that (2 x output besides), and the global average's gradient is broadcast to the
    input's shape twice (input - output besides). A GPU's kernels need less: the plan is then over."""
    out, channels, entering = [], INPUT[-1], micro_batch * int(np.prod(INPUT))
    for (name, kind, width), shape in zip(layers, output_shapes(layers)):
        params = {"conv": 3 * 3 * channels * width + width, "dense": channels * width + width}.get(kind, 0)
        channels, values = shape[-1], micro_batch * int(np.prod(shape))
        extra = {"pool": 2 * values, "gap": entering - values}.get(kind, 0)
        out.append(LayerCost(name, (2 + optimizer_slots) * 4 * params, 4 * values, 4 * values, params, kind,
                             backward_bytes=4 * extra))
        entering = values
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
    ap.add_argument("--width-scale", type=positive_number, default=1.0,
                    help="every hidden layer's width times this (default 1: the widths in LAYERS)")
    ap.add_argument("--allocator-region", choices=["planned", "grow"], default="planned",
                    help="without a GPU: cap TensorFlow's CPU allocator at the planned bytes and give it them "
                         "as one region first, as the plan's limit does on a GPU (planned, default), or let it "
                         "grow region by region, uncapped (grow: TensorFlow's CPU default; its whole-chunk "
                         "counting then adds to the peak)")
    args = parse_example(ap)
    mb, m = args.micro_batch_size, args.micro_batches
    layers = scaled(args.width_scale)
    costs = layer_costs(mb, layers=layers)
    plan = distmem.init(strategy="pipeline", framework="tensorflow", layers=costs, schedule="gpipe",
                        num_micro_batches=m, micro_batch_size=mb,
                        input_bytes=4 * mb * INPUT[0] * INPUT[1] * INPUT[2], recompute=args.recompute)
    planned = plan.mine.breakdown["planned_bytes"]  # whole MiB
    if args.allocator_region == "planned" and not plan.mine.devices:
        # Without a GPU the CPU allocator gets the stage's limit, as a GPU's would (read when
        # TensorFlow creates its CPU device, so set before TensorFlow starts).
        # TensorFlow's own first tensors (a few bytes: shapes) open the allocator's first region,
        # 2 MiB, before the job has any; the cap leaves it that, so the job's region is the limit.
        os.environ.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", str((planned >> 20) + 2))

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
        # of the limit from the start. The CPU one grows region by region (2 MiB, doubling) and no
        # chunk spans two: the planned bytes are made and freed at once, one region of the limit
        # beside the first 2 MiB one, and later chunks are split from it as on a GPU. The
        # reservation is not the job's: the peak restarts after it.
        try:
            tf.zeros([planned // 4])
        except tf.errors.ResourceExhaustedError:  # a TF_CPU_BFC_MEM_LIMIT_IN_MB of the user's, below it
            echo(f"[rank {rank}] TF_CPU_BFC_MEM_LIMIT_IN_MB={os.environ.get('TF_CPU_BFC_MEM_LIMIT_IN_MB')} is below this "
                 f"stage's planned {planned >> 20} MiB: the allocator grows region by region instead")
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

    sent = [None]  # the previous tick's send, kept until this tick's exchange is done
    nothing = tf.zeros([0])

    def exchange(vector, tick, dest=None, source=None, shape=None):
        """Send ``vector`` to rank ``dest`` and receive rank ``source``'s as ``shape``: one
        ``hvd.alltoall`` that every rank joins at each tick, each sending only to its neighbour.
        What is sent is a view of an activation (forward) or the input gradient just made
        (backward); what arrives is the next stage input or the gradient of this stage's output,
        held until used: all of them the plan's (the stage inputs, and the backward's gradients in
        flight). Horovod's background thread lets go of a send a moment after the caller has the
        result; keeping the previous send until this tick's exchange is done makes that moment the
        same whatever the thread's timing (the next backward's peak is lower by one micro-batch's
        activations, which makes room for it)."""
        flat = nothing if vector is None else tf.reshape(vector, [-1])
        splits = [0] * hvd.size()
        if dest is not None:
            splits[dest] = int(flat.shape[0])
        got, _ = hvd.alltoall(flat, splits=splits, name=f"tick{tick}")
        sent[0] = flat
        return None if source is None else tf.reshape(got, shape)

    # The steps below keep nothing in local names: what a stage holds is in tapes/inputs/outputs/grads_in
    # and grads (the gradients, held once like the weights), as the plan counts it. Over several
    # micro-batches they accumulate in place; each micro-batch's own gradients, which the tape hands
    # back together, are alive beside them until added (the plan's accumulation transient).
    grads = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables] if m > 1 else []

    def forward(k, tapes, inputs, outputs, losses):
        x = images[k] if stage == 0 else inputs[k]
        with tf.GradientTape(persistent=False) as tape:
            if stage > 0:  # the data needs no gradient
                tape.watch(x)
            y = model(x, training=True)
            if stage == p - 1:
                y = loss_fn(labels[k], y) / m
                losses.append(float(y))
        tapes[k], inputs[k], outputs[k] = tape, x, y
        return None if stage == p - 1 else y

    def backward(k, tapes, inputs, outputs, grads_in):
        upstream = None if stage == p - 1 else grads_in.pop(k)
        x = inputs.pop(k)
        wrt = model.trainable_variables if stage == 0 else [x] + model.trainable_variables
        made = tapes.pop(k).gradient(outputs.pop(k), wrt, output_gradients=upstream)
        dx, dw = (None, made) if stage == 0 else (made[0], made[1:])
        if m > 1:
            for a, g in zip(grads, dw):
                a.assign_add(g)
        else:
            grads[:] = dw
        return dx

    for step in range(args.steps):
        tapes, inputs, outputs, grads_in, losses = {}, {}, {}, {}, []
        # Forward: at tick t stage s runs micro-batch t - s; every stage keeps all m micro-batches.
        for t in range(m + p - 1):
            k, kk = t - stage, t - (stage - 1)  # kk: the micro-batch the previous stage sends this tick
            got = exchange(forward(k, tapes, inputs, outputs, losses) if 0 <= k < m else None, f"{step}f{t}",
                           rank + 1 if stage < p - 1 and 0 <= k < m else None,
                           *((rank - 1, shapes[stage]) if stage > 0 and 0 <= kk < m else ()))
            if got is not None:
                inputs[kk] = got
            del got
        # Backward in reverse: at tick t stage s runs micro-batch's backward when the gradient arrives.
        for t in range(m + p - 1):
            k, k_next = t - (p - 1 - stage), t - (p - 1 - (stage + 1))
            got = exchange(backward(k, tapes, inputs, outputs, grads_in) if 0 <= k < m else None, f"{step}b{t}",
                           rank - 1 if stage > 0 and 0 <= k < m else None,
                           *((rank + 1, shapes[stage + 1]) if stage < p - 1 and 0 <= k_next < m else ()))
            if got is not None:
                grads_in[k_next] = got
            del got
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if m > 1:
            for a in grads:
                a.assign(tf.zeros_like(a))
        else:
            grads.clear()
        if stage == p - 1:
            echo(f"[rank {rank}] step {step}: loss {sum(losses):.4f}")
    rep = distmem.report(path=args.report)
    if rep is not None:
        echo(f"[rank 0] report for {plural(len(rep.ranks), 'rank')} written to {args.report}")
    return 0


if __name__ == "__main__":
    run_example(main)
