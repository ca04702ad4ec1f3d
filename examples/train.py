"""Train a small Keras model on synthetic data with Horovod, under a distmem plan.

    horovodrun -np 4 -H localhost:4 python examples/train.py --strategy data
    mpirun -np 4 python examples/train.py

distmem.init() comes first, before TensorFlow touches a device; Horovod may be initialised before or
after it. On a machine without GPUs the plan is computed (against DISTMEM_FLEET if set) and nothing
is applied; the report still shows real allocator figures for CPU:0.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up chatter out of the log

import distmem  # noqa: E402
from distmem.units import plural  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="data", choices=["data"],
                   help="memory strategy (pipeline and model parallel: examples/pipeline.py, model_parallel.py)")
    p.add_argument("--steps", type=at_least(1), default=30, help="training steps")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="per-rank batch size")
    p.add_argument("--memory", default="auto", choices=["auto", "growth", "limit"])
    p.add_argument("--report", default=os.environ.get("DISTMEM_REPORT", "runs/last/report.json"),
                   help="where rank 0 writes the JSON report")
    p.add_argument("--plot", default=None, help="also draw the report as a PNG here")
    p.add_argument("--every", type=at_least(1), default=10, help="gather a timeline point every N batches")
    return parse_example(p)


def main():
    args = parse_args()
    plan = distmem.init(strategy=args.strategy, memory=args.memory)

    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd

    hvd.init()
    tf.keras.utils.set_random_seed(1234 + hvd.rank())
    n = args.batch_size * args.steps
    x = np.random.rand(n, 32, 32, 3).astype("float32")
    y = np.random.randint(0, 10, size=(n,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch_size)

    model = tf.keras.Sequential([
        tf.keras.layers.Input((32, 32, 3)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    # Every rank starts from rank 0's weights. Broadcast them now rather than with Horovod's
    # BroadcastGlobalVariablesCallback: that one broadcasts inside the first batch's
    # on_train_batch_end, and Keras then warns on every rank that the hook is slow. (The optimizer's
    # slots start at zero on every rank, so the weights are all that differ.)
    from horovod.tensorflow import broadcast_variables

    broadcast_variables(model.variables, root_rank=0)
    callbacks = []
    timeline = None
    try:
        from distmem.keras import MemoryReport

        timeline = MemoryReport(every_n_batches=args.every, path=args.report.replace(".json", "-timeline.json"),
                                plot=args.plot)
        callbacks.append(timeline)
    except ImportError:
        pass
    model.fit(data, steps_per_epoch=args.steps, epochs=1, callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    rep = distmem.report(path=args.report)
    if rep is not None:
        echo(f"[rank 0] report for {plural(len(rep.ranks), 'rank')} written to {args.report}")
        if args.plot:
            try:
                from distmem.report.sinks import plot

                points = timeline.every.points if timeline is not None else None
                plot(rep, args.plot, timeline=points)
                echo(f"[rank 0] plot written to {args.plot}")
            except ImportError:
                pass
    return 0 if plan is not None else 1


if __name__ == "__main__":
    run_example(main)
