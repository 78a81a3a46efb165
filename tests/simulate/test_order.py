"""The communication order run without values (`check_order`): what a plan too large to run concretely is checked
by before any verdict. Each broken plan of the concrete simulator's tests (`BROKEN`) is refused with the same
message, and one slice of the mesh stands for the rest only along axes where every rank runs its neighbour's
program."""
import pytest

from plan.mlp_plans import dp_plan, pp_plan, tp_plan, zero_plan
from tests.simulate.test_simulate import BROKEN
from tv_ray.engine.driver import verify_plan
from tv_ray.errors import CommunicationError
from tv_ray.execute import OrderRun, check_order, symmetric_axes
from tv_ray.partition import derive
from tv_ray.plan import Plan


@pytest.mark.parametrize("build", [tp_plan, dp_plan, zero_plan, pp_plan,
                                   lambda: dp_plan("mean", overrides={"1": "dp_copy"})])
def test_correct_plans_complete(build):
    plan = Plan.from_json(build())
    run = OrderRun(plan, plan.dims)
    run.run()
    assert all(state.done for state in run.active)


def test_one_slice_stands_for_the_mesh_only_where_every_rank_runs_its_neighbours_program():
    assert symmetric_axes(Plan.from_json(dp_plan())) == ("dp",)
    assert symmetric_axes(Plan.from_json(pp_plan())) == ()                  # send/recv cross pp
    assert symmetric_axes(Plan.from_json(dp_plan(overrides={"1": "dp_bug"}))) == ()    # rank 1 runs its own
    plan = Plan.from_json(dp_plan())
    run = OrderRun(plan, plan.dims)
    assert [state.rank for state in run.active] == [0] and run.virtual == {1}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_communication_is_named_as_the_concrete_run_names_it(case):
    build, message = BROKEN[case]
    plan = Plan.from_json(build())
    with pytest.raises(CommunicationError) as info:
        check_order(plan, plan.dims)
    assert str(info.value) == message


def test_a_plan_not_run_concretely_that_deadlocks_is_refused_not_proved(monkeypatch):
    monkeypatch.setattr(derive, "CONCRETE_LIMIT", 0)
    plan = Plan.from_json(pp_plan(recv_first=True))
    with pytest.raises(CommunicationError, match="^deadlock: rank 0"):
        derive.derive(plan)                                     # what `tv-ray check` re-derives with
    outcome = verify_plan(plan, progress=False)
    assert outcome.status == "refuted" and outcome.failure.startswith("deadlock: rank 0 (pp=0)")
    assert not outcome.runs                                     # no concrete run: the order alone refused it
    assert verify_plan(Plan.from_json(pp_plan()), progress=False).status == "proved"
