"""Shape reduction (tv_ray.reduce): real plans reduce, keep their side conditions, and still simulate."""
from __future__ import annotations

import dataclasses
import json

import pytest

import tv_ray
import tv_ray.models as models
from tv_ray.errors import ShapeError
from tv_ray.ir.dims import Expr
from tv_ray.semantics import check_graph
from tv_ray.plan import Fixed
from tv_ray.reduce import Atom, SideCondition, _view_blocks, collect, reduce_plan, solve, value_of
from tv_ray.semantics.table import Context

SPEC = "dp=2,tp=2,pp=2,mb=2"


@pytest.fixture(scope="module")
def llama_graph():
    return tv_ray.capture_step("llama3-tiny", optim="adamw", clip=1.0)


@pytest.fixture(scope="module")
def llama_plan(llama_graph):
    return tv_ray.parallelize(llama_graph, SPEC, model="llama3-tiny", sp=True)


@pytest.fixture(scope="module")
def gpt2_plan():
    graph = tv_ray.capture_step("gpt2-tiny", optim="adamw", clip=1.0)
    return tv_ray.parallelize(graph, SPEC, model="gpt2-tiny")


def _check_reduction(plan, reduction):
    assert reduction.full == plan.dims
    assert set(reduction.reduced) == set(plan.dims)
    assert all(1 <= reduction.reduced[d] <= plan.dims[d] for d in plan.dims)
    assert reduction.failing(reduction.reduced) == []
    assert reduction.failing(reduction.full) == []
    # the plan's every shape still evaluates and agrees with its op rules at the reduced dims
    check_graph(plan.logical, dims=reduction.reduced, allow_comm=False)
    for program in plan.programs.values():
        check_graph(program, dims=reduction.reduced, ctx=Context(axis_sizes=plan.axis_sizes))
    json.dumps(reduction.to_json())


def test_llama3_tiny_reduces_and_still_simulates(llama_plan):
    reduction = reduce_plan(llama_plan)
    _check_reduction(llama_plan, reduction)
    assert reduction.reduced == {"batch": 8, "seq": 2, "kv_heads": 2, "n_rep": 2, "head_dim": 2,
                                 "ffn": 4, "vocab": 4}
    result = tv_ray.simulate(llama_plan, seed=0, dims=reduction.reduced)
    assert result.ok(1e-9), result.max_abs_dev()


def test_gpt2_tiny_reduces_and_still_simulates(gpt2_plan):
    reduction = reduce_plan(gpt2_plan)
    _check_reduction(gpt2_plan, reduction)
    assert sum(reduction.reduced.values()) < sum(gpt2_plan.dims.values())
    result = tv_ray.simulate(gpt2_plan, seed=0, dims=reduction.reduced)
    assert result.ok(1e-9), result.max_abs_dev()


def test_a_routing_choice_keeps_more_experts_than_it_picks():
    """deepseek-tiny at 8 experts, top-2 of them: the reduction keeps 3, so routing stays a choice."""
    spec = models.get("deepseek-tiny").with_dims(experts=8)
    plan = tv_ray.parallelize(tv_ray.capture_step(spec), "dp=2,ep=2", model="deepseek-tiny", dims=spec.dims)
    reduction = reduce_plan(plan)
    _check_reduction(plan, reduction)
    assert reduction.reduced["experts"] == 4      # ep = 2 must divide it: 3 would not
    order = next(c for c in reduction.conditions if c.text == "3 <= experts")
    assert order.sources[0]["why"].startswith("topk picks among more than k along dim 1")
    assert tv_ray.simulate(plan, seed=0, dims=reduction.reduced).ok(1e-9)


@pytest.mark.parametrize("which", ["llama_plan", "gpt2_plan"])
def test_closed_form_agrees_with_z3(which, request):
    plan = request.getfixturevalue(which)
    closed = reduce_plan(plan)
    by_z3 = reduce_plan(plan, use_closed_form=False)
    assert closed.solver == "closed-form" and by_z3.solver == "z3"
    assert sum(closed.reduced.values()) == sum(by_z3.reduced.values())
    assert closed.reduced == by_z3.reduced


def test_side_conditions_name_matmul_inner_dim_and_softmax_axis(llama_plan):
    reduction = reduce_plan(llama_plan)
    whys = {(c.kind, c.text): [s["why"] for s in c.sources] for c in reduction.conditions}
    # the tp-local inner dim of the attention output projection, and the attention softmax over keys
    inner = whys[("reduced", "head_dim*kv_heads*n_rep/2 >= 2")]
    assert any("mm inner dim (matmul contraction)" in why for why in inner)
    assert any(why.startswith("softmax axis") for why in whys[("reduced", "seq >= 2")])
    assert any(why.startswith("log_softmax axis") for why in whys[("reduced", "vocab >= 2")])
    serialised = json.dumps(reduction.to_json())
    assert "matmul contraction" in serialised and "softmax axis" in serialised
    source = next(c for c in reduction.conditions if c.text == "head_dim*kv_heads*n_rep/2 >= 2").sources[0]
    assert source["path"].startswith(("logical.ops[", "programs.")) and "op" in source


