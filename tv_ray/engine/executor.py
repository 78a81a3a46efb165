"""Executors: where unique obligations are solved. The engine hands them batches and takes verdicts back.

An executor runs `solve_batch` on batches of `SolveTask`s — each task is one
unique key with its formula, which travels as a flat term table (pickled:
never as live objects) — and yields (key, Verdict) as batches finish, keeping at most
`in_flight` batches outstanding. `LocalExecutor(jobs=1)` solves in this
process; `jobs > 1` uses a pool of worker processes. The Ray executor
(`tv_ray.engine.ray_executor`) implements the same two methods; `executor_for`
picks one by name.

Why term tables and not Arrow record batches: the llama3-tiny dp=2,tp=2,pp=2,mb=2
tasks (202 keys, 18,879 term nodes) pickle to 429 kB in batches of 64 and take
473 kB as Arrow record batches (key, equations, and the table column-wise:
kinds, payloads, argument lists, roots) — 1.10x the bytes, and 3x the time to
encode (27 vs 8 ms). Variable names are most of either, and a batch already
travels as one object.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

from tv_ray.engine.solve import Budget, Verdict, solve
from tv_ray.processes import in_processes
from tv_ray.terms import from_table, to_table


@dataclass(frozen=True)
class SolveTask:
    """One unique key and its formula: `roots`, the left sides then the right sides (`equations` of each).
    Pickled — to a worker process or a Ray actor — as a flat term table, never as live terms; solved in this
    process as they are (serialising 405B's 168 formulas took 26 s of a local run)."""

    key: str
    roots: tuple
    equations: int

    @staticmethod
    def make(key: str, lhs, rhs) -> "SolveTask":
        return SolveTask(key, (*lhs, *rhs), len(lhs))

    def __reduce__(self):
        return _from_table, (self.key, to_table(*self.roots), self.equations)


def _from_table(key: str, table: dict, equations: int) -> SolveTask:
    roots = from_table(table)
    return SolveTask(key, roots if isinstance(roots, tuple) else (roots,), equations)


def solve_batch(tasks: list[SolveTask], budget: Budget) -> list[tuple[str, Verdict]]:
    """Solve every task of a batch (runs inside a worker)."""
    return [(task.key, solve(task.roots[:task.equations], task.roots[task.equations:], budget)) for task in tasks]


class Executor(Protocol):
    name: str

    def run(self, batches: Iterable[list[SolveTask]], budget: Budget) -> Iterator[tuple[str, Verdict]]: ...

    def close(self) -> None: ...


class LocalExecutor:
    """Solve here (jobs=1) or in `jobs` worker processes, at most `in_flight` batches outstanding."""

    def __init__(self, jobs: int = 1, in_flight: int | None = None):
        self.jobs = max(1, jobs)
        self.in_flight = in_flight or 2 * self.jobs
        self.name = f"local({self.jobs})"
        self._pool: cf.ProcessPoolExecutor | None = None

    def run(self, batches: Iterable[list[SolveTask]], budget: Budget) -> Iterator[tuple[str, Verdict]]:
        if self.jobs == 1:
            for batch in batches:
                yield from solve_batch(batch, budget)
            return
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("fork"))
        pending: set[cf.Future] = set()
        for batch in batches:
            if len(pending) >= self.in_flight:
                done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for f in done:
                    yield from f.result()
            pending.add(self._pool.submit(solve_batch, batch, budget))
        for f in cf.as_completed(pending):
            yield from f.result()

    def width(self) -> int:
        """How many generation jobs run at once: the worker processes."""
        return self.jobs

    def map(self, fn: Callable, jobs: list[tuple]) -> Iterator[tuple[int, object]]:
        """`fn(*job)` for each job in `jobs` worker processes (`tv_ray.processes.in_processes`), yielding
        (job index, result) as each finishes."""
        return in_processes(self.jobs)(fn, jobs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


ENGINES = ("ray", "local")


def executor_for(engine: str, jobs: int | None = None, address: str | None = None) -> Executor:
    """`ray`: solver actors on a local Ray (every core but one; `jobs` actors if given) or the cluster at
    `address` / RAY_ADDRESS. `local`: this process (jobs 1) or `jobs` worker processes."""
    if engine == "local":
        return LocalExecutor(jobs or 1)
    if engine == "ray":
        from tv_ray.engine.ray_executor import RayExecutor
        return RayExecutor(actors=jobs, address=address)
    from tv_ray.errors import TvRayError
    raise TvRayError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


__all__ = ["SolveTask", "solve_batch", "Executor", "LocalExecutor", "executor_for", "ENGINES"]
