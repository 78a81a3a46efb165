"""Stage generation side by side: the whole symbolic run in this process against one pipeline stage per shard in
Ray tasks (every core of a local Ray), on the same plan in the same run — and a check that both give the same
stages (ids, keys, reads, mirrored copies).

    python bench/generation.py [--model llama3-8b] [--configs "dp=4,tp=8,pp=4,mb=8"] [--batch 512]
                               [--out bench/results/generation.json]

Each config runs in its own process, its whole and its sharded generation each in a child of that (so their
memory peaks do not add up); rows (seconds, ratio, stages, unique keys, peak memory of the driver) are merged
into `--out`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time

from per_config import run_configs


def digest(part) -> str:
    """The stages a partition holds, independent of their order: the recorded ones (id, ranks, key, reads), and
    each mirrored one as (dp block of its rank, its representative's stage) — what `Partition.copy` expands it
    from (a mirrored group stage is kept under whichever member completed the group, so not by rank)."""
    import numpy as np
    h = hashlib.sha256()
    rows = sorted((o.id, f"{o.ranks}|{o.key}|{','.join(map(str, o.reads))}") for o in part.obligations)
    for cid, row in rows:
        h.update(f"{cid}|{row}\n".encode())
    if part.copies:
        rank_of = {cid: n for n, (cid, _) in enumerate(rows)}
        ranks, of, mb = part.flat_copies()
        rep = np.asarray([rank_of[o.id] for o in part.obligations], dtype=np.int64)[of]
        block = np.asarray([part.mirrors.block[r] if part.mirrors else 0 for r in ranks.tolist()], dtype=np.int64)
        mb = mb.astype(np.int64)
        h.update(np.sort((mb * (int(block.max()) + 1) + block) * len(rows) + rep).tobytes())
    return h.hexdigest()


def measure(model: str, spec: str, batch: int, mode: str) -> dict:
    """One generation of the config's stages, `whole` (this process) or `sharded` (Ray tasks on every core)."""
    import tv_ray
    from tv_ray.partition.derive import derived_claims
    from tv_ray.engine.ray_executor import RayExecutor
    from tv_ray.partition.generate import ops_of, partition
    from tv_ray.partition.symmetry import find_mirrors
    from tv_ray.reduce import reduce_plan
    plan = tv_ray.parallelize(tv_ray.capture_step(model, optim="adamw", clip=1.0), spec, model=model,
                              dims={"batch": batch})
    dims = reduce_plan(plan).reduced
    found, notes = find_mirrors(plan, dims, True)
    claims = derived_claims(plan, dims, found)[1]
    generation, width = {"shards": False}, 1
    if mode == "sharded":
        executor = RayExecutor()
        width = executor.width()
        generation = {"shards": True, "generate": executor.map, "groups": width}
    started = time.perf_counter()
    part = partition(plan, dims, claims, found or not notes, **generation)
    seconds = time.perf_counter() - started
    return {"ranks": plan.num_ranks, "ops": ops_of(plan, range(plan.num_ranks)), "stages": part.size,
            "unique": len(part.formulas), "shards": part.shards, "cpus": width, "seconds": round(seconds, 1),
            "digest": digest(part), "notes": part.symmetry[-1:],
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def one(model: str, spec: str, batch: int) -> dict:
    """The whole and the sharded generation, each in its own process (their peaks do not add up)."""
    got = {}
    for mode in ("whole", "sharded"):
        child = subprocess.run([sys.executable, __file__, "--mode", mode, "--model", model, "--configs", spec,
                                "--batch", str(batch)], capture_output=True, text=True, check=True)
        got[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    whole, sharded = got["whole"], got["sharded"]
    return {"model": model, "parallel": spec, "batch": batch, "ranks": whole["ranks"], "ops": whole["ops"],
            "stages": whole["stages"], "unique": whole["unique"], "shards": sharded["shards"],
            "ray_cpus": sharded["cpus"], "whole_s": whole["seconds"], "sharded_s": sharded["seconds"],
            "speedup": round(whole["seconds"] / sharded["seconds"], 2),
            "same_stages": whole["digest"] == sharded["digest"] and whole["stages"] == sharded["stages"],
            "notes": sharded["notes"], "peak_rss_gib": {"whole": whole["peak_rss_gib"],
                                                        "sharded_driver": sharded["peak_rss_gib"]}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--configs", default="dp=4,tp=8,pp=4,mb=8")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--out", default="bench/results/generation.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # the per-config child
    parser.add_argument("--mode", choices=("whole", "sharded"), help=argparse.SUPPRESS)   # its children
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.model, args.configs, args.batch, args.mode)), flush=True)
        return 0
    if args.one:
        print(json.dumps(one(args.model, args.configs, args.batch)), flush=True)
        return 0
    extra = ["--model", args.model, "--batch", str(args.batch)]
    return run_configs(__file__, args.configs, extra, args.out, lambda row: row["same_stages"])


if __name__ == "__main__":
    sys.exit(main())
