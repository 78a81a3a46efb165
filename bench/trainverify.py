"""llama3-8b at TrainVerify's configurations: wall time, obligations, unique keys, share closed by each tier.

    python bench/trainverify.py [--configs "dp=512;dp=16,tp=8,pp=4,mb=32"] [--batch 512] [--jobs 1]
                                [--out bench/results/trainverify_8b.json]

Each config runs in its own process (peak memory is per config): capture the step (AdamW, clip 1.0),
build the plan, verify it (z3 as the SMT tier), and record the phases, the counts, how many stages were
mirrored from a data-parallel representative or moved from microbatch 0, and the unique keys closed per
tier. Rows are appended to `--out` as they finish. TrainVerify reported 685 s (dp=512) and 8,532 s
(dp=16,tp=8,pp=4,mb=32) on 30 workers.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def one(model: str, spec: str, batch: int, jobs: int) -> dict:
    import tv_ray
    from tv_ray.engine.driver import verify_plan
    from tv_ray.engine.executor import LocalExecutor
    from tv_ray.engine.solve import Budget
    started = time.perf_counter()
    graph = tv_ray.capture_step(model, optim="adamw", clip=1.0)
    captured = time.perf_counter()
    plan = tv_ray.parallelize(graph, spec, model=model, dims={"batch": batch})
    built = time.perf_counter()
    outcome = verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=jobs), progress=False)
    done = time.perf_counter()
    counts = outcome.counts()
    return {"model": model, "parallel": spec, "batch": batch, "ranks": plan.num_ranks, "status": outcome.status,
            **counts, "mirrored": outcome.partition.mirrored,
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
    parser.add_argument("--out", default="bench/results/trainverify_8b.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # the per-config child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.configs, args.batch, args.jobs)), flush=True)
        return 0
    out = Path(args.out)
    ok = True
    for spec in args.configs.split(";"):
        child = subprocess.run([sys.executable, __file__, "--one", "--model", args.model, "--configs", spec,
                                "--batch", str(args.batch), "--jobs", str(args.jobs)],
                               capture_output=True, text=True)
        if child.returncode:
            print(child.stderr[-2000:], file=sys.stderr)
            ok = False
            continue
        row = json.loads(child.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        rows = json.loads(out.read_text())["rows"] if out.exists() else []     # other runs may have written
        rows = [r for r in rows if r["parallel"] != spec] + [row]
        out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        ok &= row["status"] == "proved"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
