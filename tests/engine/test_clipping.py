"""Faults on the gradient-clipping path: at the concrete runs' small inputs the gradient norm stays under
max_norm and the clip coefficient is 1, so nothing before it shows at the outputs; one more run, at inputs where
the coefficient is below 1 (`clamping_point`), confirms them (found by the mutation fuzz: an eps change was
left unknown, a twice-reduced squared sum was refuted only after four rounds of dropped claims)."""
import numpy as np
import pytest

from tests.engine.bugs import changed, correct, inserted_after
from tests.engine.mutants import _like, _set_attrs
from tv_ray import api
from tv_ray.partition.claims import INPUT_SCALE, clamping_point, run_concrete
from tv_ray.reduce import reduce_plan


@pytest.fixture(scope="module")
def plan():
    return correct("llama3-tiny", "dp=2,tp=2,mb=2", "adamw", 1.0, sp=True, zero=1)


def _verify(plan):
    return api.verify(plan, engine="local", progress=False, timeout=3.0)


def test_the_clipping_run_is_one_where_the_coefficient_is_below_one(plan):
    dims = reduce_plan(plan).reduced
    default = run_concrete(plan, dims, 7)[0].logical
    assert default["optim.clip_coef"] == 1.0      # the default inputs: never clipped
    scale, logical = clamping_point(plan, dims, 7, default)
    assert scale > INPUT_SCALE and logical["optim.clip_coef"] < 1.0
    clipped = run_concrete(plan, dims, logical=logical)[0]      # the ranks run on the point the probe found
    # the same coefficient up to the order of the sums (dp and tp add the squared norms in their own order: on
    # some CPUs the last bit differs); a run at another point gives another one altogether
    assert clipped.logical is logical
    assert np.isclose(clipped.ranks[0]["optim.clip_coef"], logical["optim.clip_coef"], rtol=1e-12, atol=0)
    unclipped = correct("llama3-tiny", "dp=2,tp=2,mb=2", "adamw", None, sp=True, zero=1)
    dims = reduce_plan(unclipped).reduced
    assert clamping_point(unclipped, dims, 7, run_concrete(unclipped, dims, 7)[0].logical) is None  # no clamp


def test_a_wrong_clipping_eps_is_refuted_at_the_changed_add(plan):
    """grad-norm eps 1e-6 → 5e-7: the coefficient moves by 5e-7 relative where clipping is active."""
    eps = plan.programs["main"].value("optim.grad_norm_eps")
    assert eps.attr["other"] == 1e-6
    result = _verify(changed(plan, _set_attrs(eps, other=5e-7), program="main"))
    assert result.status == "refuted", result.report["headline"]
    assert result.report["stage"]["tensor"] == "optim.grad_norm_eps"
    assert "physical = logical + -5e-07" in result.report["headline"]


def test_a_squared_sum_reduced_twice_is_reported_in_the_first_round(plan):
    """The outputs deviate in the clipping run, so the stated claims stay: the first accumulation reading the
    doubled sum is where it shows, and no claim is dropped on the way."""
    summed = plan.programs["main"].value("optim.lm_head.weight.grad_sq_sum~1")
    again = _like(summed, f"{summed.name}.again", "all_reduce", [summed.name], dict(summed.attrs))
    result = _verify(inserted_after(plan, summed, again, "main"))
    assert result.status == "refuted", result.report["headline"]
    assert result.report["stage"]["tensor"] == "optim.lm_head.weight.norm_sq_acc"
    assert "the reduction over tp is one too many" in result.report["headline"]
    assert result.outcome.dropped == []
    assert result.report["outputs_wrong_count"] > 0
