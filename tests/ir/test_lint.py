"""Graph lint: every kind of mistake is named with its node, what is wrong and the fix (messages pinned)."""
from __future__ import annotations

import pytest

from tv_ray.errors import GraphError
from tv_ray.ir.graph import Graph, Node, TensorSpec
from tv_ray.ir.lint import lint
from tv_ray.ir.ops import Op
from tv_ray.semantics import Context


def spec(name, *shape, dtype="float"):
    return TensorSpec.from_json({"name": name, "shape": list(shape), "dtype": dtype}, "")


def graph(*nodes, inputs=None, outputs=None) -> Graph:
    inputs = inputs or (spec("view_2", 6, 12), spec("t_1", 12, 24))
    return Graph(tuple(inputs), tuple(nodes), tuple((outputs or {"out": nodes[-1].name}).items()), "g")


def lint_message(g: Graph, **kwargs) -> str:
    with pytest.raises(GraphError) as err:
        lint(g, **kwargs)
    return str(err.value)


def test_wrong_stated_shape():
    g = graph(Node.make("mm_3", "mm", ["view_2", "t_1"], shape=[6, 10]))
    assert lint_message(g) == ("node mm_3 = mm(view_2, t_1): stated shape [6, 10] but mm of [6, 12] and [12, 24] "
                               "gives [6, 24]; fix the stated shape or the inputs")


def test_wrong_stated_shape_of_three_inputs_and_of_none():
    g = graph(Node.make("a", "addmm", ["b", "view_2", "t_1"], shape=[6, 12]),
              inputs=(spec("b", 24), spec("view_2", 6, 12), spec("t_1", 12, 24)))
    assert lint_message(g) == ("node a = addmm(b, view_2, t_1): stated shape [6, 12] but addmm of [24], [6, 12] "
                               "and [12, 24] gives [6, 24]; fix the stated shape or the inputs")
    g = graph(Node.make("f", "full", [], {"size": ["seq"], "value": 0.0}, shape=["seq + 1"]))
    assert lint_message(g) == ("node f = full(): stated shape [seq + 1] but full gives [seq]; "
                               "fix the stated shape or the attributes")


def test_shape_rule_failure():
    g = graph(Node.make("m", "mm", ["t_1", "view_2"], shape=[12, 12]))
    assert lint_message(g) == ("node m = mm(t_1, view_2): mm: inner dims differ: [12, 24] @ [6, 12]; "
                               "fix the inputs or the attributes")


def test_undefined_argument():
    g = graph(Node.make("m", "mm", ["view_2", "missing"], shape=[6, 24]))
    assert lint_message(g) == ("g.ops[0].args: m = mm(...) reads 'missing', which is not an input "
                               "nor the result of an earlier op")


def test_comm_op_in_a_logical_graph():
    g = graph(Node.make("r", "all_reduce", ["view_2"], {"axes": ["tp"], "reduce": "sum"}, shape=[6, 12]))
    assert lint_message(g, allow_comm=False) == (
        "node r = all_reduce(view_2): communication op all_reduce in a logical graph; the single-device step "
        "has no mesh, so move it to a rank's program")
    lint(g, ctx=Context(axis_sizes={"tp": 2}))  # fine in a rank's program


def test_arity_attributes_and_dtype():
    g = graph(Node.make("n", "neg", ["view_2", "t_1"], shape=[6, 12]))
    assert lint_message(g) == "node n = neg(view_2, t_1): neg takes 1 tensor argument(s), got 2; fix the arguments"
    g = graph(Node("s", Op.SUM, ("view_2",), (("dims", (0,)),), ()))
    assert lint_message(g) == "node s = sum(view_2): sum needs attribute 'keepdim'; add it"
    g = graph(Node.make("e", "eq", ["view_2"], {"other": 0.0}, shape=[6, 12]))
    assert lint_message(g) == ("node e = eq(view_2): stated dtype float but eq of float gives bool; "
                               "fix the stated dtype")


def test_symbolic_graph_is_clean_symbolically_and_at_dims():
    inputs = (spec("x", "batch", "seq", "d"), spec("w", "d", "ffn"), spec("tok", "batch", "seq", dtype="int"))
    g = graph(
        Node.make("x2", "view", ["x"], {"size": ["batch*seq", -1]}, shape=["batch*seq", "d"]),
        Node.make("h", "mm", ["x2", "w"], shape=["batch*seq", "ffn"]),
        Node.make("lp", "_log_softmax", ["h"], {"dim": -1}, shape=["batch*seq", "ffn"]),
        Node.make("t", "view", ["tok"], {"size": ["batch*seq"]}, shape=["batch*seq"], dtype="int"),
        Node.make("loss", "nll_loss", ["lp", "t"], {"reduction": "mean", "ignore_index": -100}, shape=[]),
        inputs=inputs)
    lint(g, allow_comm=False)
    lint(g, {"batch": 2, "seq": 3, "d": 4, "ffn": 5}, allow_comm=False)


def test_lint_at_dims_catches_what_only_the_sizes_show():
    g = graph(Node.make("c", "local_chunk", ["x"], {"dim": 0, "axes": ["tp"]}, shape=["seq/2"]),
              inputs=(spec("x", "seq"),))
    lint(g, ctx=Context(axis_sizes={"tp": 2}))
    assert lint_message(g, dims={"seq": 4}, ctx=Context(axis_sizes={"tp": 3})) == (
        "node c = local_chunk(x): local_chunk: dim 0 of [4] into 3 chunks: 4 is not divisible by 3; "
        "fix the inputs or the attributes")
