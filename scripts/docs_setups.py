"""The minimal setup a documented block states or implies, for the docs test (scripts/docs_regen.py):
a model the snippet refers to, a file a command names (``costs.json``, ``train.py``, your own
``mypkg.models:build``), a report the command reads. A block names its setups in its marker
(``<!-- distmem-docs: python setup=torch-model -->``); what the user reads is never edited.

Each setup gives files written into the block's working folder (``files``: path -> text; ``made``:
path -> a Python program that writes it, the path as its argument, run with the environment's
python), environment variables (``{work}`` is the working folder, ``{root}`` this tree;
``PYTHONPATH`` is prepended), and a Python preamble run before a snippet. Keep each small: it stands
for what the reader already has at that point of the docs, not for what the block should show.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List

__all__ = ["Setup", "SETUPS"]


@dataclass
class Setup:
    name: str
    what: str
    files: Dict[str, str] = field(default_factory=dict)
    made: Dict[str, str] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    preamble: str = ""
    format_files: bool = False


def _costs(names: List[str], state_mib: int, act_mib: int) -> str:
    mib = 1024 ** 2
    return json.dumps([{"name": n, "state_bytes": state_mib * mib * (1 + k % 3), "activation_bytes": act_mib * mib,
                        "output_bytes": act_mib * mib // 4, "params": state_mib * mib // 16} for k, n in
                       enumerate(names)], indent=1) + "\n"


_DENSE = [f"dense_{k}" for k in range(8)]

_TIMELINE = """
import sys
import distmem
distmem.init(strategy="data", framework="none")
from distmem import ReportEvery
with ReportEvery(2, path=sys.argv[1]) as every:
    for _ in range(6):
        every.step()
"""

_REPORT = """
import sys
import distmem
distmem.init(strategy="data", framework="none")
distmem.report(path=sys.argv[1])
"""

_SAVED = """
import sys
import tensorflow as tf
inp = tf.keras.Input((128,))
model = tf.keras.Model(inp, tf.keras.layers.Dense(10)(tf.keras.layers.Dense(64, activation="relu")(inp)))
model.compile(optimizer="adam", loss="mse")
model.save(sys.argv[1])
"""

SETUPS: Dict[str, Setup] = {s.name: s for s in [
    Setup("keras-model", "a Keras model, its loss, an optimizer and a few batches (a hand-written TensorFlow loop)",
          preamble="import tensorflow as tf\nimport distmem\n"
                   "model = tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64, activation='relu'),"
                   " tf.keras.layers.Dense(10)])\n"
                   "loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)\n"
                   "opt = tf.keras.optimizers.SGD(0.01)\n"
                   "batches = [(tf.random.normal((512, 32)), tf.random.uniform((512,), maxval=10, dtype=tf.int64))"
                   " for _ in range(3)]\n"),
    Setup("torch-model", "a torch model over 512 features, its optimizer, the device, F",
          preamble="import torch\nimport torch.nn.functional as F\nimport distmem\ndev = torch.device('cpu')\n"
                   "model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))"
                   ".to(dev)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"),
    Setup("torch-build", "the reader's build() of a torch model (imports torch when called: after init())",
          preamble="def build():\n    import torch\n    return torch.nn.Linear(8, 2)\n"),
    Setup("tenant-models", "the two models of the tenants example (built when called) and the 16 GiB card the "
                           "text names, declared on a machine without it",
          preamble="import distmem\nimport tensorflow as tf\n"
                   "def build_bert():\n    return tf.keras.Sequential([tf.keras.Input((16,)), "
                   "tf.keras.layers.Dense(8)])\n"
                   "def build_resnet():\n    return tf.keras.Sequential([tf.keras.Input((16,)), "
                   "tf.keras.layers.Dense(4)])\n",
          env={"DISTMEM_FLEET": "1x16GiB"}),
    Setup("layer-costs", "per-layer costs (costs.json, and `costs` in a snippet): eight layers a user measured",
          files={"costs.json": _costs(_DENSE, 600, 900)},
          preamble="import json\nimport distmem\ncosts = json.load(open('costs.json'))\n"),
    Setup("model-parallel", "costs of the layers build_model() makes (matched by name); without GPUs the page's "
                            "flow runs on logical CPU devices",
          files={"costs.json": _costs(_DENSE, 600, 900)},
          preamble="import json\nimport distmem\ncosts = json.load(open('costs.json'))\n"
                   "def build_model():\n    import tensorflow as tf\n    inp = tf.keras.Input((64,))\n    x = inp\n"
                   "    for name in %r:\n        x = tf.keras.layers.Dense(64, name=name)(x)\n"
                   "    return tf.keras.Model(inp, x)\n" % (_DENSE,)),
    Setup("fit-costs", "costs.json for distmem fit --layers: a layer list measured at batch 1",
          files={"costs.json": _costs([f"block_{k}" for k in range(24)], 50, 12)}),
    Setup("user-scripts", "the reader's own train.py and serve.py (a few lines each)",
          files={"train.py": "import os\nprint('train.py on rank', os.environ.get('OMPI_COMM_WORLD_RANK', "
                             "os.environ.get('HOROVOD_RANK', os.environ.get('RANK', '0'))))\n",
                 "serve.py": "print('serve.py')\n"}),
    Setup("factory", "the reader's own module:factory (mypkg.models:build, a Keras model over 128 features) and "
                     "package (python -m mypackage.train), on the PYTHONPATH as its text says",
          files={"mypkg/__init__.py": "",
                 "mypkg/models.py": "def build():\n    import tensorflow as tf\n    inp = tf.keras.Input((128,))\n"
                                    "    return tf.keras.Model(inp, tf.keras.layers.Dense(10)(inp))\n",
                 "mypackage/__init__.py": "",
                 "mypackage/train.py": "import json, os\nprint('worker', json.loads(os.environ['TF_CONFIG'])['task'])\n"},
          env={"PYTHONPATH": "{work}"}),
    Setup("saved-keras", "a Keras model saved where the command reads it (saved/model.keras)",
          made={"saved/model.keras": _SAVED}),
    Setup("reports", "a run's report and timeline where the commands read them (runs/x/report.json, "
                     "runs/x/timeline.json), from one process",
          made={"runs/x/report.json": _REPORT, "runs/x/timeline.json": _TIMELINE}),
    Setup("tf", "TensorFlow imported as tf, as the page's earlier code has it",
          preamble="import tensorflow as tf\n"),
    Setup("torch-loader", "the reader's build_model() (a torch MLP over 1024 features) and a loader of a few "
                          "(x, y) batches",
          preamble="import torch\n"
                   "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(1024, 256), torch.nn.ReLU(), "
                   "torch.nn.Linear(256, 10))\n"
                   "loader = [(torch.randn(256, 1024), torch.randint(0, 10, (256,))) for _ in range(3)]\n"),
    Setup("loop", "a training loop's pieces the snippet calls (a loader, a train_step) after distmem.init(), "
                  "which the page calls first",
          preamble="import distmem\ndistmem.init(strategy='data')\nloader = range(250)\n"
                   "def train_step(batch):\n    pass\n"),
]}
