"""How obligations and unique keys grow with data parallelism and microbatches (key dedup at work).

    python bench/dedup_scaling.py [--model llama3-tiny] [--configs dp=1,dp=2] [--batch N] [--jobs 2]
                                  [--out bench/results/dedup_scaling.json]
    python bench/dedup_scaling.py --model llama3-8b --configs "dp=2;dp=8;dp=32" --batch 32 --jobs 2 \
                                  --out bench/results/dedup_scaling_8b.json

For each config: obligations, unique keys, the share solved (unique / obligations), obligations mirrored
from a dp representative, keys closed per tier, time per phase (the plan's construction included) and peak
memory, all measured in one run side by side; `--both` also runs every config without dp symmetry.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import tv_ray

CONFIGS = ["dp=1", "dp=2", "dp=4", "dp=8", "dp=2,mb=2", "dp=2,mb=4", "dp=2,tp=2,pp=2,mb=2", "dp=4,tp=2,pp=2,mb=2"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-tiny")
    parser.add_argument("--configs", default=";".join(CONFIGS), help="parallel specs separated by ';'")
    parser.add_argument("--batch", type=int, default=None, help="the model's full batch (dp must divide it)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--both", action="store_true", help="each config also without dp symmetry, side by side")
    parser.add_argument("--out", default="bench/results/dedup_scaling.json")
    args = parser.parse_args()
    graph = tv_ray.capture_step(args.model, optim="adamw", clip=1.0)
    rows = []
    for spec in args.configs.split(";"):
        t = time.perf_counter()
        plan = tv_ray.parallelize(graph, spec, model=args.model, dims={"batch": args.batch} if args.batch else None)
        for symmetry in ((True, False) if args.both else (True,)):
            t = time.perf_counter() if not symmetry else t
            result = tv_ray.verify(plan, jobs=args.jobs, progress=False, symmetry=symmetry)
            counts = result.outcome.counts()
            row = {"parallel": spec, "ranks": plan.num_ranks, "symmetry": symmetry, "status": result.status, **counts,
                   "solved_share": round(counts["unique"] / counts["obligations"], 5),
                   "mirrored": result.outcome.partition.mirrored, "tiers": result.outcome.tiers(),
                   "seconds": round(time.perf_counter() - t, 2),
                   "phases": {k: round(v, 2) for k, v in result.outcome.phases.items()},
                   "dims": result.outcome.reduction.reduced,
                   "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "rows": rows}, f, indent=1)
    return 0 if all(r["status"] == "proved" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
