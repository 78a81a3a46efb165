"""A stage whose formula is too large to form ends unknown within seconds, naming the stage, its ranks and why —
never a run that does not end, never a proof."""
import functools
import re
import time

from tv_ray import api
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


def test_a_stage_summing_every_part_of_a_partial_claim_is_formed_past_the_limit(step, monkeypatch):
    """dp=8,tp=2: the embedding gradient is a (dp, tp) partial; the stage after its dp all-reduce sums all 16
    parts of every element. Built, it has 609 nodes (every other stage at most 334): past the limit its like terms
    are collected — the last part is the gradient minus the others, so the sum is the gradient's own atoms. The
    dp all-reduce's sums of parts are not built, though (`FreeSum`): the stage is those atoms against
    themselves, formed with nothing to collect."""
    plan = api.parallelize(step, "dp=8,tp=2,pp=2,mb=1", model="llama3-tiny")
    monkeypatch.setattr(stages, "MAX_STAGE_NODES", 400)
    run = functools.partial(verify_plan, plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(),
                            progress=False)
    kept = stages.SymbolicRun._summed_subgroup
    monkeypatch.setattr(stages.SymbolicRun, "_summed_subgroup", lambda self, node, members, values: None)
    assert run().status is Status.PROVED
    monkeypatch.setattr(stages, "collect", lambda term, memo: term)
    outcome = run()
    assert outcome.status is Status.UNKNOWN
    unformed = {o.id for o in outcome.partition.obligations if o.key in outcome.partition.unformed}
    assert {str(s) for s in unformed} == {"g0,1/embedding_dense_backward~1"}
    monkeypatch.setattr(stages.SymbolicRun, "_summed_subgroup", kept)
    assert run().status is Status.PROVED


def test_a_large_stage_has_its_like_terms_collected_and_is_proved_by_reflexivity(step, monkeypatch):
    """The loss summed over dp x tp adds every sample's term in another association than the logical mean: past
    `COLLECT_NODES` both sides collect to the very same term (at 405B scale a 229,383-node equation z3 took 7 s on
    and yices 19 s, now none)."""
    plan = api.parallelize(step, "dp=2,tp=2", model="llama3-tiny")
    run = functools.partial(verify_plan, plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(),
                            progress=False)

    def loss_method(outcome) -> str:
        loss = [o for o in outcome.partition.obligations if str(o.id) == "g0,1,2,3/nll_loss_forward"]
        assert len(loss) == 1
        return outcome.verdict_of(loss[0]).method

    plain = run()
    monkeypatch.setattr(stages, "COLLECT_NODES", 30)
    collected = run()
    assert plain.status is collected.status is Status.PROVED
    assert (loss_method(plain), loss_method(collected)) == ("normalised", "identical")
