"""Solve functions that misbehave on purpose, shipped to Ray solver actors by value (tests only: actors cannot
import this module, so importing it registers it to be pickled by value).

Each takes (tasks, budget) like `tv_ray.engine.executor.solve_batch`; the marker files make a fault fire
once across actor restarts (a restarted actor is a new process)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import ray

from tv_ray.engine.executor import solve_batch
from tv_ray.engine.solve import Budget

BUDGET = Budget(solvers=("z3",), timeout_s=2.0)      # what the fault tests solve with

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def dies_once(marker: str):
    """The first batch kills its actor's process mid-batch (after solving half of it)."""
    def solve(tasks, budget):
        if not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            solve_batch(tasks[: len(tasks) // 2], budget)
            os._exit(1)
        return solve_batch(tasks, budget)
    return solve


def hangs_on(key: str, log: str):
    """A solver that never returns on `key` (ignores every timeout); every call is logged with its pid."""
    def solve(tasks, budget):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {len(tasks)}\n")
        if any(t.key == key for t in tasks):
            time.sleep(3600)
        return solve_batch(tasks, budget)
    return solve


def logs_pids(log: str):
    """Solves normally; logs which process solved each batch."""
    def solve(tasks, budget):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {len(tasks)}\n")
        return solve_batch(tasks, budget)
    return solve


def slowed(seconds: float):
    """Solves normally, each task `seconds` late: a run that lasts long enough to be cut short."""
    def solve(tasks, budget):
        time.sleep(seconds * len(tasks))
        return solve_batch(tasks, budget)
    return solve


def cli_slowed(seconds: float, argv: list[str]) -> int:
    """`tv-ray` with every key's solve `slowed` (the Ray engine's solver actors, or the local engine in this
    process), and a cluster given up for lost after 3 s of refusals (not 10)."""
    from tv_ray import cli
    from tv_ray.engine import executor, ray_executor

    def executor_for(engine, jobs=None, address=None):
        if engine == "local":
            assert not jobs or jobs == 1, jobs
            executor.solve_batch = slowed(seconds)       # what LocalExecutor.run calls in this process
            return executor.LocalExecutor()
        assert engine == "ray", engine
        return ray_executor.RayExecutor(actors=jobs, address=address, solve=slowed(seconds))
    executor.executor_for = executor_for
    ray_executor.LOST_S = 3.0
    return cli.main(argv)


if __name__ == "__main__":                       # python faults.py SECONDS verify ...: `cli_slowed`
    sys.exit(cli_slowed(float(sys.argv[1]), sys.argv[2:]))
