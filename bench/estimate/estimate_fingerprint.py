"""Every byte an estimate reports on a sample of zoo cases, to show that a change of structure
changed none: peaks at two batches, inference peak, breakdowns, the peak's detail, every table row,
footprint, a range, warnings (the estimate's and Python's). Run it before and after, compare JSON.

    PYTHONPATH=. python bench/estimate/estimate_fingerprint.py keras OUT.json ResNet50,GRU,...
    PYTHONPATH=. python bench/estimate/estimate_fingerprint.py torch OUT.json resnet18,vit_b_16,...
"""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
from bench.estimate import estimate_zoo as Z, estimate_zoo_keras as Zk, estimate_zoo_torch as Zt  # noqa: E402

fw, out = sys.argv[1], sys.argv[2]
res = {}
def dump(est, extra_b):
    d = {"peak": est.peak_bytes, "inf": est.inference_bytes(), "bd": est.breakdown(), "pd": est.peak_detail(),
         "other": est.train_bytes(extra_b), "bd2": est.breakdown(extra_b), "warn": est.warnings,
         "rows": [r.to_dict(est.batch_size) for r in est.layers], "fp": est.footprint_bytes("torch"),
         "rb": est.range_bytes(0, max(1, len(est.layers)//2), micro_batches=2), "method": est.method}
    return d
if fw == "keras":
    from distmem.estimate import estimate_keras
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    for c in Zk.KERAS_CASES:
        if names and c["model"] not in names: continue
        model, _ = Zk.keras_build(c)
        opt = Zk.keras_optimizer(c["optimizer"])
        for dev in ("cpu", "gpu"):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                est = estimate_keras(model, c["batch"], opt, device=dev, name=c["model"])
                d = dump(est, c["batch"] * 2 + 1)
            d["pywarn"] = sorted(str(x.message) for x in w)
            res[Z.case_id(c) + "/" + dev] = d
        Zk.keras_ns()[1].mixed_precision.set_global_policy("float32")
        print(Z.case_id(c), res[Z.case_id(c) + "/cpu"]["peak"], flush=True)
else:
    import torch
    from distmem.estimate import estimate_torch
    names = sys.argv[3].split(",")
    for c in Zt.TORCH_CASES:
        if c["model"] not in names: continue
        model, inputs = Zt.torch_build(c, "meta")
        args, kwargs = inputs(c["batch"], "meta")
        opt = Zt.torch_optimizer(c["optimizer"], [torch.nn.Parameter(torch.zeros(2, 2))])
        prec = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}.get(c["precision"])
        for dev in ("cuda", "cpu"):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                est = estimate_torch(model, example_input=kwargs or args, batch_size=c["batch"], optimizer=opt,
                                     precision=prec, device=dev, name=c["model"])
                d = dump(est, c["batch"] + 3)
            d["pywarn"] = sorted(str(x.message) for x in w if "distmem" in str(x.message))
            res[Z.case_id(c) + "/" + dev] = d
        print(Z.case_id(c), res[Z.case_id(c) + "/cuda"]["peak"], flush=True)
json.dump(res, open(out, "w"), indent=0, sort_keys=True, default=str)
