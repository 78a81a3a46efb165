"""The plan grid through the verifier: every correct built-in plan must be proved and its certificate must check.

    python bench/verify_grid.py [--models llama3-tiny,gpt2-tiny] [--full] [--check-sample 50] [--jobs 1]
                                [--only cp=2] [--out bench/results/verify_grid.json]

Default grid: dp, tp, pp, mb in {1, 2} (and mb = 4 with pp = 2) x sp (when tp = 2) x zero {0, 3} with
AdamW and clipping at 1.0 (tied as the model defines). `--full` adds zero
1-2, untied/tied and SGD: the 768 configs of bench/plan_grid.py. For each
config: verify (proved?), write the certificate, `check` it re-solving
`--check-sample` unique keys with a different method. Exits 1 if any config
is not proved or its certificate fails. `--only TEXT`: the configs whose parallel spec holds TEXT.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time

import tv_ray
import tv_ray.models
from plan_grid import configs, finish, has_experts
from tv_ray.certificate import check_certificate
from tv_ray.errors import TvRayError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3-tiny,gpt2-tiny")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--check-sample", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", default="", help="the configs whose parallel spec holds this text")
    parser.add_argument("--out", default="bench/results/verify_grid.json")
    args = parser.parse_args()
    rows, failures = [], 0
    start = time.perf_counter()
    variants = list(itertools.product((None, False) if args.full else (None,),
                                      ("sgd", "adamw") if args.full else ("adamw",)))
    for model in args.models.split(","):
        for tied, optim in variants:
            graph = tv_ray.capture_step(model, optim=optim, clip=1.0, tied=tied)
            for spec, flags in configs(range(4) if args.full else (0, 3), has_experts(model),
                                       tv_ray.models.get(model).dims["batch"]):
                if args.only not in spec:
                    continue
                row = {"model": model, "tied": tied, "optim": optim, "parallel": spec, **flags}
                t = time.perf_counter()
                try:
                    plan = tv_ray.parallelize(graph, spec, model=model, **flags)
                    result = tv_ray.verify(plan, jobs=args.jobs, progress=False)
                    row.update(status=result.status, **result.outcome.counts(), tiers=result.outcome.tiers(),
                               verify_s=round(time.perf_counter() - t, 2))
                    if result.proved:
                        with tempfile.TemporaryDirectory() as out:
                            result.save(out)
                            t = time.perf_counter()
                            check = check_certificate(out, sample=args.check_sample)
                            row.update(check="ok", check_s=round(time.perf_counter() - t, 2),
                                       rechecked_by_other_method=check.different_method)
                    else:
                        row["headline"] = result.report.get("headline")
                except TvRayError as err:
                    row.update(status="error", error=str(err))
                ok = row.get("status") == "proved" and row.get("check") == "ok"
                failures += not ok
                rows.append(row)
                print(json.dumps(row), flush=True)
    return finish(rows, failures, start, args.out, obligations=sum(r.get("obligations", 0) for r in rows),
                  unique=sum(r.get("unique", 0) for r in rows))


if __name__ == "__main__":
    sys.exit(main())
