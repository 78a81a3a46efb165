"""A 3-node local Ray cluster (`ray.cluster_utils.Cluster`): the certificates the local executor gives on the
llama3-tiny plans of the CI grid subset, and a worker node removed mid-run loses no work; the solver pool follows
the cluster (a node added mid-run gets actors and work, one removed with no room left for its actors shrinks the
pool, no key lost or taken twice); a driver whose cluster dies stops with a resumable checkpoint."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tv_ray import api
from tv_ray.engine.driver import _batches
from tv_ray.partition.derive import derive
from tv_ray.engine import ray_executor
from tv_ray.engine.executor import LocalExecutor, SolveTask, solve_batch
from tv_ray.engine.ray_executor import RayExecutor

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults  # noqa: E402
from certificates import GRID_IDS, GRID_SUBSET, content  # noqa: E402
from faults import BUDGET  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()                   # another test's local Ray: this module needs its own cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def plan():
    return api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2,pp=2,mb=2",
                           model="llama3-tiny")


@pytest.fixture(scope="module")
def keyed(plan):
    """The plan's unique keys as solver tasks, and their verdicts solved in this process."""
    part = derive(plan).partition
    tasks = [SolveTask.make(key, lhs, rhs) for key, (lhs, rhs) in part.formulas.items()]
    return tasks, dict(LocalExecutor().run(_batches(tasks, 64), BUDGET))


def _workers(head, n: int) -> None:
    """The cluster made the head (1 CPU) and `n` worker nodes of 2 CPUs, whatever the tests before left."""
    while len(head.worker_nodes) > n:
        head.remove_node(next(iter(head.worker_nodes)))
    while len(head.worker_nodes) < n:
        head.add_node(num_cpus=2)
    head.wait_for_nodes()


def _where_solved(log: str, seconds: float):
    """Solves normally, each task `seconds` late; logs the node that solved each key."""
    def solve(tasks, budget):
        time.sleep(seconds * len(tasks))
        out = solve_batch(tasks, budget)
        node = ray.get_runtime_context().get_node_id()
        with open(log, "a") as f:
            f.write("".join(f"{node} {t.key}\n" for t in tasks))
        return out
    return solve


def _pool_changes(caplog, verb: str, since: float = 0.0) -> list[str]:
    """The pool's INFO messages that it grew (or shrank), logged after `since` (time.time())."""
    return [r.getMessage() for r in caplog.records if r.name == "tv_ray.engine" and r.levelno == logging.INFO
            and r.created > since and r.getMessage().startswith(f"solver pool {verb} to ")]


# the llama3-tiny plans of the CI grid subset with microbatches: one generated in pipeline shards (Ray tasks here),
# one with microbatch copies (every grid plan is proved on a one-node Ray in test_grid_subset.py)
SPREAD = [i for i, config in enumerate(GRID_SUBSET) if config[0] == "llama3-tiny" and "mb=" in config[1]]


@pytest.mark.parametrize("i", SPREAD, ids=[GRID_IDS[i] for i in SPREAD])
def test_a_three_node_cluster_gives_the_certificate_of_the_local_executor(i, cluster, grid_local, tmp_path):
    """The plan's certificate from solver actors spread over three nodes equals the local executor's."""
    plan, local = grid_local(i)
    on_cluster = api.verify(plan, executor=RayExecutor(actors=4, cpus_per_actor=1), progress=False,
                            shards=GRID_SUBSET[i][-1])
    assert on_cluster.proved and on_cluster.outcome.executor == "ray(4 actors on 3 nodes)"
    on_cluster.save(tmp_path)
    assert content(tmp_path) == content(local)


def test_a_worker_node_removed_mid_run_loses_no_work(cluster, keyed, tmp_path):
    head, workers = cluster
    tasks, expected = keyed
    executor = RayExecutor(actors=6, batch=8, cpus_per_actor=0.5, solve=faults.logs_pids(str(tmp_path / "calls")))
    seen: list[str] = []
    for key, verdict in executor.run(_batches(tasks, 64), BUDGET):
        seen.append(key)
        assert verdict.verdict == expected[key].verdict and verdict.method == expected[key].method
        if len(seen) == 24:                   # remove a worker node that holds an actor: it dies with it,
            busy = {ray.get(s.handle.where.remote())["node"] for s in executor._shards}   # Ray restarts it
            removed = next(w for w in workers if w.node_id[:12] in busy)
            head.remove_node(removed)
    executor.close()
    assert sorted(seen) == sorted(expected) and len(seen) > 48 and executor.restarts >= 1


