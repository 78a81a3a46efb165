"""A stage whose formula is too large to form ends unknown within seconds, naming the stage, its ranks and why —
never a run that does not end, never a proof."""
import re
import time

from tv_ray.certificate.outcome import Status
from tv_ray.diagnose import diagnose
from tv_ray.engine.driver import verify_plan
from tv_ray.engine.executor import LocalExecutor
from tv_ray.engine.solve import Budget
from tv_ray.partition import stages


def test_a_stage_past_the_size_limit_is_unknown_with_its_reason(tiny_dp2_plan, monkeypatch):
    monkeypatch.setattr(stages, "MAX_STAGE_NODES", 100)
    started = time.perf_counter()
    outcome = verify_plan(tiny_dp2_plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(), progress=False)
    assert time.perf_counter() - started < 120
    assert outcome.status is Status.UNKNOWN
    unformed = [o for o in outcome.partition.obligations if o.key in outcome.partition.unformed]
    assert unformed and all(outcome.verdict_of(o).method == "unformed" for o in unformed)
    report = diagnose(outcome)
    assert report["headline"].startswith(f"not proved: {len(unformed)} stage(s) open")
    first = report["open"][0]
    assert re.fullmatch(rf"stage {re.escape(first['stage'])} on rank \d+ \(.*\): its formula has [\d,]+ nodes \(more "
                        r"than 100\): the ops since the last cut are too many to prove at once — no claim cuts them "
                        r"\(a value no lineage can state, such as a scaled partial sum, runs through\)", first["reason"])
