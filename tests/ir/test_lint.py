"""Structural lint: names, arity, attributes, dtypes and communication, each named with its node (messages pinned)."""
from __future__ import annotations

import pytest

from tv_ray.errors import GraphError
from tv_ray.ir.graph import Graph, Node, TensorSpec
from tv_ray.ir.lint import lint
from tv_ray.ir.ops import Op


def spec(name, *shape, dtype="float"):
    return TensorSpec.from_json({"name": name, "shape": list(shape), "dtype": dtype}, "")


def graph(*nodes, inputs=None, outputs=None) -> Graph:
    inputs = inputs or (spec("view_2", 6, 12), spec("t_1", 12, 24))
    return Graph(tuple(inputs), tuple(nodes), tuple((outputs or {"out": nodes[-1].name}).items()), "g")


def lint_error(g: Graph, **kwargs) -> GraphError:
    with pytest.raises(GraphError) as err:
        lint(g, **kwargs)
    return err.value


def test_undefined_argument():
    err = lint_error(graph(Node.make("m", "mm", ["view_2", "missing"], shape=[6, 24])))
    assert str(err) == ("g.ops[0].args: m = mm(...) reads 'missing', which is not an input "
                        "nor the result of an earlier op")
    assert (err.node, err.path) == ("m", "g.ops[0].args")


def test_duplicate_definition():
    err = lint_error(graph(Node.make("n", "neg", ["view_2"], shape=[6, 12]),
                           Node.make("n", "neg", ["t_1"], shape=[12, 24])))
    assert str(err) == "g.ops[1].out: 'n' is defined twice (SSA: one definition per name)"
    assert (err.node, err.path) == ("n", "g.ops[1].out")


def test_comm_op_in_a_logical_graph():
    g = graph(Node.make("r", "all_reduce", ["view_2"], {"axes": ["tp"], "reduce": "sum"}, shape=[6, 12]))
    err = lint_error(g, allow_comm=False)
    assert str(err) == (
        "node r = all_reduce(view_2): communication op all_reduce in a logical graph; the single-device step "
        "has no mesh, so move it to a rank's program")
    assert (err.node, err.program) == ("r", "g")
    lint(g)  # fine in a rank's program


def test_arity_attributes_and_dtype():
    g = graph(Node.make("n", "neg", ["view_2", "t_1"], shape=[6, 12]))
    assert str(lint_error(g)) == \
        "node n = neg(view_2, t_1): neg takes 1 tensor argument(s), got 2; fix the arguments"
    g = graph(Node("s", Op.SUM, ("view_2",), (("dims", (0,)),), ()))
    assert str(lint_error(g)) == "node s = sum(view_2): sum needs attribute 'keepdim'; add it"
    g = graph(Node("s", Op.NEG, ("view_2",), (("dims", (0,)),), ()))
    assert str(lint_error(g)) == "node s = neg(view_2): neg takes no attribute 'dims' (it takes: none); remove it"
    g = graph(Node.make("h", "neg", ["view_2"], shape=[6, 12], dtype="half"))
    assert str(lint_error(g)) == "node h = neg(view_2): unknown dtype 'half'; one of float, int, bool, token"


def test_the_signature_memo_still_names_the_bad_node():
    # b repeats a's signature and is not re-checked; c, with two arguments, is a new signature: checked, named
    g = graph(Node.make("a", "neg", ["view_2"], shape=[6, 12]),
              Node.make("b", "neg", ["a"], shape=[6, 12]),
              Node.make("c", "neg", ["a", "b"], shape=[6, 12]))
    assert lint_error(g).node == "c"


def test_lint_needs_no_rules():
    """A wrong stated shape is the semantics' to find (tv_ray.semantics.check), not the structural lint's."""
    lint(graph(Node.make("mm_3", "mm", ["view_2", "t_1"], shape=[6, 10])))