def test_split_factors_keep_dividing_at_llama3_8b_like_dims(llama_graph):
    dims = dict(tv_ray.models.get("llama3-8b").dims, batch=16)
    plan = tv_ray.parallelize(llama_graph, "dp=16,tp=8", model="llama3-tiny", dims=dims)
    reduction = reduce_plan(plan)
    _check_reduction(plan, reduction)
    r = reduction.reduced
    for expr in ("kv_heads", "head_dim*kv_heads", "head_dim*kv_heads*n_rep", "ffn", "vocab"):
        assert Expr.of(expr).eval(r) % 8 == 0, expr
    assert r["batch"] % 16 == 0
    assert r == {"batch": 16, "seq": 2, "kv_heads": 8, "n_rep": 2, "head_dim": 2, "ffn": 16, "vocab": 16}
    texts = {c.text for c in reduction.conditions if c.kind == "split"}
    assert {"8 divides head_dim*kv_heads", "8 divides ffn", "8 divides vocab", "16 divides batch"} <= texts


def _with_token_split(plan, factors, **dims):
    index = next(i for i, entry in enumerate(plan.lineage) if entry.logical == "tokens")
    lineage = list(plan.lineage)
    lineage[index] = dataclasses.replace(lineage[index], slice=((0, factors),))
    return index, dataclasses.replace(plan, lineage=tuple(lineage), dims={**plan.dims, **dims})


def test_split_that_cannot_divide_the_full_dim_is_a_shape_error(llama_plan):
    index, mutant = _with_token_split(llama_plan, ("dp", Fixed(0, 3)))
    with pytest.raises(ShapeError) as err:
        reduce_plan(mutant)
    assert str(err.value) == (
        f"shape reduction: 6 divides batch fails at the full dims (batch=8), so no dims table keeps it; "
        f"dimension batch is constrained by lineage[{index}] (lineage slice of tokens dim 0 by "
        f"['dp', '0/3']); fix the dims or the split")


def test_unsatisfiable_below_full_reduces_to_the_full_value(llama_plan):
    # 4 | batch (dp, microbatches), 6 | batch (this split) and batch/4 >= 2: only 12 itself
    _, mutant = _with_token_split(llama_plan, ("dp", Fixed(0, 3)), batch=12)
    reduction = reduce_plan(mutant)
    assert reduction.reduced["batch"] == 12 == reduction.full["batch"]
    assert reduction.failing(reduction.reduced) == []


def _cond(kind, atom):
    return SideCondition(kind, atom, str(atom))


def test_solver_uses_z3_when_per_dim_minima_are_not_feasible():
    product = Expr.of("batch*seq/4")
    conditions = [_cond("integer", Atom("integer", product)), _cond("positive", Atom("at_least", product, 1))]
    reduced, solver, _ = solve(conditions, {"batch": 8, "seq": 16})
    assert solver == "z3" and reduced == {"batch": 2, "seq": 2}


def test_solver_falls_back_to_full_dims_when_only_they_satisfy():
    conditions = [_cond("order", Atom("at_least", Expr.of("seq - 16"), 0)),
                  _cond("integer", Atom("integer", Expr.of("batch*seq/32")))]
    reduced, solver, _ = solve(conditions, {"batch": 2, "seq": 16})
    assert reduced == {"batch": 2, "seq": 16}


def test_view_blocks_name_merged_and_split_factors():
    e = Expr.of
    table = {"batch": 4, "seq": 8, "d": 6}

    def full(expr):
        return value_of(expr, table)
    blocks = list(_view_blocks((e("batch"), e("seq"), e("d")), (e("batch*seq"), e("d")), full))
    assert [set(map(str, b)) for b in blocks] == [{"batch", "seq", "batch*seq"}]
    assert list(_view_blocks((e("batch"), e(1), e("d")), (e("batch"), e("d")), full)) == []


def test_collect_is_deterministic(llama_plan):
    first = [c.to_json() for c in reduce_plan(llama_plan).conditions]
    again = [c.to_json() for c in reduce_plan(llama_plan).conditions]
    assert first == again and len(collect(llama_plan)) == len(first)


def test_a_repeated_op_counts_its_conditions_again_as_if_collected_afresh(llama_plan):
    """An op whose kind, attributes and shapes (the very objects: a microbatch copy) were collected before has its
    conditions counted again, not re-derived: the conditions, counts and sources are those of collecting every op
    afresh — each op given shapes of its own, so that nothing repeats."""
    def afresh(graph):
        nodes = tuple(dataclasses.replace(n, shape=tuple(list(n.shape)), attrs=tuple(list(n.attrs)))
                      for n in graph.nodes)
        return dataclasses.replace(graph, nodes=nodes)
    fresh = dataclasses.replace(llama_plan, programs={name: afresh(g) for name, g in llama_plan.programs.items()})
    repeated = [c.to_json() for c in collect(llama_plan)]
    assert repeated == [c.to_json() for c in collect(fresh)]
    # microbatch copies share their shapes, so they were repeats; the counts say how many ops stated each
    assert sum(c["count"] for c in repeated) > len(repeated) + 100


def test_a_triu_keeps_its_diagonal_visible(llama_plan):
    """A causal mask (diagonal 1) needs seq >= 2; one made with diagonal 3 keeps 4 rows, where the two differ."""
    from tests.engine.bugs import changed
    from tests.engine.mutants import _set_attrs
    whys = {c.text: [s["why"] for s in c.sources] for c in reduce_plan(llama_plan).conditions}
    assert "triu mask (diagonal 1)" in whys["seq >= 2"]
    program, triu = next((name, n) for name, g in llama_plan.programs.items() for n in g.nodes if n.op.value == "triu")
    wider = reduce_plan(changed(llama_plan, _set_attrs(triu, diagonal=3), program=program))
    assert wider.reduced["seq"] == 4
    assert "triu mask (diagonal 3)" in [s["why"] for c in wider.conditions if c.text == "seq >= 4" for s in c.sources]
