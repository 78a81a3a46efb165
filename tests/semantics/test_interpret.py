"""The concrete interpreter: a small MLP step against torch, node-level checks, errors that name the node."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tv_ray.errors import GraphError, ShapeError, SimulationError
from tv_ray.ir.graph import Graph, Node, TensorSpec
from tv_ray.semantics import Context, eval_node, run_graph
from tv_ray.semantics.interpret import _last_reads

DIMS = {"batch": 3, "d": 4, "ffn": 5}


def spec(name, *shape, dtype="float", role="activation"):
    return TensorSpec(name, tuple(TensorSpec.from_json({"name": name, "shape": list(shape)}, "").shape), dtype, role)


def mlp() -> Graph:
    """y = sum(silu(x @ w1) @ w2) / batch, as a captured graph would write it."""
    nodes = (
        Node.make("h", "mm", ["x", "w1"], shape=["batch", "ffn"]),
        Node.make("a", "silu", ["h"], shape=["batch", "ffn"]),
        Node.make("w2_t", "transpose", ["w2"], {"dim0": 0, "dim1": 1}, shape=["ffn", "d"]),
        Node.make("y", "mm", ["a", "w2_t"], shape=["batch", "d"]),
        Node.make("s", "sum", ["y"], {"dims": [], "keepdim": False}, shape=[]),
        Node.make("loss", "div", ["s"], {"other": 3}, shape=[]),
    )
    inputs = (spec("x", "batch", "d"), spec("w1", "d", "ffn", role="param"), spec("w2", "d", "ffn", role="param"))
    return Graph(inputs, nodes, (("loss", "loss"), ("hidden", "h")), "mlp")


def test_run_graph_matches_torch():
    rng = np.random.default_rng(0)
    values = {"x": rng.standard_normal((3, 4)), "w1": rng.standard_normal((4, 5)), "w2": rng.standard_normal((4, 5))}
    out = run_graph(mlp(), DIMS, values)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    expected = (torch.nn.functional.silu(t["x"] @ t["w1"]) @ t["w2"].T).sum() / 3
    assert set(out) == {"loss", "hidden"}
    np.testing.assert_allclose(out["loss"], expected.numpy(), rtol=1e-12)
    np.testing.assert_allclose(out["hidden"], (t["x"] @ t["w1"]).numpy(), rtol=1e-12)


def test_values_are_freed_after_their_last_reader():
    last = _last_reads(mlp())
    assert last["x"] == 0 and last["h"] == len(mlp().nodes)  # h is an output: kept to the end
    assert last["a"] == 3 and "loss" in last


def test_eval_node_checks_the_stated_shape():
    node = Node.make("n", "neg", ["x"], shape=[3])
    with pytest.raises(ShapeError) as err:
        eval_node(node, [np.ones(2)], {})
    assert str(err.value) == ("node n = neg(x): the result has shape [2] but the node states [3]; "
                              "fix the stated shape or the inputs")


def test_eval_node_checks_the_stated_dtype():
    node = Node.make("n", "eq", ["x", "y"], shape=[2])
    with pytest.raises(GraphError, match="the result has dtype bool but the node states float"):
        eval_node(node, [np.ones(2), np.ones(2)], {})


def test_errors_name_the_node_being_executed():
    graph = Graph((spec("x", 2, 3), spec("i", 2, dtype="int")),
                  (Node.make("e", "embedding", ["x", "i"], shape=[2, 3]),), (("out", "e"),), "g")
    with pytest.raises(ShapeError) as err:
        run_graph(graph, {}, {"x": np.ones((2, 3)), "i": np.array([0, 7])})
    assert str(err.value) == "embedding: an index lies outside [0, 2)\n  while executing e = embedding(x, i)"


def test_numpy_failures_become_simulation_errors_naming_the_node():
    # lint would reject this graph; the interpreter still names the node rather than leaking a numpy error
    graph = Graph((spec("x", 2, 3),), (Node.make("m", "mm", ["x", "x"], shape=[2, 3]),), (("out", "m"),), "g")
    with pytest.raises(SimulationError, match=r"^ValueError: .*\n  while executing m = mm\(x, x\)$"):
        run_graph(graph, {}, {"x": np.ones((2, 3))})


def test_communication_needs_the_plan_simulator():
    graph = Graph((spec("x", 2),), (Node.make("r", "all_reduce", ["x"], {"axes": ["tp"], "reduce": "sum"},
                                              shape=[2]),), (("out", "r"),), "prog")
    with pytest.raises(SimulationError) as err:
        run_graph(graph, {}, {"x": np.ones(2)}, Context({"tp": 2}, {"tp": 0}))
    assert str(err.value) == ("r = all_reduce(x): communication needs every rank of the group; run the plan "
                              "with the plan simulator\n  while executing r = all_reduce(x)")


def test_rank_dependent_ops_read_the_context():
    graph = Graph((spec("x", 4, 2),), (
        Node.make("c", "local_chunk", ["x"], {"dim": 0, "axes": ["tp"]}, shape=[2, 2]),
        Node.make("r", "axis_index", [], {"axes": ["tp"]}, shape=[], dtype="int"),
    ), (("chunk", "c"), ("rank", "r")), "prog")
    x = np.arange(8.0).reshape(4, 2)
    out = run_graph(graph, {}, {"x": x}, Context({"tp": 2}, {"tp": 1}))
    np.testing.assert_array_equal(out["chunk"], x[2:])
    assert out["rank"] == 1 and out["rank"].dtype == np.int64


def test_inputs_are_checked():
    with pytest.raises(GraphError, match=r"^mlp: no value given for input 'w2'$"):
        run_graph(mlp(), DIMS, {"x": np.ones((3, 4)), "w1": np.ones((4, 5))})
    with pytest.raises(ShapeError, match=r"^mlp: input 'x' has shape \[4, 3\] but the graph declares \[3, 4\]$"):
        run_graph(mlp(), DIMS, {"x": np.ones((4, 3)), "w1": np.ones((4, 5)), "w2": np.ones((4, 5))})
