"""A CI subset of bench/verify_grid.py: correct plans across the recipe features are proved on Ray with the
certificate the local executor gives (timings aside), and their certificates check (re-derived, re-proved by a
different method on a sample of keys)."""
import sys
from pathlib import Path

import pytest

from tv_ray import api
from tv_ray.certificate import check_certificate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from certificates import GRID_IDS, GRID_SUBSET, content  # noqa: E402


@pytest.mark.parametrize("i", range(len(GRID_SUBSET)), ids=GRID_IDS)
def test_correct_plan_is_proved_on_ray_with_the_local_certificate_and_it_checks(i, grid_local, tmp_path):
    plan, local = grid_local(i)
    result = api.verify(plan, jobs=2, progress=False, shards=GRID_SUBSET[i][-1])   # the default engine: Ray
    assert result.proved, (result.report["headline"], result.report.get("problems"), result.report.get("open"))
    assert result.counterexample is None and result.outcome.executor.startswith("ray(2 actors")
    result.save(tmp_path)
    assert content(tmp_path) == content(local)
    report = check_certificate(tmp_path, sample=10)
    assert report.resolved == 10 and report.obligations == result.outcome.counts()["obligations"]
