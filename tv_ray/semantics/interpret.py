"""The concrete interpreter: runs a graph on float64 / int64 / bool numpy arrays with the rule table.

`eval_node` runs one node and checks its result against the node's stated
shape and dtype; `run_graph` walks a graph in order (no recursion), frees
each value after its last reader, and re-raises any failure naming the node.
Communication needs every rank at once, so it belongs to the plan simulator.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from tv_ray.errors import GraphError, ShapeError, SimulationError, TvRayError
from tv_ray.ir.dims import Dims
from tv_ray.ir.graph import Graph, Node, describe
from tv_ray.ir.ops import COMMUNICATION
from tv_ray.semantics.shapes import fmt
from tv_ray.semantics.table import NUMPY_DTYPES, Context, instantiate_attrs, instantiate_shape, numpy_dtype, rule_for


class Instantiated(NamedTuple):
    """A node at some dims, made once per node and dims (`instantiated`): its attributes and stated shape there,
    its op's concrete rule and the numpy dtype it states (None for a dtype without values)."""

    attrs: dict
    shape: tuple[int, ...]
    concrete: Callable
    dtype: Any


def eval_node(node: Node, args: list[np.ndarray], dims: Dims, ctx: Context = Context(),
              at: Instantiated | None = None) -> np.ndarray:
    """Run one node on concrete arrays; the result must have the node's stated shape and dtype. `at`: the
    node at `dims` (`instantiated`), when the caller keeps it.

    Example: ``eval_node(Node.make("y", "neg", ["x"], shape=[2]), [np.ones(2)], {})`` is ``[-1., -1.]``.
    """
    if node.op in COMMUNICATION:
        raise SimulationError(f"{describe(node)}: communication needs every rank of the group; "
                              f"run the plan with the plan simulator", node=node.name)
    at = at or instantiated(node, dims)
    out = np.asarray(at.concrete(list(args), at.attrs, ctx))
    if out.shape != at.shape:
        raise ShapeError(f"node {describe(node)}: the result has shape {fmt(out.shape)} but the node "
                         f"states {fmt(at.shape)}; fix the stated shape or the inputs", node=node.name)
    if out.dtype != at.dtype:
        numpy_dtype(node.dtype)         # a stated dtype without values raises its own error
        raise GraphError(f"node {describe(node)}: the result has dtype {out.dtype} but the node states "
                         f"{node.dtype}; fix the stated dtype", node=node.name)
    return out


def instantiated(node: Node, dims: Dims) -> Instantiated:
    """A node at `dims`: its attributes and stated shape there, its concrete rule (UnknownOpError for an op
    without one) and its numpy dtype."""
    return Instantiated(instantiate_attrs(node, dims), instantiate_shape(node.shape, dims),
                        rule_for(node.op, "concrete").concrete, NUMPY_DTYPES.get(node.dtype))


def _last_reads(graph: Graph) -> dict[str, int]:
    """For each value, the position of the last node that reads it (outputs are kept to the end)."""
    last: dict[str, int] = {}
    for position, node in enumerate(graph.nodes):
        for arg in node.args:
            last[arg] = position
    for _, value in graph.outputs:
        last[value] = len(graph.nodes)
    return last


def _check_inputs(graph: Graph, dims: Dims, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    values: dict[str, np.ndarray] = {}
    for spec in graph.inputs:
        if spec.name not in inputs:
            raise GraphError(f"{graph.name}: no value given for input {spec.name!r}", program=graph.name)
        value = np.asarray(inputs[spec.name])
        stated = instantiate_shape(spec.shape, dims)
        if value.shape != stated:
            raise ShapeError(f"{graph.name}: input {spec.name!r} has shape {fmt(value.shape)} "
                             f"but the graph declares {fmt(stated)}")
        values[spec.name] = value.astype(numpy_dtype(spec.dtype), copy=False)
    unknown = set(inputs) - {spec.name for spec in graph.inputs}
    if unknown:
        raise GraphError(f"{graph.name}: {sorted(unknown)[0]!r} is not an input of the graph", program=graph.name)
    return values


def run_graph(graph: Graph, dims: Dims, inputs: Mapping[str, np.ndarray],
              ctx: Context = Context(), keep: bool = False) -> dict[str, np.ndarray]:
    """Run a graph on concrete inputs; returns its outputs by output name (`keep`: every value by its name,
    inputs included, none freed).

    Example: ``run_graph(g, {"batch": 2}, {"x": np.ones((2, 3))})["loss"]``.
    """
    values = _check_inputs(graph, dims, inputs)
    last = {} if keep else _last_reads(graph)
    for position, node in enumerate(graph.nodes):
        try:
            values[node.name] = eval_node(node, [values[arg] for arg in node.args], dims, ctx)
        except TvRayError as err:
            fields = err.fields()
            if "node" in fields:
                fields["node"] = fields["node"] or node.name
            raise type(err)(f"{err}\n  while executing {describe(node)}", **fields) from err
        except (ArithmeticError, ValueError, IndexError, TypeError) as err:
            raise SimulationError(f"{type(err).__name__}: {err}\n  while executing {describe(node)}",
                                  node=node.name) from err
        if keep:
            continue
        for arg in set(node.args):
            if last[arg] == position:
                del values[arg]
        if node.name not in last:
            del values[node.name]
    return values if keep else {out: values[value] for out, value in graph.outputs}
