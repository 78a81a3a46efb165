"""The Ray executor: unique obligations solved by solver actors on a local Ray or a cluster.

    executor = RayExecutor()                      # local Ray on every core (ray.init), or RAY_ADDRESS
    executor = RayExecutor(address="10.0.0.1:6379", actors=30)

Tasks are routed to actors by their key (hash partitioning: a key goes to
one actor at a time, so nothing needs a global lock to solve a key once)
and travel in batches of `batch` tasks; each actor has at most `in_flight`
batches outstanding and the driver stops pulling work while every actor is
full (backpressure). Each actor keeps its solvers warm between batches.

The pool follows the cluster as it grows and shrinks. It starts with an
actor per CPU but one (the driver's) unless the cluster has only one, or
with `actors=N`; every `SCALE_S` the driver reads the cluster's CPUs again
and CPUs it gained (a node added, by hand or by an autoscaler) get new
actors, up to that rule and the CPUs free (`actors=N` keeps N, regrowing
only to N). An actor that has not come up for `RESTART_S` — new, or
restarted by Ray after its node went away, with no room for it anywhere —
leaves the pool (never the last one that answers). Whenever the pool
changes, the tasks not sent yet are routed again under its new size (those
in flight stay where they are, so a key is in one place at a time, and
`run` takes each key's verdict once), and a leaving actor's unsent tasks and
its batches in flight go to the others. Each change is logged (INFO,
"tv_ray.engine") with the actor and node counts; `name` describes the
largest pool the executor has had, e.g. "ray(4 actors on 3 nodes)". Actors
that work are not taken away: a cluster that shrank without killing any
keeps them until the next stage generation, which lets every actor go
(`map`; its Ray tasks take the CPUs the cluster has then, `width()` reads
them at each call), and the next pool is sized to the cluster again.

Faults, each logged with the actor, its process and its node:

- an actor that dies (killed, out of memory, its node removed) is restarted
  by Ray and its unfinished batches are sent again once it answers (to
  another actor if it leaves the pool instead) — a key's verdict is taken
  once, never counted twice; a key in flight at `MAX_ATTEMPTS` deaths is
  unknown; an actor that stops answering with batches in flight for
  `RESTART_S` is taken for dead the same way;
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
  cannot outlast it. Ray's state calls block for good on a lost GCS, so the
  pool's reads of the cluster's CPUs run in a thread it stops waiting for.)
"""
from __future__ import annotations

import logging
import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import socket
import threading
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
SCALE_S = 5.0                 # how often the driver reads the cluster's CPUs to grow the pool
RESTART_S = 60.0              # an actor not up this long (no room on the cluster) leaves the pool
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
    tasks: list[SolveTask]
    alone: bool = False                 # one task of a batch that hung, retried by itself


