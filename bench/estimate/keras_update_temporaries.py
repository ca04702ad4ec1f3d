"""Weight-sized temporaries one Keras optimizer update holds, on TensorFlow's CPU allocator: one
2048x2048 Dense layer (16 MiB of weights), batch 1, four steps; the peak in weight units less the
weight, its slots and its gradient.

    python bench/estimate/keras_update_temporaries.py adam      # sgd | momentum | rmsprop | adam | adamw
"""
import os, sys, json
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"; os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the allocator distmem's TF adapter sets
import numpy as np, tensorflow as tf
K = tf.keras
name = sys.argv[1]
opt = {"sgd": lambda: K.optimizers.SGD(), "momentum": lambda: K.optimizers.SGD(momentum=0.9),
       "rmsprop": lambda: K.optimizers.RMSprop(), "adam": lambda: K.optimizers.Adam(),
       "adamw": lambda: K.optimizers.AdamW()}[name]()
inp = K.Input((2048,)); out = K.layers.Dense(2048, use_bias=False)(inp)
m = K.Model(inp, out); m.compile(optimizer=opt, loss="mse")
x = tf.constant(np.random.rand(1, 2048).astype("float32")); y = tf.constant(np.random.rand(1, 2048).astype("float32"))
info = tf.config.experimental.get_memory_info
peaks = []
for _ in range(4):
    tf.config.experimental.reset_memory_stats("CPU:0"); m.train_on_batch(x, y); peaks.append(info("CPU:0")["peak"])
w = 2048 * 2048 * 4
slots = sum(int(np.prod(v.shape)) for v in opt.variables if len(v.shape) > 1) * 4
print(json.dumps({"optimizer": name, "tensorflow": tf.__version__, "peaks_in_weights": [round(p / w, 2) for p in peaks], "slots_in_weights": slots / w,
                  "temporaries": round(max(peaks) / w - 1 - slots / w - 1, 2)}))
