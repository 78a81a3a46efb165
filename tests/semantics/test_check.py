"""Graph type check: shapes and dtypes re-derived with the rule table, the bad node named (messages pinned)."""
from __future__ import annotations

import pytest

from tv_ray.errors import GraphError
from tv_ray.ir import Expr
from tv_ray.ir.graph import Graph, Node, TensorSpec
from tv_ray.semantics import Context, check_graph


def spec(name, *shape, dtype="float"):
    return TensorSpec.from_json({"name": name, "shape": list(shape), "dtype": dtype}, "")


def graph(*nodes, inputs=None) -> Graph:
    inputs = inputs or (spec("view_2", 6, 12), spec("t_1", 12, 24))
    return Graph(tuple(inputs), tuple(nodes), (("out", nodes[-1].name),), "g")


def check_error(g: Graph, **kwargs) -> GraphError:
    with pytest.raises(GraphError) as err:
        check_graph(g, **kwargs)
    return err.value


def test_wrong_stated_shape():
    err = check_error(graph(Node.make("mm_3", "mm", ["view_2", "t_1"], shape=[6, 10])))
    assert str(err) == ("node mm_3 = mm(view_2, t_1): stated shape [6, 10] but mm of [6, 12] and [12, 24] "
                        "gives [6, 24]; fix the stated shape or the inputs")
    assert (err.node, err.program, err.path) == ("mm_3", "g", None)


def test_wrong_stated_shape_of_three_inputs_and_of_none():
    g = graph(Node.make("a", "addmm", ["b", "view_2", "t_1"], shape=[6, 12]),
              inputs=(spec("b", 24), spec("view_2", 6, 12), spec("t_1", 12, 24)))
    assert str(check_error(g)) == ("node a = addmm(b, view_2, t_1): stated shape [6, 12] but addmm of [24], "
                                   "[6, 12] and [12, 24] gives [6, 24]; fix the stated shape or the inputs")
    g = graph(Node.make("f", "full", [], {"size": ["seq"], "value": 0.0}, shape=["seq + 1"]))
    assert str(check_error(g)) == ("node f = full(): stated shape [seq + 1] but full gives [seq]; "
                                   "fix the stated shape or the attributes")


def test_shape_rule_failure():
    err = check_error(graph(Node.make("m", "mm", ["t_1", "view_2"], shape=[12, 12])))
    assert str(err) == ("node m = mm(t_1, view_2): mm: inner dims differ: [12, 24] @ [6, 12]; "
                        "fix the inputs or the attributes")
    assert err.node == "m"


def test_wrong_stated_dtype():
    g = graph(Node.make("e", "eq", ["view_2"], {"other": 0.0}, shape=[6, 12]))
    assert str(check_error(g)) == ("node e = eq(view_2): stated dtype float but eq of float gives bool; "
                                   "fix the stated dtype")


def test_structure_is_checked_first():
    """The rules see only well-formed nodes: a later arity error wins over an earlier wrong shape."""
    err = check_error(graph(Node.make("mm_3", "mm", ["view_2", "t_1"], shape=[6, 10]),
                            Node.make("n", "neg", ["view_2", "t_1"], shape=[6, 12])))
    assert str(err) == "node n = neg(view_2, t_1): neg takes 1 tensor argument(s), got 2; fix the arguments"
    g = graph(Node.make("r", "all_reduce", ["view_2"], {"axes": ["tp"], "reduce": "sum"}, shape=[6, 12]))
    assert check_error(g, allow_comm=False).node == "r"
    check_graph(g, ctx=Context(axis_sizes={"tp": 2}))  # fine in a rank's program


def test_symbolic_graph_is_clean_symbolically_and_at_dims():
    inputs = (spec("x", "batch", "seq", "d"), spec("w", "d", "ffn"), spec("tok", "batch", "seq", dtype="int"))
    g = graph(
        Node.make("x2", "view", ["x"], {"size": ["batch*seq", -1]}, shape=["batch*seq", "d"]),
        Node.make("h", "mm", ["x2", "w"], shape=["batch*seq", "ffn"]),
        Node.make("lp", "_log_softmax", ["h"], {"dim": -1}, shape=["batch*seq", "ffn"]),
        Node.make("t", "view", ["tok"], {"size": ["batch*seq"]}, shape=["batch*seq"], dtype="int"),
        Node.make("loss", "nll_loss", ["lp", "t"], {"reduction": "mean", "ignore_index": -100}, shape=[]),
        inputs=inputs)
    check_graph(g, allow_comm=False)
    check_graph(g, {"batch": 2, "seq": 3, "d": 4, "ffn": 5}, allow_comm=False)


def test_check_at_dims_catches_what_only_the_sizes_show():
    g = graph(Node.make("c", "local_chunk", ["x"], {"dim": 0, "axes": ["tp"]}, shape=["seq/2"]),
              inputs=(spec("x", "seq"),))
    check_graph(g, ctx=Context(axis_sizes={"tp": 2}))
    assert str(check_error(g, dims={"seq": 4}, ctx=Context(axis_sizes={"tp": 3}))) == (
        "node c = local_chunk(x): local_chunk: dim 0 of [4] into 3 chunks: 4 is not divisible by 3; "
        "fix the inputs or the attributes")


def test_memo_is_per_dims_and_keeps_no_failures():
    x = TensorSpec("x", (Expr.of("n"),))
    nodes = (Node.make("a", "view", ["x"], {"size": ["n/3", 3]}, ["n/3", 3]),
             Node.make("b", "view", ["a"], {"size": ["n"]}, ["n"]),
             Node.make("c", "view", ["b"], {"size": ["n/3", 3]}, ["n/3", 3]))
    g = Graph((x,), nodes, (("out", "c"),), "g")
    check_graph(g, {"n": 6})
    err = check_error(g, dims={"n": 7})   # the memo of n=6 is not reused; the first user of n/3 is named
    assert str(err).startswith("node a = view(x): shape expression n/3 is not an integer at {'n': 7}: 7/3")
    assert err.node == "a"


def test_an_op_repeated_on_arguments_shaped_alike_is_checked_once_and_anything_else_again():
    """The check remembers the ops that passed by op, attributes, stated shape and dtype and argument shapes and
    dtypes: a repeat passes, a repeat that states another shape or reads other shapes is checked and named."""
    ok = Node.make("mm_3", "mm", ["view_2", "t_1"], shape=[6, 24])
    again = Node.make("mm_4", "mm", ["view_2", "t_1"], shape=[6, 24])
    check_graph(graph(ok, again))
    err = check_error(graph(ok, again, Node.make("mm_5", "mm", ["view_2", "t_1"], shape=[6, 10])))
    assert str(err) == ("node mm_5 = mm(view_2, t_1): stated shape [6, 10] but mm of [6, 12] and [12, 24] "
                        "gives [6, 24]; fix the stated shape or the inputs")
    wide = spec("t_2", 12, 30)
    err = check_error(graph(ok, Node.make("mm_6", "mm", ["view_2", "t_2"], shape=[6, 24]),
                            inputs=(spec("view_2", 6, 12), spec("t_1", 12, 24), wide)))
    assert str(err) == ("node mm_6 = mm(view_2, t_2): stated shape [6, 24] but mm of [6, 12] and [12, 30] "
                        "gives [6, 30]; fix the stated shape or the inputs")
