"""The symbolic interpretation: every op on numpy object arrays of scalar terms, element by element, over the reals.

A float element is a `Term` (tv_ray.terms). An int or bool element is a
Python int/bool, or a `Choice`: a value that depends on one integer data
element (a token id) through a table over that element's range — so
``eq(tokens - 4, col)`` is a table of booleans, evaluated exactly. Where a
float depends on a Choice (embedding rows, nll picks, one-hot casts), the
result is written with one-hot indicator variables of the data element::

    select(t, [a0, a1, a2]) = δ(t=0)·a0 + δ(t=1)·a1 + (1 − δ(t=0) − δ(t=1))·a2

which is a polynomial in the indicators and therefore in reach of the tier 0
normaliser; the last indicator is eliminated so the form is canonical. An
indicator is a variable named ``onehot:<element>=<v>/<range>`` (`tv_ray.terms.onehot`);
the random-point refuter draws them one-hot.

Non-linear functions stay uninterpreted applications (``rsqrt``, ``sigmoid``,
``gelu[none]``, a top-k routing mask's ``topk_mask[k]:p``) except exp and log,
which the normaliser's guarded axioms know.
An arange's elements are variables named by its definition where they are
used as numbers (a float arange; an int one's `Position`s once cast or mixed
with reals): shape reduction keeps only the first positions, so their values
must not be taken as known (docs/reduction.md).
Softmax and log-softmax use their real-number forms (no max subtraction:
over the reals it cancels). Structural ops (views, slices, cat, chunks) reuse
the concrete rules, which only move elements. An op without a symbolic rule
raises `UnknownOpError` naming it; the obligation that needs it stays unknown.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from tv_ray.errors import SymbolicError, UnknownOpError
from tv_ray.ir.graph import Node
from tv_ray.ir.ops import Op, registrar
from tv_ray.semantics.rules_reduce import _reduced_dims
from tv_ray.semantics.rules_tensor import arange_length
from tv_ray.semantics.table import Context, instantiate_attrs, instantiate_shape, numpy_dtype, rule_for
from tv_ray.terms import ONE, ZERO, Kind, Term, app, const, exp, log, max_, postorder, pow_, substitute, sum_
from tv_ray.terms.atom import Atom
from tv_ray.terms.onehot import indicator
from tv_ray.terms.routing import selected
from tv_ray.terms.term import grid_vars


# ±inf (causal masks) follow the extended reals where a mask needs them — x + (−∞) = −∞ for a finite
# x, exp(−∞) = 0 — and stay an uninterpreted constant everywhere else.
INF = app("inf")
NEG_INF = -INF


def _exp(t: Term) -> Term:
    return ZERO if t is NEG_INF else exp(t)


@dataclass(frozen=True)
class Choice:
    """An int/bool value depending on one integer data element `base` (an `Atom`) in [0, len(table)):
    value = table[base]. (A masked target's element ranges over one more value than the ids: the loss's
    ignore_index, the table's last entry.)"""

    base: Atom
    table: tuple

    def __post_init__(self):
        if not self.table:
            raise SymbolicError(f"integer element {self.base} has an empty range")


def choice(base: Atom, high: int, ignore: int | None = None) -> Choice:
    """The int data element `base`, ranging over [0, high) — and `ignore` (a target the loss ignores) if given."""
    return Choice(base, tuple(range(high)) + (() if ignore is None else (ignore,)))


class Position(int):
    """An element of an int arange: its int where it indexes (a gather, a comparison, a slice), the variable of
    its position where it is used as a number (`to_term`: a cast to float, arithmetic with reals) — as a float
    arange's elements are (`_arange`; docs/reduction.md). Arithmetic on ints gives plain ints."""

    def __new__(cls, value: int, variable: Term | None = None):
        self = int.__new__(cls, value)
        self.variable = variable
        return self

    def __reduce__(self):
        return Position, (int(self), self.variable)


def to_term(x) -> Term:
    """A float element as a Term (ints, bools and Choices are cast exactly; a `Position` is its variable)."""
    if isinstance(x, Term):
        return x
    if isinstance(x, Position):
        return x.variable
    if isinstance(x, Choice):
        return select(x, [const(int(v)) for v in x.table])
    if isinstance(x, (bool, np.bool_)):
        return ONE if x else ZERO
    if isinstance(x, (int, np.integer)):
        return const(int(x))
    if isinstance(x, (float, np.floating)):
        if np.isinf(x):
            return INF if x > 0 else -INF
        if np.isnan(x):
            raise SymbolicError("the constant nan is not a real number")
        return _float_constant(float(x))
    if isinstance(x, Fraction):
        return const(x)
    raise SymbolicError(f"{x!r} is not a scalar")


ROOT_LIMIT = 16      # √(p/q) with p, q up to this is read off the double nearest it


@functools.lru_cache(maxsize=1 << 12)
def _float_constant(x: float) -> Term:
    """A float as a real: its exact binary value — or √(p/q) where it is the double nearest √(p/q) (within two
    units in the last place; p, q ≤ `ROOT_LIMIT`, p/q no square of a rational), which is what it was written as:
    DTensor divides a replicated tensor's norm by fl(√n) for a mesh axis of n ranks, and the squares of n such
    norms must sum to the norm's square."""
    value = Fraction(x)
    if value != 0:
        square = value * value
        near = square.limit_denominator(ROOT_LIMIT)
        if near.numerator <= ROOT_LIMIT and abs(square - near) <= near / 2 ** 50 and \
                not (_is_square(near.numerator) and _is_square(near.denominator)):
            root = app("sqrt", const(near))
            return root if x > 0 else -root
    return const(value)


def _is_square(n: int) -> bool:
    return math.isqrt(n) ** 2 == n


def select(c: Choice, values: Sequence[Term]) -> Term:
    """The float that is values[v] when c's data element is v: Σᵥ δᵥ·values[v], each values[v] taken where the element
    is v — its own indicators of that element made 0 or 1 (δᵥ·X = δᵥ·X|element=v), so that a choice made inside
    another on the same element (a masked gather, a where on a token's range) gives no product of its indicators.
    Each distinct value is searched for those indicators once (a where has two values over n choices)."""
    first = values[0]
    if all(v is first for v in values):
        return first
    n, found = len(values), {}
    out = []
    for v, term in enumerate(values):
        if term not in found:
            found[term] = _indicators(term, c.base)
        own = found[term]
        at = substitute(term, {node: ONE if node.payload.onehot[0] == v else ZERO for node in own}) if own else term
        out.append(indicator(c.base, v, n) * at)
    return sum_(out)


def _indicators(term: Term, element: Atom) -> list[Term]:
    """The indicator variables of data element `element` in `term`."""
    return [node for node in postorder(term) if node.kind is Kind.VAR and isinstance(node.payload, Atom)
            and node.payload.onehot is not None and node.payload.element == element]


def lift_int(fn: Callable, *xs):
    """Apply an int/bool function pointwise; Choices over one data element are tabulated."""
    bases = {x.base for x in xs if isinstance(x, Choice)}
    if not bases:
        return fn(*xs)
    if len(bases) > 1:
        raise SymbolicError(f"an integer value depends on two data elements ({', '.join(sorted(map(str, bases)))}); "
                            f"this is outside the symbolic domain")
    n = next(len(x.table) for x in xs if isinstance(x, Choice))
    table = tuple(fn(*(x.table[v] if isinstance(x, Choice) else x for x in xs)) for v in range(n))
    if all(t == table[0] for t in table):
        return table[0]
    return Choice(next(iter(bases)), table)


def _is_float(x) -> bool:
    return isinstance(x, Term)


def elementwise(fn: Callable, *arrays) -> np.ndarray:
    """fn over broadcast object arrays, element by element."""
    arrays = [a if isinstance(a, np.ndarray) else np.asarray(a, dtype=object) for a in arrays]
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    bs = [np.broadcast_to(a, shape) for a in arrays]
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(shape):
        out[idx] = fn(*(b[idx] for b in bs))
    return out


def as_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    """Float results hold Terms only; int/bool results hold ints, bools and Choices."""
    out = np.asarray(array, dtype=object)
    if dtype == "float":
        flat = out.reshape(-1)
        if not all(isinstance(x, Term) for x in flat):
            out = elementwise(to_term, out)
    return out


SYMBOLIC: dict[Op, Callable] = {}
register = registrar(SYMBOLIC, "symbolic rule")


# -- structural ops: the concrete rule moves elements and never computes ----------------------
STRUCTURAL = (Op.VIEW, Op.PERMUTE, Op.TRANSPOSE, Op.EXPAND, Op.UNSQUEEZE, Op.SQUEEZE, Op.CLONE, Op.SLICE,
              Op.SELECT, Op.CAT, Op.LOCAL_CHUNK)


@register(*STRUCTURAL)
def _structural(node: Node, xs, attrs, ctx):
    return np.asarray(rule_for(node.op, "concrete").concrete(list(xs), attrs, ctx), dtype=object)


@register(Op.SLICE_BACKWARD)
def _slice_backward(node, xs, attrs, ctx):
    out = np.full(attrs["input_size"], ZERO, dtype=object)
    dim = attrs["dim"] % out.ndim
    out[(slice(None),) * dim + (slice(attrs["start"], attrs["end"], attrs["step"]),)] = xs[0]
    return out


@register(Op.ARANGE)
def _arange(node, xs, attrs, ctx):
    """A float arange is positions used as numbers (RoPE angles): its elements are variables named by its
    definition, since shape reduction keeps only some positions (DESIGN.md rule 4: at reduced dims a constant
    changed at a position past them would never show). An int arange's elements index, as `Position`s: the
    same variables where they are used as numbers."""
    n = arange_length(attrs["start"], attrs["end"], attrs["step"])
    out = np.empty((n,), dtype=object)
    out[:] = grid_vars(positions(node), (n,))
    if node.dtype != "float":
        values = range(attrs["start"], attrs["start"] + n * attrs["step"], attrs["step"])
        out[:] = [Position(v, variable) for v, variable in zip(values, out)]
    return out


def positions(node: Node) -> str:
    """The name of an arange's element variables: its definition, in dims (so two aranges share them exactly
    where they are the same function of the dims)."""
    return "arange(" + ",".join(str(node.attr[k]) for k in ("start", "end", "step")) + ")"


@register(Op.FULL, Op.FULL_LIKE, Op.AXIS_INDEX)
def _constant(node, xs, attrs, ctx):
    shapes = [np.zeros(x.shape, dtype=numpy_dtype(node.dtype)) for x in xs]    # full_like of an int tensor: ints
    value = np.asarray(rule_for(node.op, "concrete").concrete(shapes, attrs, ctx))
    return np.asarray(value.tolist() if value.ndim else value.item(), dtype=object).reshape(value.shape)


@register(Op.TRIU)
def _triu(node, xs, attrs, ctx):
    keep = np.triu(np.ones(xs[0].shape[-2:], dtype=bool), attrs["diagonal"])
    zero = ZERO if node.dtype == "float" else 0
    return np.where(np.broadcast_to(keep, xs[0].shape), xs[0], zero)


# -- elementwise ------------------------------------------------------------------------------
def _sigmoid(x: Term) -> Term:
    return app("sigmoid", x)


UNARY: dict[Op, Callable[[Term], Term]] = {
    Op.NEG: lambda x: -x,
    Op.RSQRT: lambda x: app("rsqrt", x),
    Op.SQRT: lambda x: app("sqrt", x),
    Op.RECIPROCAL: lambda x: ONE / x,
    Op.EXP: _exp,
    Op.LOG: log,
    Op.SIGMOID: _sigmoid,
    Op.SILU: lambda x: x * _sigmoid(x),
    Op.TANH: lambda x: app("tanh", x),
    Op.COS: lambda x: app("cos", x),
    Op.SIN: lambda x: app("sin", x),
    Op.ABS: lambda x: app("abs", x),
}


def _unary(op: Op) -> Callable:
    fn = UNARY[op]

    def rule(node, xs, attrs, ctx):
        def one(x):
            if op in (Op.NEG, Op.ABS) and not _is_float(x):
                return lift_int(lambda v: -v if op == Op.NEG else abs(v), x)
            return fn(to_term(x))
        return elementwise(one, xs[0])
    return rule


for _op in UNARY:
    register(_op)(_unary(_op))


@register(Op.GELU)
def _gelu(node, xs, attrs, ctx):
    name = f"gelu[{attrs['approximate']}]"
    return elementwise(lambda x: app(name, to_term(x)), xs[0])


@register(Op.CAST)
def _cast(node, xs, attrs, ctx):
    kind = attrs["dtype"]
    if kind == "float":
        return elementwise(to_term, xs[0])

    def one(x):
        if _is_float(x):
            raise SymbolicError(f"cast of a real value to {kind} is outside the symbolic domain")
        return lift_int(lambda v: bool(v) if kind == "bool" else int(v), x)
    return elementwise(one, xs[0])


def _operands(xs, attrs):
    if len(xs) == 2:
        return xs[0], xs[1]
    return xs[0], np.asarray(attrs["other"], dtype=object)


def _scaled(attrs, b):
    return b * attrs["alpha"] if "alpha" in attrs else b


ARITH: dict[Op, Callable] = {
    Op.ADD: lambda x, y, a: x + _scaled(a, y),
    Op.SUB: lambda x, y, a: x - _scaled(a, y),
    Op.MUL: lambda x, y, a: x * y,
    Op.DIV: lambda x, y, a: x / y,
}
COMPARE: dict[Op, Callable] = {
    Op.EQ: lambda x, y: x == y,
    Op.NE: lambda x, y: x != y,
    Op.LT: lambda x, y: x < y,
    Op.GE: lambda x, y: x >= y,
    Op.LOGICAL_AND: lambda x, y: bool(x) and bool(y),
    Op.LOGICAL_OR: lambda x, y: bool(x) or bool(y),
}


def _masked(op: Op, a: Term, b: Term) -> Term | None:
    """x + (−∞) and x − (+∞) are −∞ (and the mirror images): how additive masks work."""
    if op not in (Op.ADD, Op.SUB):
        return None
    infinite = {INF, NEG_INF}
    if b in infinite and a not in infinite:
        return b if op == Op.ADD else -b
    if a in infinite and b not in infinite:
        return a
    return None


def _binary(one_for: Callable) -> Callable:
    """A rule applying one_for(node, attrs)(a, b) to every pair of broadcast elements."""
    def rule(node, xs, attrs, ctx):
        x, y = _operands(xs, attrs)
        return elementwise(one_for(node, attrs), x, y)
    return rule


def _arith(op: Op) -> Callable:
    fn = ARITH[op]

    def one_for(node, attrs):
        def one(a, b):
            if node.dtype == "float":
                a, b = to_term(a), to_term(b)
                masked = _masked(op, a, b)
                return masked if masked is not None else fn(a, b, attrs)
            return lift_int(lambda p, q: _integral(fn(p, q, attrs)), a, b)
        return one
    return _binary(one_for)


def _integral(value):
    """An integer op's value: a float scalar operand (`other` is a float attribute) gives a float; back to int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _compare(op: Op) -> Callable:
    fn = COMPARE[op]

    def one(a, b):
        if _is_float(a) or _is_float(b):
            raise SymbolicError(f"{op} on real values is outside the symbolic domain")
        return lift_int(fn, a, b)
    return _binary(lambda node, attrs: one)


for _op in ARITH:
    register(_op)(_arith(_op))
for _op in COMPARE:
    register(_op)(_compare(_op))


def _min(a: Term, b: Term) -> Term:
    return -max_(-a, -b)   # min(a, b) = -max(-a, -b) over the reals


@register(Op.MAXIMUM, Op.MINIMUM)
def _extremum(node, xs, attrs, ctx):
    pick = max_ if node.op == Op.MAXIMUM else _min
    ints = max if node.op == Op.MAXIMUM else min

    def one(a, b):
        if node.dtype == "float":
            return pick(to_term(a), to_term(b))
        return lift_int(ints, a, b)
    return elementwise(one, xs[0], xs[1])


@register(Op.CLAMP)
def _clamp(node, xs, attrs, ctx):
    bounds = {k: int(v) if node.dtype != "float" else v for k, v in attrs.items() if k in ("min", "max")}

    def one(x):
        if node.dtype != "float":       # an integer clamp's bounds are integral (attrs store them as floats)
            return lift_int(lambda v: min(max(v, bounds.get("min", v)), bounds.get("max", v)), x)
        out = to_term(x)
        if "min" in attrs:
            out = max_(out, const(float(attrs["min"])))
        if "max" in attrs:
            out = _min(out, const(float(attrs["max"])))
        return out
    return elementwise(one, xs[0])


@register(Op.POW)
def _pow(node, xs, attrs, ctx):
    if "exponent" in attrs:
        e = attrs["exponent"]
        if float(e).is_integer():
            n = int(e)
            return elementwise(lambda x: ONE if n == 0 else pow_(to_term(x), n), xs[0])
        return elementwise(lambda x: app(f"pow[{float(e)!r}]", to_term(x)), xs[0])
    if "base" in attrs:
        b = float(attrs["base"])
        return elementwise(lambda x: app(f"powbase[{b!r}]", to_term(x)), xs[0])
    return elementwise(lambda x, y: app("pow", to_term(x), to_term(y)), xs[0], xs[1])


@register(Op.WHERE)
def _where(node, xs, attrs, ctx):
    def one(c, a, b):
        if isinstance(c, Choice):
            if node.dtype == "float":
                return select(c, [to_term(a) if t else to_term(b) for t in c.table])
            return lift_int(lambda t, p, q: p if t else q, c, a, b)
        if _is_float(c):
            raise SymbolicError("where with a real-valued condition is outside the symbolic domain")
        return (to_term(a) if c else to_term(b)) if node.dtype == "float" else (a if c else b)
    return elementwise(one, xs[0], xs[1], xs[2])


# -- matrix products ----------------------------------------------------------------------------
def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=object)
    for idx in np.ndindex(out.shape[:-1]):
        row = a[idx]
        batch = idx[:-1]
        for j in range(b.shape[-1]):
            col = b[batch + (slice(None), j)]
            out[idx + (j,)] = sum_([row[k] * col[k] for k in range(a.shape[-1])])
    return out


@register(Op.MM, Op.BMM)
def _mm(node, xs, attrs, ctx):
    return _matmul(as_dtype(xs[0], "float"), as_dtype(xs[1], "float"))


@register(Op.ADDMM)
def _addmm(node, xs, attrs, ctx):
    prod = _matmul(as_dtype(xs[1], "float"), as_dtype(xs[2], "float"))
    return elementwise(lambda p, c: p + to_term(c), prod, xs[0])


# -- reductions ---------------------------------------------------------------------------------
def _reduce(x: np.ndarray, dims, keepdim: bool, combine: Callable[[list], object]) -> np.ndarray:
    dims = _reduced_dims(dims, x.ndim, "reduction")
    kept = [d for d in range(x.ndim) if d not in dims]
    moved = np.transpose(x, kept + list(dims))
    rows = moved.reshape(moved.shape[:len(kept)] + (-1,))
    out = np.empty(rows.shape[:-1], dtype=object)
    for idx in np.ndindex(out.shape):
        out[idx] = combine(list(rows[idx]))
    if keepdim:
        out = out.reshape(tuple(1 if d in dims else x.shape[d] for d in range(x.ndim)))
    return out


@register(Op.SUM, Op.MEAN)
def _sum(node, xs, attrs, ctx):
    x = xs[0]
    if node.dtype != "float":
        def ints(values):
            total = 0
            for v in values:
                total = lift_int(lambda p, q: int(p) + int(q), total, v)
            return total
        return _reduce(x, attrs["dims"], attrs["keepdim"], ints)
    x = as_dtype(x, "float")
    n = max(1, int(np.prod([x.shape[d] for d in _reduced_dims(attrs["dims"], x.ndim, "mean")])))
    scale = ONE / const(n) if node.op == Op.MEAN else ONE
    return _reduce(x, attrs["dims"], attrs["keepdim"], lambda vs: sum_(vs) * scale)


@register(Op.AMAX)
def _amax(node, xs, attrs, ctx):
    if node.dtype != "float":
        return _reduce(xs[0], attrs["dims"], attrs["keepdim"],
                       lambda vs: _fold_int(max, vs))
    return _reduce(as_dtype(xs[0], "float"), attrs["dims"], attrs["keepdim"], lambda vs: max_(*vs))


def _fold_int(fn, values):
    out = values[0]
    for v in values[1:]:
        out = lift_int(fn, out, v)
    return out


# -- softmax family: real-number forms ---------------------------------------------------------
def _along(x: np.ndarray, dim: int, fn: Callable[[list], list]) -> np.ndarray:
    """Apply fn to every 1-d line of x along `dim` (fn maps a list to a list of the same length)."""
    moved = np.moveaxis(x, dim, -1)
    out = np.empty(moved.shape, dtype=object)
    for idx in np.ndindex(moved.shape[:-1]):
        out[idx] = fn(list(moved[idx]))
    return np.moveaxis(out, -1, dim)


def _dim(attrs, x) -> int:
    return attrs["dim"] % x.ndim


@register(Op.SOFTMAX)
def _softmax(node, xs, attrs, ctx):
    def line(v):
        es = [_exp(t) for t in v]
        total = sum_(es)
        return [e / total for e in es]
    return _along(as_dtype(xs[0], "float"), _dim(attrs, xs[0]), line)


@register(Op.LOG_SOFTMAX)
def _log_softmax(node, xs, attrs, ctx):
    def line(v):
        lse = log(sum_([_exp(t) for t in v]))
        return [t if t is NEG_INF else t - lse for t in v]
    return _along(as_dtype(xs[0], "float"), _dim(attrs, xs[0]), line)


def _paired(x: np.ndarray, y: np.ndarray, dim: int, fn) -> np.ndarray:
    stacked = np.empty(x.shape, dtype=object)
    for idx in np.ndindex(x.shape):
        stacked[idx] = (x[idx], y[idx])
    return _along(stacked, dim, fn)


@register(Op.TOPK_MASK)
def _topk_mask(node, xs, attrs, ctx):
    """Each element's routing indicator: an application to its whole line along dim (`tv_ray.terms.routing`)."""
    k = attrs["k"]
    return _along(as_dtype(xs[0], "float"), _dim(attrs, xs[0]), lambda v: [selected(k, p, v) for p in range(len(v))])


@register(Op.SOFTMAX_BACKWARD)
def _softmax_backward(node, xs, attrs, ctx):
    grad, out = as_dtype(xs[0], "float"), as_dtype(xs[1], "float")

    def line(pairs):
        dot = sum_([g * o for g, o in pairs])
        return [o * (g - dot) for g, o in pairs]
    return _paired(grad, out, _dim(attrs, grad), line)


@register(Op.LOG_SOFTMAX_BACKWARD)
def _log_softmax_backward(node, xs, attrs, ctx):
    grad, out = as_dtype(xs[0], "float"), as_dtype(xs[1], "float")

    def line(pairs):
        total = sum_([g for g, _ in pairs])
        return [g - exp(o) * total for g, o in pairs]
    return _paired(grad, out, _dim(attrs, grad), line)


# -- loss and indexing with integer data ----------------------------------------------------------
def _weight(t, ignore: int) -> Term:
    """1 where the target is not ignore_index (a Term, or a Choice cast)."""
    return to_term(lift_int(lambda v: int(v != ignore), t))


def _pick(row: Sequence[Term], t) -> Term:
    if isinstance(t, Choice):
        return select(t, [row[v] if 0 <= v < len(row) else ZERO for v in t.table])
    return row[int(t)] if 0 <= int(t) < len(row) else ZERO


@register(Op.NLL_LOSS)
def _nll_loss(node, xs, attrs, ctx):
    rows = nll_rows(xs[0], xs[1], attrs["ignore_index"])
    if attrs["reduction"] == "none":
        return np.asarray(rows + [None], dtype=object)[:-1]
    total = sum_(rows)
    if attrs["reduction"] == "mean":
        total = total / nll_total_weight(xs[1], attrs["ignore_index"])
    return np.asarray(total, dtype=object)


def nll_rows(logp: np.ndarray, target: np.ndarray, ignore: int) -> list[Term]:
    """Each row's loss: minus its target's log-probability, 0 where the target is `ignore`."""
    logp = as_dtype(logp, "float")
    if logp.ndim != 2:
        raise SymbolicError("nll_loss over more than 2 dims has no symbolic rule")
    return [-_pick(list(logp[i]), target[i]) * _weight(target[i], ignore) for i in range(logp.shape[0])]


def nll_total_weight(target: np.ndarray, ignore: int) -> Term:
    """How many targets are not `ignore`: a mean nll_loss's divisor."""
    return sum_([_weight(t, ignore) for t in target.reshape(-1)])


@register(Op.NLL_LOSS_TOTAL_WEIGHT)
def _nll_total(node, xs, attrs, ctx):
    return np.asarray(nll_total_weight(xs[0], attrs["ignore_index"]), dtype=object)


@register(Op.NLL_LOSS_BACKWARD)
def _nll_backward(node, xs, attrs, ctx):
    grad, logp, target, total = xs
    n, vocab = logp.shape
    ignore = attrs["ignore_index"]
    out = np.empty((n, vocab), dtype=object)
    for i in range(n):
        g = to_term(grad[i] if attrs["reduction"] == "none" else grad.reshape(-1)[0])
        scale = -g * _weight(target[i], ignore)
        if attrs["reduction"] == "mean":
            scale = scale / to_term(total.reshape(-1)[0])
        for v in range(vocab):
            hit = to_term(lift_int(lambda t, v=v: int(t == v), target[i]))
            out[i, v] = hit * scale
    return out


@register(Op.EMBEDDING)
def _embedding(node, xs, attrs, ctx):
    weight, ids = as_dtype(xs[0], "float"), xs[1]
    out = np.empty(ids.shape + weight.shape[1:], dtype=object)
    for idx in np.ndindex(ids.shape):
        for c in range(weight.shape[1]):
            out[idx + (c,)] = _pick(list(weight[:, c]), ids[idx])
    return out


@register(Op.EMBEDDING_BACKWARD)
def _embedding_backward(node, xs, attrs, ctx):
    grad, ids = as_dtype(xs[0], "float"), xs[1]
    flat_ids = ids.reshape(-1)
    rows = grad.reshape(len(flat_ids), -1)
    vocab = attrs["num_weights"]
    out = np.empty((vocab, rows.shape[1]), dtype=object)
    for v in range(vocab):
        hits = [to_term(lift_int(lambda t, v=v: int(t == v), flat_ids[i])) for i in range(len(flat_ids))]
        for c in range(rows.shape[1]):
            out[v, c] = sum_([h * rows[i, c] for i, h in enumerate(hits)])
    return out


@register(Op.GATHER)
def _gather(node, xs, attrs, ctx):
    """out[i] = x[i with i[dim] replaced by index[i]] (an index from data picks by its one-hot choice)."""
    x, index, dim = xs[0], xs[1], attrs["dim"]
    floats = node.dtype == "float"
    out = np.empty(index.shape, dtype=object)
    for idx in np.ndindex(index.shape):
        row = [x[idx[:dim] + (j,) + idx[dim + 1:]] for j in range(x.shape[dim])]
        if floats:
            out[idx] = _pick([to_term(v) for v in row], index[idx])
        elif isinstance(index[idx], Choice):
            raise SymbolicError("gather of integers by an index from data has no symbolic rule")
        else:
            out[idx] = row[int(index[idx])]
    return out


@register(Op.SCATTER, Op.SCATTER_ADD)
def _scatter(node, xs, attrs, ctx):
    """out = x with src[i] written (added, for scatter_add) at i with i[dim] replaced by index[i], in index order; an
    index from data writes position p by its choice: select(index[i] = p, [written, as before])."""
    if node.dtype != "float":
        raise SymbolicError(f"{node.op} of integers has no symbolic rule")
    x, index, src, dim = as_dtype(xs[0], "float"), xs[1], as_dtype(xs[2], "float"), attrs["dim"]
    add = node.op == Op.SCATTER_ADD
    out = np.array(x, dtype=object)
    for idx in np.ndindex(index.shape):
        for p in range(x.shape[dim]):
            hit = lift_int(lambda t, p=p: t == p, index[idx])
            if not isinstance(hit, Choice) and not hit:        # a fixed index elsewhere (a numpy bool too)
                continue
            at = idx[:dim] + (p,) + idx[dim + 1:]
            old = to_term(out[at])
            new = to_term(src[idx]) + old if add else to_term(src[idx])
            out[at] = select(hit, [new if h else old for h in hit.table]) if isinstance(hit, Choice) else new
    return out


# -- collectives over a group ------------------------------------------------------------------------
def reduce_members(xs: list[np.ndarray], kind: str) -> np.ndarray:
    """The elementwise sum / average / max of the group members' values."""
    xs = [as_dtype(x, "float") for x in xs]
    out = np.empty(xs[0].shape, dtype=object)
    for idx in np.ndindex(out.shape):
        vals = [x[idx] for x in xs]
        if kind == "max":
            out[idx] = max_(*vals)
        else:
            total = sum_(vals)
            out[idx] = total / const(len(vals)) if kind == "avg" else total
    return out


def group_rule(op: Op, xs: list[np.ndarray], attrs: dict) -> list[np.ndarray]:
    """The members' results of a collective on symbolic values."""
    if op == Op.ALL_REDUCE:
        out = reduce_members(xs, attrs["reduce"])
        return [out for _ in xs]
    if op == Op.REDUCE_SCATTER:
        out = reduce_members(xs, attrs["reduce"])
        return [np.asarray(c, dtype=object) for c in np.split(out, len(xs), axis=attrs["dim"] % out.ndim)]
    if op in (Op.ALL_GATHER, Op.ALL_TO_ALL, Op.BROADCAST):
        return [np.asarray(v, dtype=object) for v in rule_for(op, "group").group(list(xs), attrs)]
    raise UnknownOpError(f"no symbolic group rule for op {op}", op=str(op))


def eval_symbolic(node: Node, args: list[np.ndarray], dims, ctx: Context = Context()) -> np.ndarray:
    """Run one node on object arrays of terms; the result has the node's stated shape."""
    fn = SYMBOLIC.get(node.op)
    if fn is None:
        raise UnknownOpError(f"no symbolic rule for op {node.op} (node {node.name})", op=str(node.op))
    out = as_dtype(fn(node, args, instantiate_attrs(node, dims), ctx), node.dtype)
    stated = instantiate_shape(node.shape, dims)
    if out.shape != stated:
        raise SymbolicError(f"node {node.name} = {node.op}(...): symbolic result has shape {out.shape}, "
                            f"the node states {stated}", node=node.name)
    return out


__all__ = ["Choice", "Position", "choice", "select", "to_term", "positions", "nll_rows", "nll_total_weight",
           "eval_symbolic", "group_rule", "SymbolicError", "SYMBOLIC", "lift_int", "elementwise", "as_dtype"]
