"""Graph lint: re-derives every node's shape and dtype with the rule table and names the first bad node.

Checks SSA names, arity, attributes, dtypes and shapes — symbolically (over
shape expressions) when `dims` is None, else at `dims`. Every error is one
line naming the node, what is wrong and the fix.
"""
from __future__ import annotations

from typing import Sequence

from tv_ray.errors import GraphError, TvRayError
from tv_ray.ir.dims import Dims, Expr
from tv_ray.ir.graph import Graph, Node, check_names
from tv_ray.ir.ops import ARITY, ATTRS, COMMUNICATION, DTYPES
from tv_ray.semantics.interpret import describe
from tv_ray.semantics.shapes import fmt, same_shape
from tv_ray.semantics.table import Context, instantiate, rule_for


def _of(shapes: Sequence[Sequence]) -> str:
    texts = [fmt(s) for s in shapes]
    return " and ".join(texts) if len(texts) <= 2 else ", ".join(texts[:-1]) + " and " + texts[-1]


def _check_signature(node: Node, allow_comm: bool) -> None:
    if node.op in COMMUNICATION and not allow_comm:
        raise GraphError(f"node {describe(node)}: communication op {node.op} in a logical graph; "
                         f"the single-device step has no mesh, so move it to a rank's program")
    arity = ARITY[node.op]
    if (arity is None and not node.args) or (arity is not None and len(node.args) not in arity):
        want = "at least 1" if arity is None else " or ".join(map(str, arity))
        raise GraphError(f"node {describe(node)}: {node.op} takes {want} tensor argument(s), "
                         f"got {len(node.args)}; fix the arguments")
    schema = ATTRS.get(node.op, {})
    attrs = node.attr
    for key in attrs:
        if key not in schema:
            raise GraphError(f"node {describe(node)}: {node.op} takes no attribute {key!r} "
                             f"(it takes: {', '.join(schema) or 'none'}); remove it")
    for key, (_, required) in schema.items():
        if required and key not in attrs:
            raise GraphError(f"node {describe(node)}: {node.op} needs attribute {key!r}; add it")
    if node.dtype not in DTYPES:
        raise GraphError(f"node {describe(node)}: unknown dtype {node.dtype!r}; one of {', '.join(DTYPES)}")


class _At:
    """Shapes and attributes evaluated at one dims table, each distinct Expr once.

    Expr is hash-consed, so a memo keyed by it is exact; a program of 10^5 ops
    repeats a few hundred expressions, and Expr.eval (Fraction arithmetic) is
    most of what lint would otherwise spend. Only successes are kept, so a bad
    expression still fails at the first node that uses it.
    """

    def __init__(self, dims: Dims):
        self.dims = dims
        self.memo: dict[Expr, int] = {}

    def expr(self, expr: Expr) -> int:
        value = self.memo.get(expr)
        if value is None:
            value = self.memo[expr] = expr.eval(self.dims)
        return value

    def shape(self, shape: tuple) -> tuple:
        try:
            return tuple([self.memo[d] for d in shape])
        except (KeyError, TypeError):
            return tuple(self.expr(d) if isinstance(d, Expr) else instantiate(d, self.dims) for d in shape)

    def attrs(self, attrs: tuple) -> dict:
        out: dict = {}
        if not attrs:
            return out
        for key, value in attrs:
            if isinstance(value, Expr):
                value = self.expr(value)
            elif isinstance(value, tuple) and value and isinstance(value[0], Expr):
                value = self.shape(value)
            else:
                value = instantiate(value, self.dims)
            out[key] = value
        return out


def lint(graph: Graph, dims: Dims | None = None, ctx: Context = Context(), *, allow_comm: bool = True) -> None:
    """Raise GraphError at the first node whose names, arity, attributes, dtype or shape are wrong.

    Example: ``lint(logical, allow_comm=False)`` checks a logical graph symbolically;
    ``lint(program, plan_dims, Context(axis_sizes=mesh))`` checks a rank's program at full size.
    """
    check_names(graph, graph.name)
    at = None if dims is None else _At(dims)
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, str] = {}
    for spec in graph.inputs:
        shapes[spec.name] = tuple(spec.shape) if dims is None else instantiate(tuple(spec.shape), dims)
        dtypes[spec.name] = spec.dtype
    signatures_seen: set[tuple] = set()
    rules_of: dict = {}
    for node in graph.nodes:
        # the signature depends only on these, and a program repeats a few hundred of them
        signature = (node.op, len(node.args), node.dtype, *[key for key, _ in node.attrs])
        try:
            known = signature in signatures_seen
        except TypeError:   # an unhashable dtype: let the check name it
            known = False
        if not known:
            _check_signature(node, allow_comm)
            signatures_seen.add(signature)
        in_shapes = [shapes[a] for a in node.args]
        in_dtypes = [dtypes[a] for a in node.args]
        rules = rules_of.get(node.op) or rules_of.setdefault(node.op, rule_for(node.op))
        try:
            attrs = node.attr if at is None else at.attrs(node.attrs)
            stated = tuple(node.shape) if at is None else at.shape(node.shape)
            derived = tuple(rules.shape(in_shapes, attrs, ctx))
            dtype = rules.dtype(in_dtypes, attrs)
        except TvRayError as err:
            raise GraphError(f"node {describe(node)}: {err}; fix the inputs or the attributes") from None
        if not same_shape(stated, derived):
            raise GraphError(f"node {describe(node)}: stated shape {fmt(stated)} but {node.op} of "
                             f"{_of(in_shapes)} gives {fmt(derived)}; fix the stated shape or the inputs"
                             if in_shapes else
                             f"node {describe(node)}: stated shape {fmt(stated)} but {node.op} gives "
                             f"{fmt(derived)}; fix the stated shape or the attributes")
        if dtype != node.dtype:
            raise GraphError(f"node {describe(node)}: stated dtype {node.dtype} but {node.op} of "
                             f"{', '.join(in_dtypes) or 'no inputs'} gives {dtype}; fix the stated dtype")
        shapes[node.name], dtypes[node.name] = stated, node.dtype
