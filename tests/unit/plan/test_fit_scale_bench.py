"""bench/plan/fit_scale.py's own logic, on CPU: the cases it asks (at least 200, every family, wrapper,
precision and GPU size, the most informative first), how it packs runs on the one GPU, and how it
judges a run (allocator out of memory, NVML over the rank's part of its GPU, a rejection that would
have trained) and sums them up."""
import argparse
import importlib.util
import json
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


def test_an_out_of_memory_run_keeps_what_the_allocator_held_when_it_gave_up():
    """The record keeps the message's first 400 characters, which a full GPU's list of processes
    fills before the allocator's own figures: they are read from the whole message first."""
    procs = " ".join(f"Process {600 + i} has 2.26 GiB memory in use." for i in range(12))
    msg = ("CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
           f"40.00 GiB is free. {procs} 16.73 GiB allowed; Of the allocated memory 13.84 GiB is allocated by "
           "PyTorch, and 639.44 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
           "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert "reserved by PyTorch" not in msg[:400]
    got = fs.oom_parts(msg)
    assert got == {"oom_request": int(2.32 * GiB), "oom_allocated": int(13.84 * GiB),
                   "oom_stranded": int(639.44 * 1024 ** 2)}, got
    assert fs.oom_parts("CUDA out of memory") == {}


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


def test_rules_are_read_from_one_half_of_the_models_and_checked_on_the_other():
    """The step kernels outside the allocator come from the fit half's models alone; the held-out
    half is only checked against them (a run above is counted, never folded in); the chosen layouts
    are counted per allocator, per half."""
    assert fs.half_of("tv:vgg16") == "fit" and fs.half_of("tv:resnet50") == "held_out"

    def rec(case, model, runs):
        r = record(case, runs)
        r["answer"]["params"] = {"model": model}
        return r

    plain, xs, fsdp2 = spec(), dict(spec(), expandable=True), dict(spec(), shard="fsdp2")
    recs = [rec("a", "tv:vgg16", [(plain, result(oom=True, error="CUDA out of memory", outside=600 * MiB)),
                                  (xs, result(outside=762 * MiB))]),
            rec("b", "tv:vgg16", [(fsdp2, result(outside=828 * MiB))]),
            rec("c", "tv:resnet50", [(plain, result(outside=770 * MiB)), (xs, result(outside=700 * MiB))])]
    s = fs.split(recs, bare=694 * MiB)
    assert s["from_fit_half"] == {"step_kernels_mib": 68.0, "fsdp2_kernels_mib": 66.0}
    assert s["held_out_above_rule"] == {"runs": 1, "of": 2, "max_mib": 8.0}
    assert s["fit"]["chosen_default_allocator"] == {"runs": 2, "out_of_memory": 1}  # the FSDP2 run: chosen too
    assert s["fit"]["chosen_expandable_segments"] == {"runs": 1, "out_of_memory": 0}
    assert s["held_out"]["models"] == 1 and s["held_out"]["outside_max_mib"] == 770.0
    assert fs.summarize(recs)["split"]["how"].startswith("by model")


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


def test_redo_takes_what_counts_against_the_targets_then_new_cases(tmp_path):
    order = fs.order_cases(fs.all_cases())
    ok, oom, wrong, err, refused = (c.id for c in order[:5])
    recs = [record(ok, [(spec(), result()), (spec("best_rejected"), result(oom=True, error="x"))]),
            record(oom, [(spec(), result(oom=True, error="CUDA out of memory"))]),
            record(wrong, [(spec(), result()), (spec("mb_up"), result())]),
            record(err, [(spec(), result(oom=None, error="AssertionError: Attempted step but _scale is None"))]),
            {"case": refused, "answer": {"family": "timm", "error": "bench: NotImplementedError: aten::_unique2"},
             "runs": []}]
    # the chosen layouts that failed first, then the wrong rejections, then what said nothing
    assert fs.to_redo(recs) == [oom, err, wrong, refused]
    path = tmp_path / "first.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = argparse.Namespace(only=None, max_cases=0, redo=str(path), new=2)
    assert [c.id for c in fs.selected(args)] == [oom, err, wrong, refused, order[5].id, order[6].id]


def test_summarize_merges_each_cases_latest_run(tmp_path):
    a, b = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first = [record("x", [(spec(), result(oom=True, error="CUDA out of memory"))]), record("y", [(spec(), result())])]
    again = dict(record("x", [(spec(), result())]), tag="h200-2")
    a.write_text("".join(json.dumps(r) + "\n" for r in first))
    b.write_text(json.dumps(again) + "\n")
    (tmp_path / "second_summary.json").write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.11", "seconds": 140}))
    out, summary = tmp_path / "merged.jsonl", tmp_path / "merged_summary.json"
    assert fs.main(["summarize", str(a), str(b), "--merge-to", str(out), "--summary-out", str(summary)]) == 0
    merged = fs.read_records(str(out))
    assert [r["case"] for r in merged] == ["x", "y"] and merged[0].get("tag") == "h200-2"
    s = json.loads(summary.read_text())
    assert s["chosen_failed"] == 0 and s["cases"] == 2 and s["device"] == "NVIDIA H200"
    assert s["cases_by_tag"] == {"h200-2": 1, fs.UNTAGGED: 1}
    assert [r["cases"] for r in s["runs"]] == [2, 1] and s["runs"][1]["seconds"] == 140
    # files run on different cards: the summary names both, and each file's card
    (tmp_path / "first_summary.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3"}))
    assert fs.main(["summarize", str(a), str(b), "--summary-out", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert s["device"] == "NVIDIA H100 80GB HBM3 and NVIDIA H200"
    assert [r["device"] for r in s["runs"]] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]


def test_a_pipeline_stage_before_the_last_trains_under_float16_loss_scaling():
    """A stage that does not compute the loss receives its output's gradient scaled by the loss
    scale; its GradScaler must know the scale to unscale its own gradients (on the H200 the stage's
    step failed: 'Attempted step but _scale is None', hand:gpt-1b pp4 mixed_float16)."""
    pytest.importorskip("torch")
    os.environ[fs.SMOKE_SEQ_ENV] = "8"
    try:
        spec_ = {"model": "hand:gpt-125m", "micro_batch": 1, "accumulation": 2, "precision": "mixed_float16",
                 "shard": "", "world": 1, "pipeline": 2, "schedule": "1f1b", "recompute": False, "first_block": 0,
                 "stop_block": 3, "blocks": 14, "in_flight": 2, "limit_bytes": 0, "steps": 1}
        r = fs.gpu_run(spec_, device="cpu")
    finally:
        os.environ.pop(fs.SMOKE_SEQ_ENV, None)
    assert r["oom"] is False and r["error"] is None, r
    # the optimizer stepped (a skipped step holds no optimizer state: not the job's steady state)
    # and a whole step ran after its first one (the spec asks 1: 2 ran)
    assert r["optimizer_steps"] >= 1 and r["optimizer_steps"] + r["skipped_steps"] == 2, r


def test_a_run_whose_optimizer_never_stepped_proves_nothing():
    """Every step skipped by float16's loss scaler: no optimizer state was held, so the run is booked
    as an error, neither trained nor out of memory (on the H200 a ConvNeXt's chosen rank 'trained'
    4 steps without its Adam state: steps 3.91 GiB each, no growth)."""
    s = spec()
    skipped = dict(result(), optimizer_steps=0, skipped_steps=4)
    v = fs.judge(s, skipped)
    assert v["status"] == "error" and "never stepped" in v["why"] and not v.get("trained")
    assert fs.judge(s, dict(result(), optimizer_steps=1, skipped_steps=3))["status"] == "trained"
    assert fs.judge(s, result())["status"] == "trained"  # records from before the count


def test_a_rule_on_trial_is_asked_of_one_half_through_fits_own_argument(monkeypatch):
    """``run --half held_out --headroom H``: the held-out half's cases alone, each asked as
    ``fit(..., headroom=H)`` (the askers are other processes: the environment carries it); without
    it fit's default is left alone."""
    base = dict(only=None, max_cases=0, redo=None, set="scale")
    held = fs.selected(argparse.Namespace(half="held_out", **base))
    fit = fs.selected(argparse.Namespace(half="fit", **base))
    every = fs.selected(argparse.Namespace(half="all", **base))
    assert held and fit and len(held) + len(fit) == len(every)
    assert {fs.half_of(c.model) for c in held} == {"held_out"} and {fs.half_of(c.model) for c in fit} == {"fit"}
    monkeypatch.delenv(fs.HEADROOM_ENV, raising=False)
    assert "headroom" not in fs._fit_kwargs(held[0], "model")
    monkeypatch.setenv(fs.HEADROOM_ENV, "0.01")
    assert fs._fit_kwargs(held[0], "model")["headroom"] == 0.01


def test_the_headroom_bench_prices_each_rank_as_fit_prices_it_now(tmp_path, monkeypatch):
    """fit_headroom's need is over the figure fit plans from: a rank asked again by a later fit_scale
    run (the same layout) takes that run's figure, not the one recorded when it was first run; the
    finer ratios keep their three decimals."""
    spec_ = importlib.util.spec_from_file_location("fit_headroom", os.path.join(ROOT, "bench", "plan", "fit_headroom.py"))
    fh = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(fh)
    monkeypatch.setattr(fh, "modelled_bound_ratio", lambda: 1.03)
    s0 = dict(spec(), micro_batch=8, accumulation=1, shard="", world=4, pipeline=1, schedule=None,
              recompute=False, first_block=0, stop_block=3, in_flight=1)
    key = list(fh._key(s0))

    def line(ratio, oom):
        return {"case": "c", "role": "chosen", "half": "fit", "model": "tv:vgg16", "key": key, "ratio": ratio,
                "true_peak": 100 * MiB, "estimated_peak": 90 * MiB, "figure": "point", "planned_bytes": 95 * MiB,
                "result": {"oom": oom}}

    lines = [line(1.00, True), line(1.005, True), line(1.015, False), line(1.02, False)]
    first = fh.summarize(lines)["rows"][0]
    assert first["min_ratio"] == 1.015 and set(first["runs"]) == {"1.00", "1.005", "1.015", "1.02"}
    assert first["need"] == round(100 / (90 * 1.03) * 1.015 - 1, 4) and first["figure_from"] == "first run"
    later = tmp_path / "later.jsonl"
    later.write_text(json.dumps({"case": "c", "runs": [{"spec": dict(s0, estimated_peak=103 * MiB, figure="bounded"),
                                                        "result": {}, "verdict": {}}]}) + "\n")
    again = fh.summarize(lines, figures=fh.figures_of(str(later)))
    row = again["rows"][0]
    assert row["figure_from"] == "asked again" and again["figures_asked_again"] == 1
    assert row["need"] == round(100 / 103 * 1.015 - 1, 4)  # over the bounded figure fit gives now
    assert row["need_over_point"] == round(100 / (103 / 1.03) * 1.015 - 1, 4)
    assert again["ratios"] == [1.0, 1.005, 1.015, 1.02]
