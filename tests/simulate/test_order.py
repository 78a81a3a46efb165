"""The communication order run without values (`check_order`): what a plan too large to run concretely is checked
by before any verdict. Each broken plan of the concrete simulator's tests (`BROKEN`) is refused with the same
message, and one slice of the mesh stands for the rest only along axes where every rank runs its neighbour's
program."""
import pytest

from plan.mlp_plans import dp_plan, pp_plan, tp_plan, zero_plan
from tests.engine.mutants import base_plan, with_program
from tests.simulate.test_simulate import BROKEN
from tv_ray.engine.driver import verify_plan
from tv_ray.errors import CommunicationError
from tv_ray.execute import OrderRun, check_order, symmetric_axes
from tv_ray.ir import Graph, Op
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


def test_one_slice_finds_the_deadlock_every_rank_has():
    """llama3-tiny dp=2,tp=2,pp=2,mb=2 with stage 0 sending its first activation only after the first gradient
    came back: dp and tp are symmetric, so ranks 0 and 4 alone are stepped, and they deadlock as all eight do."""
    plan = base_plan()
    program = plan.programs["stage0"]
    nodes = list(program.nodes)
    send = next(i for i, n in enumerate(nodes) if n.op == Op.SEND)
    recv = next(i for i, n in enumerate(nodes) if n.op == Op.RECV and i > send)
    nodes.insert(recv, nodes.pop(send))
    broken = with_program(plan, "stage0", Graph(program.inputs, tuple(nodes), program.outputs, program.name))
    sliced, whole = OrderRun(broken, broken.dims), OrderRun(broken, broken.dims, sliced=False)
    assert sliced.symmetric == ("dp", "tp") and [s.rank for s in sliced.active] == [0, 4]
    messages = []
    for run in (sliced, whole):
        with pytest.raises(CommunicationError) as info:
            run.run()
        messages.append(str(info.value))
    assert messages[0].startswith("deadlock: rank 0 (pp=0, dp=0, tp=0) waits at programs.stage0.ops[")
    assert messages[0].count(" waits at ") == 2 and messages[1].count(" waits at ") == 8
    assert all(state.pc == whole.ranks[state.rank].pc for state in sliced.active)   # stuck at the same ops
    check_order(plan, plan.dims)                                                    # the plan as built completes


def test_a_plan_not_run_concretely_that_deadlocks_is_refused_not_proved(monkeypatch):
    monkeypatch.setattr(derive, "CONCRETE_LIMIT", 0)
    plan = Plan.from_json(pp_plan(recv_first=True))
    with pytest.raises(CommunicationError, match="^deadlock: rank 0"):
        derive.derive(plan)                                     # what `tv-ray check` re-derives with
    outcome = verify_plan(plan, progress=False)
    assert outcome.status == "refuted" and outcome.failure.startswith("deadlock: rank 0 (pp=0)")
    assert not outcome.runs                                     # no concrete run: the order alone refused it
    assert verify_plan(Plan.from_json(pp_plan()), progress=False).status == "proved"
