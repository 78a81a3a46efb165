"""llama3-8b at TrainVerify's configurations: wall time, obligations, unique keys, share closed by each tier.

    python bench/trainverify.py [--configs "dp=512;dp=16,tp=8,pp=4,mb=32"] [--batch 512] [--jobs 1]
                                [--engine local|ray] [--out bench/results/trainverify_8b.json]

Each config runs in its own process (peak memory is per config): capture the step (AdamW, clip 1.0),
build the plan, verify it (z3 as the SMT tier), and record the phases, the counts, how many stages were
mirrored from a data-parallel representative or moved from microbatch 0, and the unique keys closed per
tier. `--engine ray`: a local Ray with `--jobs` solver actors, the stages generated one pipeline stage per shard
in Ray tasks (every core); `local`: one process generates, `--jobs` processes solve. Rows are appended to `--out` as they finish. TrainVerify reported 685 s (dp=512) and 8,532 s
(dp=16,tp=8,pp=4,mb=32) on 30 workers.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from per_config import run_configs


def one(model: str, spec: str, batch: int, jobs: int, engine: str) -> dict:
    import tv_ray
    from tv_ray.engine.driver import verify_plan
    from tv_ray.engine.executor import LocalExecutor
    from tv_ray.engine.solve import Budget
    started = time.perf_counter()
    graph = tv_ray.capture_step(model, optim="adamw", clip=1.0)
    captured = time.perf_counter()
    plan = tv_ray.parallelize(graph, spec, model=model, dims={"batch": batch})
    built = time.perf_counter()
    if engine == "ray":
        from tv_ray.engine.ray_executor import RayExecutor
        executor = RayExecutor(actors=jobs)
    else:
        executor = LocalExecutor(jobs=jobs)
    outcome = verify_plan(plan, budget=Budget(solvers=("z3",)), executor=executor, progress=False)
    done = time.perf_counter()
    counts = outcome.counts()
    return {"model": model, "parallel": spec, "batch": batch, "ranks": plan.num_ranks, "status": outcome.status,
            **counts, "engine": outcome.executor, "shards": outcome.partition.shards,
            "mirrored": outcome.partition.mirrored,
            "moved": outcome.partition.moved, "accumulated": outcome.partition.accumulated, "tiers": outcome.tiers(),
            "wall_s": round(done - started, 1), "capture_s": round(captured - started, 1),
            "plan_s": round(built - captured, 1), "verify_s": round(done - built, 1),
            "phases_s": {k: round(v, 1) for k, v in outcome.phases.items()}, "dims": outcome.reduction.reduced,
            "symmetry_notes": outcome.partition.symmetry[:3], "problems": outcome.problems[:3],
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--configs", default="dp=512;dp=16,tp=8,pp=4,mb=32")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--engine", choices=("local", "ray"), default="local")
    parser.add_argument("--out", default="bench/results/trainverify_8b.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # the per-config child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.configs, args.batch, args.jobs, args.engine)), flush=True)
        return 0
    extra = ["--model", args.model, "--batch", str(args.batch), "--jobs", str(args.jobs), "--engine", args.engine]
    return run_configs(__file__, args.configs, extra, args.out, lambda row: row["status"] == "proved")


if __name__ == "__main__":
    sys.exit(main())
