"""The Ray engine: the same verdicts and certificate as the local executor, and faults that lose nothing."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tv_ray import api
from tv_ray.engine import ray_executor
from tv_ray.engine.driver import _batches, verify_plan
from tv_ray.engine.executor import LocalExecutor, SolveTask
from tv_ray.engine.ray_executor import RayExecutor
from tv_ray.engine.solve import Budget

ray = pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults  # noqa: E402
from faults import BUDGET  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield


@pytest.fixture(scope="module")
def plan():
    return api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2,pp=2,mb=2",
                           model="llama3-tiny")


@pytest.fixture(scope="module")
def reference(plan):
    """The plan verified in this process: the verdicts every Ray run must give."""
    return verify_plan(plan, budget=BUDGET, executor=LocalExecutor(), progress=False)


def _verdicts(verdicts) -> dict:
    return {k: (v.verdict, v.tier, v.method) for k, v in verdicts.items()}


def test_a_solver_actor_killed_mid_batch_is_restarted_and_nothing_is_lost_or_counted_twice(local_ray, plan,
                                                                                           reference, tmp_path):
    executor = RayExecutor(actors=2, batch=16, solve=faults.dies_once(str(tmp_path / "died")))
    outcome = verify_plan(plan, budget=BUDGET, executor=executor, progress=False)
    executor.close()
    assert (tmp_path / "died").exists() and executor.restarts >= 1
    assert outcome.status == "proved" and _verdicts(outcome.verdicts) == _verdicts(reference.verdicts)
    assert outcome.counts() == reference.counts()


def test_a_solver_that_hangs_is_killed_and_its_key_is_unknown_never_proved(local_ray, plan, reference, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(ray_executor, "GRACE_S", 1.0)
    small = sorted(k for k, (lhs, _) in reference.partition.formulas.items() if len(lhs) == 1)
    stuck = small[len(small) // 2]                       # one equation: its limit is 0.2 + 1 + 1 s
    log = tmp_path / "calls"
    budget = Budget(solvers=("z3",), timeout_s=0.2)
    executor = RayExecutor(actors=1, batch=32, solve=faults.hangs_on(stuck, str(log)))
    outcome = verify_plan(plan, budget=budget, executor=executor, progress=False)
    executor.close()
    verdict = outcome.verdicts[stuck]
    assert outcome.status == "unknown" and verdict.verdict == "unknown" and verdict.method == "engine"
    assert verdict.reason.startswith("solver killed after ") and "did not stop at its 0.2 s timeout" in verdict.reason
    assert {k for k, v in outcome.verdicts.items() if not v.proved} == {stuck}
    assert len({line.split()[0] for line in log.read_text().splitlines()}) >= 3   # killed twice: three processes


def test_solver_actors_are_recycled_after_their_task_limit(local_ray, reference, tmp_path):
    log = tmp_path / "calls"
    tasks = [SolveTask.make(key, lhs, rhs) for key, (lhs, rhs) in reference.partition.formulas.items()]
    executor = RayExecutor(actors=1, batch=16, recycle_tasks=32, solve=faults.logs_pids(str(log)))
    verdicts = dict(executor.run(_batches(tasks, 64), BUDGET))
    executor.close()
    pids = [line.split()[0] for line in log.read_text().splitlines()]
    assert _verdicts(verdicts) == _verdicts(reference.verdicts) and executor.restarts >= 2 and len(set(pids)) >= 3
    assert sum(int(line.split()[1]) for line in log.read_text().splitlines()) == len(tasks)


