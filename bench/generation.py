"""Stage generation side by side: the whole symbolic run in this process against one pipeline stage per shard in
Ray tasks (every core of a local Ray), on the same plan in the same run — and a check that both give the same
stages (ids, keys, reads, mirrored copies).

    python bench/generation.py [--model llama3-8b] [--configs "dp=4,tp=8,pp=4,mb=8"] [--batch 512]
                               [--out bench/results/generation.json]

Each config runs in its own process; rows (seconds, ratio, stages, unique keys, peak memory of this process)
are appended to `--out`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time

from per_config import run_configs


def digest(part) -> str:
    """The stages a partition holds, mirrored ones expanded (id, ranks, key, reads), independent of their order
    (a mirrored group stage is kept under whichever member of the group completed it last)."""
    h = hashlib.sha256()
    for row in sorted(f"{o.id}|{o.ranks}|{o.key}|{','.join(o.reads)}" for o in part.every()):
        h.update(row.encode())
    return h.hexdigest()


def one(model: str, spec: str, batch: int) -> dict:
    import gc

    import tv_ray
    from tv_ray.engine.driver import _unmirrored, claims_for
    from tv_ray.engine.ray_executor import RayExecutor
    from tv_ray.partition.generate import ops_of, partition
    from tv_ray.partition.symmetry import find_mirrors
    from tv_ray.reduce import reduce_plan
    plan = tv_ray.parallelize(tv_ray.capture_step(model, optim="adamw", clip=1.0), spec, model=model,
                              dims={"batch": batch})
    dims = reduce_plan(plan).reduced
    found, notes = find_mirrors(plan, dims, True)
    claims = claims_for(plan, dims, 0, _unmirrored(plan, found))[1]
    symmetry = found or not notes
    started = time.perf_counter()
    whole = partition(plan, dims, claims, symmetry, shards=False)
    whole_s = time.perf_counter() - started
    row = {"model": model, "parallel": spec, "batch": batch, "ranks": plan.num_ranks,
           "ops": ops_of(plan, range(plan.num_ranks)), "stages": whole.size, "unique": len(whole.formulas)}
    expected = digest(whole)
    del whole
    gc.collect()
    executor = RayExecutor()
    width = executor.width()
    started = time.perf_counter()
    sharded = partition(plan, dims, claims, symmetry, shards=True, generate=executor.map, groups=width)
    sharded_s = time.perf_counter() - started
    return {**row, "shards": sharded.shards, "ray_cpus": width, "whole_s": round(whole_s, 1),
            "sharded_s": round(sharded_s, 1), "speedup": round(whole_s / sharded_s, 2),
            "same_stages": digest(sharded) == expected and sharded.size == row["stages"],
            "notes": sharded.symmetry[-1:], "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                    / 2 ** 20, 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--configs", default="dp=4,tp=8,pp=4,mb=8")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--out", default="bench/results/generation.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # the per-config child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.configs, args.batch)), flush=True)
        return 0
    extra = ["--model", args.model, "--batch", str(args.batch)]
    return run_configs(__file__, args.configs, extra, args.out, lambda row: row["same_stages"])


if __name__ == "__main__":
    sys.exit(main())
