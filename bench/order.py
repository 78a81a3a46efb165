"""The communication-order check at frontier size: one slice of the mesh against every rank, side by side.

    python bench/order.py [--configs "llama3-8b:dp=16,tp=8,pp=4,mb=32:512;..."] [--out bench/results/order.json]

A config is MODEL:SPEC:BATCH (AdamW, clipping at 1.0). For each plan: `check_order` at the plan's reduced dims,
stepping one slice of the mesh (the ranks at coordinate 0 of every axis whose ranks share programs and no
send/recv crosses: what `tv-ray verify` runs on a plan too large to run concretely) and stepping every rank,
in one process one after the other; both must agree (both complete, or both deadlock).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import tv_ray
import tv_ray.models
from tv_ray.errors import CommunicationError
from tv_ray.execute import OrderRun
from tv_ray.reduce import reduce_plan

CONFIGS = ("llama3-8b:dp=16,tp=8,pp=4,mb=32:512;deepseek-v2-lite-16b:dp=16,tp=4,pp=2,mb=16:256;"
           "deepseek-v2-236b:dp=16,tp=8,pp=4,mb=16:256;llama3-405b:dp=64,tp=8,pp=16,mb=16:2048")


def measure(model: str, spec: str, batch: int) -> dict:
    base = tv_ray.models.get(model)
    model_spec = base.with_dims({**base.dims, "batch": batch})
    started = time.perf_counter()
    plan = tv_ray.parallelize(tv_ray.capture_step(model_spec, optim="adamw", clip=1.0), spec, model=model_spec)
    dims = reduce_plan(plan).reduced
    row = {"model": model, "parallel": spec, "batch": batch, "ranks": plan.num_ranks,
           "plan_s": round(time.perf_counter() - started, 1)}
    for mode, sliced in (("sliced", True), ("every_rank", False)):
        t = time.perf_counter()
        run = OrderRun(plan, dims, sliced)
        try:
            run.run()
            outcome = "completes"
        except CommunicationError as err:
            outcome = str(err)[:200]
        row[mode] = {"seconds": round(time.perf_counter() - t, 2), "stepped": len(run.active),
                     "symmetric": list(run.symmetric), "outcome": outcome}
    row["ratio"] = round(row["every_rank"]["seconds"] / row["sliced"]["seconds"], 1)
    row["agree"] = (row["sliced"]["outcome"] == "completes") == (row["every_rank"]["outcome"] == "completes")
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--out", default="bench/results/order.json")
    args = parser.parse_args()
    rows = []
    for config in args.configs.split(";"):
        model, spec, batch = config.split(":")
        rows.append(measure(model, spec, int(batch)))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    return 0 if all(row["agree"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
