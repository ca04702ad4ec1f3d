"""bench/plan/fit_scale.py's own logic, on CPU: the cases it asks (at least 200, every family, wrapper,
precision and GPU size, the most informative first), how it packs runs on the one GPU, and how it
judges a run (allocator out of memory, NVML over the rank's part of its GPU, a rejection that would
have trained) and sums them up."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_spec = importlib.util.spec_from_file_location("fit_scale", os.path.join(ROOT, "bench", "plan", "fit_scale.py"))
fs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("fit_scale", fs)
_spec.loader.exec_module(fs)

GiB, MiB = fs.GiB, fs.MiB


def test_at_least_200_cases_over_every_family_wrapper_precision_and_gpu_size():
    cases = fs.all_cases()
    assert len(cases) >= 200 and len({c.id for c in cases}) == len(cases)
    families = {fs.MODELS[c.model].family for c in cases}
    assert families == {"torchvision", "timm", "huggingface", "hand-written"}
    assert {c.precision for c in cases} == {"auto", "float32", "mixed_bfloat16", "mixed_float16"}
    assert {c.shardings for c in cases} == {"auto", "none", "zero1,zero2", "fsdp2,fsdp2_keep"}
    assert min(c.gib for c in cases) == 8 and max(c.gib for c in cases) == 80
    tags = {t for c in cases for t in fs.MODELS[c.model].tags}
    assert {"large-vocab", "checkpointing", "pipeline", "conv", "attention"} <= tags
    assert any(c.hosts > 1 for c in cases) and any(c.count == 1 for c in cases)
    # fit's FSDP2 units are the top-level children: never asked of a model whose children share
    # weights, nor of a Hugging Face model (its two children are not the units its users shard)
    assert not any((fs.MODELS[c.model].tied or fs.MODELS[c.model].family == "huggingface")
                   and c.shardings in ("auto", "fsdp2,fsdp2_keep") for c in cases)


def test_the_most_informative_cases_run_first():
    cases = fs.all_cases()
    order = fs.order_cases(cases)
    assert sorted(c.id for c in order) == sorted(c.id for c in cases)
    first = order[:40]
    assert {fs.MODELS[c.model].family for c in first} == {"torchvision", "timm", "huggingface", "hand-written"}
    assert {c.precision for c in first} == {c.precision for c in cases}
    assert {c.shardings for c in first} == {c.shardings for c in cases}
    assert {t for c in first for t in c.tags() if t.startswith("gpu")} == \
        {t for c in cases for t in c.tags() if t.startswith("gpu")}
    # every model once before any model twice
    models = [c.model for c in order]
    n = len(set(models))
    assert len(set(models[:n])) == n


def job(need_gib, order=0, queued=0.0):
    return fs.Job((order, 0), {"limit_bytes": int(need_gib * GiB)}, int(need_gib * GiB), queued)


def test_runs_are_packed_within_the_gpu_and_a_large_one_is_not_starved():
    cap = 100 * GiB
    head, small = job(60, 0), job(10, 1)
    assert fs.pick([head, small], 50 * GiB, cap, 3, 10, now=1.0) is small  # the head waits, a small one fills in
    assert fs.pick([head, small], 50 * GiB, cap, 3, 10, now=20.0) is None  # the head waited long: nothing jumps it
    assert fs.pick([head, small], 30 * GiB, cap, 3, 10, now=20.0) is head
    assert fs.pick([head, small], 0, cap, 10, 10, now=0.0) is None  # every worker busy
    assert fs.pick([job(150)], 0, cap, 0, 10, now=0.0) is not None  # larger than the GPU: alone, booked as it goes
    assert fs.pick([job(150), small], 10 * GiB, cap, 1, 10, now=0.0) is None
    fsdp = {"limit_bytes": 2 * GiB, "shard": "fsdp2", "params_m": 1000}
    assert fs.job_need(fsdp) >= 4 * 10 ** 9, "an FSDP2 run holds the whole model once before sharding it"


def spec(role="chosen", limit=8 * GiB, share=12 * GiB, nccl=0, est=7 * GiB):
    return {"role": role, "case": "c", "describe": "dp4", "model": "tv:resnet50", "precision": "float32",
            "limit_bytes": limit, "planned_bytes": limit, "share_bytes": share, "slice_bytes": share + GiB + nccl,
            "outside_nccl": nccl, "outside_modelled_process": 700 * MiB, "estimated_peak": est}


def result(oom=False, peak=7 * GiB, nvml=9 * GiB, error=None, outside=800 * MiB):
    return {"oom": oom, "error": error, "peak_allocated": peak, "nvml_peak": nvml, "outside_measured": outside}


def test_a_run_is_judged_by_the_allocator_and_by_nvml_for_the_whole_process():
    assert fs.judge(spec(), result())["status"] == "trained"
    assert fs.judge(spec(), result(oom=True, error="CUDA out of memory"))["status"] == "oom"
    # NVML over the rank's part of its GPU (share + the outside memory the plan counted), the real
    # job's NCCL communicators (modelled) included
    assert fs.judge(spec(), result(nvml=13 * GiB + MiB))["status"] == "over_share"
    assert fs.judge(spec(nccl=GiB), result(nvml=13 * GiB))["status"] == "trained"
    assert fs.judge(spec(nccl=GiB), result(nvml=13 * GiB + MiB))["status"] == "over_share"
    v = fs.judge(spec(), result())
    assert v["estimate_error"] == pytest.approx(0.0) and v["peak_over_limit"] == pytest.approx(7 / 8, abs=1e-3)
    assert v["unused_of_share"] == pytest.approx(5 / 12, abs=1e-3)
    assert v["limit_slack_of_share"] == pytest.approx(1 / 12, abs=1e-3)
    assert v["outside_over_model"] == 100 * MiB
    # the GPU itself full (the bench's packing, not the cap): an error of the bench, not a verdict
    msg = ("CUDA out of memory. Tried to allocate 784.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
           "12.00 MiB is free.")
    assert fs.physical_oom(msg) and not fs.physical_oom(msg.replace("12.00 MiB", "100.00 GiB"))
    assert fs.judge(spec(), dict(result(oom=True, error=msg), physical_oom=True))["status"] == "error"


def record(case, runs, chosen=True, fit_seconds=2.0):
    answer = {"family": "torchvision", "fit_seconds": fit_seconds}
    if chosen:
        answer["chosen"] = {"layout": {"pipeline": 1, "shard": "", "accumulation": 2, "recompute": False,
                                       "ranks_per_gpu": 1, "precision": "float32"}}
    return {"case": case, "answer": answer,
            "runs": [{"spec": s, "result": r, "verdict": fs.judge(s, r)} for s, r in runs]}


def test_the_summary_counts_what_the_issue_asks():
    recs = [
        record("a", [(spec(), result()), (spec("best_rejected"), result(oom=True, error="x"))]),
        record("b", [(spec(), result(oom=True, error="CUDA out of memory")), (spec("mb_up"), result())]),
        record("c", [(spec(), result(nvml=20 * GiB))]),
        record("d", [(spec("best_rejected"), result(oom=True, error="x"))], chosen=False, fit_seconds=4.0),
        record("e", [(spec(), dict(result(oom=None, error="RuntimeError: boom")))]),
    ]
    s = fs.summarize(recs)
    assert s["cases"] == 5 and s["chosen_runs"] == 3 and s["errors"] == 1
    assert s["chosen_failed"] == 2 and s["chosen_out_of_memory"] == 1 and s["chosen_over_share_nvml"] == 1
    assert s["rejected_runs"] == 3 and s["rejected_would_have_trained"] == 1
    assert s["rejected_would_have_trained_rate"] == pytest.approx(1 / 3, abs=1e-3)
    assert s["cases_where_nothing_fits"] == 1
    assert s["fit_seconds"]["max"] == 4.0 and s["fit_seconds"]["median"] == 2.0
    assert s["limit_slack_of_share_median"] == pytest.approx(1 / 12, abs=1e-3)
    assert s["outside_allocator"]["runs_above_model"] == 7  # 800 MiB measured against 700 modelled
    line = fs.line(s)
    assert line["figure"] == pytest.approx(2 / 3, abs=1e-3) and line["peer"] == 1.0


def test_runs_follow_the_answer():
    stage = {"first_block": 0, "stop_block": 10, "in_flight": 1, "allocator_bytes": 6 * GiB,
             "planned_bytes": 7 * GiB, "share_bytes": 12 * GiB, "gpu_total_bytes": 16 * GiB, "shared_by": 1}
    lay = {"micro_batch": 64, "accumulation": 2, "precision": "float32", "shard": "", "data_parallel": 4,
           "pipeline": 1, "schedule": None, "recompute": False, "ranks_per_gpu": 1}
    cand = {"layout": lay, "describe": "dp4", "stage": stage, "outside_total": 1500 * MiB,
            "outside_nccl": 800 * MiB, "outside_parts": {}}
    answer = {"case": "x", "params": {"model": "tv:resnet50"}, "blocks": 10, "expandable_segments": True,
              "chosen": cand, "best_rejected": cand, "mb_up": dict(cand, status="rejected")}
    specs = {s["role"]: s for s in fs.run_specs(answer)}
    assert list(specs) == ["chosen", "best_rejected", "mb_up", "default_allocator"]
    assert specs["chosen"]["limit_bytes"] == 7 * GiB and specs["chosen"]["expandable"]
    assert specs["best_rejected"]["limit_bytes"] == specs["mb_up"]["limit_bytes"] == 12 * GiB
    assert not specs["default_allocator"]["expandable"]
    assert specs["chosen"]["slice_bytes"] == 12 * GiB + 1500 * MiB
    assert specs["chosen"]["outside_modelled_process"] == 700 * MiB


def test_skip_done_keeps_the_earlier_cases(tmp_path):
    path = tmp_path / "done.jsonl"
    first = fs.order_cases(fs.all_cases())[0]
    path.write_text('{"case": "%s", "answer": {}, "runs": []}\n' % first.id)
    assert [r["case"] for r in fs.read_records(str(path))] == [first.id]
