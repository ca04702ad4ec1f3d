"""Train a small Keras model with tf.distribute under a distmem plan; rank 0 prints the report.

    python launch/tf_config.py -n 4 examples/tf_distribute.py          # MultiWorkerMirroredStrategy, 4 workers
    distmem launch-tf -n 4 examples/tf_distribute.py --steps 5         # the same launcher
    python examples/tf_distribute.py --mirrored --replicas 2           # MirroredStrategy, one process

MultiWorkerMirroredStrategy: every worker is one rank (its TF_CONFIG says which); distmem.init()
comes first, before the strategy is created (creating it starts TensorFlow's devices), and
``distmem.use_strategy(strategy)`` lets distmem.report() gather through the strategy's
collectives, bounded by a timeout. Works on the newest TensorFlow (Keras 3), without Horovod.

--mirrored: one process, MirroredStrategy across several logical devices of its GPU, each with its
own limit (distmem's "tenants" split, one slice per replica); without a GPU, across logical CPU
devices (limits recorded, not enforced).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, positive_number, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import distmem  # noqa: E402
import distmem.comm  # noqa: E402
import distmem.comm.tf_strategy  # noqa: E402
from distmem.units import plural  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least(1), default=5, help="training steps")
    p.add_argument("--batch-size", type=at_least(1), default=16, help="batch size per replica")
    p.add_argument("--memory", default="auto", choices=["auto", "growth", "limit"], help="data-parallel memory mode")
    p.add_argument("--mirrored", action="store_true", help="MirroredStrategy over logical devices of one process")
    p.add_argument("--replicas", type=at_least(1), default=2, help="--mirrored: logical devices (replicas)")
    p.add_argument("--replica-memory", default="auto", help="--mirrored: limit of each replica's slice (default: "
                                                            "an equal share of the GPU)")
    p.add_argument("--report", default=os.environ.get("DISTMEM_REPORT"), help="rank 0 also writes the JSON report here")
    p.add_argument("--timeout", type=positive_number, default=None, help="seconds the report gather may wait for other ranks")
    return parse_example(p)


def build_model(tf):
    return tf.keras.Sequential([
        tf.keras.layers.Input((32, 32, 3)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


def main():
    args = parse_args()
    if args.mirrored:
        names = [f"replica{i}" for i in range(args.replicas)]
        plan = distmem.init(strategy="tenants", tenants={n: args.replica_memory for n in names})
    else:
        plan = distmem.init(strategy="data", memory=args.memory)

    import numpy as np
    import tensorflow as tf

    if args.mirrored:
        strategy = tf.distribute.MirroredStrategy(devices=[plan.device(n) for n in names])
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        distmem.use_strategy(strategy)
    rank = plan.rank
    replicas = strategy.num_replicas_in_sync
    tf.keras.utils.set_random_seed(1234)
    global_batch = args.batch_size * replicas
    n = global_batch * args.steps
    x = np.random.rand(n, 32, 32, 3).astype("float32")
    y = np.random.randint(0, 10, size=(n,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = data.with_options(opts)
    with strategy.scope():
        model = build_model(tf)
        optimizer = tf.keras.optimizers.SGD(0.01)
    # A custom loop, not model.fit: Keras 3's fit does not accept MultiWorkerMirroredStrategy's
    # distributed batches (keras-team/keras#20585). Both Keras 2 and 3 optimizers sum the replicas'
    # gradients in apply_gradients, so the loop is the same on TF 2.15 and 2.21.
    batches = iter(strategy.experimental_distribute_dataset(data))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(yb, tf.int32), logits=logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(it):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=next(it)), axis=None)

    losses = [float(train_step(batches)) for _ in range(args.steps)]
    if not args.mirrored:
        # Data parallel means identical weights everywhere: compare a checksum across ranks.
        checksum = float(sum(float(tf.reduce_sum(tf.cast(v, tf.float64))) for v in model.trainable_variables))
        sums = distmem.comm.get_comm().allgather(round(checksum, 6), timeout=args.timeout or 60)
        if len(set(sums)) != 1:
            raise SystemExit(f"rank {rank}: replicas diverged, weight checksums by rank: {sums}")
    if rank == 0:
        echo(f"[rank 0] {type(strategy).__name__}: {plural(replicas, 'replica')} in sync, "
              f"{plural(plan.world_size, 'rank')}, {plural(args.steps, 'step')}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    rep = distmem.report(path=args.report, timeout=args.timeout)  # collective: every rank calls it
    if rep is not None:
        if args.mirrored:
            from distmem.plan.strategies.tenants import tenant_table

            usage = {}
            for t in plan.extras["tenants"]:
                info = tf.config.experimental.get_memory_info(t["device"].lstrip("/"))
                usage[t["device"].lstrip("/")] = {"current_bytes": info["current"], "peak_bytes": info["peak"]}
            echo(tenant_table(plan, usage))
        echo(f"[rank 0] report: {len(rep.ranks)} of {plural(rep.world_size, 'rank')} reporting"
              + (f", missing {rep.missing}" if rep.missing else ""))
        return 1 if rep.missing else 0
    return 0


if __name__ == "__main__":
    run_example(main)
