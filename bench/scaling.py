"""Solver throughput on Ray against the single-process executor, side by side in one run.

    python bench/scaling.py [--plans "llama3-tiny:dp=2,tp=2,pp=2,mb=2;gpt2-tiny:dp=2,tp=2"]
                            [--out bench/results/scaling.json]

The unique obligations of the plans (each key once, as the engine solves them) are solved, in this order,
by: the local executor in this process; Ray with 1, 2 and 4 solver actors on a local Ray (this machine's
cores; 4 actors share them at half a CPU each); and 4 actors on a 3-node local cluster
(`ray.cluster_utils.Cluster`, one process per node on this machine). Each row: unique keys per second and
the obligations those keys stand for per second, and the ratio to the local executor. Ray start-up and
actor creation are excluded (timed separately); every configuration must give the same verdicts. Writes
`--out` (JSON) and a PNG next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _tasks(specs: str):
    import tv_ray
    from tv_ray.partition.derive import derive
    from tv_ray.engine.executor import SolveTask
    tasks, weight = {}, {}
    for item in specs.split(";"):
        model, spec = item.split(":")
        plan = tv_ray.parallelize(tv_ray.capture_step(model, optim="adamw", clip=1.0), spec, model=model)
        part = derive(plan).partition
        counts = part.key_counts()
        for key, (lhs, rhs) in part.formulas.items():
            tasks.setdefault(key, SolveTask.make(key, lhs, rhs))
            weight[key] = weight.get(key, 0) + counts[key]
    return list(tasks.values()), weight


def _measure(name: str, executor, tasks, weight, budget) -> tuple[dict, dict]:
    from tv_ray.engine.driver import _batches
    started = time.perf_counter()
    if hasattr(executor, "_start"):
        executor._start()                    # Ray connection and actors: not part of the throughput
        warm = list(executor.run(_batches(tasks[:len(executor._shards)], 1), budget))
        assert len(warm) == len(executor._shards)
    ready = time.perf_counter()
    verdicts = dict(executor.run(_batches(tasks, 64), budget))
    seconds = time.perf_counter() - ready
    executor.close()
    assert len(verdicts) == len(tasks)
    row = {"executor": name, "unique": len(tasks), "obligations": sum(weight.values()),
           "seconds": round(seconds, 2), "startup_s": round(ready - started, 2),
           "unique_per_s": round(len(tasks) / seconds, 1),
           "obligations_per_s": round(sum(weight.values()) / seconds, 1)}
    print(json.dumps(row), flush=True)
    return row, {k: (v.verdict, v.method) for k, v in verdicts.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", default="llama3-tiny:dp=2,tp=2,pp=2,mb=2;gpt2-tiny:dp=2,tp=2;llama3-tiny:tp=2,pp=2,mb=4")
    parser.add_argument("--out", default="bench/results/scaling.json")
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster
    from tv_ray.engine.executor import LocalExecutor
    from tv_ray.engine.ray_executor import RayExecutor
    from tv_ray.engine.solve import Budget
    budget = Budget(solvers=("z3",), timeout_s=10.0)
    tasks, weight = _tasks(args.plans)
    print(f"{len(tasks)} unique keys standing for {sum(weight.values())} obligations", flush=True)
    rows, reference = [], None
    row, reference = _measure("local (1 process)", LocalExecutor(), tasks, weight, budget)
    rows.append(row)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    for n in (1, 2, 4):
        row, verdicts = _measure(f"ray {n} actor{'s' if n > 1 else ''}", RayExecutor(
            actors=n, cpus_per_actor=min(1.0, os.cpu_count() / n)), tasks, weight, budget)
        assert verdicts == reference, f"ray with {n} actors gave other verdicts"
        rows.append(row)
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    row, verdicts = _measure("ray 3-node cluster, 4 actors", RayExecutor(actors=4, cpus_per_actor=0.5), tasks,
                             weight, budget)
    assert verdicts == reference, "the 3-node cluster gave other verdicts"
    rows.append(row)
    ray.shutdown()
    cluster.shutdown()
    base = rows[0]["unique_per_s"]
    for r in rows:
        r["ratio_to_local"] = round(r["unique_per_s"] / base, 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plans": args.plans, "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    _plot(rows, out.with_suffix(".png"))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["executor"] for r in rows], [r["unique_per_s"] for r in rows], color="#4a7ab5")
    for i, r in enumerate(rows):
        ax.text(r["unique_per_s"], i, f" {r['ratio_to_local']}×", va="center")
    ax.set_xlabel("unique obligations solved per second")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
