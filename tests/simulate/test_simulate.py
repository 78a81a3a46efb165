"""The concrete simulator: correct plans agree with the logical step; planted bugs are named."""
import pytest

from plan.mlp_plans import dp_plan, mutated, pp_plan, tp_plan, zero_plan
from tv_ray.errors import PlanError, SimulationError
from tv_ray.plan import Plan
from tv_ray.simulate import simulate

TOL = 1e-9
W1_OUTPUTS = ["grad/w1", "new/exp_avg/w1", "new/w1"]


def run(obj, **kwargs):
    return simulate(Plan.from_json(obj), **kwargs)


@pytest.mark.parametrize("build", [tp_plan, dp_plan, lambda: dp_plan("mean"), zero_plan, pp_plan,
                                   lambda: dp_plan("mean", overrides={"1": "dp_copy"})],
                         ids=["tp", "dp_sum_partial_loss", "dp_mean", "zero_reduce_scatter", "pp_2mb", "override"])
def test_correct_plans_agree(build):
    result = run(build())
    assert result.deviating(TOL) == []
    devs = result.max_abs_dev()
    assert set(devs) == {"loss", "grad", "param", "state"}
    assert all(dev is not None and dev <= TOL for dev in devs.values())
    assert set(result.deviation) == {"loss", "grad/w1", "grad/w2", "new/w1", "new/w2", "new/exp_avg/w1"}


def test_deterministic_for_a_seed():
    plan = Plan.from_json(tp_plan(all_reduce=False))
    assert simulate(plan, seed=3).deviation == simulate(plan, seed=3).deviation
    assert simulate(plan, seed=3).deviation != simulate(plan, seed=4).deviation


def test_other_dims():
    plan = Plan.from_json(zero_plan())
    assert simulate(plan, dims={"batch": 2, "d": 2, "ffn": 4}).dims == {"batch": 2, "d": 2, "ffn": 4}
    assert simulate(plan, dims={"batch": 2, "d": 2, "ffn": 4}).ok(TOL)
    assert simulate(plan, dims={"batch": 8, "d": 8, "ffn": 16}).ok(TOL)
    with pytest.raises(PlanError, match=r"^programs.zero.inputs\[0\].shape\[0\]: shape expression batch/2 is not an "
                                        r"integer at \{'batch': 3, 'd': 4, 'ffn': 8\}: 3/2$"):
        simulate(plan, dims={"batch": 3})
    with pytest.raises(PlanError, match=r"^dims.seq: not a dimension of the plan \(batch, d, ffn\)$"):
        simulate(plan, dims={"seq": 2})


def test_dropped_all_reduce():
    result = run(tp_plan(all_reduce=False))
    assert result.deviating(TOL) == ["grad/w1", "grad/w2", "loss", "new/exp_avg/w1", "new/w1", "new/w2"]
    assert result.max_abs_dev()["loss"] > 1e-3


def test_divisor_changed_on_one_rank():
    result = run(dp_plan("mean", overrides={"1": "dp_bug"}))
    assert result.deviating(TOL) == ["grad/w1", "grad/w2", "new/exp_avg/w1", "new/w1", "new/w2"]
    assert result.max_abs_dev()["loss"] <= TOL


def test_reduce_scatter_over_the_wrong_axis():
    result = run(zero_plan(rs_axes=("tp",)))
    assert result.deviating(TOL) == W1_OUTPUTS


def test_pipeline_microbatches_received_in_the_wrong_order():
    result = run(pp_plan(swap_tags=True))
    assert result.deviating(TOL) == W1_OUTPUTS      # loss and grad/w2 are symmetric in the microbatches


def _wrong_tag() -> dict:
    obj = pp_plan()
    obj["programs"]["stage0"]["ops"][2]["attrs"]["tag"] = 7
    return obj


def _mismatched_collectives() -> dict:
    obj = tp_plan()
    obj["programs"]["tp_avg"] = mutated(obj["programs"]["tp"])
    obj["programs"]["tp_avg"]["ops"][3]["attrs"]["reduce"] = "avg"
    obj["ranks"] = {"program": "tp", "overrides": {"1": "tp_avg"}}
    return obj


def _sends_the_input() -> dict:
    obj = pp_plan()
    obj["programs"]["stage0"]["ops"][2]["args"] = ["x.mb0"]     # sends the input, not the activation
    return obj


BROKEN = {   # a plan whose communication cannot complete -> the message naming why
    "pipeline_deadlock": (lambda: pp_plan(recv_first=True),
        "deadlock: rank 0 (pp=0) waits at programs.stage0.ops[0] (da.mb0 = recv from rank 1 (pp=1), tag 0); "
        "rank 1 (pp=1) waits at programs.stage1.ops[0] (a.mb0 = recv from rank 0 (pp=0), tag 0)"),
    "send_to_the_wrong_tag": (_wrong_tag,
        "deadlock: rank 0 (pp=0) waits at programs.stage0.ops[6] (da.mb0 = recv from rank 1 (pp=1), tag 0); "
        "rank 1 (pp=1) waits at programs.stage1.ops[0] (a.mb0 = recv from rank 0 (pp=0), tag 0); "
        "sent but never received: rank 0→1 tag 1 ×1, rank 0→1 tag 7 ×1"),
    "mismatched_collectives": (_mismatched_collectives,
        "mismatched collectives on the tp group [0, 1] (collective #1 there): rank 0 (tp=0) runs "
        "programs.tp.ops[3] all_reduce {\"axes\":[\"tp\"],\"reduce\":\"sum\"}, rank 1 (tp=1) runs "
        "programs.tp_avg.ops[3] all_reduce {\"axes\":[\"tp\"],\"reduce\":\"avg\"}"),
    "recv_of_the_wrong_shape": (_sends_the_input,
        "rank 1 (pp=1) at programs.stage1.ops[0] (a.mb0 = recv()) expects float (2, 8) but "
        "programs.stage0.ops[2] sent float (2, 4)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_communication_is_named(case):
    build, message = BROKEN[case]
    with pytest.raises(SimulationError) as info:
        run(build())
    assert str(info.value) == message
