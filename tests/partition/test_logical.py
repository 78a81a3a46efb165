"""The logical graph's terms (tv_ray/partition/logical.py): definitions left for later are the ones built at once."""
from __future__ import annotations

import numpy as np
import pytest

from tv_ray import api
from tv_ray.partition import logical as logical_module
from tv_ray.partition.logical import LogicalTerms
from tv_ray.partition.symmetry import Blocks
from tv_ray.reduce import reduce_plan


@pytest.mark.parametrize("model", ["llama3-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("blocks", [False, True], ids=["whole batch", "blocks"])
def test_a_definition_left_for_later_is_the_one_built_at_once(model, blocks, monkeypatch):
    graph = api.capture_step(model, optim="adamw", clip=1.0)
    plan = api.parallelize(graph, "dp=2", model=model)
    dims = reduce_plan(plan).reduced
    cut = Blocks.of(graph, dims, 2) if blocks else None
    later = LogicalTerms.build(graph, dims, cut)
    monkeypatch.setattr(LogicalTerms, "_deferrable", lambda self, node: False)
    now = LogicalTerms.build(graph, dims, cut)
    assert len(later._later) > 0.3 * len(graph.nodes)          # the optimizer's and most elementwise ops
    assert now._later == set()
    deferred = sorted(later._later)
    unmade = dict(later._unmade)
    assert len(unmade) > 0.2 * len(graph.nodes) and now._unmade == {}
    for name, shape in unmade.items():      # a slice asked for is made alone: the very atoms of the whole's slice
        half = tuple(slice(n // 2, n) for n in shape) + (Ellipsis,)
        got, whole = later.value_at(name, half), now.value_at(name, half)
        assert name in later._unmade and got.shape == whole.shape
        assert all(a is b for a, b in zip(got.reshape(-1), whole.reshape(-1))), name
    for name in now.value:
        assert np.array_equal(later.full(name), now.value[name]), name   # interned terms: equal is identical
    assert later._unmade == {}
    for name in deferred:
        shape = now.definition[name].shape
        got = later.definition_at(name, tuple(slice(0, n) for n in shape) + (Ellipsis,))
        assert got.shape == shape and all(a is b for a, b in zip(got.reshape(-1), now.definition[name].reshape(-1)))
    assert later._later == set()


def test_an_op_that_may_give_a_constant_is_built_at_once():
    """A scalar 0 (x·0 is 0), an op outside NEVER_CONSTANT (a power may be 1), or an argument that holds a
    constant anywhere keeps its definition built, so its value keeps the constants."""
    from tv_ray.ir import Expr, Graph, Node, Op, TensorSpec
    from tv_ray.terms import Kind
    x = TensorSpec("x", (Expr.of(2),), "float")
    nodes = [Node.make("zero", Op.MUL, ("x",), {"other": 0.0}, (2,)),
             Node.make("twice", Op.MUL, ("x",), {"other": 2.0}, (2,)),
             Node.make("sum", Op.ADD, ("zero", "twice"), {}, (2,))]
    graph = Graph(inputs=(x,), nodes=tuple(nodes), outputs=(("out", "sum"),))
    lt = LogicalTerms.build(graph, {})
    assert lt._later == {"twice"}
    assert all(v.kind is Kind.CONST for v in lt.value["zero"])         # the zeros stay visible downstream
    assert "sum" not in lt._later                                       # it reads a tensor of constants
    assert logical_module.NEVER_CONSTANT >= {Op.MUL, Op.ADD} and Op.POW not in logical_module.NEVER_CONSTANT
