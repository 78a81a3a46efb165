"""The full plan grid through the simulator: every built-in recipe config must match the logical step.

    python bench/plan_grid.py [--models llama3-tiny,gpt2-tiny] [--only cp=2] [--out bench/results/plan_grid.json]

Grid: dp, tp, pp, mb in {1, 2} (and mb = 4 with pp = 2: more microbatches than stages, where 1F1B has a steady
state) x sp (when tp = 2) x zero 0-3 x tied on/off x sgd/adamw, with clipping at 1.0; cp = 2 (dp = 1 and 2); for a
model with routed experts also ep = 2 (carved out of dp: dp = 2 and dp = 4, and dp = 2 with cp = 2). Records the
max abs deviation of every config and exits 1 if any exceeds 1e-9 or fails to build. `--only TEXT`: the configs
whose parallel spec holds TEXT.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import tv_ray
import tv_ray.models
from tv_ray.errors import TvRayError

TOL = 1e-9


def configs(zeros=range(4), experts: bool = False, batch: int = 8):
    """Every recipe config of the grid: (parallel spec, flags); cp = 2 too, and `experts`: ep = 2 too (with cp as
    well); the data-parallel degree times the microbatches divides `batch`."""
    data = [(1, 1, 1), (2, 1, 1)] + ([(2, 2, 1), (4, 2, 1)] if experts else []) + [(1, 1, 2), (2, 1, 2)] + \
        ([(2, 2, 2)] if experts else [])
    pipelines = [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4)]      # (pp, mb)
    for (dp, ep, cp), tp, (pp, mb) in itertools.product(data, (1, 2), pipelines):
        if batch % (dp * mb):
            continue
        for sp in ((False, True) if tp == 2 else (False,)):
            for zero in zeros:
                extra = (f",ep={ep}" if ep > 1 else "") + (f",cp={cp}" if cp > 1 else "")
                yield f"dp={dp},tp={tp},pp={pp},mb={mb}{extra}", {"sp": sp, "zero": zero}


def has_experts(model: str) -> bool:
    return "experts" in tv_ray.models.get(model).dims


def finish(rows: list[dict], failures: int, start: float, out: str, **totals) -> int:
    """Write the rows and a summary to `out`; exit status 1 if any config failed."""
    summary = {"configs": len(rows), "failures": failures, "seconds": round(time.perf_counter() - start, 1),
               **totals}
    with open(out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    print(json.dumps(summary))
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3-tiny,gpt2-tiny")
    parser.add_argument("--out", default="bench/results/plan_grid.json")
    parser.add_argument("--only", default="", help="the configs whose parallel spec holds this text")
    args = parser.parse_args()
    rows, failures = [], 0
    start = time.perf_counter()
    for model in args.models.split(","):
        for tied, optim in itertools.product((True, False), ("sgd", "adamw")):
            graph = tv_ray.capture_step(model, optim=optim, clip=1.0, tied=tied)
            for spec, flags in configs(experts=has_experts(model), batch=tv_ray.models.get(model).dims["batch"]):
                if args.only not in spec:
                    continue
                row = {"model": model, "tied": tied, "optim": optim, "parallel": spec, **flags}
                try:
                    plan = tv_ray.parallelize(graph, spec, model=model, **flags)
                    dev = tv_ray.simulate(plan, seed=0).deviation
                    row["max_abs_dev"] = max(dev.values())
                    row["ok"] = row["max_abs_dev"] <= TOL
                except TvRayError as err:
                    row["error"], row["ok"] = str(err), False
                failures += not row["ok"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return finish(rows, failures, start, args.out)


if __name__ == "__main__":
    sys.exit(main())
