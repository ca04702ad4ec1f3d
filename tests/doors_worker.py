"""One rank slot of the "one job, one answer" property test: for every generated job that has a
rank ``slot``, play that rank under its launcher variables and answer through each per-rank door
(``distmem.init``, ``distmem.plan_from_env``, ``distmem doctor --json``), one ``DOOR {json}`` line each.
The ranks of a host meet in the real host-local exchange, so the slots stay in step by themselves.

    python doors_worker.py JOBS.json SLOT LAYOUT_DIR
"""
import json
import os
import sys

import doors


def main(spec: str, slot: int, layout_dir: str) -> int:
    import distmem

    with open(spec, encoding="utf-8") as f:
        all_jobs = json.load(f)
    base = dict(os.environ)
    for job in all_jobs:
        size = sum(n for _, n in job["hosts"])
        if slot >= size:
            continue
        layers = None
        if "layers" in job["options"]:
            layers = os.path.join(layout_dir, f"layers-{job['index']}-{slot}.json")
            with open(layers, "w", encoding="utf-8") as f:
                json.dump(job["options"]["layers"], f)
        for door in ("init", "plan_from_env", "doctor"):
            os.environ.clear()
            os.environ.update(base)
            os.environ.update(doors.rank_env(job, slot, door, layout_dir))
            distmem.reset()
            try:
                if door == "init":
                    plan = distmem.init(verbose=False, **doors.python_kwargs(job))
                    answer = doors.answer_of_plan(plan.to_dict())[slot]
                elif door == "plan_from_env":
                    plan = distmem.plan_from_env(**doors.python_kwargs(job))
                    answer = doors.answer_of_plan(plan.to_dict())[slot]
                else:
                    rc, out, err = doors.run_cli(["doctor", "--json", "--no-horovod-probe"]
                                                 + doors.cli_words(job, layers), dict(os.environ))
                    d = json.loads(out) if out.strip().startswith("{") else {"problems": [err]}
                    problem = doors.doctor_error(d.get("problems", []))
                    if problem is not None:
                        answer = doors.error_answer(problem)
                    elif "plan" in d.get("facts", {}):
                        answer = doors.answer_of_plan(d["facts"]["plan"])[slot]
                    else:
                        answer = doors.error_answer(f"doctor rc {rc}: {d.get('problems')} {err[-300:]}")
            except Exception as exc:  # noqa: BLE001 - every door's error is an answer
                answer = doors.error_answer(exc)
            print("DOOR " + json.dumps({"job": job["index"], "door": door, "rank": slot, "answer": answer}),
                  flush=True)
            if os.environ.get("DOORS_TRACE"):
                import time

                print(f"{time.time():.1f} slot {slot} job {job['index']} {door} done", file=sys.stderr, flush=True)
    distmem.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
