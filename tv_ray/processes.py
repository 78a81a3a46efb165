"""How work runs in this process and in processes forked from it.

`gc_paused` keeps the cyclic collector off while ~10^7 small acyclic objects
are built (a plan, its stages); `in_processes` runs jobs in processes forked
for the call, each inheriting the jobs rather than receiving them pickled.
Neither imports anything of tv_ray: the capture, the partition and the
checker use them alike.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import multiprocessing
import pickle
from typing import Callable, Iterable, Iterator

# Runs `fn(*job)` for each job, yielding (job index, result) as each finishes: `in_processes`, `RayExecutor.map`
# (Ray tasks), `LocalExecutor.map` (worker processes).
Generate = Callable[[Callable, list[tuple]], Iterable[tuple[int, object]]]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while a plan is built, read, checked, written or verified.

    These allocate ~10^7 small acyclic objects (JSON values, nodes, tuples, terms);
    each full collection would walk every one of them, which made loading 3-4x
    slower. Example: ``with gc_paused(): plan = build(...); check_plan(plan)``; as a
    decorator (``@gc_paused()``) it pauses the collector for each call.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def in_processes(workers: int) -> Generate:
    """A `Generate` that runs the jobs in `workers` processes forked for the call, yielding (job index, result) as
    each finishes. The processes inherit the jobs as they are forked (`_FORKED`): a job travels as its index, not
    its arguments — pickling the plan and the claims to each took llama3-70b at 16 layers ~12 s."""
    def generate(fn: Callable, jobs: list[tuple]) -> Iterator[tuple[int, object]]:
        global _FORKED
        _FORKED = (fn, jobs)
        try:
            with cf.ProcessPoolExecutor(max(1, min(workers, len(jobs))),
                                        mp_context=multiprocessing.get_context("fork")) as pool:
                futures = {pool.submit(_forked_job, i): i for i in range(len(jobs))}
                for f in cf.as_completed(futures):
                    with gc_paused():
                        result = pickle.loads(f.result())
                    yield futures[f], result
        finally:
            _FORKED = None
    return generate


_FORKED: tuple[Callable, list[tuple]] | None = None      # the function and jobs of the `in_processes` call running


def _forked_job(i: int) -> bytes:
    """Job `i`, its result pickled here with the cyclic collector off (the process holds nothing cyclic worth
    collecting; with it on, pickling a 70B 16-layer shard's stages took 2.7 s instead of 0.75)."""
    gc.disable()
    fn, jobs = _FORKED
    return pickle.dumps(fn(*jobs[i]), protocol=pickle.HIGHEST_PROTOCOL)


__all__ = ["gc_paused", "in_processes", "Generate"]
