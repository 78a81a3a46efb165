"""A 3-node local Ray cluster (`ray.cluster_utils.Cluster`): the certificates the local executor gives on the
llama3-tiny plans of the CI grid subset, and a worker node removed mid-run loses no work; a driver whose cluster
dies stops with a resumable checkpoint."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tv_ray import api
from tv_ray.engine.driver import _batches
from tv_ray.partition.derive import derive
from tv_ray.engine.executor import LocalExecutor, SolveTask
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


LLAMA = [i for i, config in enumerate(GRID_SUBSET) if config[0] == "llama3-tiny"]


@pytest.mark.parametrize("i", LLAMA, ids=[GRID_IDS[i] for i in LLAMA])
def test_a_three_node_cluster_gives_the_certificate_of_the_local_executor(i, cluster, grid_local, tmp_path):
    """The llama3-tiny plans of the CI grid subset (one generated in pipeline shards, by Ray tasks here)."""
    plan, local = grid_local(i)
    on_cluster = api.verify(plan, executor=RayExecutor(actors=4, cpus_per_actor=1), progress=False,
                            shards=GRID_SUBSET[i][-1])
    assert on_cluster.proved and on_cluster.outcome.executor == "ray(4 actors on 3 nodes)"
    on_cluster.save(tmp_path)
    assert content(tmp_path) == content(local)


def test_a_worker_node_removed_mid_run_loses_no_work(cluster, plan, tmp_path):
    head, workers = cluster
    part = derive(plan).partition
    tasks = [SolveTask.make(key, lhs, rhs) for key, (lhs, rhs) in part.formulas.items()]
    expected = dict(LocalExecutor().run(_batches(tasks, 64), BUDGET))
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
