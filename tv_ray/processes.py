"""How work runs in this process and in processes forked from it.

`gc_paused` keeps the cyclic collector off while ~10^7 small acyclic objects
are built (a plan, its stages); `in_processes` runs jobs in processes forked
for the call, each inheriting the jobs rather than receiving them pickled;
`Forked` runs one job beside this process's own work; `held_to_exit` keeps
what a command made to the end of a process that ends without freeing it.
None imports anything of tv_ray: the capture, the partition, the checker and
the commands use them alike.
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


class Forked:
    """`fn(*args)` run in a process forked now, while this one goes on: `result()` waits for it and returns what it
    returned or raises what it raised (`ChildProcessError`: it ended without answering — killed, say); `stop()` ends
    it unasked.
    The child inherits `args` rather than receiving them pickled and keeps the collector off, so it does not touch
    (and copy) this process's heap. A daemonic process may have no children: see `possible`."""

    def __init__(self, fn: Callable, *args):
        ctx = multiprocessing.get_context("fork")
        self._answer, sender = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_answer, args=(fn, args, sender), daemon=True)
        self._process.start()
        sender.close()

    @staticmethod
    def possible() -> bool:
        """May this process fork one (it is not a daemonic process itself)?"""
        return not multiprocessing.current_process().daemon

    def result(self):
        try:
            raised, value = self._answer.recv()
        except EOFError:
            raise ChildProcessError(f"the forked process ended without answering (exit code "
                                    f"{self._process.exitcode})") from None
        finally:
            self.stop()
        if raised:
            raise value
        return value

    def stop(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()
        self._answer.close()


def _answer(fn: Callable, args: tuple, sender) -> None:
    gc.disable()
    try:
        answer = (False, fn(*args))
    except Exception as err:        # noqa: BLE001 — raised again by `Forked.result`, in the parent
        answer = (True, err)
    try:
        sender.send(answer)
    except Exception as err:        # noqa: BLE001 — an answer that cannot be pickled: said as text
        sender.send((True, RuntimeError(f"{fn.__name__}: its answer cannot be sent back: {err}")))
    sender.close()


_HELD: list | None = None      # what `held_to_exit` keeps, in a process that ends without teardown (`ends_unfreed`)


def ends_unfreed() -> None:
    """This process ends without freeing what it holds (`tv_ray.cli.entry`: `os._exit` once its exit handlers ran), so
    `held_to_exit` may keep objects to its end."""
    global _HELD
    _HELD = []


def held_to_exit(*objects) -> None:
    """Keep `objects` (a verification's outcome, a check's derivation) to the end of a process that ends without
    freeing them (`ends_unfreed`) rather than free them one by one on the way there: at llama3-70b, tens of millions
    of objects, 0.9 s after a verification and 1.6 s after a check. Elsewhere (the Python API) this does nothing."""
    if _HELD is not None:
        _HELD.extend(objects)


__all__ = ["gc_paused", "in_processes", "Generate", "Forked", "ends_unfreed", "held_to_exit"]
