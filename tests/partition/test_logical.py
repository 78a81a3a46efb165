"""The logical graph's terms (tv_ray/partition/logical.py): definitions left for later are the ones built at once."""
from __future__ import annotations

import numpy as np
import pytest

from tv_ray import api
from tv_ray.ir import Op
from tv_ray.partition import logical as logical_module
from tv_ray.partition.logical import LogicalTerms
from tv_ray.partition.symmetry import Blocks
from tv_ray.reduce import reduce_plan
from tv_ray.terms import Kind, postorder


@pytest.mark.parametrize("model", ["llama3-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("blocks", [False, True], ids=["whole batch", "blocks"])
def test_a_definition_left_for_later_is_the_one_built_at_once(model, blocks):
    graph = api.capture_step(model, optim="adamw", clip=1.0)
    plan = api.parallelize(graph, "dp=2", model=model)
    dims = reduce_plan(plan).reduced
    cut = Blocks.of(graph, dims, 2) if blocks else None
    later = LogicalTerms.build(graph, dims, cut)
    now = LogicalTerms.build(graph, dims, cut, eager=True)
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
    assert lt._later == {"x", "twice"}
    assert all(v.kind is Kind.CONST for v in lt.value["zero"])         # the zeros stay visible downstream
    assert "sum" not in lt._later and "sum" in lt.definition            # it reads a tensor of constants
    assert "sum" in lt._unmade and lt.atomic("sum")     # built: no constant in it, so its atoms made when asked
    assert logical_module.NEVER_CONSTANT >= {Op.MUL, Op.ADD} and Op.POW not in logical_module.NEVER_CONSTANT


def test_a_sum_of_atoms_is_left_for_later_unless_it_sums_nothing():
    """A sum (or mean) of distinct variables over a nonempty region is no constant: left for later, its value
    its atoms; a sum over an empty dim is the constant 0 and is built at once."""
    from tv_ray.ir import Expr, Graph, Node, Op, TensorSpec
    from tv_ray.terms import Kind
    x = TensorSpec("x", (Expr.of(2), Expr.of(3)), "float")
    e = TensorSpec("e", (Expr.of(2), Expr.of(0)), "float")
    nodes = [Node.make("rows", Op.SUM, ("x",), {"dims": [1], "keepdim": False}, (2,)),
             Node.make("all", Op.MEAN, ("x",), {"dims": [], "keepdim": True}, (1, 1)),
             Node.make("none", Op.SUM, ("e",), {"dims": [-1], "keepdim": False}, (2,))]
    graph = Graph(inputs=(x, e), nodes=tuple(nodes), outputs=(("a", "rows"), ("b", "all"), ("c", "none")))
    lt = LogicalTerms.build(graph, {})
    assert {"rows", "all"} <= lt._later and "none" not in lt._later
    assert all(v.kind is Kind.CONST for v in lt.value["none"])
    eager = LogicalTerms.build(graph, {}, eager=True)
    for name in ("rows", "all"):
        whole = tuple(slice(0, n) for n in eager.definition[name].shape)
        assert all(a is b for a, b in zip(lt.definition_at(name, whole).reshape(-1),
                                          eager.definition[name].reshape(-1)))
        assert all(a is b for a, b in zip(lt.full(name).reshape(-1), eager.value[name].reshape(-1)))


def test_a_view_of_atoms_is_left_for_later_and_its_definition_must_fit_its_atoms():
    """A view or copy of a tensor that is its atoms throughout gives atoms (each element one of its input's):
    left for later like a product. Its definition, built when asked, has its atoms' shape (the recorded one): a
    recorded shape that does not fit the op is named then."""
    from tv_ray.errors import SymbolicError
    from tv_ray.ir import Expr, Graph, Node, Op, TensorSpec
    x = TensorSpec("x", (Expr.of(2), Expr.of(3)), "float")
    nodes = [Node.make("xt", Op.TRANSPOSE, ("x",), {"dim0": 0, "dim1": 1}, (3, 2)),
             Node.make("copy", Op.CLONE, ("xt",), {}, (3, 2)),
             Node.make("wrong", Op.TRANSPOSE, ("x",), {"dim0": 0, "dim1": 1}, (2, 3))]
    graph = Graph(inputs=(x,), nodes=tuple(nodes), outputs=(("out", "copy"), ("bad", "wrong")))
    lt = LogicalTerms.build(graph, {})
    assert lt._later == set(lt._unmade) == {"x", "xt", "copy", "wrong"}
    assert lt.definition_at("copy", (slice(0, 3), slice(0, 2))).shape == (3, 2)
    with pytest.raises(SymbolicError, match=r"^node wrong = transpose\(\.\.\.\): symbolic result has shape \(3, 2\), "
                                            r"the node states \(2, 3\)$"):
        lt.definition_at("wrong", (slice(0, 2), slice(0, 3)))


@pytest.mark.parametrize("model", ["llama3-tiny", "gpt2-tiny"])
def test_every_blocks_contribution_summed_is_the_whole_definition(model):
    """A contribution sum's block-0 part, built when asked, renamed to every block and summed, is the tensor's
    definition over the whole batch (the same interned terms); a view of one moves those elements."""
    graph = api.capture_step(model, optim="adamw", clip=1.0)
    plan = api.parallelize(graph, "dp=2", model=model)
    dims = reduce_plan(plan).reduced
    lt = LogicalTerms.build(graph, dims, Blocks.of(graph, dims, 2))
    assert lt.contributions and not lt._parts

    def summed(name):
        return lt.contribution_of(name, tuple(slice(0, n) for n in lt.shape_of(name)) + (Ellipsis,), lt.blocks.count)

    views = 0
    for name in sorted(lt.contributions):
        node = lt.nodes[name]
        if node.args[0] in lt.contributions:            # a view or copy of one
            assert set(summed(name).reshape(-1)) <= set(summed(node.args[0]).reshape(-1)), name
            views += 1
        elif node.op is Op.NLL_LOSS:                    # a mean's blocks sum to another term: the test below
            summed(name)
        else:
            whole = lt.definition_at(name, tuple(slice(0, n) for n in lt.shape_of(name)) + (Ellipsis,))
            assert all(a is b for a, b in zip(summed(name).reshape(-1), whole.reshape(-1))), name
    assert views and set(lt._parts) == lt.contributions


@pytest.mark.parametrize("masked", [False, True])
def test_a_mean_losss_contribution_is_its_blocks_losses_over_the_whole_batchs_count(masked):
    """A loss averaged over the batch is a contribution sum: block 0's summed losses over the whole batch's count
    (some targets ignored or none), renamed to every block and summed, is the loss's definition (proved by the
    normaliser); each block's own mean summed — its losses over its own count — is not (refuted at a random
    point)."""
    from tv_ray.semantics.symbolic import eval_symbolic
    from tv_ray.terms import Proved, prove_equal, sum_
    from tv_ray.terms.random_point import refute
    graph = api.capture_step("llama3-tiny", masked=masked)
    plan = api.parallelize(graph, "dp=2", model="llama3-tiny")
    dims = reduce_plan(plan).reduced
    lt = LogicalTerms.build(graph, dims, Blocks.of(graph, dims, 4))
    [name] = [n for n in lt.contributions if lt.nodes[n].op is Op.NLL_LOSS]
    assert lt.nodes[name].attr["reduction"] == "mean" and lt.atomic(name)      # its value its atom
    loss = lt.definition_at(name, (Ellipsis,)).reshape(-1)[0]
    summed = lt.contribution_of(name, (Ellipsis,), 4).reshape(-1)[0]
    assert isinstance(prove_equal(summed, loss), Proved)
    node = lt.nodes[name]
    own = eval_symbolic(node, [lt.full(a) for a in node.args], lt.blocks.small).reshape(-1)[0]
    means = sum_([own] + [lt.blocks.rename(np.asarray([own], dtype=object), b)[0] for b in range(1, 4)])
    assert refute(means, loss).verdict == "refuted"


def test_a_tensor_unfolding_brought_in_is_unfolded_where_the_other_side_computed_it():
    """x → w = exp(x) → t = 2w → p = t·w → y = p + x. The physical side read t's claim and computed exp(x) itself
    (t·exp(x) + x); the claim is y. Unfolding y, then p, then t (the latest tensor derived from one only one side
    reads) leaves both sides reading w and x — one holding exp(x) where the other holds w's atom, unrelated
    variables to a solver. w, which unfolding brought in and which is computed from x, is unfolded too."""
    from tv_ray.ir import Expr, Graph, Node, Op, TensorSpec
    from tv_ray.partition.stages import expand
    from tv_ray.terms import add, app, mul
    from tv_ray.terms.random_point import refute
    x = TensorSpec("x", (Expr.of(1),), "float")
    nodes = [Node.make("w", Op.EXP, ("x",), {}, (1,)),
             Node.make("t", Op.MUL, ("w",), {"other": 2.0}, (1,)),
             Node.make("p", Op.MUL, ("t", "w"), {}, (1,)),
             Node.make("y", Op.ADD, ("p", "x"), {}, (1,))]
    lt = LogicalTerms.build(Graph(inputs=(x,), nodes=tuple(nodes), outputs=(("out", "y"),)), {})
    (x0,), (t0,), (y0,) = (logical_module.atoms(name, (1,)) for name in ("x", "t", "y"))
    lhs, rhs, unfolded = expand([add(mul(t0, app("exp", x0)), x0)], [y0], lt)
    assert unfolded == {"y", "p", "t", "w"}
    assert lhs == rhs or refute(lhs[0], rhs[0]).verdict != "refuted"
    assert {lt.tensor_of(n) for side in (lhs, rhs) for n in postorder(*side) if n.kind is Kind.VAR} == {"x"}
