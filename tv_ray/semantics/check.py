"""Graph type check: re-derives every node's shape and dtype with the rule table and names the first bad node.

Runs the structural lint (`tv_ray.ir.lint`) first, so the rules only see
well-formed nodes; then checks shapes and dtypes — symbolically (over shape
expressions) when `dims` is None, else at `dims`. Every error is one line
naming the node, what is wrong and the fix, and a `GraphError` whose `node`
and `program` fields say where.
"""
from __future__ import annotations

from typing import Sequence

from tv_ray.errors import TvRayError
from tv_ray.ir.dims import Dims, Expr
from tv_ray.ir.graph import Graph
from tv_ray.ir.lint import lint, node_error
from tv_ray.semantics.shapes import fmt, same_shape
from tv_ray.semantics.table import Context, instantiate, rule_for


def _of(shapes: Sequence[Sequence]) -> str:
    texts = [fmt(s) for s in shapes]
    return " and ".join(texts) if len(texts) <= 2 else ", ".join(texts[:-1]) + " and " + texts[-1]


class _At:
    """Shapes and attributes evaluated at one dims table, each distinct Expr once.

    Expr is hash-consed, so a memo keyed by it is exact; a program of 10^5 ops
    repeats a few hundred expressions, and Expr.eval (Fraction arithmetic) is
    most of what the check would otherwise spend. Only successes are kept, so a
    bad expression still fails at the first node that uses it.
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


def check_graph(graph: Graph, dims: Dims | None = None, ctx: Context = Context(), *,
                allow_comm: bool = True) -> None:
    """Raise GraphError at the first node whose names, arity, attributes, dtype or shape are wrong.

    Example: ``check_graph(logical, allow_comm=False)`` checks a logical graph symbolically;
    ``check_graph(program, plan_dims, Context(axis_sizes=mesh))`` checks a rank's program at full size.
    """
    lint(graph, allow_comm=allow_comm)
    at = None if dims is None else _At(dims)
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, str] = {}
    for spec in graph.inputs:
        shapes[spec.name] = tuple(spec.shape) if dims is None else instantiate(tuple(spec.shape), dims)
        dtypes[spec.name] = spec.dtype
    rules_of: dict = {}
    # (op, attributes, stated shape and dtype, argument shapes and dtypes) -> the stated shape, of the nodes that
    # passed: the rules are functions of these alone, so an op repeated on arguments shaped alike (every layer's,
    # every microbatch's) passes again without them
    passed: dict[tuple, tuple] = {}
    for node in graph.nodes:
        in_shapes = [shapes[a] for a in node.args]
        in_dtypes = [dtypes[a] for a in node.args]
        key = (node.op, node.attrs, node.shape, node.dtype, tuple(in_shapes), tuple(in_dtypes))
        try:
            stated = passed.get(key)
        except TypeError:          # an attribute that does not hash: checked every time
            key = stated = None
        if stated is not None:
            shapes[node.name], dtypes[node.name] = stated, node.dtype
            continue
        rules = rules_of.get(node.op) or rules_of.setdefault(node.op, rule_for(node.op))
        try:
            attrs = node.attr if at is None else at.attrs(node.attrs)
            stated = tuple(node.shape) if at is None else at.shape(node.shape)
            derived = tuple(rules.shape(in_shapes, attrs, ctx))
            dtype = rules.dtype(in_dtypes, attrs)
        except TvRayError as err:
            raise node_error(graph.name, node, f"{err}; fix the inputs or the attributes") from None
        if not same_shape(stated, derived):
            raise node_error(graph.name, node, (
                f"stated shape {fmt(stated)} but {node.op} of {_of(in_shapes)} gives {fmt(derived)}; "
                f"fix the stated shape or the inputs" if in_shapes else
                f"stated shape {fmt(stated)} but {node.op} gives {fmt(derived)}; "
                f"fix the stated shape or the attributes"))
        if dtype != node.dtype:
            raise node_error(graph.name, node, f"stated dtype {node.dtype} but {node.op} of "
                                               f"{', '.join(in_dtypes) or 'no inputs'} gives {dtype}; "
                                               f"fix the stated dtype")
        shapes[node.name], dtypes[node.name] = stated, node.dtype
        if key is not None:
            passed[key] = stated
