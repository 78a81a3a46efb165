"""The Ray executor: unique obligations solved by solver actors on a local Ray or a cluster.

    executor = RayExecutor()                      # local Ray on every core (ray.init), or RAY_ADDRESS
    executor = RayExecutor(address="10.0.0.1:6379", actors=30)

Tasks are routed to actors by their key (hash partitioning: a key always
goes to the same actor, so nothing needs a global lock to solve a key once)
and travel in batches of `batch` tasks; each actor has at most `in_flight`
batches outstanding and the driver stops pulling work while every actor is
full (backpressure). Each actor keeps its solvers warm between batches.

Faults, each logged with the actor, its process and its node:

- an actor that dies (killed, out of memory, its node removed) is restarted
  by Ray and its unfinished batches are sent again once it answers — a
  key's verdict is taken once, never counted twice; a key in flight at
  `MAX_ATTEMPTS` deaths is unknown;
- a task that runs past its limit (each equation's solver timeout plus a
  second, plus `GRACE_S`; the driver asks busy actors every `PROBE_S` how
  long their current task has run) has a solver that ignores its timeout:
  the actor is killed, that batch retried one task at a time, and a task
  that hangs by itself is reported unknown ("solver killed after ..."),
  never proved;
- an actor whose memory passes `recycle_mb` or that solved `recycle_tasks`
  tasks (solver libraries leak) is drained and restarted;
- losing the cluster ends the run with `EngineError` (the driver keeps the
  checkpoint, so `tv-ray verify --resume OUT` continues it): once an actor
  has died, the driver checks every second that the cluster's GCS still
  accepts connections, and after `LOST_S` of refusals it stops. (Ray's own
  driver would end the process after `gcs_rpc_server_reconnect_timeout_s`
  without a word about the checkpoint; the driver raises that limit for
  itself to `DRIVER_RECONNECT_S`, so a long stretch of stage generation
  cannot outlast it.)
"""
from __future__ import annotations

import logging
import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import socket
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import ray

from tv_ray.engine.executor import SolveTask, solve_batch
from tv_ray.engine.solve import Budget, Verdict
from tv_ray.errors import EngineError

log = logging.getLogger("tv_ray.engine")

BATCH = 64
MAX_ATTEMPTS = 3
GRACE_S = 5.0                 # per task, on top of its equations' solver timeouts
PROBE_S = 1.0                 # how often busy actors are asked how long their current task has run
RECYCLE_TASKS = 50_000
RECYCLE_MB = 3072
LOST_S = 10.0                 # the GCS refusing connections this long: the cluster is gone
DRIVER_RECONNECT_S = 600      # how long Ray lets this driver wait for a lost GCS before ending the process


class SolverActor:
    """Solves batches with warm solvers (the solver instances are per process), one task at a time; reports
    where it runs and, from a second thread, how long the current task has run (`progress`)."""

    def __init__(self, index: int, solve: Callable = solve_batch):
        self.index, self.solve, self.solved = index, solve, 0
        self.current: tuple[str, float] | None = None

    def where(self) -> dict:
        return {"actor": self.index, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()[:12],
                "ip": ray.util.get_node_ip_address(), "rss_mb": _rss_mb(), "solved": self.solved}

    @ray.method(concurrency_group="solve")
    def run(self, tasks: list[SolveTask], budget: Budget) -> tuple[list[tuple[str, Verdict]], dict]:
        out = []
        for task in tasks:
            self.current = (task.key, time.monotonic())
            out.extend(self.solve([task], budget))
            self.solved += 1
        self.current = None
        return out, self.where()

    @ray.method(concurrency_group="probe")
    def progress(self) -> tuple[str, float] | None:
        """The task being solved and for how many seconds (None between batches)."""
        current = self.current
        return None if current is None else (current[0], time.monotonic() - current[1])


@dataclass
class _Batch:
    shard: int
    tasks: list[SolveTask]
    alone: bool = False                 # one task of a batch that hung, retried by itself


