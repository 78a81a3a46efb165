"""The 14 TrainVerify bug classes (A1–A14) as mutations of llama3-tiny dp=2,tp=2,pp=2,mb=2 (AdamW, clip 1.0).

Each mutant (tests/engine/mutants.py) is well-formed and numerically wrong.
`verify_plan` must refute it, and the report's first refuted stage must be
where the bug first shows: on the rank(s) running the change — that very
rank for a one-rank bug — at a tensor downstream of the change, in the
change's phase and layer (`Mutant.diagnosis_problems`). The exact stage is
pinned below, with the factor the report states where the mismatch is a
simple one. The unmodified plan must be proved (a false alarm is a bug of ours).
"""
import pytest

from tests.engine.mutants import MUTANTS, Mutant, a4_control, base_plan, node
from tv_ray.diagnose import diagnose
from tv_ray.engine.driver import verify_plan
from tv_ray.plan_check import check_plan
from tv_ray.simulate import simulate

# class -> (ranks, tensor, phase, what the report says about the mismatch or None); of an op refuted on several
# ranks, the lowest is reported
PINNED = {
    "A1": ((4,), "_unsafe_view_18@0~1", "fwd", "physical is one rank's partial sum over tp"),
    "A2": ((0,), "t_50~1", "bwd", "physical is one rank's partial sum over dp"),   # every dp rank; 0 first
    "A3": ((4,), "view_37@0~1", "bwd", None),
    "A4": ((0,), "embedding@0~1", "fwd", None),
    "A5": ((0,), "embedding_dense_backward~3", "bwd", None),
    "A6": ((4,), "mul_11@0<0", "fwd", None),
    "A7": ((5,), "mul_17@0", "fwd", "physical = 1.41421 × logical"),
    "A8": ((4,), "pow_6@0", "fwd", None),
    "A9": ((0,), "add_5@1", "fwd", "physical = logical + 0.00099"),
    "A10": ((0, 1), "mm_36@0", "bwd", None),
    "A11": ((0,), "mul_73@1", "bwd", "physical = 0.642093 × logical"),
    "A12": ((6,), "nll_loss_backward@0", "bwd", "physical = 2 × logical: a sum where a mean was meant"),
    "A13": ((4,), "nll_loss_backward@0", "bwd",     # every rank of stage 1; 4 first
            "physical = 2 × logical: a sum where a mean was meant"),
    "A14": ((0,), "t_54~2", "bwd", None),
}


@pytest.fixture(scope="module")
def plan():
    return base_plan()


def _describe(outcome) -> str:
    first = outcome.first_refuted()
    where = "" if first is None else (f"first refuted: ranks={first.ranks} {first.program}.{first.tensor} "
                                      f"= {first.claim.describe()} module={first.module!r} phase={first.phase}")
    return f"status {outcome.status} {outcome.counts()} problems {outcome.problems[:3]} {where}"


def test_base_plan_is_proved(plan):
    assert plan.interior, "the parallelizer states intermediate lineage"
    outcome = verify_plan(plan, progress=False)
    assert outcome.status == "proved", _describe(outcome)


def test_a4_starts_from_a_correct_all_gather_rewrite(plan):
    """A4 first rewrites the embedding forward to gather embed.weight; that rewrite alone is correct."""
    control = a4_control(plan)
    check_plan(control)
    assert not simulate(control, seed=0).deviating(1e-9)
    outcome = verify_plan(control, progress=False)
    assert outcome.status == "proved", _describe(outcome)


@pytest.mark.parametrize("cls", list(MUTANTS))
def test_mutant_is_refuted_where_the_bug_is(plan, cls):
    mutant: Mutant = MUTANTS[cls](plan)
    assert mutant.cls == cls
    check_plan(mutant.plan)                     # silent: the plan validates and runs ...
    outcome = verify_plan(mutant.plan, progress=False)
    report = f"{cls}: {mutant.description}\n{_describe(outcome)}"
    assert outcome.deviations, report           # ... with wrong outputs in the concrete runs
    assert outcome.status == "refuted", report
    first = outcome.first_refuted()
    assert not mutant.diagnosis_problems(first), f"{report}\n{mutant.diagnosis_problems(first)}"
    ranks, tensor, phase, factor = PINNED[cls]
    assert (first.ranks, first.tensor, first.phase) == (ranks, tensor, phase), report
    diagnosis = diagnose(outcome)
    assert diagnosis["status"] == "refuted" and diagnosis["outputs_wrong_count"] > 0
    assert f"{first.program}.{tensor} should equal {first.claim.describe()}" in diagnosis["headline"]
    stage = diagnosis["stage"]
    assert stage["ranks"] == list(ranks) and stage["max_abs_dev"] > 1e-6
    if factor is None:
        assert "factor" not in stage, stage.get("factor")
    else:
        assert stage["factor"].startswith(factor), stage["factor"]


def test_a_loss_divided_by_the_local_token_count_is_refuted_at_the_loss(plan):
    """The forward's loss divided by each dp rank's own token count (before the all-reduce): the loss comes out
    dp× too large. The mean loss is a contribution sum over the dp blocks, proved as "microbatch 0's part on
    dp block 0 equals block 0's losses over the whole batch's count", so the wrong divisor is caught there."""
    from tests.engine.mutants import _set_args, edit, node, with_program
    change = {}
    for mb in (0, 1):
        old = node(plan, "stage1", f"nll_loss_forward@{mb}")
        assert old.args[1] == "nll_loss_forward.total~2"       # the count all-reduced over dp
        change[old.name] = _set_args(old, old.args[0], "nll_loss_forward.total~1")
    mutant = with_program(plan, "stage1", edit(plan.programs["stage1"], "stage1", change=change))
    check_plan(mutant)
    outcome = verify_plan(mutant, progress=False)
    assert outcome.status == "refuted", _describe(outcome)
    first = outcome.first_refuted()
    assert (first.ranks, first.tensor, first.claim.logical) == ((4, 5, 6, 7), "nll_loss_forward~1",
                                                                "nll_loss_forward"), _describe(outcome)
    assert diagnose(outcome)["stage"]["factor"].startswith("physical = 2 × logical"), diagnose(outcome)["stage"]


def test_the_embedding_gradient_reduced_over_tp_instead_of_dp_is_refuted_where_it_is(plan):
    """The embedding gradient, partial over dp × tp, all-reduced over tp where dp was meant, then split over tp:
    each tp rank holds the tp pair's parts summed, so the split sums them twice and misses the other dp rank's.
    The all-reduce over part of a partial claim's group is kept as a sum of free parts, not built, and a group
    whose sums hold every part once is the slice identically (`SymbolicRun._sums_every_part`): a part held twice
    must not pass for that."""
    from tests.engine.mutants import reduced_over
    reduction = node(plan, "stage0", "embedding_dense_backward~2")
    assert reduction.attr["axes"] == ("dp",), reduction.attr
    outcome = verify_plan(reduced_over(plan, reduction, ["tp"], "stage0"), progress=False)
    assert outcome.status == "refuted", _describe(outcome)
    first = outcome.first_refuted()
    assert (first.ranks, first.tensor, first.phase) == ((0, 1), "embedding_dense_backward~2", "bwd"), \
        _describe(outcome)
