"""Build a frontier-size plan (default llama3-405b at dp=64,tp=8,pp=16,mb=16) and report time, memory, size.

    python bench/frontier_plan.py [--model llama3-405b] [--parallel dp=64,tp=8,pp=16,mb=16] [--out DIR]

Writes bench/results/frontier_plan-MODEL.json with the phase times (capture,
parallelize, save), peak RSS and the plan file size, and side by side the plan
written with microbatch repeats (the default) and written out (`repeats=False`):
JSON and gzip sizes, save and load seconds (each load in a fresh process).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import tv_ray
from tv_ray.simulate import parse_dims


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-405b")
    parser.add_argument("--parallel", default="dp=64,tp=8,pp=16,mb=16")
    parser.add_argument("--optim", default="adamw")
    parser.add_argument("--out", default="out")
    parser.add_argument("--dims", default="batch=2048", help="model dims to override (global batch, ...)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.model}.plan.json")
    t0 = time.perf_counter()
    dims = parse_dims(args.dims)
    graph = tv_ray.capture_step(args.model, optim=args.optim, dims=dims)
    t1 = time.perf_counter()
    plan = tv_ray.parallelize(graph, args.parallel, model=args.model, dims=dims)
    t2 = time.perf_counter()
    plan.save(path)
    t3 = time.perf_counter()
    forms = {}
    for name, repeats in (("repeats", True), ("written_out", False)):
        for suffix in ("", ".gz"):
            target = f"{path}.{name}{suffix}"
            started = time.perf_counter()
            plan.save(target, repeats=repeats)
            forms[f"{name}{suffix}"] = {"mb": round(os.path.getsize(target) / 1e6, 1),
                                        "save_s": round(time.perf_counter() - started, 1),
                                        "load_s": _load_seconds(target)}
    result = {
        "model": args.model, "parallel": args.parallel, "dims": dims, "optim": args.optim, "ranks": plan.num_ranks,
        "logical_ops": len(graph.nodes), "programs": len(plan.programs),
        "ops_per_program": {name: len(p.nodes) for name, p in plan.programs.items()},
        "seconds": {"capture": round(t1 - t0, 1), "parallelize": round(t2 - t1, 1), "save": round(t3 - t2, 1)},
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "file_mib": round(os.path.getsize(path) / 2**20, 1), "forms": forms,
    }
    os.makedirs("bench/results", exist_ok=True)
    with open(f"bench/results/frontier_plan-{args.model}.json", "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


def _load_seconds(path: str) -> float:
    """`Plan.load(path)` timed in a fresh process."""
    code = ("import time; from tv_ray.plan import Plan; t = time.perf_counter(); Plan.load(%r); "
            "print(time.perf_counter() - t)" % path)
    return round(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout), 1)


if __name__ == "__main__":
    main()
