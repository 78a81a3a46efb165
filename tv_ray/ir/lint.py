"""Structural graph lint: SSA names, arity, attribute presence, dtypes and where communication may appear.

Needs no op rules, only the op set's schema (`tv_ray.ir.ops`); re-deriving
shapes and dtypes with the rule table is `tv_ray.semantics.check`, which runs
this first. Every error is one line naming the node, what is wrong and the
fix, and a `GraphError` whose `node` and `program` fields say where.
"""
from __future__ import annotations

from tv_ray.errors import GraphError
from tv_ray.ir.graph import Graph, Node, check_names, describe
from tv_ray.ir.ops import ARITY, ATTRS, COMMUNICATION, DTYPES


def node_error(program: str, node: Node, message: str) -> GraphError:
    """A lint error about one node: ``node mm_3 = mm(view_2, t_1): <message>``, with `node` and `program` set."""
    return GraphError(f"node {describe(node)}: {message}", node=node.name, program=program)


def _lint_node(node: Node, program: str, allow_comm: bool = True) -> None:
    """Raise GraphError if `node` has the wrong arity, a missing or unknown attribute, an unknown dtype, or
    (unless `allow_comm`) is communication."""
    def error(message: str) -> GraphError:
        return node_error(program, node, message)

    if node.op in COMMUNICATION and not allow_comm:
        raise error(f"communication op {node.op} in a logical graph; "
                    f"the single-device step has no mesh, so move it to a rank's program")
    arity = ARITY[node.op]
    if (arity is None and not node.args) or (arity is not None and len(node.args) not in arity):
        want = "at least 1" if arity is None else " or ".join(map(str, arity))
        raise error(f"{node.op} takes {want} tensor argument(s), got {len(node.args)}; fix the arguments")
    schema = ATTRS.get(node.op, {})
    attrs = node.attr
    for key in attrs:
        if key not in schema:
            raise error(f"{node.op} takes no attribute {key!r} "
                        f"(it takes: {', '.join(schema) or 'none'}); remove it")
    for key, (_, required) in schema.items():
        if required and key not in attrs:
            raise error(f"{node.op} needs attribute {key!r}; add it")
    if node.dtype not in DTYPES:
        raise error(f"unknown dtype {node.dtype!r}; one of {', '.join(DTYPES)}")


def lint(graph: Graph, *, allow_comm: bool = True) -> None:
    """Raise GraphError at the first structural problem: names (`check_names`), then each node's signature.

    Example: ``lint(logical, allow_comm=False)``; for shapes and dtypes too, use
    ``tv_ray.semantics.check_graph(logical, allow_comm=False)``.
    """
    check_names(graph, graph.name)
    seen: set[tuple] = set()
    for node in graph.nodes:
        # the outcome depends only on these, and a program repeats a few hundred of them
        signature = (node.op, len(node.args), node.dtype, *[key for key, _ in node.attrs])
        try:
            known = signature in seen
        except TypeError:   # an unhashable dtype: let the check name it
            known = False
        if not known:
            _lint_node(node, graph.name, allow_comm)
            seen.add(signature)