@dataclass
class _Shard:
    handle: object
    queue: deque = field(default_factory=deque)      # tasks waiting for a batch
    suspects: deque = field(default_factory=deque)   # tasks of a batch that hung, to retry one at a time
    flying: dict = field(default_factory=dict)       # ref -> _Batch, in the order the actor runs them
    draining: bool = False
    where: dict = field(default_factory=dict)
    probe: object = None                             # a pending `progress` call (is a task stuck?)
    ping: object = None                              # after a death: a `progress` call that answers once
    ping_after: float = 0.0                          # Ray has restarted the actor


class RayExecutor:
    """Solver actors on Ray behind the executor interface (`run`, `close`)."""

    def __init__(self, actors: int | None = None, address: str | None = None, *, batch: int = BATCH,
                 in_flight: int = 2, cpus_per_actor: float = 1.0, recycle_tasks: int = RECYCLE_TASKS,
                 recycle_mb: float = RECYCLE_MB, solve: Callable = solve_batch):
        self.address = address if address is not None else os.environ.get("RAY_ADDRESS")
        self.actors, self.batch, self.in_flight = actors, batch, in_flight
        self.cpus_per_actor, self.recycle_tasks, self.recycle_mb, self.solve = \
            cpus_per_actor, recycle_tasks, recycle_mb, solve
        self._shards: list[_Shard] = []
        self._out: list[tuple[str, Verdict]] = []      # verdicts decided by the engine (a task that hung)
        self._deaths: dict[str, int] = {}              # key -> actor deaths while its batch ran
        self.restarts = 0
        self.name = "ray"
        self._gcs: tuple[str, int] | None = None
        self._refused_since: float | None = None      # when the GCS first refused a connection (in a row)
        self._gcs_checked = 0.0

    # -- cluster and actors ------------------------------------------------------------------------
    def _connect(self) -> None:
        if self._gcs is not None:
            return
        if not ray.is_initialized():
            os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(DRIVER_RECONNECT_S))
            try:
                if self.address:
                    ray.init(address=self.address, log_to_driver=False, configure_logging=False)
                else:
                    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise EngineError(f"cannot reach the Ray cluster at {self.address or 'a new local Ray'}: {err}") \
                    from None
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        self._gcs = host, int(port)

    def _start(self) -> None:
        if self._shards:
            return
        self._connect()
        cpus = int(ray.cluster_resources().get("CPU", 1))
        # one CPU stays with the driver (stage generation) unless the cluster has only one
        n = self.actors or max(1, int((cpus - 1 if cpus > 1 else cpus) / self.cpus_per_actor))
        remote = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=self.cpus_per_actor,
                            concurrency_groups={"solve": 1, "probe": 1})(SolverActor)
        self._shards = [_Shard(remote.options(scheduling_strategy="SPREAD").remote(i, self.solve)) for i in range(n)]
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        self.name = f"ray({n} actor{'s' if n > 1 else ''} on {nodes} node{'s' if nodes > 1 else ''})"

    def close(self) -> None:
        for shard in self._shards:
            try:
                ray.kill(shard.handle, no_restart=True)
            except Exception:  # noqa: BLE001 — an actor already gone needs no killing
                pass
        self._shards = []      # a local Ray this started stays up for the next run (Ray stops it at exit)

    # -- stage generation ------------------------------------------------------------------------
    def width(self) -> int:
        """How many generation jobs run at once: the cluster's CPUs."""
        self._connect()
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def map(self, fn: Callable, jobs: list[tuple]) -> Iterator[tuple[int, object]]:
        """`fn(*job)` for each job as a Ray task of one CPU, yielding (job index, result) as each finishes.
        Solver actors (idle between phases) are let go first, so the tasks get every CPU."""
        self._connect()
        self.close()
        task = ray.remote(num_cpus=1, max_retries=2)(fn)
        shared: dict[int, object] = {}          # an argument every job has (the plan, the claims) is put once
        for job in jobs:
            for a in job:
                if id(a) not in shared:
                    shared[id(a)] = ray.put(a)
        refs = {task.remote(*[shared[id(a)] for a in job]): i for i, job in enumerate(jobs)}
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            i = refs.pop(done[0])
            try:
                yield i, ray.get(done[0])
            except ray.exceptions.RayError as err:
                raise EngineError(f"stage generation job {i + 1} of {len(jobs)} failed: {_first_line(err)}") from None

    # -- solving ---------------------------------------------------------------------------------
    def run(self, batches: Iterable[list[SolveTask]], budget: Budget) -> Iterator[tuple[str, Verdict]]:
        self._start()
        done: set[str] = set()
        incoming = (task for batch in batches for task in batch)
        exhausted = False
        while True:
            while not exhausted and self._room():
                task = next(incoming, None)
                if task is None:
                    exhausted = True
                elif task.key not in done:
                    self._shards[zlib.crc32(task.key.encode()) % len(self._shards)].queue.append(task)
            for shard in self._shards:
                while shard.suspects and self._free(shard):
                    self._submit(shard, [shard.suspects.popleft()], budget, alone=True)
                while shard.queue and self._free(shard) and (exhausted or len(shard.queue) >= self.batch):
                    self._submit(shard, [shard.queue.popleft() for _ in range(min(self.batch, len(shard.queue)))],
                                 budget)
            while self._out:
                yield self._out.pop()
            self._check_cluster()
            flying = {ref: (shard, b) for shard in self._shards for ref, b in shard.flying.items()}
            if not flying:
                if exhausted and not any(s.queue or s.suspects for s in self._shards):
                    return
                self._recycle()
                time.sleep(0.05)            # every actor with work is restarting
                continue
            try:
                ready, _ = ray.wait(list(flying), num_returns=1, timeout=PROBE_S)
            except ray.exceptions.RaySystemError as err:
                raise EngineError(f"lost the Ray cluster while solving ({_first_line(err)})") from None
            for ref in ready:
                shard, b = flying[ref]
                del shard.flying[ref]
                yield from self._collect(ref, shard, b, budget, done)
            self._expire(budget, {t.key: t for _, b in flying.values() for t in b.tasks}, done)
            self._recycle()

    def _check_cluster(self) -> None:
        """While an actor is down: is the cluster's GCS still there? EngineError after `LOST_S` of refusals."""
        now = time.monotonic()
        if all(shard.ping is None for shard in self._shards):
            self._refused_since = None      # every actor answers: an earlier refusal was passing
            return
        if now - self._gcs_checked < PROBE_S:
            return
        self._gcs_checked = now
        try:
            socket.create_connection(self._gcs, timeout=PROBE_S).close()
            self._refused_since = None
        except OSError as err:
            self._refused_since = self._refused_since or now
            if now - self._refused_since >= LOST_S:
                raise EngineError(f"lost the Ray cluster: its GCS at {self._gcs[0]}:{self._gcs[1]} has refused "
                                  f"connections for {now - self._refused_since:.0f} s ({err.strerror or err})") \
                    from None

    def _room(self) -> bool:
        """Backpressure: pull more work only while some actor has room and no actor's queue is long."""
        return any(self._free(s) for s in self._shards) and all(len(s.queue) < 4 * self.batch for s in self._shards)

    def _free(self, shard: _Shard) -> bool:
        return not shard.draining and self._alive(shard) and len(shard.flying) < self.in_flight

    def _alive(self, shard: _Shard) -> bool:
        """False while an actor that died is being restarted (nothing is sent to it until it answers)."""
        if shard.ping is None:
            return True
        if time.monotonic() < shard.ping_after:
            return False
        ready, _ = ray.wait([shard.ping], timeout=0)
        if not ready:
            return False
        try:
            ray.get(shard.ping)
        except ray.exceptions.RayActorError:
            shard.ping, shard.ping_after = shard.handle.progress.remote(), time.monotonic() + 0.5
            return False
        shard.ping = None
        return True

    def _submit(self, shard: _Shard, tasks: list[SolveTask], budget: Budget, alone: bool = False) -> None:
        ref = shard.handle.run.remote(tasks, budget)
        shard.flying[ref] = _Batch(self._shards.index(shard), tasks, alone)

    def _collect(self, ref, shard: _Shard, b: _Batch, budget: Budget, done: set[str]):
        try:
            results, where = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            yield from self._retry(shard, b, budget, done, f"died ({_first_line(err)})")
            return
        except ray.exceptions.RaySystemError as err:
            raise EngineError(f"lost the Ray cluster while solving ({_first_line(err)})") from None
        shard.where = where
        for key, verdict in results:
            if key not in done:
                done.add(key)
                yield key, verdict

    def _retry(self, shard: _Shard, b: _Batch, budget: Budget, done: set[str], why: str):
        """The actor died with this batch: Ray restarts it; its tasks go back to the front of its queue
        (sent once it answers again), and a task whose batch saw `MAX_ATTEMPTS` deaths is unknown."""
        if shard.ping is None:
            self.restarts += 1
            shard.ping, shard.ping_after = shard.handle.progress.remote(), time.monotonic() + 0.5
        left = [t for t in b.tasks if t.key not in done]
        log.warning("solver actor %d (%s) %s with a batch of %d keys in flight; Ray restarts it and the batch "
                    "is sent again", b.shard, _where(shard.where), why, len(left))
        again = []
        for t in left:
            self._deaths[t.key] = self._deaths.get(t.key, 0) + 1
            if self._deaths[t.key] >= MAX_ATTEMPTS:
                done.add(t.key)
                yield t.key, Verdict("unknown", 2, "engine", reason=f"solver actor {b.shard} {why}; "
                                                                       f"{MAX_ATTEMPTS} deaths with this key in flight")
            else:
                again.append(t)
        (shard.suspects if b.alone else shard.queue).extendleft(reversed(again))

    def _expire(self, budget: Budget, tasks: dict[str, SolveTask], done: set[str]) -> None:
        """Ask each busy actor how long its current task has run; past the task's limit its solver ignores
        its timeout: kill the actor (Ray restarts it), retry that batch's tasks one at a time and the actor's
        other batches as they were. A task that hangs by itself is unknown, never proved."""
        for shard in self._shards:
            if not shard.flying:
                shard.probe = None
                continue
            if shard.probe is None:
                shard.probe = shard.handle.progress.remote()
                continue
            ready, _ = ray.wait([shard.probe], timeout=0)
            if not ready:
                continue
            try:
                current = ray.get(shard.probe)
            except ray.exceptions.RayActorError:
                current = None                  # died: its batches fail and are retried by `_collect`
            shard.probe = None
            task = tasks.get(current[0]) if current else None
            if task is None or current[1] <= _task_limit(task, budget):
                continue
            log.warning("solver actor %d (%s) has run one task for %.0f s, past its limit: killed", 
                        self._shards.index(shard), _where(shard.where), current[1])
            ray.kill(shard.handle, no_restart=False)
            self.restarts += 1
            shard.ping, shard.ping_after = shard.handle.progress.remote(), time.monotonic() + 0.5
            batches, shard.flying, shard.where = list(shard.flying.values()), {}, {}
            for b in batches:
                left = [t for t in b.tasks if t.key not in done]
                hung = any(t.key == task.key for t in left)
                if hung and b.alone:
                    done.add(task.key)
                    self._out.append((task.key, Verdict(
                        "unknown", 2, "engine", seconds=current[1],
                        reason=f"solver killed after {current[1]:.0f} s: it did not stop at its "
                               f"{budget.timeout_s:g} s timeout")))
                elif hung or b.alone:
                    shard.suspects.extend(left)
                elif left:
                    shard.queue.extendleft(reversed(left))

    def _recycle(self) -> None:
        """Restart actors whose memory or task count passed the limit, once their batches are done."""
        for i, shard in enumerate(self._shards):
            w = shard.where
            if not shard.draining and w and (w["rss_mb"] > self.recycle_mb or w["solved"] >= self.recycle_tasks):
                shard.draining = True
            if shard.draining and not shard.flying:
                log.info("solver actor %d (%s) recycled after %d tasks at %.0f MB", i, _where(w), w["solved"],
                         w["rss_mb"])
                ray.kill(shard.handle, no_restart=False)
                shard.draining, shard.where = False, {}
                shard.ping, shard.ping_after = shard.handle.progress.remote(), time.monotonic() + 0.5
                self.restarts += 1


def _rss_mb() -> float:
    """This process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _task_limit(task: SolveTask, budget: Budget) -> float:
    """How long a task may take before its solver is taken to ignore its timeout."""
    return task.equations * (budget.timeout_s + 1.0) + GRACE_S


def _where(w: dict) -> str:
    return f"pid {w['pid']} on node {w['node']} at {w['ip']}" if w else "not started yet"


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


__all__ = ["RayExecutor", "SolverActor", "EngineError"]