def test_a_node_added_mid_run_gets_new_solver_actors_and_work(cluster, keyed, tmp_path, monkeypatch, caplog):
    """One worker node: the head's CPU and the worker's two make two actors (one CPU stays with the driver),
    solving slowed to 0.15 s a key (~15 s on two actors). A second worker node added at the first verdict: within
    `SCALE_S` (1 s here) the pool grows to four, and the keys not sent yet are routed over the four."""
    head, _ = cluster
    _workers(head, 1)
    monkeypatch.setattr(ray_executor, "SCALE_S", 1.0)
    caplog.set_level(logging.INFO, logger="tv_ray.engine")
    tasks, expected = keyed
    log = tmp_path / "solved"
    executor = RayExecutor(batch=8, solve=_where_solved(str(log), 0.15))
    seen, added = [], None
    for key, verdict in executor.run(_batches(tasks, 64), BUDGET):
        seen.append(key)
        assert verdict.verdict == expected[key].verdict and verdict.method == expected[key].method
        if added is None:
            assert len(executor._shards) == 2
            added = head.add_node(num_cpus=2)
    executor.close()
    assert sorted(seen) == sorted(expected)                 # every key, each verdict taken once
    solved = [line.split() for line in log.read_text().splitlines()]
    on_added = {key for node, key in solved if node == added.node_id}
    assert on_added, Counter(node[:12] for node, _ in solved)
    print(f"{len(on_added)} keys solved on the node added")
    assert _pool_changes(caplog, "grew") == [_pool_changes(caplog, "grew")[0]]
    assert _pool_changes(caplog, "grew")[0].startswith("solver pool grew to 4 actors on 3 nodes (2 new: ")
    assert executor.name == "ray(4 actors on 3 nodes)" and executor.restarts == 0


def test_a_node_removed_with_no_room_for_its_actors_shrinks_the_pool_and_loses_no_key(cluster, keyed, tmp_path,
                                                                                    monkeypatch, caplog):
    """Two worker nodes: four actors (head 1 CPU + 2 + 2, one for the driver), each worker holding one or two
    of them. A worker removed once every actor has answered leaves three CPUs: Ray restarts all but one of its
    actors elsewhere, and that one leaves the pool after `RESTART_S` (15 s here: an actor takes 5-10 s to start
    on this machine) — its unsent keys and any batch in flight go to the others. The run cannot end before:
    a quarter of the keys are routed to it."""
    head, _ = cluster
    _workers(head, 2)
    monkeypatch.setattr(ray_executor, "RESTART_S", 15.0)
    caplog.set_level(logging.INFO, logger="tv_ray.engine")
    tasks, expected = keyed
    executor = RayExecutor(batch=8, solve=_where_solved(str(tmp_path / "solved"), 0.15))
    seen, removed = [], None
    for key, verdict in executor.run(_batches(tasks, 64), BUDGET):
        seen.append(key)
        assert verdict.verdict == expected[key].verdict and verdict.method == expected[key].method
        if removed is None and len(executor._shards) == 4 and all(s.where for s in executor._shards):
            removed, since = next(iter(head.worker_nodes)), time.time()        # every actor has answered
            head.remove_node(removed)
    pool = len(executor._shards)
    executor.close()
    assert removed is not None and sorted(seen) == sorted(expected)        # no key lost, none taken twice
    shrank = _pool_changes(caplog, "shrank", since)
    assert shrank and all(re.fullmatch(r"solver pool shrank to [123] actors? on [23] nodes: solver actor \d+ \(.*\) "
                                       r"has not come up for \d+ s \(.*\); its \d+ unsent and \d+ in-flight keys "
                                       r"go to the others", m) for m in shrank), shrank
    assert pool <= 3 and executor.restarts >= 1 and executor.name == "ray(4 actors on 3 nodes)"


def test_losing_the_cluster_ends_with_a_clear_error_and_a_resumable_checkpoint(ray_head, tmp_path):
    """The driver runs as its own process against a `ray start --head` cluster that is then killed whole, its
    solving slowed (30 ms a key, ~6 s in all) so that the cluster dies with work left."""
    out = tmp_path / "out"
    bin_ = Path(sys.executable).parent
    run = subprocess.Popen([sys.executable, faults.__file__, "0.03", "verify", "--model", "llama3-tiny",
                            "--parallel", "dp=2,tp=2", "-o", str(out), "--address", ray_head.address,
                            "--solvers", "z3", "--jobs", "1", "-q"],
                           env=ray_head.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list((out / "checkpoint").glob("part-*.parquet")) and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    assert run.poll() is None, run.stderr.read()[-2000:]
    ray_head.kill(spare=(run.pid,))
    _, err = run.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("tv-ray verify: ")]
    assert run.returncode == 2 and len(lines) == 2, err[-3000:]
    assert re.fullmatch(r"tv-ray verify: lost the Ray cluster: its GCS at [\d.]+:\d+ has refused connections for "
                        r"\d+ s \(Connection refused\)", lines[0]), lines[0]
    assert lines[1] == (f"tv-ray verify: the verdicts so far are in {out}/checkpoint; continue with "
                        f"`tv-ray verify --resume {out}`")
    done = subprocess.run([str(bin_ / "tv-ray"), "verify", "--resume", str(out), "--engine", "local"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    unique = int(re.search(r"PROVED — all \d+ obligations \((\d+) unique\)", done.stdout)[1])
    resumed = int(re.search(r"resumed: (\d+) unique keys' verdicts", done.stdout)[1])
    assert 0 < resumed < unique, done.stdout
