"""Values made from positions under shape reduction (docs/reduction.md): a constant applied to RoPE's arange
changes nothing at the reduced dims' first positions, and must still be refuted, never proved."""
import pytest

from tests.engine.bugs import changed, correct
from tests.engine.mutants import _set_attrs
from tv_ray import api
from tv_ray.partition.derive import position_dims


@pytest.fixture(scope="module")
def plan():
    return correct("llama3-tiny", "dp=2")


def test_a_rope_constant_wrong_only_past_the_first_position_is_refuted(plan):
    """head_dim reduces to 2, so arange(0, head_dim, 2) holds only 0, and 0/8 = 0/8.001: proved before (found by
    the mutation fuzz). Its elements are variables now, and the run at full head_dim and seq confirms the fault."""
    div = plan.programs["main"].value("div")
    assert div.args == ("arange",) and div.attr["other"] == 8.0
    result = api.verify(changed(plan, _set_attrs(div, other=8.001)), engine="local", progress=False)
    assert result.status == "refuted", result.report
    stage = result.report["stage"]
    # the first claimed tensor after the divide (the RoPE frequencies), its counterexample a position's value
    assert (stage["tensor"], stage["phase"], stage["reads"]) == ("unsqueeze_1", "fwd", ["r0/arange"])
    assert list(stage["verdict"]["point"]) == ["arange(0,head_dim,2)[0]"]
    assert (stage["suspect"]["op"], stage["suspect"]["realises"]) == ("div", "div")     # the op changed, named
    assert result.report["headline"].endswith("first op inside the stage: main.div = div (realises div)")
    assert result.report["outputs_wrong_count"] > 0      # confirmed by the run at full head_dim
    assert api.verify(plan, engine="local", progress=False).status == "proved"


def test_the_confirming_run_restores_the_dims_that_bound_a_float_arange(plan):
    reduced = {**plan.dims, "head_dim": 2, "seq": 2, "vocab": 4}
    dims = position_dims(plan, reduced)
    assert dims == {**reduced, "head_dim": plan.dims["head_dim"], "seq": plan.dims["seq"]}
