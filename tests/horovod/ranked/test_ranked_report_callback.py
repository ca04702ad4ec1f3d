"""Every rank under horovodrun -np 4: distmem.keras.MemoryReport inside a Horovod model.fit, and
ReportEvery in a hand-written GradientTape loop. Rank 0 ends with a timeline of every rank at the
same steps, a JSON file, a PNG, Prometheus metrics and TensorBoard scalars per rank."""
import json
import os

import horovod.tensorflow as hvd
import pytest

import distmem

RANK, SIZE = hvd.rank(), hvd.size()
OUT = os.environ.get("DISTMEM_TEST_OUT", "/tmp")


def _data(tf, n=640):
    tf.keras.utils.set_random_seed(7 + RANK)
    x = tf.random.uniform((n, 16, 16, 3))
    y = tf.random.uniform((n,), maxval=10, dtype=tf.int32)
    # Rank-dependent batch sizes make the memory lines differ, as real jobs with uneven shards do.
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8 * (1 + RANK))


def _model(tf):
    return tf.keras.Sequential([tf.keras.layers.Input((16, 16, 3)), tf.keras.layers.Conv2D(16, 3, activation="relu"),
                                tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(10)])


def test_memory_report_callback_in_horovod_fit():
    import horovod.tensorflow.keras as hvdk
    import tensorflow as tf

    distmem.init(strategy="data", fleet="2x16GiB", framework="tensorflow", verbose=False)
    from distmem.keras import MemoryReport

    folder = os.path.join(OUT, "callback")
    cb = MemoryReport(every_n_batches=4, path=os.path.join(folder, "timeline.json"),
                      plot=os.path.join(folder, "memory.png"), log_dir=os.path.join(folder, "tb"),
                      prometheus=os.path.join(folder, "distmem.prom"))
    model = _model(tf)
    model.compile(optimizer=hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(_data(tf), steps_per_epoch=10, epochs=2, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0), cb])
    if RANK != 0:
        assert cb.points == [] and cb.last is None
        return
    steps = [p["step"] for p in cb.points]
    assert steps == [4, 8, 12, 16, 20]
    assert all(p["ranks"] == list(range(SIZE)) and p["missing"] == [] for p in cb.points)
    assert all(v is not None for p in cb.points for v in p["peak_bytes"])
    with open(os.path.join(folder, "timeline.json")) as f:
        data = json.load(f)
    assert [p["step"] for p in data["timeline"]] == steps and len(data["ranks"]) == SIZE
    png = open(os.path.join(folder, "memory.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    prom = open(os.path.join(folder, "distmem.prom")).read()
    assert all(f'distmem_rank_peak_bytes{{rank="{r}"' in prom for r in range(SIZE))
    assert sorted(os.listdir(os.path.join(folder, "tb"))) == ["job"] + [f"rank_{r}" for r in range(SIZE)]


@pytest.mark.parametrize("detail", ["full", "summary"])
def test_report_every_in_a_hand_written_loop(detail):
    import tensorflow as tf

    distmem.init(strategy="data", fleet="2x16GiB", framework="tensorflow", verbose=False)
    from distmem.report.periodic import ReportEvery

    model = _model(tf)
    opt = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    it = iter(_data(tf, 160))
    with ReportEvery(3, detail=detail, path=os.path.join(OUT, f"loop-{detail}.json")) as every:
        for step in range(7):
            x, y = next(it)
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            if step == 0:
                hvd.broadcast_variables(model.variables, root_rank=0)
            every.step()
    if RANK == 0:
        assert [p["step"] for p in every.points] == [3, 6, 7]
        assert every.last.detail == detail
        with open(os.path.join(OUT, f"loop-{detail}.json")) as f:
            assert len(json.load(f)["timeline"]) == 3
    else:
        assert every.points == []
