"""A CI subset of bench/verify_grid.py: correct plans across the recipe features are proved on Ray, with the
verdicts the in-process executor gives, and their certificates check (re-derived, re-proved by a different
method on a sample of keys)."""
import pytest

from tv_ray import api
from tv_ray.certificate import check_certificate
from tv_ray.engine.driver import _batches
from tv_ray.engine.executor import LocalExecutor, SolveTask
from tv_ray.engine.solve import Budget

CONFIGS = [   # (model, parallel, flags, optim, tied)
    ("llama3-tiny", "dp=2,tp=2", {"sp": True, "zero": 1}, "adamw", None),
    ("gpt2-tiny", "tp=2,pp=2,mb=2", {"zero": 0}, "sgd", False),
    ("llama3-tiny", "dp=2,pp=2,mb=2", {"zero": 3}, "sgd", None),
    ("llama3-tiny", "dp=2,tp=2", {"zero": 2}, "adamw", None),
    ("gpt2-tiny", "dp=2,tp=2,pp=2,mb=2", {"sp": True}, "adamw", None),     # dp mirrored, microbatches moved
    ("llama3-tiny", "mb=2", {"zero": 0}, "adamw", True),
]


@pytest.mark.parametrize("model,parallel,flags,optim,tied", CONFIGS,
                         ids=[f"{m}-{p}-{f}-{o}" for m, p, f, o, _ in CONFIGS])
def test_correct_plan_is_proved_and_its_certificate_checks(model, parallel, flags, optim, tied, tmp_path):
    graph = api.capture_step(model, optim=optim, clip=1.0, tied=tied)
    plan = api.parallelize(graph, parallel, model=model, **flags)
    result = api.verify(plan, jobs=2, progress=False)            # the default engine: Ray, two solver actors
    assert result.proved, (result.report["headline"], result.report.get("problems"), result.report.get("open"))
    assert result.counterexample is None and result.outcome.executor.startswith("ray(2 actors")
    tasks = [SolveTask.make(key, lhs, rhs) for key, (lhs, rhs) in result.outcome.partition.formulas.items()]
    here = dict(LocalExecutor().run(_batches(tasks, 64), Budget()))      # api.verify's default budget
    assert {k: (v.verdict, v.tier, v.method) for k, v in here.items()} == \
        {k: (v.verdict, v.tier, v.method) for k, v in result.outcome.verdicts.items()}
    result.save(tmp_path)
    report = check_certificate(tmp_path, sample=10)
    assert report.resolved == 10 and report.obligations == result.outcome.counts()["obligations"]