@dataclass
class _Shard:
    handle: object
    index: int                                       # the actor's number in logs (kept as the pool changes)
    queue: deque = field(default_factory=deque)      # tasks waiting for a batch
    suspects: deque = field(default_factory=deque)   # tasks of a batch that hung, to retry one at a time
    flying: dict = field(default_factory=dict)       # ref -> _Batch, in the order the actor runs them
    draining: bool = False
    where: dict = field(default_factory=dict)
    probe: object = None                             # a pending `progress` call (is a task stuck?)
    ping: object = None                              # new or after a death: a `progress` call that answers
    ping_after: float = 0.0                          # once the actor is up (Ray has placed or restarted it)
    heard: float = field(default_factory=time.monotonic)   # when it last answered (or died, or got work)


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
        self._largest = 0                              # the largest pool so far (`name` describes it)
        self._made = 0                                 # actors made by this pool (their numbers)
        self._sized = 0.0                              # when the cluster was last read to grow the pool
        self._reading: threading.Thread | None = None  # a read of the cluster's state that has not answered
        self._gcs: tuple[str, int] | None = None
        self._refused_since: float | None = None      # when the GCS first refused a connection (in a row)
        self._gcs_checked = 0.0

    # -- cluster and actors ------------------------------------------------------------------------
    def connect(self) -> None:
        """Join the cluster at `address`, or start a new local Ray — always a new one: plain `ray.init()` would
        join whichever cluster `ray start` last started on this machine. A local Ray keeps Ray's token
        authentication (on by default), without the notice Ray prints about it."""
        if self._gcs is not None:
            return
        if not ray.is_initialized():
            os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(DRIVER_RECONNECT_S))
            try:
                if self.address:
                    ray.init(address=self.address, log_to_driver=False, configure_logging=False)
                else:
                    # Ray turns its token authentication on for a new local Ray and says so on every run;
                    # that is what we want, so the notice (nothing to act on) is not shown
                    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
                        logging.ERROR)
                    ray.init(address="local", include_dashboard=False, log_to_driver=False,
                             configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise EngineError(f"cannot reach the Ray cluster at {self.address or 'a new local Ray'}: {err}") \
                    from None
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        self._gcs = host, int(port)

    def _start(self) -> None:
        if self._shards:
            return
        self.connect()
        self._remote = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=self.cpus_per_actor,
                                  concurrency_groups={"solve": 1, "probe": 1})(SolverActor)
        self._made, self._sized = 0, time.monotonic()
        self._shards = [self._new_actor() for _ in range(self._fits(ray.cluster_resources().get("CPU", 1)))]
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        self._named(nodes)
        log.info("solver pool: %s", _pool(len(self._shards), nodes))

    def _fits(self, cpus: float) -> int:
        """The pool for a cluster of `cpus` CPUs: `actors` if given, else one actor per `cpus_per_actor`
        CPUs but one (the driver's: stage generation) unless the cluster has only one."""
        cpus = int(cpus) or 1
        return self.actors or max(1, int((cpus - 1 if cpus > 1 else cpus) / self.cpus_per_actor))

    def _new_actor(self) -> _Shard:
        """A new solver actor; nothing is sent to it until it answers (there may be no room for it yet)."""
        shard = _Shard(self._remote.options(scheduling_strategy="SPREAD").remote(self._made, self.solve), self._made)
        shard.ping = shard.handle.progress.remote()
        self._made += 1
        return shard

    def _named(self, nodes: int) -> None:
        if len(self._shards) > self._largest:
            self._largest = len(self._shards)
            self.name = f"ray({_pool(self._largest, nodes)})"

    def close(self) -> None:
        for shard in self._shards:
            try:
                ray.kill(shard.handle, no_restart=True)
            except Exception:  # noqa: BLE001 — an actor already gone needs no killing
                pass
        self._shards = []      # a local Ray this started stays up for the next run (Ray stops it at exit)

    # -- stage generation ------------------------------------------------------------------------
    def width(self) -> int:
        """How many generation jobs run at once: the cluster's CPUs now."""
        self.connect()
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def map(self, fn: Callable, jobs: list[tuple]) -> Iterator[tuple[int, object]]:
        """`fn(*job)` for each job as a Ray task of one CPU, yielding (job index, result) as each finishes.
        Solver actors (idle between phases) are let go first, so the tasks get every CPU."""
        self.connect()
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
                    self._route(task).queue.append(task)
            for shard in self._shards:
                while shard.suspects and self._free(shard):
                    self._submit(shard, [shard.suspects.popleft()], budget, alone=True)
                while shard.queue and self._free(shard) and (exhausted or len(shard.queue) >= self.batch):
                    self._submit(shard, [shard.queue.popleft() for _ in range(min(self.batch, len(shard.queue)))],
                                 budget)
            self._follow(done)
            while self._out:
                yield self._out.pop()
            self._check_cluster()
            flying = {ref: (shard, b) for shard in self._shards for ref, b in shard.flying.items()}
            if not flying:
                if exhausted and not self._out and not any(s.queue or s.suspects for s in self._shards):
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
        """Backpressure: pull more work only while some actor has room and no working actor's queue is long
        (one coming up or being restarted holds nobody back: its queue goes elsewhere if it leaves)."""
        return any(self._free(s) for s in self._shards) and \
            all(len(s.queue) < 4 * self.batch for s in self._shards if s.ping is None)

    def _route(self, task: SolveTask) -> _Shard:
        return self._shards[zlib.crc32(task.key.encode()) % len(self._shards)]

    # -- the pool follows the cluster ------------------------------------------------------------
    def _follow(self, done: set[str]) -> None:
        """Actors that have not come up for `RESTART_S` leave the pool; every `SCALE_S`, CPUs the cluster
        gained get new actors."""
        now = time.monotonic()
        for shard in list(self._shards):
            # never the last actor that answers: with none left, the work waits for the cluster (or LOST_S)
            if self._stuck(shard, now) and any(s.ping is None and not self._stuck(s, now) for s in self._shards
                                               if s is not shard):
                self._retire(shard, done, now - shard.heard)
        if now - self._sized < SCALE_S or (self.actors and len(self._shards) >= self.actors) or \
                any(s.ping is not None for s in self._shards):
            return                         # a fixed pool that is whole, or an actor still coming up: wait
        self._sized = now
        cluster = self._cluster()
        if cluster is None:
            return
        cpus, free, nodes = cluster
        add = min(self._fits(cpus) - len(self._shards), int(free / self.cpus_per_actor + 1e-9))
        if add <= 0:
            return
        self._shards += [self._new_actor() for _ in range(add)]
        self._reroute()
        self._named(nodes)
        log.info("solver pool grew to %s (%d new: the cluster has %g CPUs, %g free)",
                 _pool(len(self._shards), nodes), add, cpus, free)

    def _stuck(self, shard: _Shard, now: float) -> bool:
        """Not up for `RESTART_S`: made or restarted with no room for it, or silent with batches in flight."""
        return now - shard.heard > RESTART_S and bool(shard.flying or not self._alive(shard))

    def _retire(self, shard: _Shard, done: set[str], silent: float) -> None:
        """Take an actor that cannot come up out of the pool: its unsent tasks and its batches in flight go
        to the others (a batch in flight counts a death for each of its keys, as in `_retry`)."""
        why = (f"has not come up for {silent:.0f} s (no room for it on the cluster, or it does not start)"
               if shard.ping is not None
               else f"has not answered for {silent:.0f} s with {len(shard.flying)} batches in flight")
        try:
            ray.kill(shard.handle, no_restart=True)
        except ray.exceptions.RayError:
            pass                           # gone already
        self._shards.remove(shard)
        queue, suspects = [], []
        for b in shard.flying.values():
            (suspects if b.alone else queue).extend(self._died(b.tasks, shard, why, done))
        self._reroute(queue + list(shard.queue), suspects + list(shard.suspects))
        cluster = self._cluster()
        log.info("solver pool shrank to %s: solver actor %d (%s) %s; its %d unsent and %d in-flight keys go to "
                 "the others", _pool(len(self._shards), cluster[2] if cluster else "?"), shard.index,
                 _where(shard.where), why, len(shard.queue) + len(shard.suspects), len(queue) + len(suspects))

    def _reroute(self, queue: Iterable[SolveTask] = (), suspects: Iterable[SolveTask] = ()) -> None:
        """Route every unsent task by its key under the pool's size now (batches in flight stay where they
        are, so a key is never in two places)."""
        tasks = list(queue)
        for shard in self._shards:
            tasks.extend(shard.queue)
            shard.queue.clear()
        for task in tasks:
            self._route(task).queue.append(task)
        for task in suspects:
            self._route(task).suspects.append(task)

    def _cluster(self) -> tuple[float, float, int] | None:
        """(CPUs, free CPUs, alive nodes), or None if Ray's state calls have not answered within `PROBE_S`.
        They block for good on a GCS that is gone, so they run in a thread the driver stops waiting for
        (finding a lost cluster is `_check_cluster`'s)."""
        if self._reading is not None and self._reading.is_alive():
            return None
        answer: list[tuple[float, float, int]] = []

        def read() -> None:
            try:
                answer.append((ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0),
                               len([n for n in ray.nodes() if n.get("Alive")])))
            except (ray.exceptions.RayError, ConnectionError, RuntimeError) as err:
                log.debug("cannot read the cluster's resources: %s", _first_line(err))
        self._reading = threading.Thread(target=read, name="tv-ray-cluster", daemon=True)
        self._reading.start()
        self._reading.join(PROBE_S)
        return answer[0] if answer else None

    def _free(self, shard: _Shard) -> bool:
        return not shard.draining and self._alive(shard) and len(shard.flying) < self.in_flight

    def _alive(self, shard: _Shard) -> bool:
        """False while an actor is starting or, after it died, being restarted (nothing is sent to it until it
        answers)."""
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
        shard.ping, shard.heard = None, time.monotonic()
        return True

    def _down(self, shard: _Shard) -> None:
        """The actor died or was killed: nothing is sent to it until a `progress` call answers (Ray has
        restarted it); `RESTART_S` from now it leaves the pool if it has not."""
        self.restarts += 1
        shard.ping, shard.ping_after, shard.heard = shard.handle.progress.remote(), time.monotonic() + 0.5, \
            time.monotonic()

    def _submit(self, shard: _Shard, tasks: list[SolveTask], budget: Budget, alone: bool = False) -> None:
        if not shard.flying:
            shard.heard = time.monotonic()     # idle until now: its silence counts from here
        ref = shard.handle.run.remote(tasks, budget)
        shard.flying[ref] = _Batch(tasks, alone)

    def _collect(self, ref, shard: _Shard, b: _Batch, budget: Budget, done: set[str]):
        try:
            results, where = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            self._retry(shard, b, done, f"died ({_first_line(err)})")
            return
        except ray.exceptions.RaySystemError as err:
            raise EngineError(f"lost the Ray cluster while solving ({_first_line(err)})") from None
        shard.where, shard.heard = where, time.monotonic()
        for key, verdict in results:
            if key not in done:
                done.add(key)
                yield key, verdict

    def _retry(self, shard: _Shard, b: _Batch, done: set[str], why: str) -> None:
        """The actor died with this batch: Ray restarts it; its tasks go back to the front of its queue
        (sent once it answers again, or to the others if it leaves the pool)."""
        if shard.ping is None:
            self._down(shard)
        log.warning("solver actor %d (%s) %s with a batch of %d keys in flight; Ray restarts it and the batch "
                    "is sent again", shard.index, _where(shard.where), why,
                    len([t for t in b.tasks if t.key not in done]))
        again = self._died(b.tasks, shard, why, done)
        (shard.suspects if b.alone else shard.queue).extendleft(reversed(again))

    def _died(self, tasks: list[SolveTask], shard: _Shard, why: str, done: set[str]) -> list[SolveTask]:
        """The tasks of a batch whose actor died with it, less those done; a task whose batch saw
        `MAX_ATTEMPTS` deaths is unknown (its verdict goes out with the next ones)."""
        again = []
        for t in tasks:
            if t.key in done:
                continue
            self._deaths[t.key] = self._deaths.get(t.key, 0) + 1
            if self._deaths[t.key] >= MAX_ATTEMPTS:
                done.add(t.key)
                self._out.append((t.key, Verdict("unknown", 2, "engine", reason=f"solver actor {shard.index} {why}; "
                                                 f"{MAX_ATTEMPTS} deaths with this key in flight")))
            else:
                again.append(t)
        return again

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
                shard.heard = time.monotonic()
            except ray.exceptions.RayActorError:
                current = None                  # died: its batches fail and are retried by `_collect`
            shard.probe = None
            task = tasks.get(current[0]) if current else None
            if task is None or current[1] <= _task_limit(task, budget):
                continue
            log.warning("solver actor %d (%s) has run one task for %.0f s, past its limit: killed",
                        shard.index, _where(shard.where), current[1])
            ray.kill(shard.handle, no_restart=False)
            self._down(shard)
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
        for shard in self._shards:
            w = shard.where
            if not shard.draining and w and (w["rss_mb"] > self.recycle_mb or w["solved"] >= self.recycle_tasks):
                shard.draining = True
            if shard.draining and not shard.flying:
                log.info("solver actor %d (%s) recycled after %d tasks at %.0f MB", shard.index, _where(w),
                         w["solved"], w["rss_mb"])
                ray.kill(shard.handle, no_restart=False)
                shard.draining, shard.where = False, {}
                self._down(shard)


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


def _pool(actors: int, nodes: int | str) -> str:
    return f"{actors} actor{'s' if actors != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''}"


def _where(w: dict) -> str:
    return f"pid {w['pid']} on node {w['node']} at {w['ip']}" if w else "not started yet"


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


__all__ = ["RayExecutor", "SolverActor", "EngineError"]
